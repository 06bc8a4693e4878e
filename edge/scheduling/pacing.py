"""Background prefill pacing: how many tokens the next chunk takes, and when it may start.

While one conversation decodes, the other slot's prompt is prefilled in chunks. These
rules keep the decoding conversation's inter-token latency (ITL) near its figure alone:

- **ITL target.** A chunk starts a cycle that lasts until the next chunk starts. The
  next chunk may start only once the tokens decoded since this one started came, on
  average, no slower than ``itl_target`` times the current clean ITL: the median
  interval between recent tokens with no chunk running or run between them. This
  holds whatever the chunk costs: its own time on a serial device (the CPU), the
  decode steps it slows on a GPU where both run at once. The clean ITL follows the
  active conversation as its context grows; what a chunk leaves behind (colder caches,
  KV blocks interleaved with the other slot's) shows in it, which is why the target
  is below the 1.25x the service promises against a conversation decoding alone. A
  floor keeps the prompt moving when the target cannot be met: a chunk may always
  start once the last one took at most ``min_share`` of the time since it started.
- **Time budget.** A chunk is sized to take about ``budget`` seconds, so no chunk stalls
  decode for long whatever the device: the time a fixed token count takes depends on
  the device's SMs and bandwidth by orders of magnitude. The budget is explicit, or by
  default ``steps_per_chunk`` times the clean ITL; ``max_chunk`` tokens bound it from above.
- **Fixed cost.** A chunk's time is modelled as ``fixed + per_token * tokens``: quantized
  linears expand every weight once per chunk whatever its length. The fixed part is
  the intercept of a least-squares line through the recent chunks' (tokens, time),
  updated while their times differ enough to measure it and held otherwise; until
  then, chunks that would stop growing double instead, so that their times come apart.
  The per-token part is the recent chunks' mean time less the fixed part over their
  mean size, so it follows the device (clocks, deeper prompt positions). When the
  fixed part exceeds ``fixed_share`` of the budget, a chunk that fits the budget would
  be mostly fixed cost, so the chunk is instead sized for the fixed part to be
  ``fixed_share`` of its time: fewer, longer chunks, each followed by the decode steps
  that keep the ITL target on average. With no fixed cost (float weights) this is the
  budget rule alone.

Every time is passed in by the caller: nothing here reads a clock, so tests step it
with invented timings.
"""

from __future__ import annotations

import statistics
from collections import deque


