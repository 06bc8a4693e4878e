"""The per-request speculative-decoding choice (API field ``speculative``)."""

from __future__ import annotations

from dataclasses import dataclass

from edge.errors import SamplingError

METHODS = ("ngram", "draft")
OFF = "off"  # a request's explicit choice of plain decoding, whatever the server's default
MAX_NUM_TOKENS = 16  # beyond this a verify step costs clearly more than a decode step


@dataclass(frozen=True)
class SpeculativeParams:
    """``method``: "ngram" (prompt lookup, no model), "draft" (a small model sharing
    the tokenizer) or "off" (plain decoding, though the server speculates by default);
    ``num_tokens``: the most tokens proposed per step (k, adapted down when acceptance
    is low)."""

    method: str = "ngram"
    num_tokens: int = 4

    @property
    def off(self) -> bool:
        return self.method == OFF

    def validate(self) -> None:
        if self.method not in (*METHODS, OFF):
            raise SamplingError(
                f"speculative.method must be one of {', '.join((*METHODS, OFF))}, got {self.method!r}"
            )
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int):
            raise SamplingError(f"speculative.num_tokens must be an integer, got {self.num_tokens!r}")
        if not 1 <= self.num_tokens <= MAX_NUM_TOKENS:
            raise SamplingError(f"speculative.num_tokens must be in [1, {MAX_NUM_TOKENS}], got {self.num_tokens}")
