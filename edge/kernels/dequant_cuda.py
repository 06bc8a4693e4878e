"""Prefill of quantized linears on CUDA: the weight expanded by a kernel (``dequant.cu``),
then multiplied by cuBLAS.

:class:`DequantCuda` launches the expansion kernels (int4 layout of :mod:`edge.quant.int4`,
int8 of :class:`edge.quant.q8_0.Int8Weight`), bit for bit what the torch references'
dequantization gives. :func:`expanded_linear` is the prefill product: the weight
expanded a row chunk at a time into one bounded buffer, each chunk's product written
into its columns of the one result. Every weight is expanded once per call, so the
engine gives quantized models longer prefill chunks (:func:`edge.runtime.budget.default_prefill_chunk`).

Graph-safe: a launch allocates nothing, reads nothing back to the host, and its grid
depends only on shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from edge.quant.int4 import BLOCK_ROWS, Int4Weight
from edge.kernels.launcher import Launcher
from edge.quant.q8_0 import Int8Weight

__all__ = ["SOURCE", "DequantCuda", "expanded_linear"]

SOURCE = "dequant.cu"
_DTYPE_NAME = {torch.float16: "f16", torch.bfloat16: "bf16"}
_SCALE_NAME = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
_THREADS = 256
_PIECE = 8  # output elements a thread writes (one 16-byte store)
_MAX_THREADS = 2**31 - 1  # the kernels index threads in 32 bits


class DequantCuda:
    """The expansion kernels of ``dequant.cu``, loaded through ``launcher``."""

    def __init__(self, launcher: Launcher, int4: bool = True, int8: bool = True) -> None:
        self.launcher = launcher
        self._k: dict[str, Any] = {}
        for dt in _DTYPE_NAME.values():
            names = [f"int4_dequant_{dt}_s{s}" for s in _SCALE_NAME.values()] if int4 else []
            names += [f"int8_dequant_{dt}"] if int8 else []
            for name in names:
                self._k[name] = launcher.kernel(SOURCE, name)

    def with_launcher(self, launcher: Launcher) -> "DequantCuda":
        other = object.__new__(DequantCuda)
        other.launcher, other._k = launcher, self._k
        return other

    @staticmethod
    def _check_out(out: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
        if (
            out.dtype not in _DTYPE_NAME
            or tuple(out.shape) != shape
            or not out.is_contiguous()
            or out.device != device
            or out.data_ptr() % 16
        ):
            raise ValueError(f"out must be a contiguous 16-byte aligned float16/bfloat16 {shape} tensor on {device}")

    def int4(self, w: Int4Weight, rb0: int, rb1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``[16 rb0, 16 rb1)`` of ``w`` (padding included, physical column order)
        into ``out`` ``[16 (rb1 - rb0), in]``: :meth:`edge.quant.int4.Int4Weight.dequantize_blocks`."""
        if not 0 <= rb0 < rb1 <= w.packed.shape[0]:
            raise ValueError(f"row blocks [{rb0}, {rb1}) outside the weight's {w.packed.shape[0]}")
        self._check_out(out, ((rb1 - rb0) * BLOCK_ROWS, w.in_features), w.device)
        threads = (rb1 - rb0) * BLOCK_ROWS * w.in_features // (2 * _PIECE)  # a thread writes two rows
        if threads > _MAX_THREADS:
            raise ValueError(f"{rb1 - rb0} row blocks at once exceed the kernel's 32-bit thread index")
        name = f"int4_dequant_{_DTYPE_NAME[out.dtype]}_s{_SCALE_NAME[w.scale.dtype]}"
        self.launcher.launch(
            self._k[name],
            -(-threads // _THREADS),
            _THREADS,
            (
                out.data_ptr(),
                w.packed.data_ptr(),
                w.scale.data_ptr(),
                0 if w.zero is None else w.zero.data_ptr(),
                np.int32(rb0),
                np.int32(rb1 - rb0),
                np.int32(w.in_features),
                np.int32(w.group_size),
            ),
        )
        return out

    def int8(self, w: Int8Weight, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``w`` into ``out`` ``[r1 - r0, in]``: the reference's
        ``weight * scale`` in float32 rounded once to ``out``'s dtype."""
        rows, cols = w.weight.shape
        if not 0 <= r0 < r1 <= rows:
            raise ValueError(f"rows [{r0}, {r1}) outside the weight's {rows}")
        self._check_out(out, (r1 - r0, cols), w.device)
        threads = (r1 - r0) * cols // _PIECE
        if threads > _MAX_THREADS:
            raise ValueError(f"{r1 - r0} rows at once exceed the kernel's 32-bit thread index")
        groups = w.scale.shape[1]
        self.launcher.launch(
            self._k[f"int8_dequant_{_DTYPE_NAME[out.dtype]}"],
            -(-threads // _THREADS),
            _THREADS,
            (
                out.data_ptr(),
                w.weight.data_ptr() + r0 * cols,
                w.scale.data_ptr() + r0 * groups * w.scale.element_size(),
                np.int32(r1 - r0),
                np.int32(cols),
                np.int32(w.group_size.bit_length() - 1),
            ),
        )
        return out


def expanded_linear(
    x: torch.Tensor,
    out_features: int,
    stored_rows: int,
    step: int,
    expand: Callable[[int, int, torch.Tensor], torch.Tensor],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W[:out_features].T + bias`` (``x`` ``[..., in]``) with the stored weight ``W``
    (``[stored_rows, in]``, rows past ``out_features`` padding) expanded ``step`` rows
    at a time: ``expand(r0, r1, buf)`` fills ``buf`` (``[r1 - r0, in]``, ``x``'s dtype)
    with rows ``[r0, r1)`` and returns it. One buffer of ``step`` rows serves every
    chunk; each chunk's product goes straight into its columns of the result."""
    cols = x.shape[-1]
    buf = torch.empty(min(step, stored_rows), cols, dtype=x.dtype, device=x.device)
    if stored_rows <= step:
        return F.linear(x, expand(0, stored_rows, buf)[:out_features], bias)
    x2 = x.reshape(-1, cols)
    y = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    for r0 in range(0, out_features, step):
        r1 = min(stored_rows, r0 + step)
        o1 = min(out_features, r1)
        w = expand(r0, r1, buf[: r1 - r0])[: o1 - r0]
        if bias is None:
            torch.mm(x2, w.t(), out=y[:, r0:o1])
        else:
            torch.addmm(bias[r0:o1], x2, w.t(), out=y[:, r0:o1])
    return y.view(*x.shape[:-1], out_features)
