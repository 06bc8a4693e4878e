"""Run-time compilation of the CUDA C kernels in ``edge/kernels/*.cu``.

NVRTC (through cuda-python's ``cuda.core``) compiles a source for one exact
architecture (``sm_87`` on Orin, or an arch given by the caller, as CI does), with
the CUDA headers found on the machine (``cuda_fp16.h`` / ``cuda_bf16.h``). Compiled
cubins are cached on disk (``$EDGE_CACHE_DIR/kernels`` or ``~/.cache/edge/kernels``),
keyed by the sha256 of the source, the headers it includes, the arch, the NVRTC
version and the options. Loading and launching belong to
:class:`edge.kernels.launcher.Launcher` (one per engine backend): kernels launch on
PyTorch's current stream, so they are ordered with torch work and can be captured by
``torch.cuda.graph``.

Works with cuda-python 13.x (``cuda.core``) and 12.x (``cuda.core.experimental``,
JetPack 6), cuda.core >= 0.2. Anything missing (cuda-python, the NVRTC library, the
headers, a GPU) raises :class:`KernelsUnavailable` naming what is missing; a kernel
that does not compile cleanly (errors *or* warnings) raises
:class:`KernelCompileError`.

Kernel arguments must have exact widths: pass ``numpy.int32`` / ``numpy.int64`` /
``numpy.float32`` scalars; a Python ``int`` is passed pointer-sized (use it for
``tensor.data_ptr()`` and for null pointers, ``0``).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib
import io
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent
STD = "c++17"
_CACHE_FORMAT = "edge-nvrtc-1"
# Headers whose contents go into the cache key (besides the local includes).
_SYSTEM_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp")
_INSTALL_HINT = (
    "install the CUDA Python stack of your driver's CUDA major version: pip install 'edge-llm[cuda]' "
    "(CUDA 13) or 'edge-llm[cuda12]' (CUDA 12); on a Jetson 'edge-llm[jetson]' with "
    "constraints-jetpack6.txt and JetPack's CUDA toolkit (docs/install.md, A Jetson)"
)


class KernelsUnavailable(RuntimeError):
    """The CUDA kernels cannot be used here; the message says what is missing."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source or reported warnings (treated as errors)."""


class UnplannedArguments(ValueError):
    """A kernel was called with arguments its plan did not admit: a bug in the caller,
    never a reason to run something else."""


# ---------------------------------------------------------------------------------------
# cuda-python discovery
# ---------------------------------------------------------------------------------------


@functools.cache
def core() -> Any:
    """The ``cuda.core`` namespace (13.x) or ``cuda.core.experimental`` (12.x)."""
    errors = []
    for name in ("cuda.core", "cuda.core.experimental"):
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: not installed ({exc.name or exc})")
            continue
        except Exception as exc:  # a broken install: say how it broke
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        needed = (
            "Program",
            "ProgramOptions",
            "ObjectCode",
            "Device",
            "LaunchConfig",
            "launch",
        )
        missing = [a for a in needed if not hasattr(mod, a)]
        if not missing:
            return mod
        errors.append(
            f"{name}: lacks {', '.join(missing)} (cuda.core >= 0.2 is needed)"
        )
    raise KernelsUnavailable(
        "cuda-python's cuda.core is not available ("
        + "; ".join(errors)
        + "); "
        + _INSTALL_HINT
    )


def _bindings(name: str, old_name: str) -> Any:
    """cuda-python's ``name`` bindings: ``cuda.bindings.<name>`` (>= 12.6) or the older
    12.x ``cuda.<old_name>``."""
    try:
        return importlib.import_module(f"cuda.bindings.{name}")
    except Exception:
        try:
            return importlib.import_module(f"cuda.{old_name}")
        except Exception as exc:
            raise KernelsUnavailable(
                f"cuda-python's {name} bindings are missing ({exc}); {_INSTALL_HINT}"
            )


def _nvrtc_module() -> Any:
    return _bindings("nvrtc", "nvrtc")


@functools.cache
def nvrtc_version() -> str:
    """``"major.minor"`` of the NVRTC library that will compile the kernels."""
    core()
    nvrtc = _nvrtc_module()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the shared library itself is not found / not loadable
        raise KernelsUnavailable(
            f"the NVRTC library (libnvrtc) could not be loaded: {exc}; {_INSTALL_HINT}"
        )
    if int(err) != 0:
        raise KernelsUnavailable(f"nvrtcVersion failed ({err}); {_INSTALL_HINT}")
    return f"{major}.{minor}"


