"""The host's wait for a GPU step it cannot run ahead of.

Plain decoding keeps a step in flight while the host reads the previous one, so a
blocking wait (the thread sleeps until the driver wakes it) costs nothing there. A
speculative verify step is different: the host needs its result to propose the next
one, so the GPU idles for as long as the wake-up takes (docs/speculative.md).
:class:`StepWait` polls the event instead, napping briefly between polls: a query also
pushes to the GPU any launch the driver still holds, so one long sleep is no substitute,
and the naps keep the core mostly idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Between two polls: short against a step (milliseconds), long against a poll (a few
# microseconds), so the host wakes at most about this late and spends little CPU.
NAP_S = 50e-6


class StepWait:
    """Polls an event until done, napping ``nap_s`` between polls (0: a busy poll).
    ``sleep`` is injectable for tests."""

    def __init__(self, nap_s: float = NAP_S, sleep: Callable[[float], None] = time.sleep) -> None:
        if nap_s < 0:
            raise ValueError(f"nap_s must be >= 0, got {nap_s}")
        self.nap_s = nap_s
        self._sleep = sleep
        self.polls = 0  # queries made, for tests and diagnostics

    def wait(self, event: Any) -> None:
        """Return once ``event`` (recorded after the step, polled with ``query()``) has completed."""
        while True:
            self.polls += 1
            if event.query():
                return
            if self.nap_s:
                self._sleep(self.nap_s)
