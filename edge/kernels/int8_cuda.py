"""CUDA W8A16 linear for int8 weights (:class:`edge.quant.Int8Weight`): the decode GEMV.

:func:`int8_linear` has the semantics of :func:`edge.quant.int8_linear_reference`
(``x @ dequant(w).T + bias`` in ``x``'s dtype) and runs the kernel of
``int8_gemv.cu`` when it can: ``x`` float16 / bfloat16 on the weight's CUDA device
with at most :data:`MAX_GEMV_TOKENS` tokens (decode has one: ``[1, in]`` or ``[in]``),
a float32 scale, a power-of-two ``group_size`` >= 16, 16-byte aligned rows. Anything
else (prefill chunks, float32 activations, odd layouts) goes to the torch reference,
which dequantizes and multiplies.

:func:`enable` compiles (NVRTC, disk-cached) and loads the kernels for a device, then
registers :func:`int8_linear` with :func:`edge.quant.register_int8_linear` for
``"cuda"``, so every ``Int8Weight.linear`` on a CUDA tensor uses it. Call it before
capturing CUDA graphs (the engine does, in ``kernel_ops``). Raises
:class:`KernelsUnavailable` (what is missing) or :class:`KernelCompileError`.

Graph-safe: a launch allocates only its output (through torch, so inside a capture
it comes from the graph's pool), reads nothing back to the host, and its grid depends
only on shapes.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from edge.kernels import nvrtc
from edge.kernels.nvrtc import KernelCompileError, KernelsUnavailable
from edge.quant import Int8Weight, int8_linear_reference, register_int8_linear

__all__ = [
    "DTYPES",
    "MAX_GEMV_TOKENS",
    "KernelCompileError",
    "KernelsUnavailable",
    "available",
    "disable",
    "enable",
    "int8_linear",
    "load",
    "plan",
    "set_tuning",
    "supports",
]

SOURCE = "int8_gemv.cu"
DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAME = {torch.float16: "f16", torch.bfloat16: "bf16"}
ROWS_PER_WARP = (4, 2, 1)
MAX_GEMV_TOKENS = 4  # more tokens (prefill): dequantize + matmul (the reference)
# A variant with more rows per warp is used while it still gives every SM this many
# CTAs (per token); fewer rows per warp means more, shorter CTAs for small matrices.
_MIN_CTAS_PER_SM = 2

# Compile-time knobs of int8_gemv.cu (defaults there); set_tuning() changes them.
TUNING: dict[str, int] = {
    "EDGE_INT8_WARPS": 4,
    "EDGE_INT8_UNROLL_R1": 4,
    "EDGE_INT8_UNROLL_R2": 4,
    "EDGE_INT8_UNROLL_R4": 2,
    "EDGE_INT8_MIN_BLOCKS": 0,
}
_DEFAULT_TUNING = dict(TUNING)
_force_rows: int | None = None


def set_tuning(
    rows_per_warp: int | None = None, **knobs: int
) -> tuple[dict[str, int], int | None]:
    """Replace the kernel's compile-time knobs (missing ones get their defaults) and,
    with ``rows_per_warp``, force one variant (None: chosen per shape). Returns the
    previous (knobs, rows_per_warp). Kernels compile on next use (benchmark sweeps)."""
    global _force_rows
    if rows_per_warp is not None and rows_per_warp not in ROWS_PER_WARP:
        raise ValueError(
            f"rows_per_warp must be one of {ROWS_PER_WARP}, got {rows_per_warp}"
        )
    unknown = set(knobs) - set(_DEFAULT_TUNING)
    if unknown:
        raise ValueError(
            f"unknown int8 GEMV knobs {sorted(unknown)}; known: {sorted(_DEFAULT_TUNING)}"
        )
    prev = (dict(TUNING), _force_rows)
    TUNING.clear()
    TUNING.update(_DEFAULT_TUNING)
    TUNING.update({k: int(v) for k, v in knobs.items()})
    _force_rows = rows_per_warp
    return prev


def _kernel(dev: int, dtype: torch.dtype, rows: int) -> Any:
    return nvrtc.get_kernel(
        dev, SOURCE, f"int8_gemv_{_DTYPE_NAME[dtype]}_r{rows}", TUNING
    )


@functools.cache
def _sm_count(dev: int) -> int:
    return int(torch.cuda.get_device_properties(dev).multi_processor_count)


def load(device: Any = None) -> None:
    """Compile (or fetch from the disk cache) and load every variant for ``device``.
    Raises KernelsUnavailable or KernelCompileError. Call before graph capture."""
    dev = nvrtc.device_index(device, "the CUDA int8 GEMV")
    nvrtc.check_available(dev)
    for dtype in DTYPES:
        for r in ROWS_PER_WARP:
            _kernel(dev, dtype, r)
    _sm_count(dev)


def available(device: Any = None) -> bool:
    """True when the kernels load on ``device``."""
    return nvrtc.loads(load, device)


def enable(device: Any = None) -> None:
    """Load the kernels for ``device`` and route ``Int8Weight.linear`` on CUDA tensors
    to :func:`int8_linear`. Raises KernelsUnavailable / KernelCompileError (nothing is
    registered then)."""
    load(device)
    register_int8_linear("cuda", int8_linear)


def disable() -> None:
    """Route CUDA int8 linears back to the torch reference."""
    register_int8_linear("cuda", None)


def supports(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`int8_linear` runs the kernel (rather than the reference) for
    these arguments."""
    if (
        x.device.type != "cuda"
        or x.dtype not in _DTYPE_NAME
        or x.device != w.weight.device
    ):
        return False
    rows, cols = w.weight.shape
    if x.shape[-1] != cols or x.numel() == 0 or x.numel() // cols > MAX_GEMV_TOKENS:
        return False
    g = w.group_size
    if g < 16 or g & (g - 1) or cols % g or cols % 16:
        return False
    if w.scale.dtype != torch.float32 or not (
        w.scale.is_contiguous() and w.weight.is_contiguous()
    ):
        return False
    if (
        not x.is_contiguous()
        or x.data_ptr() % 16
        or w.weight.data_ptr() % 16
        or w.scale.data_ptr() % 4
    ):
        return False
    if rows >= 2**31 or cols >= 2**31:
        return False
    return bias is None or (
        bias.dtype == x.dtype
        and bias.device == x.device
        and bias.numel() == rows
        and bias.is_contiguous()
    )