class Pacing:
    """Chunk sizes and start times of background prefill; see the module docstring.

    ``max_chunk``: the upper bound in tokens (``--prefill-chunk``). ``budget_s``: the
    time one chunk may take; None sizes it from the clean ITL. ``granule``: chunks are
    whole multiples of it (a KV page, a GEMM-friendly M), and the first, probing chunk
    is one granule. ``rate_weight``: weight of the newest chunk in the averages of chunk
    size and time. ``fixed_share``: the part of a chunk's time its fixed cost takes once
    that cost no longer fits the budget. ``fit_memory``: chunks after which an old
    chunk's weight in the fixed-cost fit has fallen by a factor e.
    """

    def __init__(
        self,
        max_chunk: int,
        budget_s: float | None = None,
        itl_target: float = 1.15,
        min_share: float = 0.05,
        steps_per_chunk: float = 2.0,
        granule: int = 16,
        rate_weight: float = 0.5,
        itl_window: int = 9,
        fixed_share: float = 0.5,
        fit_memory: float = 32.0,
    ) -> None:
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be positive, got {max_chunk}")
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"the prefill time budget must be positive, got {budget_s} s")
        if not itl_target > 1.0:
            raise ValueError(f"itl_target must be above 1, got {itl_target}")
        if not 0.0 < min_share <= 1.0:
            raise ValueError(f"min_share must be in (0, 1], got {min_share}")
        if not steps_per_chunk > 0:
            raise ValueError(f"steps_per_chunk must be positive, got {steps_per_chunk}")
        if granule < 1:
            raise ValueError(f"granule must be positive, got {granule}")
        if not 0.0 < rate_weight <= 1.0:
            raise ValueError(f"rate_weight must be in (0, 1], got {rate_weight}")
        if not 0.0 < fixed_share < 1.0:
            raise ValueError(f"fixed_share must be in (0, 1), got {fixed_share}")
        if not fit_memory >= 1.0:
            raise ValueError(f"fit_memory must be at least 1 chunk, got {fit_memory}")
        self.max_chunk = max_chunk
        self.explicit_budget_s = budget_s
        self.itl_target = itl_target
        self.min_share = min_share
        self.steps_per_chunk = steps_per_chunk
        self.granule = granule
        self.rate_weight = rate_weight
        self.fixed_share = fixed_share
        self._itl: deque[float] = deque(maxlen=itl_window)  # clean intervals between tokens
        self._last_token: float | None = None
        self._chunk_since_token = False  # a chunk ran or runs since the last token
        self._mean_tokens: float | None = None  # recent chunks' size and time, averaged alike
        self._mean_s = 0.0
        self._fit = _LineFit(fit_memory)  # chunk time against chunk tokens
        self._fixed_s: float | None = None  # the fit's last measurable intercept
        self._largest = 0  # tokens of the largest chunk timed
        self.in_flight = False  # a chunk was started and its time is not known yet
        self._cycle_start: float | None = None  # when the last chunk started
        self._cycle_tokens = 0  # tokens decoded since
        self._last_busy_s = 0.0
        self.last_chunk_tokens = 0
        self.last_chunk_s: float | None = None
        self.chunks = 0  # chunks that ran, and their device time, since the start
        self.busy_s = 0.0

    # -- measurements -----------------------------------------------------------------

    def stream_started(self) -> None:
        """Another conversation decodes from now on: no interval spans the switch."""
        self._last_token = None

    def token(self, now: float) -> None:
        """The active conversation got a token at ``now``."""
        clean = not self._chunk_since_token and not self.in_flight
        if clean and self._last_token is not None and now > self._last_token:
            self._itl.append(now - self._last_token)
        self._last_token = now
        self._chunk_since_token = self.in_flight
        self._cycle_tokens += 1

    def chunk_started(self, now: float) -> None:
        self.in_flight = True
        self._chunk_since_token = True
        self._cycle_start = now
        self._cycle_tokens = 0

    def chunk_done(self, tokens: int, busy_s: float) -> None:
        """The last chunk, of ``tokens``, kept the device busy for ``busy_s``."""
        self.in_flight = False
        self._last_busy_s = max(busy_s, 0.0)
        if tokens <= 0 or busy_s <= 0:
            return  # nothing ran (blocks were short): no throughput to learn
        self._fit.add(tokens, busy_s)
        fixed = self._fit.intercept()
        if fixed is not None:  # else the last measurable one holds
            self._fixed_s = max(fixed, 0.0)
        self._largest = max(self._largest, tokens)
        self.last_chunk_tokens, self.last_chunk_s = tokens, busy_s
        self.chunks += 1
        self.busy_s += busy_s
        w = self.rate_weight
        if self._mean_tokens is None:
            self._mean_tokens, self._mean_s = float(tokens), busy_s
        else:
            self._mean_tokens = w * tokens + (1.0 - w) * self._mean_tokens
            self._mean_s = w * busy_s + (1.0 - w) * self._mean_s

    # -- decisions --------------------------------------------------------------------

    @property
    def itl_s(self) -> float | None:
        """The clean ITL: median of the recent intervals with no chunk in them."""
        return statistics.median(self._itl) if self._itl else None

    @property
    def budget_s(self) -> float | None:
        """The time one chunk may take, or None before any clean ITL was seen."""
        if self.explicit_budget_s is not None:
            return self.explicit_budget_s
        itl = self.itl_s
        return None if itl is None else self.steps_per_chunk * itl

    @property
    def fixed_s(self) -> float | None:
        """A chunk's fixed cost, or None before chunks of clearly different times ran."""
        return self._fixed_s

    @property
    def per_token_s(self) -> float | None:
        """A chunk's cost per token beyond the fixed one, or None before any chunk ran."""
        if self._mean_tokens is None:
            return None
        variable = self._mean_s - (self.fixed_s or 0.0)
        # A fixed cost estimated near the whole chunk time leaves the per-token cost to
        # timing noise; a floor keeps the next chunk bounded while more chunks are timed.
        return max(variable, 0.1 * self._mean_s) / self._mean_tokens

    @property
    def tokens_per_s(self) -> float | None:
        """Background prefill throughput of the recent chunks, fixed cost included."""
        return None if self._mean_tokens is None else self._mean_tokens / self._mean_s

    def due(self, now: float) -> bool:
        """May a background chunk start now?"""
        if self.in_flight:
            return False
        if self._cycle_start is None:
            return True
        elapsed = now - self._cycle_start
        if self._last_busy_s <= self.min_share * elapsed:
            return True
        itl = self.itl_s
        return itl is not None and self._cycle_tokens > 0 and elapsed <= self.itl_target * itl * self._cycle_tokens

    def chunk_tokens(self) -> int:
        """Tokens for the next chunk, in whole granules, at least one granule and at
        most ``max_chunk``: the chunk that takes the budget, or, when the fixed cost is
        over ``fixed_share`` of the budget, the chunk whose time it is that share of.
        Before any chunk ran, one granule (a probe). Until the fixed cost is known it
        is taken as zero, and from the third chunk on a size that would not exceed the
        largest so far is twice that instead: a fixed cost shows only once chunk
        times, not just sizes, differ, and each doubling costs little more than the
        fixed cost itself where that cost is what keeps the times alike."""
        floor = min(self.granule, self.max_chunk)
        budget, per_token = self.budget_s, self.per_token_s
        if per_token is None or budget is None:
            return floor
        fixed = self.fixed_s
        target = budget if fixed is None else max(budget, fixed / self.fixed_share)
        tokens = int((target - (fixed or 0.0)) / per_token) // self.granule * self.granule
        tokens = max(floor, min(self.max_chunk, tokens))
        if fixed is None and self.chunks >= 2 and tokens <= self._largest:
            tokens = min(self.max_chunk, 2 * self._largest)
        return tokens

    def describe(self) -> dict:
        budget, itl, fixed, per_token = self.budget_s, self.itl_s, self.fixed_s, self.per_token_s
        return {
            "budget_ms": None if budget is None else budget * 1e3,
            "budget_source": "explicit" if self.explicit_budget_s is not None else f"{self.steps_per_chunk:g} x clean ITL",
            "clean_itl_ms": None if itl is None else itl * 1e3,
            "itl_target": self.itl_target,
            "max_chunk": self.max_chunk,
            "next_chunk_tokens": self.chunk_tokens(),
            "tokens_per_s": self.tokens_per_s,
            "chunk_fixed_ms": None if fixed is None else fixed * 1e3,
            "chunk_per_token_ms": None if per_token is None else per_token * 1e3,
            "last_chunk_tokens": self.last_chunk_tokens,
            "last_chunk_ms": None if self.last_chunk_s is None else self.last_chunk_s * 1e3,
            "chunks": self.chunks,
            "busy_s": self.busy_s,
        }


