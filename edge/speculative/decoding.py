"""One request's speculative decoding: its proposer, the adaptive k, the counts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge.model.kv import KVOutOfMemory, SequenceKV
from edge.runtime.kv_paged import PagedSequence
from edge.sampling import SamplerState
from edge.speculative.params import SpeculativeParams
from edge.speculative.proposers import DraftModel, PromptLookup, Proposer
from edge.speculative.verify import Verdict, verify, verify_step

if TYPE_CHECKING:
    import numpy as np

    from edge.structured.matcher import GrammarMatcher
    from edge.runtime.engine import Engine

log = logging.getLogger(__name__)

# Weight of the newest step in the acceptance-rate average that sets k.
ACCEPTANCE_SMOOTHING = 0.5


@dataclass
class SpeculativeStats:
    steps: int = 0  # verify steps (forwards of the target)
    proposed: int = 0  # proposals checked
    accepted: int = 0  # proposals kept
    emitted: int = 0  # tokens out: accepted + one from the target per step

    def add(self, other: SpeculativeStats) -> None:
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.emitted += other.emitted

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "tokens_per_step": self.emitted / self.steps if self.steps else None,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
        }


def make_proposer(params: SpeculativeParams, draft: Engine | None, slot: int | None = None) -> Proposer:
    """``slot``: the scheduler slot of the request; a draft model decodes in its own
    engine's slot of that index (its captured decode graphs)."""
    if params.method == "ngram":
        return PromptLookup()
    if params.method == "draft":
        if draft is None:
            raise ValueError("speculative method 'draft' needs a draft model")
        return DraftModel(draft, slot)
    raise ValueError(f"unknown speculative method {params.method!r}")


class SpeculativeDecoder:
    """Decode steps of one request on ``seq`` that each emit one or more tokens.

    k starts at ``params.num_tokens`` (at most the verify graphs' width, ``max_k``) and
    follows the smoothed acceptance rate: ``1 + rate * max_k``, capped at ``max_k``, so
    a proposer that keeps missing costs little more than plain decoding. On a paged
    cache the verify step runs through the slot's :class:`VerifyDecoder` (``path``:
    "graph" or "eager"); on a contiguous cache through ``Engine.forward`` ("eager")."""

    def __init__(
        self,
        engine: Engine,
        seq: SequenceKV,
        params: SpeculativeParams,
        sampler: SamplerState,
        greedy: bool,
        proposer: Proposer,
    ) -> None:
        self.engine = engine
        self.seq = seq
        self.params = params
        self.sampler = sampler
        self.greedy = greedy
        self.proposer = proposer
        self.verifier = engine.verify_decoder(seq)
        self.path = self.verifier.path if self.verifier is not None else "eager"
        width = self.verifier.max_proposals if self.verifier is not None else params.num_tokens
        self.max_k = min(params.num_tokens, width)
        if self.max_k < params.num_tokens:
            log.info("speculative num_tokens %d capped at %d (the verify graphs' width)", params.num_tokens, width)
        self.k = self.max_k
        self._rate = 1.0
        self.stats = SpeculativeStats()
        self._base = 0  # seq.length before the last step
        self._accepted = 0  # proposals the last step kept

    def step(self, context: Sequence[int], budget: int, grammar: GrammarMatcher | None = None) -> list[int]:
        """Tokens after ``context`` (prompt and output; its last token, the newest, is
        not in ``seq`` yet). ``budget``: the most tokens the request may still emit.
        ``grammar``: a structured request's matcher, at the state after ``context``: the
        proposals stop before the first token it rejects, and every verified position is
        masked (greedy output stays that of plain constrained decoding).
        Raises KVOutOfMemory (``seq`` unchanged) only when not even one token fits."""
        k = min(self.k, budget - 1, self.engine.max_seq_len - self.seq.length - 1)
        proposed = self.proposer.propose(context, k)[:k] if k > 0 else []
        masks = None
        if grammar is not None:
            proposed = proposed[: grammar.valid_prefix(proposed)]
            masks = grammar.masks_along(proposed)
        self._base = self.seq.length
        try:
            verdict = self._verify(int(context[-1]), proposed, masks)
        except KVOutOfMemory:
            if not proposed:
                raise
            log.debug("no KV room for %d proposals: a plain step", len(proposed))
            proposed = []
            verdict = self._verify(int(context[-1]), proposed, None if masks is None else masks[:1])
        self._accepted = verdict.accepted
        self.stats.steps += 1
        self.stats.proposed += len(proposed)
        self.stats.accepted += verdict.accepted
        self.stats.emitted += len(verdict.tokens)
        if proposed:
            rate = verdict.accepted / len(proposed)
            self._rate = (1 - ACCEPTANCE_SMOOTHING) * self._rate + ACCEPTANCE_SMOOTHING * rate
            self.k = max(1, min(self.max_k, 1 + int(self._rate * self.max_k)))
        return verdict.tokens

    def _verify(self, last: int, proposed: list[int], masks: np.ndarray | None = None) -> Verdict:
        bitmasks = None if masks is None else self.engine.bitmask_tensor(masks)
        if self.verifier is None:
            return verify(self.engine, self.seq, last, proposed, self.sampler, self.greedy, bitmasks=bitmasks)
        assert isinstance(self.seq, PagedSequence)
        return verify_step(self.verifier, self.seq, last, proposed, self.sampler, self.greedy, bitmasks=bitmasks)

    def describe(self) -> dict:
        """What the request's usage reports beside the counts."""
        out = {"method": self.params.method, "num_tokens": self.max_k, "verify": self.path}
        draft_path = getattr(self.proposer, "path", None)  # a draft model's decode: "graph" or "eager"
        if draft_path is not None:
            out["draft"] = draft_path
        return out

    def keep(self, n: int) -> None:
        """The request ended after the first ``n`` tokens of the last step: hold only the
        K/V plain decoding would hold then (the input and the tokens before the n-th)."""
        extra = self.seq.length - (self._base + n)
        if extra > 0:
            self.seq.rollback(extra)

    def close(self) -> None:
        if self.verifier is not None and self.verifier.bound is self.seq:
            self.verifier.unbind()
        self.proposer.close()
