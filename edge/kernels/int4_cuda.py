"""CUDA W4A16 linear for :class:`edge.quant.int4.Int4Weight`: the decode GEMV on tensor cores
with the int8 GEMV's fused epilogues, and dequantize + cuBLAS for prefill chunks.

:class:`Int4CudaLinear` is the backend's linear for the int4 format (``linear`` /
``fuses`` / ``argmax`` with :func:`edge.quant.q8_0.fused_linear_reference`'s semantics). It
loads its kernels (``int4_gemv.cu``, one module per scale dtype, compiled with its
:class:`Int4Tuning`) through the backend's launcher at construction; which weights they
take is checked once per weight (:func:`weight_support`) when the backend is planned.

- Decode (at most :data:`MAX_GEMV_TOKENS` tokens): the GEMV, with ``norm`` (RMSNorm of
  the input folded in), ``residual`` (in-place add), ``swiglu`` (``[gate; up]``
  epilogue, alone or after the norm) and the greedy lm_head's argmax (:meth:`argmax`).
  A CTA stages its tokens' activations in :attr:`Int4Tuning.stage_bytes` of shared
  memory; more tokens than fit run in launch rows, except in the plain and residual
  modes without act order, whose ``direct`` kernels read them from global memory in one
  launch row (the verify step's down projection). From 2 tokens a launch has at most
  the resident CTAs, each taking unit after unit, so it stages its tokens once.
- Prefill chunks (``Int4Tuning.prefill``): ``"dequant"``, each row chunk of the weight
  expanded by a kernel (``dequant.cu``, :mod:`edge.kernels.dequant_cuda`) into one
  bounded buffer (:attr:`Int4Tuning.dequant_chunk` elements) and multiplied by cuBLAS,
  each chunk's product written into its columns of the result; or ``"gemm"``, a GEMM that reads the packed codes
  and dequantizes inside its tile loop (mma.sync). Either is the plan, not a fallback;
  the fusions are composed with the layer ops.

Graph-safe: a launch allocates only its output (through torch), reads nothing back to
the host, and its grid depends only on shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from edge.quant.int4 import BLOCK_ROWS, Int4Weight
from edge.kernels.args import is_vector, overlap
from edge.kernels.dequant_cuda import DequantCuda, expanded_linear
from edge.kernels.launcher import Launcher
from edge.kernels.nvrtc import UnplannedArguments
from edge.quant.q8_0 import Norm, fused_linear_reference

__all__ = ["DTYPES", "MAX_GEMV_TOKENS", "MODES", "Int4CudaLinear", "Int4Tuning", "weight_support"]

SOURCE = "int4_gemv.cu"
DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAME = {torch.float16: "f16", torch.bfloat16: "bf16"}
SCALE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
MAX_GEMV_TOKENS = 8  # the mma's N; more tokens (prefill): dequantize + cuBLAS
# Modes with a direct variant (B fragments from global memory, nothing staged): taken
# when the tokens' rows do not fit one CTA's staging (the down projection's verify step).
DIRECT_MODES = ("", "residual_")
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
PREFILL = ("dequant", "gemm")
_GEMM_ROWS, _GEMM_TOKENS = 64, 64  # the prefill GEMM's CTA tile (int4_gemv.cu)
X_PAD = 16  # int4_gemv.cu's kPad: elements between two staged token rows


@dataclasses.dataclass(frozen=True)
class Int4Tuning:
    """Compile-time knobs of int4_gemv.cu (its CFG_INT4_* defines) and launch choices."""

    warps: int = 8  # warps per CTA, splitting the columns
    unroll: int = 2  # column tiles a register stage (two stages in flight), per warp and row tile
    direct_unroll: int | None = None  # the same for the direct kernels (None: unroll)
    min_blocks: int = 2  # resident CTAs per SM asked of the register allocator (0: none)
    tiles: int = 2  # row tiles a warp group multiplies at once (1 or 2; SwiGLU and argmax: 2)
    split: int | None = None  # warps sharing one unit's columns; None: chosen per shape
    warps_per_sm: int = 32  # the split is the smallest that gives every SM this many warps
    prefill: str = "dequant"  # prefill chunks: "dequant" (+ cuBLAS) or "gemm" (int4 tiles on mma.sync)
    dequant_chunk: int = 1 << 26  # weight elements dequantized at once for prefill
    stage_bytes: int = 96 << 10  # shared memory a CTA may stage activations in (more tokens: a launch row each)
    direct: bool = False  # plain / residual modes of 2+ tokens read them directly even where they fit the staging
    prefetch: int = 0  # tiles of a warp's stream ahead of its loads fetched into L2 (0: none)
    carveout: int | None = None  # shared memory the GEMVs prefer, % of the most an SM gives (None: the driver's)
    resident_grid: bool = False  # one-token launches too at most the resident CTAs (each taking unit after unit)
    skip_math: bool = False  # benchmark only: stream the weights without the products (wrong results)

    def __post_init__(self) -> None:
        if (self.warps not in (1, 2, 4, 8, 16) or not 1 <= self.unroll <= 8 or not 1 <= self.direct_stage_unroll <= 8
                or self.min_blocks < 0):
            raise ValueError(f"bad int4 GEMV tuning {self}")
        if self.tiles not in (1, 2):
            raise ValueError(f"tiles must be 1 or 2, got {self.tiles}")
        if self.split is not None and (self.split < 1 or self.warps % self.split):
            raise ValueError(f"split must divide warps ({self.warps}), got {self.split}")
        if not 0 <= self.prefetch <= 64:
            raise ValueError(f"prefetch must be 0..64 tiles, got {self.prefetch}")
        if self.carveout is not None and not 0 <= self.carveout <= 100:
            raise ValueError(f"carveout is a percentage, got {self.carveout}")
        if self.stage_bytes < 16 << 10:
            raise ValueError(f"stage_bytes must be at least 16 KiB, got {self.stage_bytes}")
        if self.prefill not in PREFILL:
            raise ValueError(f"prefill must be one of {PREFILL}, got {self.prefill!r}")

    @property
    def direct_stage_unroll(self) -> int:
        """The direct kernels' column tiles a stage (direct_unroll, else unroll)."""
        return self.unroll if self.direct_unroll is None else self.direct_unroll

    @classmethod
    def for_sms(cls, sms: int) -> Int4Tuning:
        """The default for a GPU of ``sms`` SMs: with few SMs (an Orin's 8 or 16) smaller
        CTAs, and one column tile a stage in the direct kernels, whose batches also carry
        their tokens' activations; with many one row tile and one column tile a stage,
        and one-token launches of at most the resident CTAs (docs/benchmarks.md)."""
        return cls(warps=4, direct_unroll=1) if sms <= 32 else cls(tiles=1, unroll=1, resident_grid=True)

    def defines(self, scale_dtype: torch.dtype) -> dict[str, int]:
        return {
            "CFG_INT4_SCALE": SCALE_CODES[scale_dtype],
            "CFG_INT4_WARPS": self.warps,
            "CFG_INT4_UNROLL": self.unroll,
            "CFG_INT4_DIRECT_UNROLL": self.direct_stage_unroll,
            "CFG_INT4_MIN_BLOCKS": self.min_blocks,
            "CFG_INT4_PREFETCH": self.prefetch,
            "CFG_INT4_SKIP_MATH": int(self.skip_math),
        }


