"""Log a message only the first time a key is seen (per process)."""

from __future__ import annotations

import logging
import threading

_seen: set[object] = set()
_lock = threading.Lock()


def log_once(logger: logging.Logger, key: object, level: int, msg: str, *args,
             exc_info: bool = False) -> bool:
    """Log ``msg`` unless ``key`` was logged before. Returns True when it logged."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.log(level, msg, *args, exc_info=exc_info)
    return True


def reset_log_once() -> None:
    """Forget what was logged (for tests)."""
    with _lock:
        _seen.clear()
