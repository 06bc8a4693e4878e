"""Background sampler: reads a source every period and feeds the hooks."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .log_once import log_once
from .sample import Sample
from .sources import Source

log = logging.getLogger(__name__)

Hook = Callable[[Sample], object]


def _hook_name(hook: Hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


class Sampler:
    """Reads ``source`` every ``period_s`` on a daemon thread.

    Every sample goes to each hook in the order they were added. A hook that
    raises is logged with its traceback and disabled; the sampler keeps going.
    A source whose ``read`` raises is logged (once per exception type) and that
    period's sample carries no readings.

    ``clock``/``wall_clock`` stamp samples (inject them for exact tests); the
    period itself is timed with ``time.monotonic`` and an Event, so ``stop()``
    returns promptly.
    """

    def __init__(self, source: Source, period_s: float = 1.0, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 name: str = "edge-monitor") -> None:
        if not period_s > 0:
            raise ValueError("period_s must be > 0")
        self.source = source
        self.period_s = float(period_s)
        self.clock = clock
        self.wall_clock = wall_clock
        self.name = name
        self._hooks: list[Hook] = []
        self._disabled: list[Hook] = []
        self._hooks_lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._latest: Sample | None = None
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- hooks ---------------------------------------------------------------

    def add_hook(self, hook: Hook) -> Hook:
        """Register ``hook`` (called with every Sample); returns it."""
        if not callable(hook):
            raise TypeError("hook must be callable")
        with self._hooks_lock:
            self._hooks.append(hook)
        return hook

    def remove_hook(self, hook: Hook) -> None:
        with self._hooks_lock:
            if hook in self._hooks:
                self._hooks.remove(hook)

    @property
    def hooks(self) -> list[Hook]:
        """Active hooks."""
        with self._hooks_lock:
            return list(self._hooks)

    @property
    def disabled_hooks(self) -> list[Hook]:
        """Hooks disabled because they raised."""
        with self._hooks_lock:
            return list(self._disabled)

    # -- sampling ------------------------------------------------------------

    @property
    def latest(self) -> Sample | None:
        """The most recent sample (None before the first)."""
        return self._latest

    @property
    def count(self) -> int:
        """Samples taken so far."""
        return self._count

    def sample_once(self) -> Sample:
        """Read the source once, run the hooks, and return the sample."""
        with self._sample_lock:
            t, wall = self.clock(), self.wall_clock()
            try:
                sample = self.source.read(t, wall)
            except Exception as e:
                log_once(log, ("source-read", id(self.source), type(e).__name__),
                         logging.ERROR, "monitor source %s: read failed",
                         getattr(self.source, "name", "?"), exc_info=True)
                log.debug("monitor source read failed: %s", e)
                sample = Sample(time=t, wall_time=wall,
                                source=getattr(self.source, "name", "?"))
            self._latest = sample
            self._count += 1
            for hook in self.hooks:
                try:
                    hook(sample)
                except Exception:
                    log.exception("monitor hook %s raised; disabling it", _hook_name(hook))
                    with self._hooks_lock:
                        if hook in self._hooks:
                            self._hooks.remove(hook)
                            self._disabled.append(hook)
            return sample

    # -- thread --------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Sampler":
        """Start the daemon thread (first sample immediately). Idempotent."""
        if self.running:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Signal the thread and join it (waits at most ``timeout`` s)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("monitor sampler did not stop within %.1f s", timeout or 0.0)
        self._thread = None

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # pragma: no cover - sample_once already guards
                log.exception("monitor sampler iteration failed")
            next_t += self.period_s
            now = time.monotonic()
            if next_t < now:  # fell behind (slow source, suspended): don't burst
                next_t = now + self.period_s
            self._stop.wait(next_t - now)

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