def staged_row_bytes(in_features: int, dtype: torch.dtype) -> int:
    """Shared memory one token's staged activations take in a GEMV CTA (int4_gemv.cu)."""
    return (in_features + X_PAD) * dtype.itemsize


def group_shift(group_size: int, in_features: int) -> int | None:
    """The GEMV finds a 64-column tile's group as ``tile >> shift``: log2 of the tiles in
    a group (31 for one group over the whole row); None when that is no power of two."""
    if group_size >= in_features:
        return 31
    tiles = group_size // 64
    return tiles.bit_length() - 1 if tiles & (tiles - 1) == 0 else None


def weight_support(w: Int4Weight, dtype: torch.dtype, tuning: Int4Tuning | None = None) -> str | None:
    """None when the kernels take this weight for activations of ``dtype``, else why not."""
    if dtype not in _DTYPE_NAME:
        return f"no int4 GEMV for {dtype} activations"
    if staged_row_bytes(w.in_features, dtype) > (tuning or Int4Tuning()).stage_bytes:
        return f"{w.in_features} input features do not fit the GEMV's staged activations"
    if w.group_size % 64 or group_shift(w.group_size, w.in_features) is None:
        return f"group size {w.group_size} (the GEMV needs 64 x a power of two, or one group a row)"
    if w.scale.dtype not in SCALE_CODES:
        return f"{w.scale.dtype} scales"
    if w.device.type != "cuda" or any(t.data_ptr() % 16 for t in w.tensors()):
        return "weights must be 16-byte aligned on the GPU"
    if w.packed.numel() >= 2**31:
        return "more than 2^31 packed words"
    return None