def _header_dir_candidates() -> list[tuple[str, str]]:
    """(how found, directory) for every place CUDA headers may live, best first."""
    out: list[tuple[str, str]] = []
    env = os.environ.get("EDGE_CUDA_INCLUDE")
    if env:
        out += [("EDGE_CUDA_INCLUDE", d) for d in env.split(os.pathsep) if d]
    try:
        from cuda import pathfinder  # cuda-pathfinder (comes with cuda-python >= 12.9)

        finder = getattr(pathfinder, "find_nvidia_header_directory", None)
        if finder is not None:
            d = finder("cudart")
            if d:
                out.append(("cuda.pathfinder", str(d)))
    except Exception:
        pass
    # nvidia-cuda-runtime wheels: nvidia/cu13/include (13.x), nvidia/cuda_runtime/include (12.x)
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        for base in list(getattr(nvidia, "__path__", [])):
            for sub in ("cu13/include", "cu12/include", "cuda_runtime/include"):
                out.append(("nvidia wheel", os.path.join(base, sub)))
    except Exception:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        v = os.environ.get(var)
        if v:
            out.append((var, os.path.join(v, "include")))
    out.append(("default", "/usr/local/cuda/include"))
    for d in sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True):
        out.append(("default", d))
    for d in sorted(glob.glob("/usr/local/cuda-*/targets/*/include"), reverse=True):
        out.append(("default", d))
    return out


