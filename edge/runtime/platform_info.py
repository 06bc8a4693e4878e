"""What the CUDA stack under the engine is: versions of torch, cuda-bindings, cuda-core,
NVRTC and the driver, and the GPU's architecture, SM count and whether it is integrated.

Every piece is probed on its own and never raises: a piece that is missing or broken is
reported as None with the reason in ``missing`` (``edge info`` and ``/health`` show both,
so an operator sees at once why the kernels did not load)::

    {"torch": "2.3.0a0+40ec155e58.nv24.03", "torch_cuda": "12.2", "cuda_bindings": "12.9.10",
     "cuda_core": "1.2.2", "nvrtc": "12.2", "driver": "12.2", "device": "Orin", "arch": "sm_87",
     "sm_count": 16, "integrated": true, "missing": {}}
"""

from __future__ import annotations

import ctypes
import importlib.metadata
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

LIBCUDA = "libcuda.so.1"
# cuda-python 12.x before 12.6 shipped the bindings in the cuda-python distribution itself.
BINDINGS_DISTRIBUTIONS = ("cuda-bindings", "cuda-python")


@dataclass(frozen=True)
class PlatformInfo:
    torch: str | None = None
    torch_cuda: str | None = None  # the CUDA version torch was built with (None: CPU-only build)
    cuda_bindings: str | None = None
    cuda_core: str | None = None
    nvrtc: str | None = None
    driver: str | None = None  # the CUDA version the driver supports, e.g. "12.6"
    device: str | None = None
    arch: str | None = None  # e.g. "sm_87"
    sm_count: int | None = None
    integrated: bool | None = None  # unified memory shared with the CPU (Jetson)
    missing: dict[str, str] = field(default_factory=dict)  # piece -> why it is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def distribution_version(names: tuple[str, ...], version: Callable[[str], str]) -> str:
    errors = []
    for name in names:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            errors.append(name)
    raise LookupError(f"not installed ({' or '.join(errors)})")


def driver_version(library: str = LIBCUDA) -> str:
    """``"major.minor"`` of the CUDA API the installed driver supports (``cuDriverGetVersion``),
    read from the driver library itself so it shows even when cuda-bindings is missing."""
    lib = ctypes.CDLL(library)
    out = ctypes.c_int()
    rc = lib.cuDriverGetVersion(ctypes.byref(out))
    if rc != 0:
        raise OSError(f"cuDriverGetVersion failed with CUresult {rc}")
    return f"{out.value // 1000}.{out.value % 1000 // 10}"


def nvrtc_version() -> str:
    from edge.kernels import nvrtc

    return nvrtc.nvrtc_version()


def probe_platform(
    device: int = 0,
    *,
    version: Callable[[str], str] = importlib.metadata.version,
    driver: Callable[[], str] = driver_version,
    nvrtc: Callable[[], str] = nvrtc_version,
) -> PlatformInfo:
    """Probe each piece; the callables are injectable so tests can take pieces away."""
    found: dict[str, Any] = {}
    missing: dict[str, str] = {}

    def take(key: str, probe: Callable[[], Any]) -> None:
        try:
            found[key] = probe()
        except Exception as exc:  # each piece may fail in its own way; the report says how
            missing[key] = str(exc) or type(exc).__name__

    take("cuda_bindings", lambda: distribution_version(BINDINGS_DISTRIBUTIONS, version))
    take("cuda_core", lambda: distribution_version(("cuda-core",), version))
    take("nvrtc", nvrtc)
    take("driver", driver)
    try:
        import torch
    except Exception as exc:  # the report must come out even from a broken torch install
        missing["torch"] = f"{type(exc).__name__}: {exc}"
        return PlatformInfo(**found, missing=missing)
    found["torch"] = torch.__version__
    found["torch_cuda"] = torch.version.cuda
    if torch.version.cuda is None:
        missing["torch_cuda"] = f"torch {torch.__version__} is a CPU-only build"
    device_keys = ("device", "arch", "sm_count", "integrated")
    if not torch.cuda.is_available():
        why = missing.get("torch_cuda") or "torch.cuda.is_available() is False (no GPU, or the driver is unusable)"
        missing |= {k: why for k in device_keys}
        return PlatformInfo(**found, missing=missing)
    try:
        props = torch.cuda.get_device_properties(device)
    except Exception as exc:
        missing |= {k: f"{type(exc).__name__}: {exc}" for k in device_keys}
        return PlatformInfo(**found, missing=missing)
    found |= {
        "device": props.name,
        "arch": f"sm_{props.major}{props.minor}",
        "sm_count": int(props.multi_processor_count),
        "integrated": bool(props.is_integrated),
    }
    return PlatformInfo(**found, missing=missing)
