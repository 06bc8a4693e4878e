"""Proposers: where the k tokens a verify step checks come from.

Every proposer answers ``propose(context, k)``: up to ``k`` tokens to follow
``context`` (the prompt and the output so far; its last token is the one the target
feeds next). Fewer, or none, is always allowed: the verify step then checks fewer.
``close()`` gives back what the proposer holds (a draft model's KV blocks). Proposals
here are deterministic (``draft_probs`` None: a point mass), which the accept/reject
rule handles exactly for sampled requests too.

* :class:`PromptLookup`: n-gram match over the context, no model (copies from the prompt:
  code edits, retrieval answers, summaries).
* :class:`DraftModel`: a small model sharing the tokenizer, on its own engine and paged
  KV, decoding its k proposals greedily.
* EAGLE-3 heads (future): a third class here. The published heads hold ``fc`` (three of
  the target's hidden states concatenated -> hidden), one decoder layer, ``norm``,
  ``lm_head`` over a reduced vocabulary and the ``d2t``/``t2d`` maps between it and the
  target's. They need the target's hidden states at three layers for the accepted
  positions, so ``verify`` would hand those over (an ``observe(hidden)`` call before
  ``propose``); its KV is one layer, paged like the draft model's.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from edge.model.kv import KVOutOfMemory
from edge.sampling import SamplerState

if TYPE_CHECKING:
    from edge.runtime.engine import Engine

log = logging.getLogger(__name__)


class Proposer(Protocol):
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``context``."""

    def close(self) -> None:
        """Give back what the proposer holds."""


class PromptLookup:
    """Find the longest suffix of the context (``max_ngram`` down to ``min_ngram``
    tokens) that occurred before and propose the tokens that followed it (the most recent
    occurrence with k tokens after it, else the one with the most)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        tokens = np.asarray(context, dtype=np.int64)
        n_tokens = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            suffix = tokens[n_tokens - n :]
            # Windows starting before the suffix itself: each has a token after it.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The most recent occurrence followed by k tokens, else the longest continuation.
                full = hits[hits + n + k <= n_tokens]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start : start + k].tolist()
        return []

    def close(self) -> None:
        pass


class DraftModel:
    """Greedy proposals from ``engine`` (a small model with the target's tokenizer). Its
    KV holds the context it has seen; each call rolls back what the target rejected,
    feeds what is new in one forward (its last row gives the first proposal), then
    decodes the other k - 1 through the engine's captured decode graph of ``slot``
    (``path`` "graph"; "eager" where the engine has no graphs: the reference backend).
    Its KV blocks come from the draft engine's own pool."""

    def __init__(self, engine: Engine, slot: int | None = None) -> None:
        self.engine = engine
        self.seq = engine.new_sequence(slot=slot)
        self.fed: list[int] = []  # the tokens whose K/V the draft sequence holds
        self.sampler = SamplerState(engine.cfg.vocab_size, engine.device)  # greedy: no noise read
        self.decoder = engine.slot_decoder(self.seq)
        self.path = "graph" if self.decoder is not None else "eager"
        self._warned = False

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k < 1 or not context:
            return []
        common = 0
        limit = min(len(self.fed), len(context) - 1)  # feed at least one token: its logits
        while common < limit and self.fed[common] == context[common]:
            common += 1
        self.seq.rollback(len(self.fed) - common)
        del self.fed[common:]
        new = [int(t) for t in context[common:]]
        out: list[int] = []
        try:
            logits = self.engine.prefill(self.seq, new)
            self.fed += new
            token = logits.argmax().view(1)
            out.append(int(token))
            if self.decoder is not None:
                self._decode_graph(token, k, out)
            while len(out) < k:
                logits = self.engine.forward(self.seq, [out[-1]])
                self.fed.append(out[-1])
                out.append(int(logits.argmax()))
        except KVOutOfMemory as exc:
            if not self._warned:
                log.warning("draft model KV full (%s): proposing %d of %d tokens", exc, len(out), k)
                self._warned = True
            # The prefill may have stopped between chunks: start over next time.
            self.engine.settle(self.seq)
            self.seq.release()
            self.fed.clear()
        return out

    def _decode_graph(self, token: torch.Tensor, k: int, out: list[int]) -> None:
        """The proposals after the first through the slot's decode graph, one replay each.
        Each step takes its token from the last on the device, so up to the ring's depth
        of them are launched before the first is read (none past k: it would be wasted);
        a KV pool too full for the next launch ends the proposals after those in flight."""
        decoder = self.decoder
        assert decoder is not None
        decoder.bind(self.seq, self.sampler, token)  # pos = the fed length, on the device
        inflight: deque[int] = deque()

        def take() -> None:
            self.fed.append(out[-1])  # the token the step being read took in
            out.append(decoder.read(inflight.popleft()))

        full: KVOutOfMemory | None = None
        try:
            for _ in range(k - len(out)):
                if len(inflight) == decoder.RING:
                    take()
                try:
                    inflight.append(decoder.launch(self.seq, greedy=True))  # KVOutOfMemory: nothing launched
                except KVOutOfMemory as exc:
                    full = exc
                    break
            while inflight:
                take()
        finally:
            self.engine.settle(self.seq)
        if full is not None:
            raise full

    def close(self) -> None:
        self.engine.end_sequence(self.seq)
        self.fed.clear()
