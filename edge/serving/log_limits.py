"""Logs that an attacker cannot flood: one message repeated is written once per window.

An attack repeats one event thousands of times a second (``accept()`` out of file
descriptors, invalid requests, refused connections); each logged line costs disk and
journald, and a 58 MB log hides what happened. The first occurrence of a message is
written; repeats within ``window_s`` are counted and summarized by the next one after
the window.
"""

from __future__ import annotations

import logging
import threading
import time


class RepeatLimiter(logging.Filter):
    """Passes the first record of each (logger, level, message template) per
    ``window_s``; the next one after the window says how many were dropped."""

    def __init__(self, window_s: float = 10.0, max_keys: int = 1024) -> None:
        super().__init__()
        self.window_s = window_s
        self.max_keys = max_keys
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}  # key -> (window start, dropped)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg)[:200])
        now = time.monotonic()
        with self._lock:
            start, dropped = self._seen.get(key, (None, 0))
            if start is not None and now - start < self.window_s:
                self._seen[key] = (start, dropped + 1)
                return False
            if len(self._seen) >= self.max_keys:  # many distinct messages: forget the old windows
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
            self._seen[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} (and {dropped} more like it in the last {self.window_s:.0f} s)"
        return True


def limit_repeats(window_s: float = 10.0, logger: logging.Logger | None = None) -> RepeatLimiter:
    """Install one :class:`RepeatLimiter` on the handlers of ``logger`` (the root
    logger: every record that is written passes one of them)."""
    limiter = RepeatLimiter(window_s)
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RepeatLimiter) for f in handler.filters):
            handler.addFilter(limiter)
    return limiter
