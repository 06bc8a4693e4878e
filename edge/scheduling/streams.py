"""Where the scheduler's device work runs: two CUDA streams and their events, or the
CPU's synchronous calls behind the same interface.

On a GPU the decoding slot's work goes to a high-priority stream and background
prefill to a low-priority one; a slot that moves between them orders the new stream
after the old. Every host wait on the device goes through an event made with
``blocking=True``: the waiting thread sleeps until the device signals it instead of
spinning a core (an Orin's few CPU cores share the power budget with its GPU); an
engine made with ``blocking_waits=False`` spins, for comparison.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from edge.runtime.engine import Engine


class Lane:
    """The stream of one slot's latest device work (None: none yet, or the CPU)."""

    __slots__ = ("stream",)

    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None


class PendingToken(Protocol):
    """A sampled token on its way to the host."""

    def done(self) -> bool: ...

    def wait(self) -> int: ...


class ChunkTimer(Protocol):
    """The device time of one prefill chunk, known once the chunk has run."""

    def stop(self) -> None: ...

    def elapsed_s(self) -> float | None: ...


class _KnownToken:
    def __init__(self, value: int) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self) -> int:
        return self.value


class _WallTimer:
    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._elapsed: float | None = None

    def stop(self) -> None:
        self._elapsed = time.perf_counter() - self._t0

    def elapsed_s(self) -> float | None:
        return self._elapsed


class HostStreams:
    """The CPU: every call runs to completion before it returns."""

    def bind_thread(self) -> None:
        pass

    @contextlib.contextmanager
    def on(self, lane: Lane, high: bool, carry: torch.Tensor | None = None) -> Iterator[None]:
        yield

    def pinned_token(self) -> torch.Tensor:
        return torch.empty(1, dtype=torch.long)

    def read(self, token: torch.Tensor) -> int:
        return int(token)

    def defer(self, token: torch.Tensor, host: torch.Tensor) -> PendingToken:
        return _KnownToken(int(token))

    def timer(self) -> ChunkTimer:
        return _WallTimer()

    def drain(self, lane: Lane) -> None:
        pass

    def drain_all(self) -> None:
        pass


class _EventToken:
    def __init__(self, host: torch.Tensor, event: torch.cuda.Event) -> None:
        self._host = host
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> int:
        self._event.synchronize()  # a blocking-sync event (the default): the thread sleeps
        return int(self._host[0])


class _EventTimer:
    """Timing events on the current stream; polled, never waited on."""

    def __init__(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()
        self._end: torch.cuda.Event | None = None

    def stop(self) -> None:
        self._end = torch.cuda.Event(enable_timing=True)
        self._end.record()

    def elapsed_s(self) -> float | None:
        if self._end is None or not self._end.query():
            return None
        return self._start.elapsed_time(self._end) / 1e3


class CudaStreams:
    """A high-priority stream for decode and foreground prefill, a low-priority one for
    background prefill, and sleeping waits (``blocking=False``: spinning ones, to
    compare). ``new_stream(priority)`` makes the streams (the engine's, so that an
    SM-restricted context gives its own)."""

    def __init__(self, device: torch.device, new_stream: Callable[[int], torch.cuda.Stream], blocking: bool = True) -> None:
        self.device = device
        self.blocking = blocking
        # Lower number = higher priority; out-of-range values are clamped by CUDA.
        self.high = new_stream(-5)
        self.low = new_stream(0)
        self._scratch = self.pinned_token()  # the loop thread reads one token at a time

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    @contextlib.contextmanager
    def on(self, lane: Lane, high: bool, carry: torch.Tensor | None = None) -> Iterator[None]:
        """Run the slot's work on the high or low stream; ``carry`` (a device tensor
        the slot's earlier work made) stays alive until the new stream has used it."""
        stream = self.high if high else self.low
        if lane.stream is not None and lane.stream is not stream:
            stream.wait_stream(lane.stream)
            if carry is not None and carry.is_cuda:
                carry.record_stream(stream)
        lane.stream = stream
        with torch.cuda.stream(stream):
            yield

    def pinned_token(self) -> torch.Tensor:
        return torch.empty(1, dtype=torch.long, pin_memory=True)

    def read(self, token: torch.Tensor) -> int:
        """The value of a token sampled on the current stream, waiting asleep."""
        return self.defer(token, self._scratch).wait()

    def defer(self, token: torch.Tensor, host: torch.Tensor) -> PendingToken:
        """Start copying ``token`` into pinned ``host``; read it when ``done()``."""
        if not token.is_cuda:
            return _KnownToken(int(token))
        host.copy_(token.view(1), non_blocking=True)
        event = torch.cuda.Event(blocking=self.blocking)
        event.record()
        return _EventToken(host, event)

    def timer(self) -> ChunkTimer:
        return _EventTimer()

    def drain(self, lane: Lane) -> None:
        """Wait (asleep) for the slot's work: nothing may still write blocks given away."""
        if lane.stream is not None:
            self._wait(lane.stream)

    def drain_all(self) -> None:
        for stream in (self.high, self.low, torch.cuda.current_stream(self.device)):
            self._wait(stream)

    def _wait(self, stream: torch.cuda.Stream) -> None:
        event = torch.cuda.Event(blocking=self.blocking)
        event.record(stream)
        event.synchronize()


def device_streams(engine: "Engine") -> HostStreams | CudaStreams:
    """The engine's device: its streams and its kind of wait (``blocking_waits``)."""
    if engine.device.type != "cuda":
        return HostStreams()
    return CudaStreams(engine.device, engine.new_stream, engine.blocking_waits)
