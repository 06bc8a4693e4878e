"""An exclusive lock on a directory (``flock`` on its descriptor), for steps that
check and then change what the directory holds. Advisory: it orders processes that
take it; released when the descriptor closes, also when its process is killed."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked_directory(directory: str | os.PathLike[str]) -> Iterator[Path]:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield Path(directory)
    finally:
        os.close(fd)