def plan(out_features: int, tokens: int, device_index: int) -> tuple[int, int]:
    """(rows per warp, CTAs) of a launch."""
    warps = TUNING["EDGE_INT8_WARPS"]
    if _force_rows is not None:
        r = _force_rows
    else:
        want = _MIN_CTAS_PER_SM * _sm_count(device_index)
        r = 1
        for cand in ROWS_PER_WARP:
            if -(-out_features // (warps * cand)) * tokens >= want:
                r = cand
                break
    return r, -(-out_features // (warps * r)) * tokens


def int8_linear(
    x: torch.Tensor,
    w: Int8Weight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequant(w).T + bias`` in ``x``'s dtype, ``x`` ``[..., in]`` -> ``[..., out]``.

    The kernel runs when :func:`supports` says so, else the torch reference. ``out``
    (contiguous, ``x``'s dtype, the result's shape) receives the result when given.
    """
    if not supports(x, w, bias):
        y = int8_linear_reference(x, w, bias)
        if out is None:
            return y
        return out.copy_(y)
    rows, cols = w.weight.shape
    tokens = x.numel() // cols
    shape = (*x.shape[:-1], rows)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif (
        tuple(out.shape) != shape
        or out.dtype != x.dtype
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape {shape} on {x.device}"
        )
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    r, ctas = plan(rows, tokens, dev)
    kernel = _kernel(dev, x.dtype, r)
    nvrtc.launch(
        dev,
        kernel,
        ctas,
        32 * TUNING["EDGE_INT8_WARPS"],
        (
            out.data_ptr(),
            x.data_ptr(),
            w.weight.data_ptr(),
            w.scale.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            np.int32(rows),
            np.int32(cols),
            np.int32(w.group_size.bit_length() - 1),
            np.int32(tokens),
        ),
    )
    return out
