"""One request's grammar state: the allowed-token bitmask of its next step, tokens
accepted as they are sampled, rollback for speculative proposals.

Bitmasks are int32 words, bit ``i % 32`` of word ``i // 32`` set when token ``i`` is
allowed: the layout llguidance and xgrammar fill and the engine's mask kernels read."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import numpy as np
from llguidance import LLMatcher

from edge.structured.errors import GrammarError


class GrammarViolation(RuntimeError):
    """A token the grammar does not allow was accepted: the mask was not applied."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class GrammarMatcher:
    """Wraps an ``llguidance.LLMatcher`` of ``vocab_size`` tokens (the model's: ids past
    the tokenizer's are never allowed). Not thread-safe: one request, one thread."""

    def __init__(self, ll: LLMatcher, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._ll = ll
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._mask = np.zeros(self.words, dtype=np.int32)
        self._fresh = False  # _mask is the current state's
        self.mask_s = 0.0  # host time spent computing masks
        self.masks = 0

    # -- state ---------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The grammar has ended (its end was accepted, or only the end of text is left
        and it was taken)."""
        return self._ll.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar (EOS is allowed)."""
        return self._ll.is_accepting()

    def mask(self) -> np.ndarray:
        """The bitmask of the next token (computed once per state; do not modify)."""
        if not self._fresh:
            self._fill(self._mask)
            self._fresh = True
        return self._mask

    def _fill(self, out: np.ndarray) -> None:
        t0 = time.perf_counter()
        if self._ll.is_stopped():
            out[:] = 0
            words = out.view(np.uint32)
            for t in self._eos:
                words[t >> 5] |= np.uint32(1 << (t & 31))
        else:
            self._ll.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            self._check()
        self.mask_s += time.perf_counter() - t0
        self.masks += 1

    def _check(self) -> None:
        if self._ll.is_error():
            raise GrammarViolation(f"grammar matcher failed: {self._ll.get_error()}")

    # -- tokens --------------------------------------------------------------------------

    def accept(self, token: int) -> None:
        """Advance past ``token``; GrammarViolation if the grammar does not allow it."""
        if self._ll.is_stopped() and token in self._eos:
            return  # the end of text after the grammar's end (ignore_eos runs past it)
        if not self._ll.consume_token(int(token)):
            raise GrammarViolation(f"token {token} is not allowed by the grammar: {self._ll.get_error()}")
        self._fresh = False

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if n <= 0:
            return
        if not self._ll.rollback(n):
            raise GrammarViolation(f"cannot roll the grammar back {n} tokens: {self._ll.get_error()}")
        self._fresh = False

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the start, the grammar allows (state unchanged)."""
        if not tokens:
            return 0
        return self._ll.validate_tokens([int(t) for t in tokens])

    def masks_along(self, tokens: Sequence[int]) -> np.ndarray:
        """``[len(tokens) + 1, words]``: the mask before each of ``tokens`` (which the
        grammar must allow, see :meth:`valid_prefix`) and after the last, state unchanged:
        the masks of a verify step's positions."""
        out = np.empty((len(tokens) + 1, self.words), dtype=np.int32)
        out[0] = self.mask()
        for i, t in enumerate(tokens, start=1):
            self.accept(t)
            out[i] = self.mask()
        self.rollback(len(tokens))
        return out


def make_matcher_error(ll: LLMatcher) -> GrammarError | None:
    """The construction error of ``ll`` as a GrammarError, or None."""
    if not ll.is_error():
        return None
    return GrammarError(first_line(ll.get_error()))


def first_line(message: str) -> str:
    """llguidance's error on one line: its lines up to the grammar listing it appends,
    without the caret lines."""
    kept = []
    for line in message.strip().splitlines():
        if re.match(r"^\s*\d+ \|", line):
            break
        if line.strip() and line.strip() != "^":
            kept.append(line.strip())
    return " ".join(" ".join(kept).split()) or "invalid grammar"
