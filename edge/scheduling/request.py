"""Requests as callers see them: a handle whose events stream from the engine thread.

The engine thread appends chunks to an unbounded per-request list and wakes whoever
waits: threads through a condition variable, asyncio tasks through
``loop.call_soon_threadsafe``. Neither can block the engine thread: a slow consumer
only lets its own list grow.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from edge.errors import InvalidPrompt, QueueFull
from edge.model.generation import Chunk, GenerationResult

__all__ = ["InvalidPrompt", "QueueFull", "RequestHandle"]

if TYPE_CHECKING:
    from edge.scheduling.loop import Scheduler


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class RequestHandle:
    """One submitted request. Iterate it (from a thread or from asyncio) to receive
    ``Chunk``s as they are produced; the last one has ``finish_reason`` and ``usage``.

    Every iterator sees every chunk from the start (the handle keeps them all), so
    ``result()`` after a partial iteration still returns the whole output.
    """

    def __init__(self, request_id: str, scheduler: "Scheduler | None" = None) -> None:
        self.id = request_id
        self._scheduler = scheduler
        self._cond = threading.Condition(threading.Lock())
        self._chunks: list[Chunk] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._final: Chunk | None = None

    def __repr__(self) -> str:
        state = self._final.finish_reason if self._final is not None else "running"
        return f"RequestHandle({self.id!r}, {state})"

    # -- producer side (engine thread) --------------------------------------------------

    def _push(self, chunk: Chunk) -> None:
        with self._cond:
            if self._final is not None:
                return  # nothing after the final chunk
            self._chunks.append(chunk)
            if chunk.finish_reason is not None:
                self._final = chunk
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that event loop is closed: nobody is listening there
                pass

    # -- consumer side --------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._final is not None

    @property
    def finish_reason(self) -> str | None:
        return self._final.finish_reason if self._final is not None else None

    def _get(self, index: int, timeout: float | None) -> Chunk:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._chunks) > index, timeout):
                raise TimeoutError(f"request {self.id}: no event within {timeout} s")
            return self._chunks[index]

    def __iter__(self) -> Iterator[Chunk]:
        i = 0
        while True:
            chunk = self._get(i, None)
            i += 1
            yield chunk
            if chunk.finish_reason is not None:
                return

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            with self._cond:
                if len(self._chunks) > i:
                    chunk, fut = self._chunks[i], None
                else:
                    chunk, fut = None, loop.create_future()
                    self._waiters.append((loop, fut))
            if fut is not None:
                await fut
                continue
            i += 1
            yield chunk
            if chunk.finish_reason is not None:
                return

    def cancel(self) -> None:
        """Barge-in: end the request; its stream ends with a ``cancelled`` chunk."""
        if self._scheduler is not None:
            self._scheduler.cancel(self.id)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end and collect everything (``TimeoutError`` after ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        i = 0
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            chunk = self._get(i, left)
            i += 1
            if chunk.finish_reason is not None:
                break
        with self._cond:
            chunks = list(self._chunks)
        return GenerationResult.from_chunks(chunks)
