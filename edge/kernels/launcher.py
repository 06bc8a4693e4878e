"""Per-engine kernel loading and launching.

A :class:`Launcher` belongs to one engine's backend: it keeps the kernels that backend
loaded, the per-stream scratch buffers its kernels share, and a count of every launch
by kernel name, so a test (or ``engine.info()``) can say which kernels ran. Nothing here
is process-wide: two engines in one process have two launchers.

``overlapped()`` gives a sibling launcher that shares those caches and counts but
launches each kernel while the previous one of the stream is finishing (programmatic
dependent launch, sm_90+). Every kernel here waits for its predecessor before reading
anything a kernel may write (common.cuh: grid_dependency_wait); before that it reads
only weights, the block table, ``pos`` and K/V rows before ``pos``. So only the
captured decode step uses it: its ``pos`` and table change between replays only.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from edge.kernels import nvrtc


class _Shared:
    """What a launcher and its overlapped sibling share."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.kernels: dict[tuple, Any] = {}
        self.names: dict[int, str] = {}
        self.streams: dict[int, Any] = {}
        self.scratch: dict[tuple[str, int], Any] = {}
        self.retired: list[Any] = []  # kept alive: captured graphs may still point at them
        self.counts: Counter[str] = Counter()
        self.occupancy: dict[tuple[int, int, int], int] = {}  # (id of a kernel, threads, shared bytes) -> CTAs an SM holds


class Launcher:
    """Loads and launches the CUDA kernels of one backend on one device."""

    def __init__(
        self, device_index: int, overlap: bool = False, *, sms: int | None = None, _shared: _Shared | None = None
    ) -> None:
        """``sms``: the SM count launch plans fill (default: what the current CUDA
        context has, so a green context restricted to 16 SMs plans for 16)."""
        self.device_index = int(device_index)
        self.overlap = bool(overlap) and nvrtc.overlap_supported(self.device_index)
        self._s = _shared if _shared is not None else _Shared()
        self._sms = int(sms) if sms is not None else context_sm_count(self.device_index)

    def overlapped(self) -> "Launcher":
        """The sibling that overlaps launches where the device supports it."""
        return Launcher(self.device_index, True, sms=self._sms, _shared=self._s)

    @property
    def counts(self) -> Counter[str]:
        """Launches so far by kernel name (both siblings)."""
        return self._s.counts

    def kernel(self, source: str, name: str, defines: Mapping[str, Any] | None = None) -> Any:
        """``name`` of ``source`` compiled with ``defines``, loaded once per launcher."""
        key = (source, name, tuple(sorted((defines or {}).items())))
        k = self._s.kernels.get(key)
        if k is None:
            with self._s.lock:
                k = self._s.kernels.get(key)
                if k is None:
                    k = nvrtc.load_kernel(self.device_index, source, name, defines)
                    self._s.kernels[key] = k
                    self._s.names[id(k)] = name
        return k

    def _stream(self) -> Any:
        handle = nvrtc.current_stream_handle(self.device_index)
        s = self._s.streams.get(handle)
        if s is None:
            s = self._s.streams[handle] = nvrtc.stream_object(self.device_index, handle)
        return s

    def launch(
        self,
        kernel: Any,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        args: Sequence[Any],
        shmem: int = 0,
    ) -> None:
        """Launch a kernel this launcher loaded on torch's current stream."""
        import torch

        grid = grid if isinstance(grid, tuple) else (int(grid),)
        block = block if isinstance(block, tuple) else (int(block),)
        cfg = nvrtc.launch_config(grid, block, int(shmem), self.overlap)
        self._s.counts[self._s.names.get(id(kernel), "?")] += 1
        if torch.cuda.current_device() != self.device_index:
            with torch.cuda.device(self.device_index):
                nvrtc.core().launch(self._stream(), cfg, kernel, *args)
            return
        nvrtc.activate(self.device_index)
        nvrtc.core().launch(self._stream(), cfg, kernel, *args)

    def scratch(self, name: str, fits: Callable[[Any], bool], make: Callable[[Any], Any]) -> Any:
        """Device buffers of the kernel family ``name`` for torch's current stream.
        Per stream, because the launches of one stream never overlap (each slot's graph
        decoder captures on its own stream). The cached buffers when ``fits(buffers)``,
        else ``make(old buffers or None)``'s; replaced buffers stay alive, since a
        captured graph may still use them. Allocated through torch, so a first use
        inside a capture is capture-safe."""
        key = (name, nvrtc.current_stream_handle(self.device_index))
        cur = self._s.scratch.get(key)
        if cur is not None and fits(cur):
            return cur
        with self._s.lock:
            cur = self._s.scratch.get(key)
            if cur is not None and fits(cur):
                return cur
            new = make(cur)
            if cur is not None:
                self._s.retired.append(cur)
            self._s.scratch[key] = new
            return new

    def sm_count(self) -> int:
        return self._sms

    @property
    def tensor_device(self) -> Any:
        """Where the kernels' constant tensors live."""
        import torch

        return torch.device("cuda", self.device_index)

    def shared_memory(self) -> tuple[int, int, int]:
        """(bytes per SM, most one CTA may opt in to, bytes reserved per CTA) of the device."""
        return nvrtc.shared_memory(self.device_index)

    def allow_dynamic_smem(self, kernel: Any, nbytes: int, *, carveout: int | None = None) -> None:
        """Let ``kernel`` (loaded here) launch with ``nbytes`` of dynamic shared memory
        (:func:`edge.kernels.nvrtc.allow_dynamic_smem`)."""
        nvrtc.allow_dynamic_smem(kernel, self.device_index, nbytes, carveout=carveout)

    def resident_per_sm(self, kernel: Any, threads: int, shmem: int = 0) -> int:
        """CTAs of ``kernel`` (loaded here) one SM holds at once, launched with
        ``threads`` threads and ``shmem`` dynamic shared bytes: the driver's occupancy
        query, once per configuration."""
        key = (id(kernel), int(threads), int(shmem))
        n = self._s.occupancy.get(key)
        if n is None:
            n = self._s.occupancy[key] = nvrtc.max_active_blocks(kernel, threads, self.device_index, 1, shmem)
        return n


def context_sm_count(device_index: int) -> int:
    """SMs that torch's current stream runs on: a green context's share where the stream
    belongs to one (else the thread's current context's), else the device's. The
    stream's context first, because loading kernels makes the primary context current."""
    import torch

    total = int(torch.cuda.get_device_properties(device_index).multi_processor_count)
    try:
        driver = nvrtc._driver_module()
        err, ctx = driver.cuStreamGetCtx(driver.CUstream(torch.cuda.current_stream(device_index).cuda_stream))
        if int(err) != 0 or not int(ctx):
            err, ctx = driver.cuCtxGetCurrent()
        if int(err) != 0 or not int(ctx):
            return total
        err, res = driver.cuCtxGetDevResource(ctx, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        if int(err) != 0:
            return total
        return min(total, int(res.sm.smCount)) or total
    except Exception:  # a driver or cuda-bindings without green contexts
        return total
