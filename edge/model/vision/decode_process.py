"""Image decoding in a child process of its own, so that no image can hold the server's
interpreter.

Pillow keeps the GIL through parts of a decode (allocating a 40-megapixel frame takes tens
of milliseconds with it held), and every torch op of the engine loop's decode step gives
the GIL up and must win it back: beside a large decode each step waits for it over and
over, and a stream stalls for a tenth of a second. In a child process the decode, the EXIF
turn, the RGB conversion and the resize hold only the child's interpreter; the server gets
back the resized pixels (:class:`~edge.model.vision.preprocess.PreparedImage`). The child
imports Pillow and numpy, not torch, and runs at a lower CPU priority than the token loop.
A decoder crash (a malformed file meeting a codec bug) costs one 400 and a new child, not
the service.

The protocol is one request at a time over the child's stdin / stdout: a length-prefixed
pickle each way (both ends are this module; nothing from the network is unpickled).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from edge.errors import ImageError
from edge.model.vision.request import ImageLimits

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
# The decode is batch work beside the token loop: on a board with few cores it yields them.
CHILD_NICENESS = 10


def _write_frame(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    (n,) = _LENGTH.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


class DecodeProcess:
    """A child process that turns encoded image bytes into prepared images; started at the
    first image and again after a crash. Thread-safe (one decode at a time)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def prepare(self, data: bytes, limits: ImageLimits, cfg: Any) -> Any:
        """``decode_image`` then ``preprocess`` of ``data`` in the child: a PreparedImage, or
        ImageError (the child's one line, or that it stopped)."""
        from edge.model.vision.preprocess import PreparedImage

        with self._lock:
            proc = self._running()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _write_frame(proc.stdin, (bytes(data), limits, cfg))
                reply = _read_frame(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                code = self._reap()
                log.warning("the image decoding process stopped (exit code %s); a new one starts at the next image",
                            code)
                raise ImageError(f"cannot decode image: the decoder stopped on it (exit code {code})") from None
        if reply[0] == "error":
            raise ImageError(reply[1])
        _, raw, grid, digest = reply
        return PreparedImage(raw, grid, digest, cfg.merge_size, cfg)

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            root = str(Path(__file__).resolve().parents[3])  # the folder holding the edge package
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "edge.model.vision.decode_process"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
            )
        return self._proc

    def _reap(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        proc.kill()
        return proc.wait()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        """End the child (it exits at the end of its input)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """The child: requests until the end of its input."""
    from edge.model.vision.preprocess import decode_image, preprocess

    while True:
        try:
            data, limits, cfg = _read_frame(inp)
        except EOFError:
            return
        try:
            image = preprocess(decode_image(data, limits, cfg), cfg)
            reply: tuple = ("ok", image.raw, image.grid, image.digest)
        except ImageError as exc:
            reply = ("error", str(exc))
        except Exception as exc:  # whatever the input: one line back, never a dead server
            reply = ("error", f"cannot decode image: {type(exc).__name__}: {exc}")
        _write_frame(out, reply)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server ends us
    try:
        os.nice(CHILD_NICENESS)
    except OSError:
        pass
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a library's print must not land in the protocol
    _serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
