"""Background prefill pacing: how many tokens the next chunk takes, and when it may start.

While one conversation decodes, the other slot's prompt is prefilled in chunks. Two
rules keep the decoding conversation's inter-token latency near its figure alone:

- **Duty cycle.** After a chunk that kept the device busy for ``c`` seconds, the next
  may start only ``c * (1 - share) / share`` seconds after the first one ended, so
  background work takes at most ``share`` of the device's time. On a serial device (the
  CPU) that bounds the mean inter-token latency at ``1 / (1 - share)`` of its figure
  alone; on a GPU, where a chunk and decode steps run at once, it bounds it lower still.
- **Time budget.** A chunk is sized to take about ``budget`` seconds at the prefill
  throughput measured on earlier background chunks, so no chunk stalls decode for long
  whatever the device: a fixed token count is milliseconds on a large GPU and hundreds
  of milliseconds on an 8-SM one. The budget is explicit, or by default
  ``steps_per_chunk`` decode steps of the active conversation as measured with no
  background work; ``max_chunk`` tokens bound it from above.

Every time is passed in by the caller: nothing here reads a clock, so tests step it
with invented timings.
"""

from __future__ import annotations

import statistics
from collections import deque


class Pacing:
    """Chunk sizes and start times of background prefill; see the module docstring.

    ``max_chunk``: the upper bound in tokens (``--prefill-chunk``). ``budget_s``: the
    time one chunk may take; None sizes it from the decode step. ``share``: the
    largest fraction of the device's time background chunks may take. ``granule``:
    chunks are whole multiples of it (a KV page, a GEMM-friendly M), and the first,
    probing chunk is one granule. ``rate_weight``: weight of the newest chunk in the
    throughput average.
    """

    def __init__(
        self,
        max_chunk: int,
        budget_s: float | None = None,
        share: float = 0.15,
        steps_per_chunk: float = 2.0,
        granule: int = 16,
        rate_weight: float = 0.5,
        step_window: int = 9,
    ) -> None:
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be positive, got {max_chunk}")
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"the prefill time budget must be positive, got {budget_s} s")
        if not 0.0 < share <= 1.0:
            raise ValueError(f"background_share must be in (0, 1], got {share}")
        if not steps_per_chunk > 0:
            raise ValueError(f"steps_per_chunk must be positive, got {steps_per_chunk}")
        if granule < 1:
            raise ValueError(f"granule must be positive, got {granule}")
        if not 0.0 < rate_weight <= 1.0:
            raise ValueError(f"rate_weight must be in (0, 1], got {rate_weight}")
        self.max_chunk = max_chunk
        self.explicit_budget_s = budget_s
        self.share = share
        self.steps_per_chunk = steps_per_chunk
        self.granule = granule
        self.rate_weight = rate_weight
        self._steps: deque[float] = deque(maxlen=step_window)  # decode steps with no chunk running
        self.tokens_per_s: float | None = None  # background prefill throughput, averaged
        self.in_flight = False  # a chunk was started and its time is not known yet
        self.resume_at = float("-inf")  # no chunk starts before this time
        self.last_chunk_tokens = 0
        self.last_chunk_s: float | None = None
        self.chunks = 0  # chunks that ran, and their device time, since the start
        self.busy_s = 0.0

    # -- measurements -----------------------------------------------------------------

    def decode_step(self, seconds: float) -> None:
        """A decode step of the active conversation took ``seconds`` (wall time). Only
        steps with no chunk running count: they define the figure alone."""
        if not self.in_flight and seconds > 0:
            self._steps.append(seconds)

    def chunk_started(self) -> None:
        self.in_flight = True

    def chunk_done(self, tokens: int, busy_s: float, now: float) -> None:
        """A chunk of ``tokens`` kept the device busy for ``busy_s``; it was known to
        have ended at ``now``."""
        self.in_flight = False
        busy_s = max(busy_s, 0.0)
        self.resume_at = now + busy_s * (1.0 - self.share) / self.share
        if tokens <= 0 or busy_s <= 0:
            return  # nothing ran (blocks were short): no throughput to learn
        self.last_chunk_tokens, self.last_chunk_s = tokens, busy_s
        self.chunks += 1
        self.busy_s += busy_s
        rate = tokens / busy_s
        w = self.rate_weight
        self.tokens_per_s = rate if self.tokens_per_s is None else w * rate + (1.0 - w) * self.tokens_per_s

    # -- decisions --------------------------------------------------------------------

    @property
    def step_s(self) -> float | None:
        """The active conversation's decode step alone (median of the recent ones)."""
        return statistics.median(self._steps) if self._steps else None

    @property
    def budget_s(self) -> float | None:
        """The time one chunk may take, or None before any decode step was seen."""
        if self.explicit_budget_s is not None:
            return self.explicit_budget_s
        step = self.step_s
        return None if step is None else self.steps_per_chunk * step

    def due(self, now: float) -> bool:
        """May a background chunk start now?"""
        return not self.in_flight and now >= self.resume_at

    def chunk_tokens(self) -> int:
        """Tokens for the next chunk: the budget times the measured throughput, in
        whole granules, at least one granule and at most ``max_chunk``. Before any
        throughput is known, one granule (a probe).

        Sizing by the previous chunks' tokens per second converges to the chunk that
        takes the budget even when each chunk also pays a fixed cost ``a``: with
        ``t(n) = a + b n`` the next size ``B n / t(n)`` has its fixed point at
        ``t(n) = B``; when ``a`` alone exceeds the budget it settles on one granule.
        """
        floor = min(self.granule, self.max_chunk)
        budget = self.budget_s
        if self.tokens_per_s is None or budget is None:
            return floor
        tokens = int(budget * self.tokens_per_s) // self.granule * self.granule
        return max(floor, min(self.max_chunk, tokens))

    def describe(self) -> dict:
        budget, step = self.budget_s, self.step_s
        return {
            "budget_ms": None if budget is None else budget * 1e3,
            "budget_source": "explicit" if self.explicit_budget_s is not None else f"{self.steps_per_chunk:g} decode steps",
            "decode_step_ms": None if step is None else step * 1e3,
            "share": self.share,
            "max_chunk": self.max_chunk,
            "next_chunk_tokens": self.chunk_tokens(),
            "tokens_per_s": self.tokens_per_s,
            "last_chunk_tokens": self.last_chunk_tokens,
            "last_chunk_ms": None if self.last_chunk_s is None else self.last_chunk_s * 1e3,
            "chunks": self.chunks,
            "busy_s": self.busy_s,
        }
