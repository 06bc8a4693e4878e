"""Image decoding in a child process of its own, so that no image can hold the server's
interpreter: the base64 of a data URL and the pixels both.

Pillow keeps the GIL through parts of a decode (allocating a large frame among them), and
every torch op of the engine loop's decode step gives the GIL up and must win it back:
beside a large decode each step waits for it over and over, and a stream stalls. In a
child process the base64 decode, the image decode, the EXIF turn, the RGB conversion and
the resize hold only the child's interpreter; the server gets back the encoded bytes (to
read the header from) and then the resized pixels
(:class:`~edge.model.vision.preprocess.PreparedImage`). The child imports Pillow and
numpy, not torch, and runs at a lower CPU priority than the token loop. A decoder crash
(a malformed file meeting a codec bug) costs one 400 and a new child, not the service.

The child is spawned and spoken to over a pipe as the voice front-end's recognizer is
(``edge/voice/asr.py``), one request at a time.
"""

from __future__ import annotations

import base64
import binascii
import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from edge.errors import ImageError
from edge.model.vision.request import ImageLimits

log = logging.getLogger(__name__)

# The decode is batch work beside the token loop: on a board with few cores it yields them.
CHILD_NICENESS = 10


class DecodeProcess:
    """A child process that turns encoded image bytes into prepared images; started at the
    first image and again after a crash. Thread-safe (one decode at a time)."""

    def __init__(self) -> None:
        self._child: tuple[BaseProcess, Connection] | None = None
        self._lock = threading.Lock()

    def b64decode(self, text: str) -> bytes:
        """``base64.b64decode(text, validate=True)`` in the child (one call over megabytes
        holds an interpreter throughout); ImageError when it is not base64."""
        return self._call("b64", text)[0]

    def prepare(self, data: bytes, limits: ImageLimits, cfg: Any) -> Any:
        """``decode_image`` then ``preprocess`` of ``data`` in the child: a PreparedImage, or
        ImageError (the child's one line, or that it stopped)."""
        from edge.model.vision.preprocess import PreparedImage

        raw, grid, digest = self._call("prepare", bytes(data), limits, cfg)
        return PreparedImage(raw, grid, digest, cfg.merge_size, cfg)

    def _call(self, op: str, *args: Any) -> tuple:
        with self._lock:
            _, conn = self._running()
            try:
                conn.send((op, *args))
                reply = conn.recv()
            except (EOFError, OSError):
                code = self._reap()
                log.warning("the image decoding process stopped (exit code %s); a new one starts at the next image",
                            code)
                raise ImageError(f"cannot decode image: the decoder stopped on it (exit code {code})") from None
        if reply[0] == "error":
            raise ImageError(reply[1])
        return reply[1:]

    def _running(self) -> tuple[BaseProcess, Connection]:
        if self._child is None or not self._child[0].is_alive():
            if self._child is not None:
                self._reap()
            ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), name="edge-image-decode", daemon=True)
            proc.start()
            child.close()
            self._child = (proc, conn)
        return self._child

    def _reap(self) -> int | None:
        child, self._child = self._child, None
        if child is None:
            return None
        proc, conn = child
        conn.close()
        proc.kill()
        proc.join()
        return proc.exitcode

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child[0].pid

    def close(self) -> None:
        """End the child (it exits at the end of its input)."""
        with self._lock:
            child, self._child = self._child, None
        if child is None:
            return
        proc, conn = child
        conn.close()
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _serve(conn: Connection) -> None:
    """The child: requests until the parent closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server ends us
    try:
        os.nice(CHILD_NICENESS)
    except OSError:
        pass
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:
            return
        try:
            reply: tuple = ("ok", *(_b64(*args) if op == "b64" else _prepare(*args)))
        except ImageError as exc:
            reply = ("error", str(exc))
        except Exception as exc:  # whatever the input: one line back, never a dead server
            reply = ("error", f"cannot decode image: {type(exc).__name__}: {exc}")
        conn.send(reply)


def _b64(text: str) -> tuple:
    try:
        return (base64.b64decode(text, validate=True),)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"data URL is not valid base64: {exc}") from None


def _prepare(data: bytes, limits: ImageLimits, cfg: Any) -> tuple:
    from edge.model.vision.preprocess import decode_image, preprocess

    image = preprocess(decode_image(data, limits, cfg), cfg)
    return image.raw, image.grid, image.digest