class Int4CudaLinear:
    """The int4 linear of a CUDA backend (module docstring). ``layer_ops`` composes the
    fusions a kernel mode does not take. Every weight it is given passed
    :func:`weight_support`; its scale dtype is one of ``scale_dtypes`` (a module each)."""

    name = "int4 GEMV (decode, tensor cores), dequantize + cuBLAS (prefill)"

    def __init__(
        self,
        launcher: Launcher,
        layer_ops: Any,
        tuning: Int4Tuning = Int4Tuning(),
        scale_dtypes: tuple[torch.dtype, ...] = (torch.float16,),
    ) -> None:
        self.launcher = launcher
        self.ops = layer_ops
        self.tuning = tuning
        self._sms = launcher.sm_count()
        # Symmetric weights' zero point for the GEMV (which reads zero[0] for them).
        self._eights = torch.full((16,), 8, dtype=torch.uint8, device=launcher.tensor_device)
        self._k: dict[tuple[torch.dtype, str], Any] = {}
        for sd in scale_dtypes:
            defines = tuning.defines(sd)
            names = ["int4_argmax_take"]
            for dt in _DTYPE_NAME.values():
                names.append(f"int4_gemm_{dt}")
                for infix, two in (*MODES.values(), *((a, True) for a in ARGMAX_MODES.values())):
                    names.append(f"int4_gemv_{infix}{dt}_t2")
                    if not two:
                        names.append(f"int4_gemv_{infix}{dt}_t1")
                for infix in DIRECT_MODES:
                    names += [f"int4_gemv_direct_{infix}{dt}_t1", f"int4_gemv_direct_{infix}{dt}_t2"]
            for name in names:
                self._k[(sd, name)] = k = launcher.kernel(SOURCE, name, defines)
                if name.startswith("int4_gemv_"):
                    launcher.allow_dynamic_smem(k, tuning.stage_bytes, carveout=tuning.carveout)
        self._dq = DequantCuda(launcher, int4=True, int8=False)

    @property
    def expands_weights(self) -> bool:
        """Whether a prefill chunk expands every weight it multiplies (the ``"dequant"`` plan)."""
        return self.tuning.prefill == "dequant"

    def with_launcher(self, launcher: Launcher, layer_ops: Any) -> Int4CudaLinear:
        """The same kernels launched through ``launcher`` (an overlapped sibling)."""
        other = object.__new__(Int4CudaLinear)
        other.launcher, other.ops, other.tuning, other._sms, other._k = launcher, layer_ops, self.tuning, self._sms, self._k
        other._eights = self._eights
        other._dq = self._dq.with_launcher(launcher)
        return other

    def _gemv(self, x: torch.Tensor, w: Int4Weight) -> bool:
        """Whether ``x`` is a decode input (the GEMV); else a prefill chunk."""
        return x.numel() // w.in_features <= MAX_GEMV_TOKENS

    def fuses(self, x: torch.Tensor, w: Int4Weight) -> bool:
        """Decode inputs run norm / residual / SwiGLU inside the GEMV."""
        return self._gemv(x, w)

    def _check(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None, norm: Norm | None,
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
            and (w.scale.dtype, "int4_argmax_take") in self._k
            and not (swiglu and w.out_features % 32)
            and (norm is None or is_vector(norm[0], x, cols, align=16))
            and (residual is None or (is_vector(residual, x, (*x.shape[:-1], rows)) and not overlap(residual, x)))
            and (bias is None or is_vector(bias, x, w.out_features))
        )
        if not ok:
            raise UnplannedArguments(f"int4 GEMV of {x.dtype} {tuple(x.shape)} by {w!r}")

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
        """``x @ dequant(w).T + bias`` in ``x``'s dtype, ``x`` ``[..., in]`` -> ``[..., out]``,
        with the fusions of :func:`edge.quant.q8_0.fused_linear_reference`. ``out``
        (contiguous, the result's shape) receives a plain or SwiGLU result; with
        ``residual`` the result is ``residual`` itself (updated in place)."""
        if residual is not None and out is not None:
            raise ValueError("out and residual are exclusive: the residual is updated in place")
        mode = MODES.get((norm is not None, residual is not None, bool(swiglu)))
        if not self._gemv(x, w) or mode is None:
            if norm is None and residual is None and not swiglu:
                y = self._prefill(x, w, bias)
            else:  # prefill, or a combination the GEMV has no mode for: composed
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
        self._launch(x, w, bias, mode[0], out.data_ptr(), outputs, norm=norm, two_tiles=mode[1])
        return out

    def _plain(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x, w, bias)

    def argmax(
        self,
        x: torch.Tensor,
        w: Int4Weight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
    ) -> torch.Tensor | None:
        """Greedy token ids ``[tokens]`` (int64) without the logits: ``torch.argmax`` of
        the logits rounded to ``x``'s dtype (first of equal maxima), in two launches, the
        GEMV with its argmax epilogue and the take. None for a prefill chunk."""
        if not self._gemv(x, w):
            return None
        self._check(x, w, bias, norm, None, False)
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
        take = self._k[(w.scale.dtype, "int4_argmax_take")]
        self.launcher.launch(take, 1, 32, (best.data_ptr(), out.data_ptr(), np.int32(tokens)))
        return out

    # -- launches ---------------------------------------------------------------------

    def plan(self, outputs: int, two_tiles: bool, swiglu: bool = False) -> tuple[int, int, int]:
        """(row tiles a unit, warps a unit (the column split), CTAs) of a GEMV with
        ``outputs`` outputs a token. Long column streams a warp where the SMs are few,
        split columns where they are many: the smallest split that gives every SM
        ``tuning.warps_per_sm`` warps."""
        warps = self.tuning.warps
        tiles = 2 if two_tiles else self.tuning.tiles
        blocks = -(-outputs // BLOCK_ROWS)
        units = blocks if swiglu else -(-blocks // tiles)
        split = self.tuning.split
        if split is None:
            want = self.tuning.warps_per_sm * self._sms
            split = warps
            for cand in (1, 2, 4, 8, 16):
                if cand <= warps and warps % cand == 0 and units * cand >= want:
                    split = cand
                    break
        return tiles, split, -(-units // (warps // split))

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
        tiles, split, ctas = self.plan(outputs, two_tiles, infix.endswith("swiglu_"))
        row = staged_row_bytes(w.in_features, x.dtype)
        if self.tuning.stage_bytes < row:
            raise UnplannedArguments(f"int4 GEMV: a staged row of {row} B exceeds the {self.tuning.stage_bytes} B a CTA stages")
        chunk = min(tokens, MAX_GEMV_TOKENS, self.tuning.stage_bytes // row)  # tokens a CTA stages
        direct = (chunk < tokens or (self.tuning.direct and tokens > 1)) and infix in DIRECT_MODES and w.perm is None
        if direct:
            chunk = tokens
        shmem = 0 if direct else chunk * row
        kernel = self._k[(w.scale.dtype, f"int4_gemv_{'direct_' if direct else ''}{infix}{_DTYPE_NAME[x.dtype]}_t{tiles}")]
        # At most the resident CTAs, each staging its tokens once for all the units it takes.
        if tokens > 1 or self.tuning.resident_grid:
            ctas = min(ctas, self.launcher.resident_per_sm(kernel, 32 * self.tuning.warps, shmem) * self._sms)
        self.launcher.launch(
            kernel,
            (ctas, -(-tokens // chunk)),
            32 * self.tuning.warps,
            (
                y_ptr,
                x.data_ptr(),
                w.packed.data_ptr(),
                w.scale.data_ptr(),
                (self._eights if w.zero is None else w.zero).data_ptr(),
                0 if w.perm is None else w.perm.data_ptr(),
                0 if bias is None else bias.data_ptr(),
                0 if norm is None else norm[0].data_ptr(),
                np.float32(0.0 if norm is None else norm[1]),
                np.int32(outputs),
                np.int32(w.in_features),
                np.int32(group_shift(w.group_size, w.in_features)),
                np.int32(0 if w.zero is None else -1),
                np.int32(tokens),
                np.int32(split),
                np.int32(chunk),
                best_ptr,
            ),
            shmem=shmem,
        )

    def dequantize_blocks(self, w: Int4Weight, rb0: int, rb1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``[16 rb0, 16 rb1)`` into ``out`` (contiguous ``[16 (rb1 - rb0), in]``,
        float16 / bfloat16): :meth:`edge.quant.int4.Int4Weight.dequantize_blocks` by a kernel."""
        return self._dq.int4(w, rb0, rb1, out)

    def _prefill(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill chunk: the int4 GEMM, or each row chunk of the weight dequantized
        into one bounded buffer and multiplied by cuBLAS (``tuning.prefill``)."""
        if x.dtype not in _DTYPE_NAME or x.device != w.device or x.shape[-1] != w.in_features:
            raise UnplannedArguments(f"int4 prefill of {x.dtype} {tuple(x.shape)} on {x.device} by {w!r}")
        if bias is not None and not is_vector(bias, x, w.out_features):
            raise UnplannedArguments(f"int4 prefill bias {bias.dtype} {tuple(bias.shape)} for {w!r}")
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        if self.tuning.prefill == "gemm":
            return self._gemm(x, w, bias)
        step = max(1, self.tuning.dequant_chunk // (BLOCK_ROWS * w.in_features)) * BLOCK_ROWS
        return expanded_linear(
            x, w.out_features, w.packed.shape[0] * BLOCK_ROWS, step,
            lambda r0, r1, buf: self._dq.int4(w, r0 // BLOCK_ROWS, r1 // BLOCK_ROWS, buf), bias,
        )

    def _gemm(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """The int4 GEMM on ``x`` already in the layout's column order."""
        x2 = x.reshape(-1, w.in_features)
        if not x2.is_contiguous() or x2.data_ptr() % 16:  # cp.async copies 16-byte chunks
            x2 = x2.clone(memory_format=torch.contiguous_format)
        tokens = x2.shape[0]
        y = torch.empty(tokens, w.out_features, dtype=x.dtype, device=x.device)
        grid = (-(-w.out_features // _GEMM_ROWS), -(-tokens // _GEMM_TOKENS))
        self.launcher.launch(
            self._k[(w.scale.dtype, f"int4_gemm_{_DTYPE_NAME[x.dtype]}")],
            grid,
            128,
            (
                y.data_ptr(),
                x2.data_ptr(),
                w.packed.data_ptr(),
                w.scale.data_ptr(),
                0 if w.zero is None else w.zero.data_ptr(),
                0 if bias is None else bias.data_ptr(),
                np.int32(w.out_features),
                np.int32(w.in_features),
                np.int32(w.group_size),
                np.int32(tokens),
            ),
        )
        return y.view(*x.shape[:-1], w.out_features)
