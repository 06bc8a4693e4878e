"""First start: every kernel variant an engine will load, compiled at once, in parallel.

A backend loads its kernels in its wrappers' constructors, one variant at a time: on a
first start (an empty ``~/.cache/edge/kernels``) that is one NVRTC compile after another
(minutes on an Orin's ARM cores). Here the same constructors run against a
:class:`PlanningLauncher`, which records each ``(source, defines)`` a wrapper asks for
instead of loading it, so the list is the backend's own; :func:`compile_variants` then
compiles the missing ones in a thread pool (NVRTC releases the GIL) while the engine
loads its weights, reporting progress, and the backend finds them all in the disk cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from edge.kernels import nvrtc

log = logging.getLogger(__name__)

# Shared memory (per SM, most a CTA may opt in to, reserved per CTA) of the architectures
# planned without their GPU (CI, a host preparing a board's cache).
ARCH_SHARED_MEMORY = {"sm_87": (167936, 166912, 1024), "sm_90": (233472, 232448, 1024)}


@dataclass(frozen=True)
class Variant:
    source: str
    defines: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        defs = ", ".join(f"{k.removeprefix('CFG_')}={v}" for k, v in self.defines)
        return f"{self.source}" + (f" ({defs})" if defs else "")


class _Planned:
    """What a planning launcher hands back for a kernel: its name only."""

    def __init__(self, name: str) -> None:
        self.name = name


@dataclass
class PlanningLauncher:
    """A :class:`~edge.kernels.launcher.Launcher` stand-in that records the variants the
    wrappers ask for and loads nothing (no GPU needed)."""

    arch: str
    sms: int
    smem: tuple[int, int, int]
    device_index: int = 0
    overlap: bool = False
    variants: dict[Variant, None] = field(default_factory=dict)

    def kernel(self, source: str, name: str, defines: Any = None) -> _Planned:
        self.variants[Variant(source, nvrtc._normalize_defines(defines))] = None
        return _Planned(name)

    def sm_count(self) -> int:
        return self.sms

    def shared_memory(self) -> tuple[int, int, int]:
        return self.smem

    def allow_dynamic_smem(self, kernel: Any, nbytes: int, *, carveout: int | None = None) -> None:
        if nbytes > self.smem[1]:
            raise nvrtc.KernelCompileError(f"kernel needs {nbytes} B of shared memory, the device allows {self.smem[1]} B")

    @property
    def tensor_device(self) -> Any:
        import torch

        return torch.device("meta")

    def overlapped(self) -> PlanningLauncher:
        return self


def backend_variants(
    cfg: Any,
    dtype: Any,
    *,
    arch: str,
    sms: int,
    shared_memory: tuple[int, int, int] | None = None,
    int4_scale_dtypes: Iterable[Any] = (),
    decode_tuning: Any = None,
    int8_tuning: Any = None,
    int4_tuning: Any = None,
) -> list[Variant]:
    """The variants a CUDA backend (edge/runtime/backend.py) loads for a model of ``cfg`` in
    ``dtype`` on ``sms`` SMs of ``arch``: its fused layer kernels, the paged attention of its
    head dim, the int8 linears (every float16 / bfloat16 backend has them) and, for int4
    weights, the int4 linears of each scale dtype."""
    import torch

    from edge.kernels import fused_cuda, int4_cuda, int8_cuda, paged_cuda

    launcher = PlanningLauncher(arch, sms, shared_memory or ARCH_SHARED_MEMORY[arch])
    fused_cuda.FusedCuda(launcher)  # type: ignore[arg-type]
    if dtype in paged_cuda.DTYPES and cfg.head_dim in paged_cuda.HEAD_DIMS:
        paged_cuda.PagedAttentionCuda(
            launcher, None, decode_tuning or paged_cuda.DecodeTuning(), dtypes=(dtype,),  # type: ignore[arg-type]
            head_dims=(cfg.head_dim,), sms=sms,
        )
    if dtype in int8_cuda.DTYPES:
        int8_cuda.Int8CudaLinear(launcher, None, int8_tuning or int8_cuda.Int8Tuning.for_sms(sms))  # type: ignore[arg-type]
    scales = tuple(sorted({torch.float16 if s is None else s for s in int4_scale_dtypes}, key=str))
    if scales:
        int4_cuda.Int4CudaLinear(launcher, None, int4_tuning or int4_cuda.Int4Tuning.for_sms(sms), scales)  # type: ignore[arg-type]
    return list(launcher.variants)


def compile_variants(
    variants: list[Variant],
    arch: str,
    workers: int,
    progress: Callable[[str], None] | None = None,
) -> float:
    """Compile (or find in the disk cache) every variant with ``workers`` threads; returns
    the seconds taken. ``progress`` gets a line per finished variant ("kernels 3/9: ...")."""
    t0 = time.perf_counter()
    # The largest sources first: they take longest, and the small ones fill in after them.
    ordered = sorted(variants, key=lambda v: -sum(len(text) for _, text in nvrtc._local_sources(v.source)))
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="edge-nvrtc") as pool:
        futures: dict[Future[bytes], Variant] = {
            pool.submit(nvrtc.compile_cubin, v.source, arch, dict(v.defines)): v for v in ordered
        }
        for done, future in enumerate(as_completed(futures), start=1):
            future.result()
            if progress is not None:
                progress(f"kernels {done}/{len(variants)}: {futures[future].describe()} "
                         f"({time.perf_counter() - t0:.0f} s)")
    return time.perf_counter() - t0


def missing(variants: list[Variant], arch: str) -> list[Variant]:
    """The variants not in the disk cache yet."""
    return [v for v in variants if not nvrtc.is_cached(v.source, arch, dict(v.defines))]


def start(
    cfg: Any,
    dtype: Any,
    device_index: int,
    *,
    workers: int,
    sms: int | None = None,
    int4_scale_dtypes: Iterable[Any] = (),
    decode_tuning: Any = None,
    int8_tuning: Any = None,
    int4_tuning: Any = None,
    progress: Callable[[str], None] | None = None,
) -> Future[float] | None:
    """Compile, in the background, the variants the backend of this model will load that the
    disk cache lacks; None when it has them all (every start after the first)."""
    from edge.kernels.launcher import context_sm_count

    arch = nvrtc.device_arch(device_index)
    variants = missing(
        backend_variants(
            cfg, dtype, arch=arch, sms=sms or context_sm_count(device_index),
            shared_memory=nvrtc.shared_memory(device_index), int4_scale_dtypes=int4_scale_dtypes,
            decode_tuning=decode_tuning, int8_tuning=int8_tuning, int4_tuning=int4_tuning,
        ),
        arch,
    )
    if not variants:
        return None
    workers = max(1, min(workers, len(variants)))
    if progress is not None:
        progress(f"compiling {len(variants)} kernel variants for {arch} with {workers} threads (first start)")
    runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge-prebuild")
    future = runner.submit(compile_variants, variants, arch, workers, progress)
    runner.shutdown(wait=False)
    return future
