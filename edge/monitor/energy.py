"""Energy meter: integrates total power over time, overall and per request.

Power between two samples is taken as linear (trapezoid rule). A request's
energy is the integral of that piecewise-linear power over [begin, end]:
sample intervals are clipped to the request, so partial intervals at either
end are interpolated. Beyond the last sample (a request that ends before the
next sample arrives) the last power is held, likewise before the first.

Samples without a power reading are skipped (the line bridges the gap). With
no power reading at all the meter answers None, never 0.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Callable, Hashable

from .sample import Sample


class EnergyMeter:
    """Hook: ``sampler.add_hook(meter)``; ``begin``/``end`` from any thread.

    ``clock`` must be the clock that stamps the samples (the sampler's; both
    default to ``time.monotonic``). ``history_s`` seconds of samples are kept
    for :meth:`energy_between`, plus whatever active requests still need;
    ``max_points`` bounds memory if requests are begun and never ended.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 history_s: float = 60.0, max_points: int = 100_000) -> None:
        self.clock = clock
        self.history_s = float(history_s)
        self.max_points = int(max_points)
        self._lock = threading.Lock()
        self._t: list[float] = []  # sample times with power, ascending
        self._p: list[float] = []  # watts
        self._active: dict[Hashable, float] = {}  # request id -> begin time
        self._total = 0.0
        self._total_t0: float | None = None

    # -- hook ----------------------------------------------------------------

    def __call__(self, sample: Sample) -> None:
        if sample.power_w is None:
            return
        self.add_point(sample.time, sample.power_w)

    def add_point(self, t: float, power_w: float) -> None:
        """Record power ``power_w`` at time ``t`` (what the hook does)."""
        t, p = float(t), float(power_w)
        with self._lock:
            if self._t and t <= self._t[-1]:
                if t == self._t[-1]:
                    self._p[-1] = p  # same instant: keep the latest reading
                return  # out of order: ignore
            if self._t:
                self._total += 0.5 * (self._p[-1] + p) * (t - self._t[-1])
            else:
                self._total_t0 = t
            self._t.append(t)
            self._p.append(p)
            self._prune()

    def _prune(self) -> None:
        cutoff = self._t[-1] - self.history_s
        if self._active:
            cutoff = min(cutoff, min(self._active.values()))
        # keep the last point at or before the cutoff: it bounds the interval
        i = bisect.bisect_right(self._t, cutoff) - 1
        i = max(i, len(self._t) - self.max_points)
        if i > 0:
            del self._t[:i]
            del self._p[:i]

    # -- requests ------------------------------------------------------------

    def begin(self, request_id: Hashable, t: float | None = None) -> None:
        """Start metering ``request_id`` now (or at ``t``)."""
        with self._lock:
            self._active[request_id] = self.clock() if t is None else float(t)

    def end(self, request_id: Hashable, t: float | None = None) -> float | None:
        """Stop metering ``request_id``; joules over its lifetime, None if unknown.

        Raises KeyError for an id that was never begun (or already ended).
        """
        with self._lock:
            t0 = self._active.pop(request_id)
            t1 = self.clock() if t is None else float(t)
            return self._integrate(t0, t1)

    def discard(self, request_id: Hashable) -> None:
        """Forget ``request_id`` without measuring it."""
        with self._lock:
            self._active.pop(request_id, None)

    @property
    def active_requests(self) -> int:
        return len(self._active)

    def energy_between(self, t0: float, t1: float) -> float | None:
        """Joules between times ``t0`` and ``t1`` (same rules as a request)."""
        with self._lock:
            return self._integrate(float(t0), float(t1))

    @property
    def total_joules(self) -> float | None:
        """Joules from the first to the last power sample; None without power."""
        with self._lock:
            return None if self._total_t0 is None else self._total

    @property
    def latest_power_w(self) -> float | None:
        with self._lock:
            return self._p[-1] if self._p else None

    # -- integral ------------------------------------------------------------

    def _integrate(self, a: float, b: float) -> float | None:
        ts, ps = self._t, self._p
        if not ts:
            return None
        if b <= a:
            return 0.0
        n = len(ts)

        def power(x: float, k: int) -> float:
            # power at x inside segment k = [ts[k-1], ts[k]] (k=0: before first,
            # k=n: after last) -- held outside the samples
            if k == 0:
                return ps[0]
            if k == n:
                return ps[-1]
            t_lo, t_hi = ts[k - 1], ts[k]
            return ps[k - 1] + (ps[k] - ps[k - 1]) * (x - t_lo) / (t_hi - t_lo)

        energy = 0.0
        k = bisect.bisect_right(ts, a)  # segment holding a
        while True:
            lo = ts[k - 1] if k > 0 else a
            hi = ts[k] if k < n else b
            x0, x1 = max(a, lo), min(b, hi)
            if x1 > x0:
                energy += 0.5 * (power(x0, k) + power(x1, k)) * (x1 - x0)
            if k >= n or hi >= b:
                break
            k += 1
        return energy
