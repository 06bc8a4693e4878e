"""The host's wait for a GPU step it cannot run ahead of.

Plain decoding keeps a step in flight while the host reads the previous one, so a
blocking wait (the thread sleeps until the driver wakes it) costs nothing there. A
speculative verify step is different: the host needs its result to propose the next
one, so the GPU idles for as long as the wake-up takes, which on a busy host is
hundreds of microseconds. :class:`StepWait` sleeps through most of the step instead,
from the durations of earlier steps of the same shape, and polls the event for the
rest: little CPU, and no wake-up on the critical path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

# Left to polling: this share of the expected step plus a fixed margin for the sleep's
# own overshoot (a few tens of microseconds on Linux).
POLL_SHARE = 0.08
POLL_MARGIN_S = 300e-6
# Weight of the newest step in the expected duration.
SMOOTHING = 0.25


class StepWait:
    """Waits for events of steps keyed by shape; ``sleeps=False`` polls the whole step
    (no sleeping at all). ``clock`` and ``sleep`` are injectable for tests."""

    def __init__(
        self,
        sleeps: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.sleeps = sleeps
        self._clock = clock
        self._sleep = sleep
        self.expected: dict[Hashable, float] = {}  # seconds from launch to done, by step shape
        self.slept_s = 0.0  # totals, for tests and diagnostics
        self.polls = 0

    def wait(self, event: Any, launched: float, key: Hashable) -> None:
        """Return once ``event`` (recorded after the step, polled with ``query()``) has
        completed; ``launched``: the clock when the step was launched."""
        expected = self.expected.get(key)
        if self.sleeps and expected is not None:
            wake = launched + expected * (1.0 - POLL_SHARE) - POLL_MARGIN_S
            ahead = wake - self._clock()
            if ahead > 0:
                self._sleep(ahead)
                self.slept_s += ahead
        while not event.query():
            self.polls += 1
        took = self._clock() - launched
        self.expected[key] = took if expected is None else expected + SMOOTHING * (took - expected)
