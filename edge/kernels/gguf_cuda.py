"""CUDA linear for :class:`edge.quant.gguf.GGUFWeight`: the decode GEMV reading the GGUF
blocks as stored (``gguf_gemv.cu``, a module per ggml type), with the int8 GEMV's fused
modes, and dequantize + cuBLAS for prefill chunks.

:class:`GGUFCudaLinear` is the backend's linear for the ``gguf`` format (``linear`` /
``fuses`` / ``argmax`` with :func:`edge.quant.q8_0.fused_linear_reference`'s semantics).

- Decode (at most :data:`MAX_GEMV_TOKENS` tokens, a CTA row each): the GEMV with
  ``norm`` (RMSNorm of the input folded in), ``residual`` (in-place add), ``swiglu``
  (``[gate; up]`` epilogue, alone or after the norm) and the greedy lm_head's argmax. A
  weight whose fused parts have different types (q/k/v of a Q4_K_M file) runs a launch
  per part into its columns of the output; residual and SwiGLU fusions need one part,
  else they are composed with the layer ops.
- Prefill chunks: each row chunk of a part dequantized by ``gguf_dequant_*`` into one
  bounded buffer (:attr:`GGUFTuning.dequant_chunk` elements; the values the torch
  reference computes, bit for bit) and multiplied by cuBLAS.

Graph-safe: a launch allocates only its output (through torch), reads nothing back to
the host, and its grid depends only on shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from edge.kernels.args import is_vector, overlap
from edge.kernels.dequant_cuda import expanded_linear
from edge.kernels.launcher import Launcher
from edge.kernels.nvrtc import UnplannedArguments
from edge.quant.gguf import GGUFPart, GGUFWeight
from edge.quant.q8_0 import Norm, fused_linear_reference

__all__ = ["DTYPES", "KERNEL_TYPES", "MAX_GEMV_TOKENS", "GGUFCudaLinear", "GGUFTuning", "weight_support"]

SOURCE = "gguf_gemv.cu"
DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAME = {torch.float16: "f16", torch.bfloat16: "bf16"}
# ggml type id -> values a block (gguf_gemv.cu's CFG_GGUF_TYPE).
KERNEL_TYPES = {2: 32, 8: 32, 12: 256, 13: 256, 14: 256}
MAX_GEMV_TOKENS = 8  # tokens of a decode or verify step; more (prefill): dequantize + cuBLAS
# Kernel modes keyed by (norm, residual, swiglu): the name infix and its rows-per-warp variants.
MODES: dict[tuple[bool, bool, bool], tuple[str, tuple[int, ...]]] = {
    (False, False, False): ("", (2, 1)),
    (True, False, False): ("norm_", (2, 1)),
    (False, True, False): ("residual_", (2, 1)),
    (False, False, True): ("swiglu_", (2,)),
    (True, False, True): ("norm_swiglu_", (2,)),
}
ARGMAX_MODES: dict[bool, str] = {False: "argmax_", True: "norm_argmax_"}
_MAX_SMEM = 48 * 1024  # the norm weight a launch stages, without opting in to more
_MIN_CTAS_PER_SM = 2  # two rows a warp while that still gives every SM this many CTAs


@dataclasses.dataclass(frozen=True)
class GGUFTuning:
    """Compile-time knobs of gguf_gemv.cu (its CFG_GGUF_* defines) and launch choices."""

    warps: int = 4  # warps per CTA
    unroll: int = 4  # pieces (16 values) a lane loads per row before using any
    min_blocks: int = 4  # resident CTAs per SM asked of the register allocator (0: none)
    rows_per_warp: int | None = None  # 1 or 2; None: chosen per shape
    dequant_chunk: int = 1 << 26  # weight elements dequantized at once for prefill

    def __post_init__(self) -> None:
        if self.warps not in (1, 2, 4, 8, 16) or not 1 <= self.unroll <= 8 or self.min_blocks < 0:
            raise ValueError(f"bad GGUF GEMV tuning {self}")
        if self.rows_per_warp not in (None, 1, 2):
            raise ValueError(f"rows_per_warp must be 1 or 2, got {self.rows_per_warp}")

    def defines(self, qtype: int) -> dict[str, int]:
        return {
            "CFG_GGUF_TYPE": qtype,
            "CFG_GGUF_WARPS": self.warps,
            "CFG_GGUF_UNROLL": self.unroll,
            "CFG_GGUF_MIN_BLOCKS": self.min_blocks,
        }


def weight_support(w: GGUFWeight, dtype: torch.dtype) -> str | None:
    """None when the kernels take this weight for activations of ``dtype``, else why not."""
    if dtype not in _DTYPE_NAME:
        return f"no GGUF GEMV for {dtype} activations"
    for p in w.parts:
        if p.qtype not in KERNEL_TYPES:
            return f"no GGUF GEMV for {p.type.name} blocks"
        if w.in_features % KERNEL_TYPES[p.qtype]:
            return f"{w.in_features} input features are not whole {p.type.name} blocks"
        if p.data.device.type != "cuda" or p.data.data_ptr() % 16 or not p.data.is_contiguous():
            return "weights must be contiguous and 16-byte aligned on the GPU"
    if w.out_features >= 2**31 or w.in_features % 16:
        return f"shape {tuple(w.shape)}"
    return None


class GGUFCudaLinear:
    """The GGUF linear of a CUDA backend (module docstring). ``layer_ops`` composes the
    fusions a launch does not take. Every weight it is given passed
    :func:`weight_support`; its parts' types are among ``qtypes`` (a module each)."""

    name = "GGUF GEMV on the stored blocks (decode), dequantize + cuBLAS (prefill)"
    expands_weights = True  # a prefill chunk expands every weight it multiplies

    def __init__(self, launcher: Launcher, layer_ops: Any, tuning: GGUFTuning = GGUFTuning(),
                 qtypes: tuple[int, ...] = tuple(KERNEL_TYPES)) -> None:
        self.launcher = launcher
        self.ops = layer_ops
        self.tuning = tuning
        self._sms = launcher.sm_count()
        self._k: dict[tuple[int, str], Any] = {}
        for qtype in qtypes:
            defines = tuning.defines(qtype)
            names = ["gguf_argmax_take"]
            for dt in _DTYPE_NAME.values():
                names.append(f"gguf_dequant_{dt}")
                for infix, rows in (*MODES.values(), *((a, (2,)) for a in ARGMAX_MODES.values())):
                    names += [f"gguf_gemv_{infix}{dt}_r{r}" for r in rows]
            for name in names:
                self._k[(qtype, name)] = launcher.kernel(SOURCE, name, defines)

    def with_launcher(self, launcher: Launcher, layer_ops: Any) -> GGUFCudaLinear:
        """The same kernels launched through ``launcher`` (an overlapped sibling)."""
        other = object.__new__(GGUFCudaLinear)
        other.launcher, other.ops, other.tuning, other._sms, other._k = launcher, layer_ops, self.tuning, self._sms, self._k
        return other

    def _gemv(self, x: torch.Tensor, w: GGUFWeight) -> bool:
        """Whether ``x`` is a decode input (the GEMV); else a prefill chunk."""
        return x.numel() // w.in_features <= MAX_GEMV_TOKENS

    def fuses(self, x: torch.Tensor, w: GGUFWeight) -> bool:
        """Decode inputs run norm / residual / SwiGLU inside the GEMV."""
        return self._gemv(x, w) and w.in_features * x.element_size() <= _MAX_SMEM

    def _check(self, x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None, norm: Norm | None,
               residual: torch.Tensor | None, swiglu: bool) -> None:
        cols = w.in_features
        rows = w.out_features // 2 if swiglu else w.out_features
        ok = (
            x.dtype in _DTYPE_NAME
            and x.device == w.device
            and x.shape[-1] == cols
            and x.numel() > 0
            and x.is_contiguous()
            and x.data_ptr() % 16 == 0
            and all((p.qtype, "gguf_argmax_take") in self._k for p in w.parts)
            and not (swiglu and w.out_features % 2)
            and (norm is None or (is_vector(norm[0], x, cols, align=16) and cols * x.element_size() <= _MAX_SMEM))
            and (residual is None or (is_vector(residual, x, (*x.shape[:-1], rows)) and not overlap(residual, x)))
            and (bias is None or is_vector(bias, x, w.out_features))
        )
        if not ok:
            raise UnplannedArguments(f"GGUF GEMV of {x.dtype} {tuple(x.shape)} by {w!r}")

    def linear(
        self,
        x: torch.Tensor,
        w: GGUFWeight,
        bias: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ dequant(w).T + bias`` in ``x``'s dtype, ``x`` ``[..., in]`` -> ``[..., out]``,
        with the fusions of :func:`edge.quant.q8_0.fused_linear_reference`. ``out``
        (contiguous, the result's shape) receives a plain or SwiGLU result; with
        ``residual`` the result is ``residual`` itself (updated in place)."""
        if residual is not None and out is not None:
            raise ValueError("out and residual are exclusive: the residual is updated in place")
        mode = MODES.get((norm is not None, residual is not None, bool(swiglu)))
        one_part = len(w.parts) == 1
        if not self._gemv(x, w) or mode is None or (not one_part and (residual is not None or swiglu)):
            if norm is None and residual is None and not swiglu:
                y = self._prefill(x, w, bias)
            else:  # prefill, or a combination the GEMV has no launch for: composed
                y = fused_linear_reference(
                    x, w, bias, norm=norm, residual=residual, swiglu=swiglu, ops=self.ops, matmul=self._plain
                )
            return y if out is None else out.copy_(y)
        self._check(x, w, bias, norm, residual, swiglu)
        outputs = w.out_features // 2 if swiglu else w.out_features
        shape = (*x.shape[:-1], outputs)
        if residual is not None:
            out = residual
        elif out is None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        elif tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape} on {x.device}")
        row = 0
        for part in w.parts:
            part_bias = None if bias is None else bias[row : row + part.rows]
            rows = part.rows // 2 if swiglu else part.rows
            self._launch(x, w.in_features, part, part_bias, mode[0], out.data_ptr(), rows, norm=norm,
                         ld_y=outputs, y_off=row)
            row += part.rows
        return out

    def _plain(self, x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self._gemv(x, w):
            return self._prefill(x, w, bias)
        return self.linear(x, w, bias)

    def argmax(
        self,
        x: torch.Tensor,
        w: GGUFWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
    ) -> torch.Tensor | None:
        """Greedy token ids ``[tokens]`` (int64) without the logits: ``torch.argmax`` of
        the logits rounded to ``x``'s dtype (first of equal maxima), in two launches, the
        GEMV with its argmax epilogue and the take. None for a prefill chunk or a weight
        of several parts (the caller computes the logits)."""
        if not self._gemv(x, w) or len(w.parts) != 1:
            return None
        self._check(x, w, bias, norm, None, False)
        tokens = x.numel() // w.in_features
        if out is None:
            out = torch.empty(tokens, dtype=torch.int64, device=x.device)
        elif out.dtype != torch.int64 or out.numel() != tokens or not out.is_contiguous() or out.device != x.device:
            raise ValueError(f"out must be a contiguous int64 tensor of {tokens} elements on {x.device}")
        best = self.launcher.scratch(
            "gguf-argmax",
            lambda _slots: True,
            lambda _old: torch.zeros(MAX_GEMV_TOKENS, dtype=torch.int64, device=x.device),
        )
        part = w.parts[0]
        self._launch(x, w.in_features, part, bias, ARGMAX_MODES[norm is not None], 0, part.rows, norm=norm,
                     ld_y=part.rows, y_off=0, best_ptr=best.data_ptr())
        take = self._k[(part.qtype, "gguf_argmax_take")]
        self.launcher.launch(take, 1, 32, (best.data_ptr(), out.data_ptr(), np.int32(tokens)))
        return out

    # -- launches ---------------------------------------------------------------------

    def plan(self, outputs: int, tokens: int, infix: str) -> tuple[int, int]:
        """(rows per warp, CTAs) of a launch in mode ``infix`` with ``outputs`` outputs a
        token: two rows a warp while that still gives every SM two CTAs; SwiGLU a gate
        and an up row, argmax always two."""
        warps = self.tuning.warps
        if infix.endswith("swiglu_"):
            return 2, -(-outputs // warps) * tokens
        r = 2 if infix.endswith("argmax_") else self.tuning.rows_per_warp
        if r is None:
            r = 2 if -(-outputs // (2 * warps)) * tokens >= _MIN_CTAS_PER_SM * self._sms else 1
        return r, -(-outputs // (warps * r)) * tokens

    def _launch(
        self,
        x: torch.Tensor,
        in_features: int,
        part: GGUFPart,
        bias: torch.Tensor | None,
        infix: str,
        y_ptr: int,
        outputs: int,
        *,
        norm: Norm | None = None,
        ld_y: int,
        y_off: int,
        best_ptr: int = 0,
    ) -> None:
        tokens = x.numel() // in_features
        r, ctas = self.plan(outputs, tokens, infix)
        staged = norm is not None and not infix.endswith("argmax_")
        self.launcher.launch(
            self._k[(part.qtype, f"gguf_gemv_{infix}{_DTYPE_NAME[x.dtype]}_r{r}")],
            ctas,
            32 * self.tuning.warps,
            (
                y_ptr,
                x.data_ptr(),
                part.data.data_ptr(),
                0 if bias is None else bias.data_ptr(),
                0 if norm is None else norm[0].data_ptr(),
                np.float32(0.0 if norm is None else norm[1]),
                np.int32(outputs),
                np.int32(in_features),
                np.int32(ld_y),
                np.int32(y_off),
                np.int32(tokens),
                best_ptr,
            ),
            shmem=in_features * x.element_size() if staged else 0,
        )

    def dequantize(self, part: GGUFPart, in_features: int, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``part`` into ``out`` (contiguous ``[r1 - r0, in]``, float16 /
        bfloat16): :func:`edge.quant.gguf.dequantize_rows` by a kernel, bit for bit."""
        if out.dtype not in _DTYPE_NAME or tuple(out.shape) != (r1 - r0, in_features) or not out.is_contiguous():
            raise UnplannedArguments(f"GGUF dequantize into {out.dtype} {tuple(out.shape)}")
        pieces = (r1 - r0) * (in_features // 16)
        self.launcher.launch(
            self._k[(part.qtype, f"gguf_dequant_{_DTYPE_NAME[out.dtype]}")],
            -(-pieces // 256),
            256,
            (out.data_ptr(), part.data[r0].data_ptr(), np.int32(r1 - r0), np.int32(in_features)),
        )
        return out

    def _prefill(self, x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill chunk: each row chunk of each part dequantized into one bounded
        buffer and multiplied by cuBLAS."""
        if x.dtype not in _DTYPE_NAME or x.device != w.device or x.shape[-1] != w.in_features:
            raise UnplannedArguments(f"GGUF prefill of {x.dtype} {tuple(x.shape)} on {x.device} by {w!r}")
        if bias is not None and not is_vector(bias, x, w.out_features):
            raise UnplannedArguments(f"GGUF prefill bias {bias.dtype} {tuple(bias.shape)} for {w!r}")
        cols = w.in_features
        outs, row = [], 0
        for part in w.parts:
            step = min(part.rows, max(1, self.tuning.dequant_chunk // cols))
            part_bias = None if bias is None else bias[row : row + part.rows]
            outs.append(expanded_linear(
                x, part.rows, part.rows, step,
                lambda r0, r1, buf, part=part: self.dequantize(part, cols, r0, r1, buf), part_bias,
            ))
            row += part.rows
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
