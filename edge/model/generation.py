"""Per-request generation state shared by ``Engine.generate`` and the scheduler:
sampler tensors, incremental detokenization, stop conditions, usage and timings."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from edge.sampling import SamplerState, SamplingParams, StopChecker
from edge.model.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    import numpy as np

    from edge.structured.matcher import GrammarMatcher


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    decode_tok_s: float | None = None
    prefill_ms: float | None = None
    total_ms: float | None = None
    seed: int | None = None
    energy_j: float | None = None
    energy_j_per_token: float | None = None
    speculative: dict | None = None  # SpeculativeStats.as_dict() of a speculative request
    grammar: dict | None = None  # a constrained request's host mask time (GrammarMatcher)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    """One streamed event: newly produced token ids and the text they make visible.
    The last chunk of a request carries ``finish_reason`` and ``usage``."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    message: str | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    message: str | None = None

    @classmethod
    def from_chunks(cls, chunks: list[Chunk]) -> "GenerationResult":
        """A whole request from its streamed chunks (the last one carries the end)."""
        final = chunks[-1]
        return cls(
            token_ids=[t for c in chunks for t in c.token_ids],
            text="".join(c.text for c in chunks),
            finish_reason=final.finish_reason or "length",
            usage=final.usage or Usage(),
            message=final.message,
        )


class Generation:
    """Turns sampled token ids into visible text and decides when to stop."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_ids: list[int],
        params: SamplingParams,
        sampler: SamplerState,
        eos_token_ids: frozenset[int] = frozenset(),
        grammar: GrammarMatcher | None = None,
    ) -> None:
        """``grammar``: the request's structured-output matcher (edge/structured): every
        fed token advances it, and :meth:`next_mask` is the next step's bitmask."""
        self.prompt_ids = prompt_ids
        self.grammar = grammar
        self.params = params
        self.sampler = sampler
        sampler.load(params, prompt_ids)
        eos = tokenizer.eos_token_ids if tokenizer is not None else eos_token_ids
        self.stop = StopChecker(params, eos)
        # A checkpoint without tokenizer.json still generates token ids, with no text.
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.usage = Usage(prompt_tokens=len(prompt_ids), seed=params.seed)
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.t_prefilled: float | None = None

    @property
    def done(self) -> bool:
        return self.stop.done

    def next_mask(self) -> np.ndarray | None:
        """The bitmask of the tokens the next step may sample (None: unconstrained)."""
        return None if self.grammar is None else self.grammar.mask()

    def mark_prefilled(self, cached_tokens: int = 0) -> None:
        self.t_prefilled = time.perf_counter()
        self.usage.cached_tokens = cached_tokens
        self.usage.prefill_ms = (self.t_prefilled - self.t_start) * 1e3

    def feed(self, token: int) -> Chunk:
        """Account one sampled token; the returned chunk holds what became visible."""
        if self.t_first is None:
            self.t_first = time.perf_counter()
            self.usage.ttft_ms = (self.t_first - self.t_start) * 1e3
        if self.grammar is not None:
            self.grammar.accept(token)
        stop_token = self.stop.on_token(token)
        if self.grammar is not None and self.grammar.done and not self.stop.done:
            self.stop.finish_reason = "stop"  # the grammar ended (ignore_eos runs no further)
        if stop_token:
            return Chunk([], "")
        self.token_ids.append(token)
        text = self.stop.on_text(self.detok.push(token) if self.detok else "")
        if self.stop.done and self.stop.finish_reason != "stop":
            text += self._drain()
        return Chunk([token], text)

    def finish(self, reason: str | None = None, message: str | None = None) -> Chunk:
        """The final chunk. ``reason`` overrides (cancelled, error, length on OOM)."""
        tail = ""
        if reason in (None, "length") and self.stop.finish_reason != "stop":
            tail = self._drain()
        final = reason or self.stop.finish_reason or "length"
        now = time.perf_counter()
        u = self.usage
        u.completion_tokens = len(self.token_ids)
        u.total_ms = (now - self.t_start) * 1e3
        if self.t_first is not None and len(self.token_ids) > 1:
            u.decode_tok_s = (len(self.token_ids) - 1) / max(now - self.t_first, 1e-9)
        g = self.grammar
        if g is not None and g.masks:
            u.grammar = {"masks": g.masks, "mask_ms_per_token": g.mask_s * 1e3 / g.masks}
        return Chunk([], tail, finish_reason=final, usage=u, message=message)

    def _drain(self) -> str:
        """Text held back (a partial UTF-8 character, a possible stop-string prefix)."""
        return self.stop.on_text(self.detok.flush() if self.detok else "") + self.stop.flush()