def _cudart_major(include_dir: str) -> int | None:
    try:
        text = Path(include_dir, "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(m.group(1)) // 1000 if m else None


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding ``cuda_fp16.h`` and ``cuda_bf16.h`` (their CUDA major version
    matching NVRTC's when several are found)."""
    found: list[str] = []
    looked: list[str] = []
    for how, d in _header_dir_candidates():
        d = os.path.abspath(d)
        if d in looked:
            continue
        looked.append(d)
        if all(
            os.path.isfile(os.path.join(d, h)) for h in ("cuda_fp16.h", "cuda_bf16.h")
        ):
            found.append(d)
    if not found:
        raise KernelsUnavailable(
            "CUDA headers cuda_fp16.h / cuda_bf16.h not found (looked in: "
            + ", ".join(looked)
            + "); pip install nvidia-cuda-runtime (same CUDA major version as NVRTC), "
            "set CUDA_HOME, or point EDGE_CUDA_INCLUDE at the include directory"
        )
    try:
        want = int(nvrtc_version().split(".")[0])
    except KernelsUnavailable:
        want = None
    for d in found:
        if want is not None and _cudart_major(d) == want:
            return (d,)
    return (found[0],)


# ---------------------------------------------------------------------------------------
# compilation and the disk cache
# ---------------------------------------------------------------------------------------

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _local_sources(name: str) -> list[tuple[str, str]]:
    """(name, text) of a source in KERNEL_DIR and every local header it includes."""
    seen: dict[str, str] = {}
    todo = [name]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        path = KERNEL_DIR / n
        try:
            text = path.read_text()
        except OSError as exc:
            raise KernelCompileError(f"kernel source {path} cannot be read: {exc}")
        seen[n] = text
        for inc in _INCLUDE_RE.findall(text):
            if (KERNEL_DIR / inc).is_file():
                todo.append(inc)
    return [(n, seen[n]) for n in sorted(seen)]


def cache_dir() -> Path:
    base = os.environ.get("EDGE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "edge"
    return root / "kernels"


def _normalize_defines(
    defines: Mapping[str, Any] | Iterable[tuple[str, Any]] | None,
) -> tuple[tuple[str, str], ...]:
    if not defines:
        return ()
    items = defines.items() if isinstance(defines, Mapping) else defines
    return tuple(sorted((str(k), str(v)) for k, v in items))


def cache_key(source: str, arch: str, defines: Mapping[str, Any] | None = None) -> str:
    h = hashlib.sha256()
    h.update(_CACHE_FORMAT.encode())
    for n, text in _local_sources(source):
        h.update(f"\0src:{n}\0".encode())
        h.update(text.encode())
    for d in cuda_include_dirs():
        for hdr in _SYSTEM_HEADERS:
            p = Path(d, hdr)
            if p.is_file():
                h.update(f"\0hdr:{hdr}\0".encode())
                h.update(p.read_bytes())
    h.update(f"\0arch:{arch}\0nvrtc:{nvrtc_version()}\0std:{STD}\0".encode())
    h.update(repr(_normalize_defines(defines)).encode())
    return h.hexdigest()


# One lock per cache key: two threads asking for the same variant compile it once, while
# different variants compile at the same time (NVRTC releases the GIL while it compiles).
_key_locks: dict[str, threading.Lock] = {}
_key_locks_guard = threading.Lock()


def _key_lock(key: str) -> threading.Lock:
    with _key_locks_guard:
        return _key_locks.setdefault(key, threading.Lock())


def _check_arch(arch: str) -> str:
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"arch must look like 'sm_87', got {arch!r}")
    return arch


def compile_cubin(
    source: str,
    arch: str,
    defines: Mapping[str, Any] | None = None,
    *,
    use_cache: bool = True,
) -> bytes:
    """Compile ``KERNEL_DIR/source`` (or an absolute path: the benchmark kernels under
    tools/) for ``arch`` (e.g. ``"sm_87"``) and return the cubin.

    Needs no GPU. Raises KernelCompileError on any error or warning, KernelsUnavailable
    when cuda-python / NVRTC / the headers are missing.
    """
    _check_arch(arch)
    cc = core()
    includes = cuda_include_dirs()
    key = cache_key(source, arch, defines)
    path = _cache_path(source, arch, key)
    with _key_lock(key):
        if use_cache:
            try:
                data = path.read_bytes()
                if data:
                    return data
            except OSError:
                pass
        data = _compile(cc, source, arch, defines, includes)
        if use_cache:
            _atomic_write(path, data)
        return data


def _cache_path(source: str, arch: str, key: str) -> Path:
    return cache_dir() / f"{Path(source).stem}-{arch}-{key[:32]}.cubin"


def is_cached(source: str, arch: str, defines: Mapping[str, Any] | None = None) -> bool:
    """Whether the disk cache holds this variant's cubin."""
    return _cache_path(source, arch, cache_key(source, arch, defines)).is_file()


def _compile(cc: Any, source: str, arch: str, defines: Mapping[str, Any] | None, includes: tuple[str, ...]) -> bytes:
    macro = [(k, v) for k, v in _normalize_defines(defines)]
    src = (KERNEL_DIR / source).read_text()
    opts = cc.ProgramOptions(
        name=source,
        arch=arch,
        std=STD,
        include_path=[str(KERNEL_DIR), *includes],
        define_macro=macro or None,
    )
    log = io.StringIO()
    try:
        prog = cc.Program(src, "c++", opts)
        obj = prog.compile("cubin", logs=log)
    except KernelsUnavailable:
        raise
    except Exception as exc:
        text = log.getvalue().replace("\x00", "").strip()
        raise KernelCompileError(
            f"NVRTC failed to compile {source} for {arch} with {dict(macro)}:\n{exc}\n{text}"
        ) from exc
    text = log.getvalue().replace("\x00", "").strip()
    if text:
        raise KernelCompileError(
            f"NVRTC reported warnings for {source} ({arch}, {dict(macro)}); warnings are errors:\n{text}"
        )
    code = obj.code
    return (
        bytes(code)
        if not isinstance(code, (str, os.PathLike))
        else Path(code).read_bytes()
    )


def _atomic_write(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            dir=path.parent, prefix=path.name + ".", suffix=".tmp"
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError:
        pass  # a read-only cache only costs a recompile next time


# ---------------------------------------------------------------------------------------
# devices, modules, streams, launches
# ---------------------------------------------------------------------------------------

_tls = threading.local()  # the device whose context is current on this thread


def _torch_cuda() -> Any:
    try:
        import torch
    except Exception as exc:
        raise KernelsUnavailable(f"torch is not importable: {exc}")
    if not torch.cuda.is_available():
        raise KernelsUnavailable(
            "no CUDA GPU is visible to torch (torch.cuda.is_available() is False: CPU-only "
            f"torch build {torch.__version__!r}, no driver, or CUDA_VISIBLE_DEVICES hides it)"
        )
    return torch


@functools.cache
def device_arch(device_index: int) -> str:
    """``sm_XY`` of a device (via cuda.core, else torch)."""
    try:
        cc = core().Device(device_index).compute_capability
        major, minor = int(cc[0]), int(cc[1])
    except KernelsUnavailable:
        raise
    except Exception:
        torch = _torch_cuda()
        major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def activate(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    if getattr(_tls, "device", None) != device_index:
        core().Device(device_index).set_current()
        _tls.device = device_index


def load_kernel(
    device_index: int, source: str, name: str, defines: Mapping[str, Any] | None = None
) -> Any:
    """The kernel ``name`` of ``source`` compiled with ``defines`` for this device, read
    from the disk cache or compiled, and loaded. Callers keep what they load
    (:class:`edge.kernels.launcher.Launcher` does, per engine)."""
    cc = core()
    arch = device_arch(device_index)
    cubin = compile_cubin(source, arch, dict(_normalize_defines(defines)))
    activate(device_index)
    from_cubin = getattr(cc.ObjectCode, "from_cubin", None)
    mod = from_cubin(cubin) if from_cubin is not None else cc.ObjectCode(cubin, "cubin")
    try:
        return mod.get_kernel(name)
    except Exception as exc:
        raise KernelCompileError(f"kernel {name!r} not found in {source} {dict(defines or {})}: {exc}") from exc


class TorchStream:
    """``__cuda_stream__`` view of a torch stream handle (created once per torch stream)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = int(handle)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def current_stream_handle(device_index: int) -> int:
    """cudaStream_t (as int) of torch's current stream on the device."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


def stream_object(device_index: int, handle: int) -> Any:
    """A cuda.core stream object for a torch stream handle."""
    wrapper = TorchStream(handle)
    try:
        activate(device_index)
        return core().Device(device_index).create_stream(wrapper)
    except Exception:
        return wrapper  # cuda.core's launch takes any __cuda_stream__ object


@functools.lru_cache(maxsize=4096)
def launch_config(grid: tuple[int, ...], block: tuple[int, ...], shmem: int, overlap: bool) -> Any:
    """A cuda.core LaunchConfig (``overlap``: programmatic dependent launch, sm_90+)."""
    if overlap:
        return core().LaunchConfig(
            grid=grid, block=block, shmem_size=shmem, programmatic_stream_serialization=True
        )
    return core().LaunchConfig(grid=grid, block=block, shmem_size=shmem)


@functools.cache
def overlap_supported(device_index: int) -> bool:
    """True when launches on the device can overlap: sm_90+ and a cuda.core whose
    LaunchConfig takes ``programmatic_stream_serialization``."""
    if int(re.sub(r"\D", "", device_arch(device_index))) < 90:
        return False
    try:
        launch_config((1,), (32,), 0, True)
    except TypeError:
        return False
    return True


def max_active_blocks(
    kernel: Any, block_size: int, device_index: int, default: int = 2, dynamic_smem: int = 0
) -> int:
    """Resident CTAs per SM for this kernel launched with ``dynamic_smem`` bytes (driver
    occupancy query; ``default`` if the installed cuda.core cannot tell)."""
    try:
        occ = kernel.occupancy.max_active_blocks_per_multiprocessor(block_size, dynamic_smem)
        return max(1, int(occ))
    except Exception:
        return default


def _driver_module() -> Any:
    return _bindings("driver", "cuda")


@functools.cache
def shared_memory(device_index: int) -> tuple[int, int, int]:
    """(bytes per SM, most one CTA may opt in to, bytes the driver reserves per CTA),
    from the driver (the same call on every cuda-python version)."""
    driver = _driver_module()
    (err,) = driver.cuInit(0)
    if int(err) == 0:
        err, dev = driver.cuDeviceGet(device_index)
    if int(err) != 0:
        raise KernelsUnavailable(f"CUDA device {device_index} cannot be queried: {err}")
    names = (
        "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
        "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
        "CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK",
    )
    values = []
    for name in names:
        err, v = driver.cuDeviceGetAttribute(getattr(driver.CUdevice_attribute, name), dev)
        if int(err) != 0:
            raise KernelsUnavailable(f"cuDeviceGetAttribute({name}) failed: {err}")
        values.append(int(v))
    return values[0], values[1], values[2]


def allow_dynamic_smem(kernel: Any, device_index: int, nbytes: int, *, carveout: int | None = None) -> None:
    """Let ``kernel`` launch with ``nbytes`` of dynamic shared memory on the device (above
    48 KB a kernel must opt in). KernelCompileError when the device cannot give that.
    ``carveout``: the shared memory the kernel prefers, in percent of the most an SM can
    give (the rest stays L1, which also holds the kernel's loads in flight); None leaves
    it to the driver, which takes as much as fits the most CTAs."""
    _, optin, _ = shared_memory(device_index)
    if nbytes > optin:
        raise KernelCompileError(
            f"kernel needs {nbytes} B of shared memory, the device allows {optin} B per block"
        )
    attrs = _driver_module().CUfunction_attribute
    _set_function_attribute(kernel, device_index, attrs.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
    if carveout is not None:  # a percentage (the tunings check it; the driver refuses others)
        _set_function_attribute(kernel, device_index, attrs.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                carveout)


def _handle(kernel: Any) -> Any:
    handle = getattr(kernel, "handle", None)
    return kernel._handle if handle is None else handle  # cuda.core < 0.3: _handle


def _set_function_attribute(kernel: Any, device_index: int, attr: Any, value: int) -> None:
    driver = _driver_module()
    handle = _handle(kernel)
    # cuda.core loads through the library API (CUkernel, per device) where the driver has
    # it, else through modules (CUfunction).
    if isinstance(handle, driver.CUkernel):
        err, dev = driver.cuDeviceGet(device_index)
        (err,) = driver.cuKernelSetAttribute(attr, int(value), handle, dev)
    else:
        (err,) = driver.cuFuncSetAttribute(handle, attr, int(value))
    if int(err) != 0:
        raise KernelCompileError(f"could not set {attr} to {value}: {err}")


def function_attribute(kernel: Any, device_index: int, name: str) -> int:
    """A loaded kernel's ``CU_FUNC_ATTRIBUTE_<name>`` on the device (as the driver reports it)."""
    driver = _driver_module()
    attr = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
    handle = _handle(kernel)
    if isinstance(handle, driver.CUkernel):
        err, dev = driver.cuDeviceGet(device_index)
        err, value = driver.cuKernelGetAttribute(attr, handle, dev)
    else:
        err, value = driver.cuFuncGetAttribute(attr, handle)
    if int(err) != 0:
        raise KernelsUnavailable(f"could not read {attr}: {err}")
    return int(value)


def kernel_resources(kernel: Any) -> dict[str, int]:
    """Registers, local (spill) memory and static shared memory of a loaded kernel."""
    out = {}
    attrs = getattr(kernel, "attributes", None)
    for name in (
        "num_regs",
        "local_size_bytes",
        "shared_size_bytes",
        "max_threads_per_block",
    ):
        try:
            v = getattr(attrs, name)
            out[name] = int(v() if callable(v) else v)
        except Exception:
            pass
    return out


def check_available(device_index: int | None = None) -> None:
    """Raise KernelsUnavailable unless cuda-python, NVRTC, the headers and (when
    ``device_index`` is given) a CUDA device are all present."""
    core()
    nvrtc_version()
    cuda_include_dirs()
    if device_index is not None:
        torch = _torch_cuda()
        if device_index >= torch.cuda.device_count():
            raise KernelsUnavailable(f"CUDA device {device_index} does not exist")


def device_index(device: Any, what: str = "the CUDA kernels") -> int:
    """CUDA device index of ``device`` (None: the current device); KernelsUnavailable
    naming ``what`` for a non-CUDA device or a torch without CUDA."""
    if device is not None:
        import torch

        device = torch.device(device)
        if device.type != "cuda":
            raise KernelsUnavailable(f"{what} need a CUDA device, got {device}")
        if device.index is not None:
            _torch_cuda()
            return device.index
    return _torch_cuda().cuda.current_device()


def loads(load: Any, device: Any = None) -> bool:
    """True when ``load(device)`` succeeds, False when kernels are unavailable there."""
    try:
        load(device)
        return True
    except (KernelsUnavailable, KernelCompileError):
        return False


def _reset_for_tests() -> None:
    """Forget every cached import / discovery (tests monkeypatch imports)."""
    core.cache_clear()
    nvrtc_version.cache_clear()
    cuda_include_dirs.cache_clear()
    device_arch.cache_clear()
    overlap_supported.cache_clear()
    shared_memory.cache_clear()


__all__ = [
    "KERNEL_DIR",
    "KernelCompileError",
    "KernelsUnavailable",
    "TorchStream",
    "UnplannedArguments",
    "cache_dir",
    "cache_key",
    "check_available",
    "compile_cubin",
    "core",
    "cuda_include_dirs",
    "current_stream_handle",
    "device_arch",
    "function_attribute",
    "kernel_resources",
    "launch_config",
    "load_kernel",
    "max_active_blocks",
    "allow_dynamic_smem",
    "shared_memory",
    "nvrtc_version",
    "overlap_supported",
    "stream_object",
]