class _LineFit:
    """Least squares of chunk time on chunk tokens, older chunks weighing less
    (``memory``: chunks to forget by a factor e), so the line follows the device."""

    def __init__(self, memory: float) -> None:
        self.keep = 1.0 - 1.0 / memory
        self.w = self.n = self.t = self.nn = self.nt = self.tt = 0.0  # weighted sums

    def add(self, n: float, t: float) -> None:
        k = self.keep
        self.w = k * self.w + 1.0
        self.n, self.t = k * self.n + n, k * self.t + t
        self.nn, self.nt, self.tt = k * self.nn + n * n, k * self.nt + n * t, k * self.tt + t * t

    def intercept(self, min_time_cv: float = 0.2) -> float | None:
        """The line's time at zero tokens, or None while chunk times vary less than
        ``min_time_cv`` of their mean: an intercept is measurable only from chunks
        whose times, not just sizes, differ by more than their noise."""
        if self.w == 0.0:
            return None
        mn, mt = self.n / self.w, self.t / self.w
        var_n, var_t = self.nn / self.w - mn * mn, self.tt / self.w - mt * mt
        if var_n <= 0.0 or var_t < (min_time_cv * mt) ** 2:
            return None
        return mt - (self.nt / self.w - mn * mt) / var_n * mn
