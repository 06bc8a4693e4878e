"""CUDA W8A16 linear for int8 weights (:class:`edge.quant.Int8Weight`): the decode GEMV.

:func:`int8_linear` has the semantics of :func:`edge.quant.int8_linear_reference`
(``x @ dequant(w).T + bias`` in ``x``'s dtype) and runs the kernel of
``int8_gemv.cu`` when it can: ``x`` float16 / bfloat16 on the weight's CUDA device
with at most :data:`MAX_GEMV_TOKENS` tokens (decode has one: ``[1, in]`` or ``[in]``),
a float32 scale, a power-of-two ``group_size`` >= 16, 16-byte aligned rows. Anything
else (prefill chunks, float32 activations, odd layouts) goes to the torch reference,
which dequantizes and multiplies.

It also takes the fusions of :func:`edge.quant.linear` (meaning:
:func:`edge.quant.fused_linear_reference`) and runs these combinations in the kernel
(:data:`MODES`), which is what lets an int8 decoder layer run 7 launches instead of 10:
``norm`` (qkv: RMSNorm of the residual stream folded in), ``residual`` (o and down:
``x += y`` in place), ``norm`` + ``swiglu`` (gate_up: norm, SwiGLU epilogue).
Other combinations, and whatever the plain kernel would not take, compose the
unfused ops (the caller's ``ops``) around the plain linear.

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
from types import ModuleType
from typing import Any

import numpy as np
import torch

from edge.kernels import nvrtc, reference
from edge.kernels.nvrtc import KernelCompileError, KernelsUnavailable
from edge.quant import (
    Int8Weight,
    Norm,
    fused_linear_reference,
    int8_linear_reference,
    register_int8_linear,
)

__all__ = [
    "DTYPES",
    "MAX_GEMV_TOKENS",
    "MODES",
    "KernelCompileError",
    "KernelsUnavailable",
    "available",
    "disable",
    "enable",
    "int8_argmax",
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
# Kernel modes of int8_gemv.cu, keyed by (norm, residual, swiglu) given: the name
# infix and the rows-per-warp variants compiled (SwiGLU takes row pairs).
MODES: dict[tuple[bool, bool, bool], tuple[str, tuple[int, ...]]] = {
    (False, False, False): ("", ROWS_PER_WARP),
    (True, False, False): ("norm_", ROWS_PER_WARP),
    (False, True, False): ("residual_", ROWS_PER_WARP),
    (True, False, True): ("norm_swiglu_", (4, 2)),
}
# The greedy lm_head (int8_argmax): the plain or norm launch with the argmax epilogue,
# keyed by norm given.
ARGMAX_MODES: dict[bool, str] = {False: "argmax_", True: "norm_argmax_"}
MAX_GEMV_TOKENS = 4  # more tokens (prefill): dequantize + matmul (the reference)
_MAX_SMEM = 48 * 1024  # dynamic shared memory a launch may use without opting in
# A variant with more rows per warp is used while it still gives every SM this many
# CTAs (per token); fewer rows per warp means more, shorter CTAs for small matrices.
_MIN_CTAS_PER_SM = 2

# Compile-time knobs of int8_gemv.cu (defaults there); set_tuning() changes them.
TUNING: dict[str, int] = {
    "EDGE_INT8_WARPS": 4,
    "EDGE_INT8_UNROLL_R1": 4,
    "EDGE_INT8_UNROLL_R2": 4,
    "EDGE_INT8_UNROLL_R4": 2,
    "EDGE_INT8_MIN_BLOCKS": 4,
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


def _kernel(dev: int, dtype: torch.dtype, rows: int, infix: str = "") -> Any:
    return nvrtc.get_kernel(
        dev, SOURCE, f"int8_gemv_{infix}{_DTYPE_NAME[dtype]}_r{rows}", TUNING
    )


def _take_kernel(dev: int) -> Any:
    return nvrtc.get_kernel(dev, SOURCE, "int8_argmax_take", TUNING)


@functools.cache
def _sm_count(dev: int) -> int:
    return int(torch.cuda.get_device_properties(dev).multi_processor_count)


def load(device: Any = None) -> None:
    """Compile (or fetch from the disk cache) and load every variant for ``device``.
    Raises KernelsUnavailable or KernelCompileError. Call before graph capture."""
    dev = nvrtc.device_index(device, "the CUDA int8 GEMV")
    nvrtc.check_available(dev)
    for dtype in DTYPES:
        for infix, rows in (*MODES.values(), *((a, ROWS_PER_WARP) for a in ARGMAX_MODES.values())):
            for r in rows:
                _kernel(dev, dtype, r, infix)
    _take_kernel(dev)
    _sm_count(dev)


def available(device: Any = None) -> bool:
    """True when the kernels load on ``device``."""
    return nvrtc.loads(load, device)


def enable(device: Any = None) -> None:
    """Load the kernels for ``device`` and route ``Int8Weight.linear`` on CUDA tensors
    to :func:`int8_linear`. Raises KernelsUnavailable / KernelCompileError (nothing is
    registered then)."""
    load(device)
    register_int8_linear("cuda", int8_linear, fuses=supports, argmax=int8_argmax)


def disable() -> None:
    """Route CUDA int8 linears back to the torch reference."""
    register_int8_linear("cuda", None)


def _mode(
    norm: Norm | None, residual: torch.Tensor | None, swiglu: bool
) -> tuple[str, tuple[int, ...]] | None:
    return MODES.get((norm is not None, residual is not None, bool(swiglu)))


def supports(
    x: torch.Tensor,
    w: Int8Weight,
    bias: torch.Tensor | None = None,
    *,
    norm: Norm | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
) -> bool:
    """Whether :func:`int8_linear` runs the kernel (rather than the reference) for
    these arguments. Registered as :func:`edge.quant.fuses`' test: every fused mode
    takes what the plain one takes (given norm weights and a residual that fit)."""
    if _mode(norm, residual, swiglu) is None:
        return False
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
    if rows >= 2**31 or cols >= 2**31 or (swiglu and rows % 2):
        return False
    if norm is not None and not (_is_vector(norm[0], x, cols, align=16) and _norm_smem(x, cols) <= _MAX_SMEM):
        return False
    if residual is not None and not (
        _is_vector(residual, x, (*x.shape[:-1], rows))
        and not _overlap(residual, x)  # other warps still read x while y is written
    ):
        return False
    return bias is None or _is_vector(bias, x, rows)


def _norm_smem(x: torch.Tensor, cols: int) -> int:
    """Dynamic shared memory of a norm-mode launch: the norm weight."""
    return cols * x.element_size()


def _is_vector(
    t: torch.Tensor, x: torch.Tensor, shape: int | tuple[int, ...], align: int = 1
) -> bool:
    """``t`` contiguous, of ``x``'s dtype and device, ``shape`` (an int: ``t.numel()``)."""
    ok_shape = t.numel() == shape if isinstance(shape, int) else tuple(t.shape) == shape
    return (
        ok_shape
        and t.dtype == x.dtype
        and t.device == x.device
        and t.is_contiguous()
        and t.data_ptr() % align == 0
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def plan(
    out_features: int, tokens: int, device_index: int, min_rows: int = 1
) -> tuple[int, int]:
    """(rows per warp, CTAs) of a launch over ``out_features`` weight rows, with at
    least ``min_rows`` rows per warp (SwiGLU: 2, a gate and an up row)."""
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
    r = max(r, min_rows)
    return r, -(-out_features // (warps * r)) * tokens


def int8_linear(
    x: torch.Tensor,
    w: Int8Weight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    norm: Norm | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    ops: ModuleType = reference,
) -> torch.Tensor:
    """``x @ dequant(w).T + bias`` in ``x``'s dtype, ``x`` ``[..., in]`` -> ``[..., out]``,
    with the fusions of :func:`edge.quant.linear` (``norm``, ``residual``, ``swiglu``;
    ``ops`` composes them where the kernel does not run).

    The kernel runs when :func:`supports` says so, else the torch reference. ``out``
    (contiguous, ``x``'s dtype, the result's shape) receives the result when given;
    with ``residual`` the result is ``residual`` itself (updated in place), so ``out``
    must be None.
    """
    if residual is not None and out is not None:
        raise ValueError("out and residual are exclusive: the residual is updated in place")
    if not supports(x, w, bias, norm=norm, residual=residual, swiglu=swiglu):
        if norm is None and residual is None and not swiglu:
            y = int8_linear_reference(x, w, bias)
        else:  # the plain kernel may still take the linear of the composition
            y = fused_linear_reference(
                x, w, bias, norm=norm, residual=residual, swiglu=swiglu, ops=ops,
                matmul=int8_linear,
            )
        if out is None:
            return y
        return out.copy_(y)
    rows = w.out_features
    outputs = rows // 2 if swiglu else rows
    shape = (*x.shape[:-1], outputs)
    if residual is not None:
        out = residual
    elif out is None:
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
    infix, _ = _mode(norm, residual, swiglu)  # type: ignore[misc]  # supports() checked
    _launch(x, w, bias, infix, out.data_ptr(), outputs, norm=norm, min_rows=2 if swiglu else 1)
    return out


def _launch(
    x: torch.Tensor,
    w: Int8Weight,
    bias: torch.Tensor | None,
    infix: str,
    y_ptr: int,
    outputs: int,
    *,
    norm: Norm | None = None,
    best_ptr: int = 0,
    min_rows: int = 1,
) -> None:
    """One GEMV launch in mode ``infix`` (arguments checked by :func:`supports`)."""
    rows, cols = w.weight.shape
    tokens = x.numel() // cols
    dev = nvrtc.device_index(x.device)
    staged = norm is not None and infix != ARGMAX_MODES[True]  # the kernel's kStaged
    smem = _norm_smem(x, cols) if staged else 0
    r, ctas = plan(rows, tokens, dev, min_rows)
    nvrtc.launch(
        dev,
        _kernel(dev, x.dtype, r, infix),
        ctas,
        32 * TUNING["EDGE_INT8_WARPS"],
        (
            y_ptr,
            x.data_ptr(),
            w.weight.data_ptr(),
            w.scale.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            0 if norm is None else norm[0].data_ptr(),
            np.float32(0.0 if norm is None else norm[1]),
            np.int32(outputs),
            np.int32(cols),
            np.int32(w.group_size.bit_length() - 1),
            np.int32(tokens),
            best_ptr,
        ),
        shmem=smem,
    )


def _best(device: torch.device) -> torch.Tensor:
    """The current stream's argmax slots (int64 ``[MAX_GEMV_TOKENS]``, zeroed when made;
    ``int8_argmax_take`` empties each slot it reads), from ``nvrtc.stream_scratch``."""
    return nvrtc.stream_scratch(
        "argmax",
        nvrtc.device_index(device),
        lambda _slots: True,
        lambda _old: torch.zeros(MAX_GEMV_TOKENS, dtype=torch.int64, device=device),
    )


def int8_argmax(
    x: torch.Tensor,
    w: Int8Weight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    norm: Norm | None = None,
) -> torch.Tensor | None:
    """Greedy token ids ``[tokens]`` (int64) of ``x @ dequant(w).T + bias`` without the
    logits: ``torch.argmax`` of the logits rounded to ``x``'s dtype (the first of equal
    maxima), in two launches, the GEMV with its argmax epilogue and the take. With
    ``norm`` the input is RMSNorm'd inside the GEMV, as :func:`int8_linear`'s norm mode
    (the logits of ``int8_linear(x, w, bias, norm=norm)``). ``out`` (contiguous int64
    ``[tokens]`` on ``x``'s device) receives them. None when the kernel does not take
    these arguments: the caller computes the logits instead."""
    if not supports(x, w, bias, norm=norm):
        return None
    tokens = x.numel() // w.in_features
    if out is None:
        out = torch.empty(tokens, dtype=torch.int64, device=x.device)
    elif out.dtype != torch.int64 or out.numel() != tokens or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous int64 tensor of {tokens} elements on {x.device}")
    best = _best(x.device)
    _launch(x, w, bias, ARGMAX_MODES[norm is not None], 0, w.out_features, norm=norm, best_ptr=best.data_ptr())
    dev = nvrtc.device_index(x.device)
    nvrtc.launch(dev, _take_kernel(dev), 1, 32, (best.data_ptr(), out.data_ptr(), np.int32(tokens)))
    return out
