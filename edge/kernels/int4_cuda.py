"""CUDA W4A16 linear for :class:`edge.int4.Int4Weight`: the decode GEMV on tensor cores
with the int8 GEMV's fused epilogues, and dequantize + cuBLAS for prefill chunks.

:class:`Int4CudaLinear` is one backend's int4 implementation (the LinearImpl shape of
the engine's backend: ``linear`` / ``fuses`` / ``argmax``, :func:`edge.quant.linear`'s
semantics). It owns the kernels it loaded (``int4_gemv.cu``, one module per scale dtype
and :class:`Int4Tuning`) and launches them through its launcher; nothing here is
process-wide.

- Decode (at most :data:`MAX_GEMV_TOKENS` tokens, ``x`` float16 / bfloat16 on the
  weight's device, group size a multiple of 64): the GEMV, with ``norm`` (RMSNorm of the
  input folded in), ``residual`` (in-place add), ``swiglu`` (``[gate; up]`` epilogue,
  alone or after the norm) and the greedy lm_head's argmax (:meth:`argmax`).
- Prefill chunks: each row chunk of the weight is dequantized by a kernel into a
  bounded buffer (:attr:`Int4Tuning.dequant_chunk` elements) and multiplied by cuBLAS;
  the fusions are composed with the layer ops.
- Anything else (float32 activations, group sizes below 64) runs the torch reference,
  :class:`edge.int4.Int4ReferenceLinear`.

Graph-safe: a launch allocates only its output (through torch), reads nothing back to
the host, and its grid depends only on shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from edge.int4 import BLOCK_ROWS, Int4Weight, int4_linear_reference
from edge.kernels import nvrtc, reference
from edge.quant import Norm, fused_linear_reference

SOURCE = "int4_gemv.cu"
DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAME = {torch.float16: "f16", torch.bfloat16: "bf16"}
SCALE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
MAX_GEMV_TOKENS = 8  # the mma's N; more tokens (prefill): dequantize + cuBLAS
# Kernel modes keyed by (norm, residual, swiglu) given: the name infix and whether the
# mode needs two row tiles a CTA (SwiGLU pairs the gate tile with its up tile).
MODES: dict[tuple[bool, bool, bool], tuple[str, bool]] = {
    (False, False, False): ("", False),
    (True, False, False): ("norm_", False),
    (False, True, False): ("residual_", False),
    (False, False, True): ("swiglu_", True),
    (True, False, True): ("norm_swiglu_", True),
}
ARGMAX_MODES: dict[bool, str] = {False: "argmax_", True: "norm_argmax_"}
# One-tile CTAs (more, shorter CTAs) while two-tile CTAs would give fewer than this many
# CTAs an SM.
_MIN_CTAS_PER_SM = 4


@dataclasses.dataclass(frozen=True)
class Int4Tuning:
    """Compile-time knobs of int4_gemv.cu and launch choices (one per backend)."""

    warps: int = 8  # warps per CTA, splitting the columns
    unroll: int = 4  # 16-byte loads in flight per lane and row tile
    min_blocks: int = 2  # resident CTAs per SM asked of the register allocator (0: none)
    tiles: int | None = None  # row tiles per CTA (1 or 2); None: chosen per shape
    dequant_chunk: int = 1 << 26  # weight elements dequantized at once for prefill

    def __post_init__(self) -> None:
        if self.warps not in (1, 2, 4, 8, 16) or not 1 <= self.unroll <= 8 or self.min_blocks < 0:
            raise ValueError(f"bad int4 GEMV tuning {self}")
        if self.tiles not in (None, 1, 2):
            raise ValueError(f"tiles must be 1, 2 or None, got {self.tiles}")

    def defines(self, scale_dtype: torch.dtype) -> dict[str, int]:
        return {
            "EDGE_INT4_SCALE": SCALE_CODES[scale_dtype],
            "EDGE_INT4_WARPS": self.warps,
            "EDGE_INT4_UNROLL": self.unroll,
            "EDGE_INT4_MIN_BLOCKS": self.min_blocks,
        }


class NvrtcLauncher:
    """Loads and launches kernels on one device through :mod:`edge.kernels.nvrtc` (the
    launcher interface the engine's backend hands its implementations)."""

    def __init__(self, device_index: int) -> None:
        self.device_index = int(device_index)

    def kernel(self, source: str, name: str, defines: dict[str, Any] | None = None) -> Any:
        return nvrtc.get_kernel(self.device_index, source, name, defines)

    def launch(self, kernel: Any, grid: int | tuple[int, ...], block: int | tuple[int, ...], args: Any,
               shmem: int = 0) -> None:
        nvrtc.launch(self.device_index, kernel, grid, block, args, shmem)

    def scratch(self, name: str, fits: Any, make: Any) -> Any:
        return nvrtc.stream_scratch(name, self.device_index, fits, make)

    def sm_count(self) -> int:
        return int(torch.cuda.get_device_properties(self.device_index).multi_processor_count)


def _is_vector(t: torch.Tensor, x: torch.Tensor, shape: int | tuple[int, ...], align: int = 1) -> bool:
    ok_shape = t.numel() == shape if isinstance(shape, int) else tuple(t.shape) == shape
    return ok_shape and t.dtype == x.dtype and t.device == x.device and t.is_contiguous() and t.data_ptr() % align == 0


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def weight_support(w: Int4Weight) -> str | None:
    """Why the GEMV cannot take this weight (None: it can)."""
    if w.group_size % 64:
        return f"group size {w.group_size} (the GEMV needs a multiple of 64)"
    if w.scale.dtype not in SCALE_CODES:
        return f"{w.scale.dtype} scales"
    if w.packed.numel() >= 2**31:
        return "more than 2^31 packed words"
    return None


class Int4CudaLinear:
    """The int4 linear of a CUDA backend (module docstring). ``layer_ops`` composes the
    fusions a kernel does not take."""

    name = "int4 GEMV (decode, tensor cores), dequantize + cuBLAS (prefill)"

    def __init__(self, launcher: Any, layer_ops: Any = reference, tuning: Int4Tuning = Int4Tuning()) -> None:
        self.launcher = launcher
        self.ops = layer_ops
        self.tuning = tuning
        self._sms = launcher.sm_count()
        self._kernels: dict[tuple[torch.dtype, str], Any] = {}

    def load(self, scale_dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)) -> "Int4CudaLinear":
        """Compile (or fetch from the disk cache) and load every kernel for these scale
        dtypes now (before graph capture). Raises KernelsUnavailable / KernelCompileError."""
        for sd in scale_dtypes:
            for dtype in DTYPES:
                for infix, _ in (*MODES.values(), *((a, True) for a in ARGMAX_MODES.values())):
                    self._kernel(sd, f"int4_gemv_{infix}{_DTYPE_NAME[dtype]}_t2")
                    if not infix.endswith(("swiglu_", "argmax_")):
                        self._kernel(sd, f"int4_gemv_{infix}{_DTYPE_NAME[dtype]}_t1")
                self._kernel(sd, f"int4_dequant_{_DTYPE_NAME[dtype]}")
            self._kernel(sd, "int4_argmax_take")
        return self

    def _kernel(self, scale_dtype: torch.dtype, name: str) -> Any:
        key = (scale_dtype, name)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = self.launcher.kernel(SOURCE, name, self.tuning.defines(scale_dtype))
        return k

    # -- the backend's interface ------------------------------------------------------

    def supports(
        self,
        x: torch.Tensor,
        w: Int4Weight,
        bias: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> bool:
        """Whether the GEMV runs for these arguments (else: prefill path or reference)."""
        if (norm is not None, residual is not None, bool(swiglu)) not in MODES:
            return False
        if x.device.type != "cuda" or x.dtype not in _DTYPE_NAME or x.device != w.device:
            return False
        cols = w.in_features
        if x.shape[-1] != cols or x.numel() == 0 or x.numel() // cols > MAX_GEMV_TOKENS:
            return False
        if weight_support(w) is not None or not x.is_contiguous() or x.data_ptr() % 16:
            return False
        if swiglu and w.out_features % 32:
            return False
        rows = w.out_features // 2 if swiglu else w.out_features
        if norm is not None and not _is_vector(norm[0], x, cols, align=16):
            return False
        if residual is not None and not (
            _is_vector(residual, x, (*x.shape[:-1], rows)) and not _overlap(residual, x)
        ):
            return False
        return bias is None or _is_vector(bias, x, w.out_features)

    def fuses(self, x: torch.Tensor, w: Int4Weight) -> bool:
        """Decode inputs run norm / residual / SwiGLU inside the GEMV."""
        return self.supports(x, w)

    def linear(
        self,
        x: torch.Tensor,
        w: Int4Weight,
        bias: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ dequant(w).T + bias`` in ``x``'s dtype with :func:`edge.quant.linear`'s
        fusions. ``out`` (contiguous, the result's shape) receives a plain or SwiGLU
        result; with ``residual`` the result is ``residual`` itself."""
        if residual is not None and out is not None:
            raise ValueError("out and residual are exclusive: the residual is updated in place")
        if not self.supports(x, w, bias, norm=norm, residual=residual, swiglu=swiglu):
            if norm is None and residual is None and not swiglu:
                y = self.matmul(x, w, bias)
            else:
                y = fused_linear_reference(
                    x, w, bias, norm=norm, residual=residual, swiglu=swiglu, ops=self.ops, matmul=self.matmul
                )
            return y if out is None else out.copy_(y)
        outputs = w.out_features // 2 if swiglu else w.out_features
        shape = (*x.shape[:-1], outputs)
        if residual is not None:
            out = residual
        elif out is None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        elif tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape} on {x.device}")
        infix, two = MODES[(norm is not None, residual is not None, bool(swiglu))]
        self._launch(x, w, bias, infix, out.data_ptr(), outputs, norm=norm, two_tiles=two)
        return out

    def argmax(
        self,
        x: torch.Tensor,
        w: Int4Weight,
        bias: torch.Tensor | None,
        out: torch.Tensor | None,
        *,
        norm: Norm | None = None,
    ) -> torch.Tensor | None:
        """Greedy token ids ``[tokens]`` (int64) without the logits: ``torch.argmax`` of
        the logits rounded to ``x``'s dtype (first of equal maxima), in two launches.
        None when the GEMV does not take these arguments."""
        if not self.supports(x, w, bias, norm=norm):
            return None
        tokens = x.numel() // w.in_features
        if out is None:
            out = torch.empty(tokens, dtype=torch.int64, device=x.device)
        elif out.dtype != torch.int64 or out.numel() != tokens or not out.is_contiguous() or out.device != x.device:
            raise ValueError(f"out must be a contiguous int64 tensor of {tokens} elements on {x.device}")
        best = self.launcher.scratch(
            "int4-argmax",
            lambda _slots: True,
            lambda _old: torch.zeros(MAX_GEMV_TOKENS, dtype=torch.int64, device=x.device),
        )
        self._launch(x, w, bias, ARGMAX_MODES[norm is not None], 0, w.out_features, norm=norm, two_tiles=True,
                     best_ptr=best.data_ptr())
        take = self._kernel(w.scale.dtype, "int4_argmax_take")
        self.launcher.launch(take, 1, 32, (best.data_ptr(), out.data_ptr(), np.int32(tokens)))
        return out

    # -- kernels ----------------------------------------------------------------------

    def plan(self, out_features: int, two_tiles: bool) -> tuple[int, int]:
        """(row tiles a CTA, CTAs) of a GEMV over ``out_features`` outputs."""
        blocks = -(-out_features // BLOCK_ROWS)
        tiles = 2 if two_tiles else self.tuning.tiles
        if tiles is None:
            tiles = 2 if -(-blocks // 2) >= _MIN_CTAS_PER_SM * self._sms else 1
        return tiles, -(-blocks // tiles)

    def _launch(
        self,
        x: torch.Tensor,
        w: Int4Weight,
        bias: torch.Tensor | None,
        infix: str,
        y_ptr: int,
        outputs: int,
        *,
        norm: Norm | None = None,
        two_tiles: bool = False,
        best_ptr: int = 0,
    ) -> None:
        tokens = x.numel() // w.in_features
        swiglu = infix.endswith("swiglu_")
        tiles, ctas = self.plan(outputs, two_tiles)
        if swiglu:
            ctas = outputs // BLOCK_ROWS  # a gate tile and its up tile each
        kernel = self._kernel(w.scale.dtype, f"int4_gemv_{infix}{_DTYPE_NAME[x.dtype]}_t{tiles}")
        self.launcher.launch(
            kernel,
            ctas,
            32 * self.tuning.warps,
            (
                y_ptr,
                x.data_ptr(),
                w.packed.data_ptr(),
                w.scale.data_ptr(),
                0 if w.zero is None else w.zero.data_ptr(),
                0 if w.perm is None else w.perm.data_ptr(),
                0 if bias is None else bias.data_ptr(),
                0 if norm is None else norm[0].data_ptr(),
                np.float32(0.0 if norm is None else norm[1]),
                np.int32(outputs),
                np.int32(w.in_features),
                np.int32(w.group_size),
                np.int32(tokens),
                best_ptr,
            ),
        )

    def dequantize_blocks(self, w: Int4Weight, rb0: int, rb1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``[16 rb0, 16 rb1)`` into ``out`` (contiguous, ``[16 (rb1 - rb0), in]`` of
        float16 / bfloat16): :meth:`edge.int4.Int4Weight.dequantize_blocks`, by a kernel."""
        n = (rb1 - rb0) * 2 * w.in_features  # words: one thread each
        kernel = self._kernel(w.scale.dtype, f"int4_dequant_{_DTYPE_NAME[out.dtype]}")
        self.launcher.launch(
            kernel,
            -(-n // 256),
            256,
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

    def matmul(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The plain linear of a call the GEMV does not take: dequantize + cuBLAS on a
        CUDA float16 / bfloat16 input, else the torch reference."""
        if x.device.type != "cuda" or x.dtype not in _DTYPE_NAME or x.device != w.device or weight_support(w):
            return int4_linear_reference(x, w, bias)
        if x.numel() // w.in_features <= MAX_GEMV_TOKENS and self.supports(x, w, bias):
            return self.linear(x, w, bias)
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        blocks = w.packed.shape[0]
        step = max(1, self.tuning.dequant_chunk // (BLOCK_ROWS * w.in_features))
        buf = torch.empty(min(step, blocks) * BLOCK_ROWS, w.in_features, dtype=x.dtype, device=x.device)
        outs = []
        for rb0 in range(0, blocks, step):
            rb1 = min(blocks, rb0 + step)
            r0, r1 = rb0 * BLOCK_ROWS, min(w.out_features, rb1 * BLOCK_ROWS)
            deq = self.dequantize_blocks(w, rb0, rb1, buf[: (rb1 - rb0) * BLOCK_ROWS])
            outs.append(F.linear(x, deq[: r1 - r0], None if bias is None else bias[r0:r1]))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
