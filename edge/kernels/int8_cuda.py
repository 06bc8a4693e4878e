"""CUDA W8A16 linear for int8 weights (:class:`edge.quant.q8_0.Int8Weight`): the decode GEMV.

:class:`Int8CudaLinear` is the backend's linear for the q8_0 format. ``linear`` has
the semantics of :func:`edge.quant.q8_0.int8_linear_reference` (``x @ dequant(w).T + bias``
in ``x``'s dtype) and runs the kernel of ``int8_gemv.cu`` for decode (one token, or up to
:data:`MAX_GEMV_TOKENS` where the tensor-core kernel does not apply), the tensor-core
kernel of ``int8_mma.cu`` for :data:`MIN_MMA_TOKENS` to :data:`MAX_MMA_TOKENS` tokens (the speculative
verify step: every weight byte read once for all of them; weights whose group size and
input width are multiples of 64, :func:`mma_support`; no more CTAs than are resident; the
modes the tuning prestages take their tokens from one ``int8_stage`` launch before them,
the other norm modes stage their tokens once per CTA for all the row tiles it takes, the
plain and residual modes read them with each batch, the ``direct`` kernels, unless the
tuning stages them where they fit); a prefill chunk expands the weight by a kernel
(``dequant.cu``, :mod:`edge.kernels.dequant_cuda`: the reference's values, bit for bit)
and cuBLAS multiplies, which is the plan, not a fallback. Which weights the kernel takes
is checked once per weight (:func:`weight_support`) when the backend is planned.

It also takes the fusions of :func:`edge.quant.q8_0.fused_linear_reference` and runs these
combinations in the kernel (:data:`MODES`), which lets an int8 decoder layer run 7
launches instead of 10: ``norm`` (qkv: RMSNorm of the residual stream folded in),
``residual`` (o and down: ``x += y`` in place), ``norm`` + ``swiglu`` (gate_up: norm,
SwiGLU epilogue). Other combinations compose the layer ops around the plain kernel.

Graph-safe: a launch allocates only its output (through torch, so inside a capture
it comes from the graph's pool), reads nothing back to the host, and its grid depends
only on shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from edge.kernels.args import is_vector, overlap
from edge.kernels.dequant_cuda import DequantCuda, expanded_linear
from edge.kernels.launcher import Launcher
from edge.kernels.nvrtc import UnplannedArguments
from edge.quant.q8_0 import DEQUANT_CHUNK_ELEMENTS, Int8Weight, Norm, fused_linear_reference

__all__ = ["DTYPES", "MAX_GEMV_TOKENS", "MAX_MMA_TOKENS", "MIN_MMA_TOKENS", "MODES", "PAIR_MODES", "Int8CudaLinear",
           "Int8Tuning", "mma_support", "weight_support"]

SOURCE = "int8_gemv.cu"
MMA_SOURCE = "int8_mma.cu"
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
MAX_GEMV_TOKENS = 4  # the per-token GEMV's most; more tokens (prefill): dequantize + matmul
MIN_MMA_TOKENS = 2  # from 2 tokens one read of the weights beats a per-token GEMV each (docs/benchmarks.md)
MAX_MMA_TOKENS = 8  # the tensor-core kernel's most (the mma's N)
MMA_PAD = 8  # int8_mma.cu kStagePad: elements between staged token rows
# Tensor-core modes with a direct variant (B fragments from global memory, nothing
# staged): taken by default (Int8Tuning.mma_direct) and where the tokens' rows do not
# fit one CTA's staging (the down projection).
MMA_DIRECT_MODES = ("", "residual_")
# One-tile modes with a prestaged variant of two row tiles a unit (Int8Tuning.mma_pair_tiles).
PAIR_MODES = ("", "norm_", "residual_")
_MAX_SMEM = 48 * 1024  # dynamic shared memory a launch may use without opting in
# A variant with more rows per warp is used while it still gives every SM this many
# CTAs (per token); fewer rows per warp means more, shorter CTAs for small matrices.
_MIN_CTAS_PER_SM = 2



@dataclasses.dataclass(frozen=True)
class Int8Tuning:
    """Compile-time knobs of int8_gemv.cu (its CFG_INT8_* defines), an optional forced
    rows-per-warp variant (None: chosen per shape) and the prefill expansion's bound."""

    warps: int = 4
    unroll_r1: int = 4
    unroll_r2: int = 4
    unroll_r4: int = 2
    min_blocks: int = 4
    rows_per_warp: int | None = None
    dequant_chunk: int = DEQUANT_CHUNK_ELEMENTS  # weight elements expanded at once for prefill
    mma_warps: int = 8  # int8_mma.cu: warps a CTA, splitting its row tile's columns
    mma_unroll: int = 2  # int8_mma.cu: column tiles a register stage (two stages in flight)
    mma_norm_unroll: int | None = None  # the same for the one-tile norm mode (qkv); None: mma_unroll
    mma_norm_warps: int | None = None  # warps a CTA in the one-tile norm mode (qkv); None: mma_warps
    mma_stage_bytes: int = 96 << 10  # shared memory a tensor-core CTA may stage tokens in (more: a launch row each)
    # Plain / residual modes read their tokens directly even where they fit the staging:
    # a CTA of these takes few units, and staging them cost more than reading them with
    # each batch (docs/benchmarks.md).
    mma_direct: bool = True
    # Shared memory the tensor-core kernels prefer, in percent of the most an SM can give
    # (None: the driver's choice): the driver fills SMs with staging CTAs up to the largest
    # carveout, which leaves L1 too small for the weight loads in flight (docs/benchmarks.md).
    mma_carveout: int | None = 72
    # GEMV modes (infixes of MODES) whose one-token launches take the tensor-core kernel:
    # on few SMs its norm + SwiGLU streams the gate_up weight faster than the GEMV, and its
    # paired norm mode the qkv weight (docs/benchmarks.md); a many-SM GPU keeps the GEMV.
    mma_one_token: tuple[str, ...] = ()
    # Modes (infixes of MODES and ARGMAX_MODES) whose tensor-core launches of several
    # tokens take them prestaged: one small launch stages them once for the whole grid
    # instead of each CTA staging them itself, and the plain and residual modes then run
    # the byte chain too (docs/benchmarks.md).
    mma_prestage: tuple[str, ...] = ()
    # One-tile modes (plain, norm, residual) whose prestaged launches take units of two
    # adjacent row tiles (where the mode is not prestaged, nothing changes): each read of
    # the tokens serves both, and half as many units balance better over the few CTAs of
    # a small GPU (docs/benchmarks.md).
    mma_pair_tiles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dequant_chunk < 1:
            raise ValueError(f"dequant_chunk must be positive, got {self.dequant_chunk}")
        if self.rows_per_warp is not None and self.rows_per_warp not in ROWS_PER_WARP:
            raise ValueError(f"rows_per_warp must be one of {ROWS_PER_WARP}, got {self.rows_per_warp}")
        if ({self.mma_warps, self.norm_warps} - {1, 2, 4, 8, 16}) or not 1 <= self.mma_unroll <= 4 \
                or not 1 <= self.norm_unroll <= 4:
            raise ValueError(f"bad int8 tensor-core tuning: {self.mma_warps} / {self.norm_warps} warps, "
                             f"unroll {self.mma_unroll} / {self.norm_unroll}")
        if self.mma_stage_bytes < 16 << 10:
            raise ValueError(f"mma_stage_bytes must be at least 16 KiB, got {self.mma_stage_bytes}")
        if self.mma_carveout is not None and not 0 <= self.mma_carveout <= 100:
            raise ValueError(f"mma_carveout is a percentage, got {self.mma_carveout}")
        known = {infix for infix, _ in MODES.values()}
        if not set(self.mma_one_token) <= known:
            raise ValueError(f"mma_one_token takes modes of {sorted(known)}, got {list(self.mma_one_token)}")
        if not set(self.mma_prestage) <= known | set(ARGMAX_MODES.values()):
            raise ValueError(f"mma_prestage takes modes of {sorted(known | set(ARGMAX_MODES.values()))}, "
                             f"got {list(self.mma_prestage)}")
        if not set(self.mma_pair_tiles) <= set(PAIR_MODES):
            raise ValueError(f"mma_pair_tiles takes modes of {list(PAIR_MODES)}, got {list(self.mma_pair_tiles)}")

    @property
    def norm_unroll(self) -> int:
        """The one-tile norm mode's column tiles a stage (mma_norm_unroll, else mma_unroll)."""
        return self.mma_unroll if self.mma_norm_unroll is None else self.mma_norm_unroll

    @property
    def norm_warps(self) -> int:
        """The one-tile norm mode's warps a CTA (mma_norm_warps, else mma_warps)."""
        return self.mma_warps if self.mma_norm_warps is None else self.mma_norm_warps

    def warps_of(self, infix: str) -> int:
        """Warps a tensor-core CTA of mode ``infix`` has."""
        return self.norm_warps if infix == "norm_" else self.mma_warps

    @classmethod
    def for_sms(cls, sms: int) -> Int8Tuning:
        """The default for a GPU of ``sms`` SMs: the verify step's norm modes prestaged,
        and with few SMs (an Orin's 8 or 16) its residual ones too, the one-tile modes in
        pairs of row tiles, one column tile a tensor-core stage, 4-warp CTAs in the one-tile
        norm mode, and the decode step's qkv (norm, prestaged in pairs) and gate_up (norm +
        SwiGLU) on the tensor-core kernel (docs/benchmarks.md)."""
        if sms <= 32:
            return cls(mma_unroll=1, mma_norm_unroll=4, mma_norm_warps=4, mma_one_token=("norm_", "norm_swiglu_"),
                       mma_prestage=("norm_", "residual_", "norm_swiglu_"), mma_pair_tiles=("norm_", "residual_"))
        return cls(mma_prestage=("norm_", "norm_swiglu_"))

    def defines(self) -> dict[str, int]:
        return {
            "CFG_INT8_WARPS": self.warps,
            "CFG_INT8_UNROLL_R1": self.unroll_r1,
            "CFG_INT8_UNROLL_R2": self.unroll_r2,
            "CFG_INT8_UNROLL_R4": self.unroll_r4,
            "CFG_INT8_MIN_BLOCKS": self.min_blocks,
        }

    def mma_defines(self, infix: str = "") -> dict[str, int]:
        """int8_mma.cu's defines for the kernels of mode ``infix``."""
        return {"CFG_INT8_MMA_WARPS": self.warps_of(infix), "CFG_INT8_MMA_UNROLL": self.mma_unroll,
                "CFG_INT8_MMA_NORM_UNROLL": self.norm_unroll}


def weight_support(w: Int8Weight, dtype: torch.dtype) -> str | None:
    """None when the GEMV takes this weight for activations of ``dtype``, else why not."""
    rows, cols = w.weight.shape
    g = w.group_size
    if dtype not in _DTYPE_NAME:
        return f"no int8 GEMV for {dtype} activations"
    if g < 16 or g & (g - 1) or cols % g or cols % 16:
        return f"group size {g} / {cols} input columns"
    if w.scale.dtype != torch.float32 or not (w.scale.is_contiguous() and w.weight.is_contiguous()):
        return "scales must be contiguous float32"
    if w.weight.device.type != "cuda" or w.weight.data_ptr() % 16 or w.scale.data_ptr() % 4:
        return "weights must be 16-byte aligned on the GPU"
    if rows >= 2**31 or cols >= 2**31:
        return "weight too large for int32 indexing"
    return None


def mma_support(w: Int8Weight) -> str | None:
    """None when the tensor-core kernel takes this (GEMV-supported) weight, else why not:
    its 64-column tiles must not straddle groups, and row tiles come in pairs."""
    rows, cols = w.weight.shape
    if cols % 64 or w.group_size % 64:
        return f"group size {w.group_size} / {cols} input columns: not whole 64-column tiles"
    if rows % 32:
        return f"{rows} rows: not a multiple of 32"
    return None


class Int8CudaLinear:
    """The q8_0 linear of a CUDA backend: the GEMV (decode) with its fused epilogues,
    dequantize + GEMM for prefill chunks. ``layer_ops`` composes the fusions a kernel
    mode does not take. Every weight it is given passed :func:`weight_support`."""

    name = "int8 GEMV (decode), dequantize + GEMM (prefill)"
    expands_weights = True  # a prefill chunk expands every weight it multiplies

    def __init__(self, launcher: Launcher, layer_ops: Any, tuning: Int8Tuning = Int8Tuning()) -> None:
        self.launcher = launcher
        self.ops = layer_ops
        self.tuning = tuning
        self._sms = launcher.sm_count()
        defines = tuning.defines()
        self._k: dict[str, Any] = {}
        for dtype in DTYPES:
            for infix, rows in (*MODES.values(), *((a, ROWS_PER_WARP) for a in ARGMAX_MODES.values())):
                for r in rows:
                    name = f"int8_gemv_{infix}{_DTYPE_NAME[dtype]}_r{r}"
                    self._k[name] = launcher.kernel(SOURCE, name, defines)
        self._k["take"] = launcher.kernel(SOURCE, "int8_argmax_take", defines)
        self._mma_smem = min(launcher.shared_memory()[1], tuning.mma_stage_bytes)
        for dtype in DTYPES:
            for infix in (*(m[0] for m in MODES.values()), *ARGMAX_MODES.values()):  # the same modes
                name = f"int8_mma_{infix}{_DTYPE_NAME[dtype]}"
                self._k[name] = k = launcher.kernel(MMA_SOURCE, name, tuning.mma_defines(infix))
                launcher.allow_dynamic_smem(k, self._mma_smem, carveout=tuning.mma_carveout)
            for infix in MMA_DIRECT_MODES:
                name = f"int8_mma_direct_{infix}{_DTYPE_NAME[dtype]}"
                self._k[name] = launcher.kernel(MMA_SOURCE, name, tuning.mma_defines())
            for infix in tuning.mma_prestage:
                name = f"int8_mma_pre_direct_{infix}{_DTYPE_NAME[dtype]}"
                self._k[name] = launcher.kernel(MMA_SOURCE, name, tuning.mma_defines(infix))
                if infix in tuning.mma_pair_tiles:
                    name = f"int8_mma_pre_pair_{infix}{_DTYPE_NAME[dtype]}"
                    self._k[name] = launcher.kernel(MMA_SOURCE, name, tuning.mma_defines(infix))
                if _tiles(infix) == 2:
                    name = f"int8_mma_pre_{infix}{_DTYPE_NAME[dtype]}"
                    self._k[name] = k = launcher.kernel(MMA_SOURCE, name, tuning.mma_defines(infix))
                    launcher.allow_dynamic_smem(k, self._mma_smem, carveout=tuning.mma_carveout)
            if tuning.mma_prestage:
                for norm in ("", "norm_"):
                    name = f"int8_stage_{norm}{_DTYPE_NAME[dtype]}"
                    self._k[name] = launcher.kernel(MMA_SOURCE, name, tuning.mma_defines())
        self._dq = DequantCuda(launcher, int4=False, int8=True)

    def with_launcher(self, launcher: Launcher, layer_ops: Any) -> "Int8CudaLinear":
        """The same kernels launched through ``launcher`` (an overlapped sibling)."""
        other = object.__new__(Int8CudaLinear)
        other.launcher, other.ops, other.tuning, other._sms, other._k = launcher, layer_ops, self.tuning, self._sms, self._k
        other._mma_smem = self._mma_smem
        other._dq = self._dq.with_launcher(launcher)
        return other

    def plan(self, out_features: int, tokens: int, min_rows: int = 1) -> tuple[int, int]:
        """(rows per warp, CTAs) of a launch over ``out_features`` weight rows, with at
        least ``min_rows`` rows per warp (SwiGLU: 2, a gate and an up row)."""
        warps = self.tuning.warps
        r = self.tuning.rows_per_warp
        if r is None:
            want = _MIN_CTAS_PER_SM * self._sms
            r = 1
            for cand in ROWS_PER_WARP:
                if -(-out_features // (warps * cand)) * tokens >= want:
                    r = cand
                    break
        r = max(r, min_rows)
        return r, -(-out_features // (warps * r)) * tokens

    def _gemv(self, x: torch.Tensor, w: Int8Weight) -> bool:
        """Whether ``x`` is a decode input (a GEMV kernel); else a prefill chunk (the GEMM)."""
        tokens = x.numel() // w.in_features
        return tokens <= MAX_GEMV_TOKENS or self._mma(tokens, w, None)

    def _mma(self, tokens: int, w: Int8Weight, infix: str | None) -> bool:
        """Whether ``tokens`` tokens in mode ``infix`` run on the tensor-core kernel
        (int8_mma.cu): from 2 tokens, and 1 in the tuning's ``mma_one_token`` modes."""
        low = 1 if infix in self.tuning.mma_one_token else MIN_MMA_TOKENS
        return low <= tokens <= MAX_MMA_TOKENS and mma_support(w) is None

    def fuses(self, x: torch.Tensor, w: Int8Weight) -> bool:
        """Decode inputs run norm / residual / SwiGLU inside the GEMV."""
        return self._gemv(x, w) and _norm_smem(x, w.in_features) <= _MAX_SMEM

    def _check(self, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, norm: Norm | None,
               residual: torch.Tensor | None, swiglu: bool) -> None:
        rows, cols = w.weight.shape
        ok = (
            x.dtype in _DTYPE_NAME
            and x.device == w.weight.device
            and x.shape[-1] == cols
            and x.numel() > 0
            and x.is_contiguous()
            and x.data_ptr() % 16 == 0
            and not (swiglu and rows % 2)
            and (norm is None or (is_vector(norm[0], x, cols, align=16) and _norm_smem(x, cols) <= _MAX_SMEM))
            and (residual is None or (is_vector(residual, x, (*x.shape[:-1], rows)) and not overlap(residual, x)))
            and (bias is None or is_vector(bias, x, rows))
        )
        if not ok:
            raise UnplannedArguments(f"int8 GEMV of {x.dtype} {tuple(x.shape)} by {tuple(w.weight.shape)}")

    def linear(
        self,
        x: torch.Tensor,
        w: Int8Weight,
        bias: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ dequant(w).T + bias`` in ``x``'s dtype, ``x`` ``[..., in]`` -> ``[..., out]``,
        with the fusions of :func:`edge.quant.q8_0.fused_linear_reference`. ``out``
        (contiguous, ``x``'s dtype, the result's shape) receives the result when given;
        with ``residual`` the result is ``residual`` itself (updated in place)."""
        if residual is not None and out is not None:
            raise ValueError("out and residual are exclusive: the residual is updated in place")
        mode = _mode(norm, residual, swiglu)
        if not self._gemv(x, w) or mode is None:
            if norm is None and residual is None and not swiglu:
                y = self._prefill(x, w, bias)
            else:  # prefill, or a combination the GEMV has no mode for: composed
                y = fused_linear_reference(
                    x, w, bias, norm=norm, residual=residual, swiglu=swiglu, ops=self.ops, matmul=self._plain
                )
            return y if out is None else out.copy_(y)
        self._check(x, w, bias, norm, residual, swiglu)
        rows = w.out_features
        outputs = rows // 2 if swiglu else rows
        shape = (*x.shape[:-1], outputs)
        if residual is not None:
            out = residual
        elif out is None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        elif tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape} on {x.device}")
        self._launch(x, w, bias, mode[0], out.data_ptr(), outputs, norm=norm, min_rows=2 if swiglu else 1)
        return out

    def _plain(self, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x, w, bias)

    def dequantize(self, w: Int8Weight, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``[r0, r1)`` of the weight into ``out`` (contiguous ``[r1 - r0, in]``,
        float16 / bfloat16) by a kernel: the reference's dequantization, bit for bit."""
        return self._dq.int8(w, r0, r1, out)

    def _prefill(self, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill chunk: each row chunk of the weight expanded into one bounded buffer
        (``tuning.dequant_chunk`` elements), cuBLAS multiplies."""
        if x.dtype not in _DTYPE_NAME or x.device != w.device or x.shape[-1] != w.in_features:
            raise UnplannedArguments(f"int8 prefill of {x.dtype} {tuple(x.shape)} on {x.device} by {w!r}")
        if bias is not None and not is_vector(bias, x, w.out_features):
            raise UnplannedArguments(f"int8 prefill bias {bias.dtype} {tuple(bias.shape)} for {w!r}")
        rows = w.out_features
        step = min(rows, max(1, self.tuning.dequant_chunk // w.in_features))
        return expanded_linear(x, rows, rows, step, lambda r0, r1, buf: self._dq.int8(w, r0, r1, buf), bias)

    def _launch(
        self,
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
        """One GEMV launch in mode ``infix``."""
        rows, cols = w.weight.shape
        tokens = x.numel() // cols
        if self._mma(tokens, w, infix):
            self._launch_mma(x, w, bias, infix, y_ptr, outputs, tokens, norm, best_ptr)
            return
        staged = norm is not None and infix != ARGMAX_MODES[True]  # the kernel's kStaged
        smem = _norm_smem(x, cols) if staged else 0
        r, ctas = self.plan(rows, tokens, min_rows)
        self.launcher.launch(
            self._k[f"int8_gemv_{infix}{_DTYPE_NAME[x.dtype]}_r{r}"],
            ctas,
            32 * self.tuning.warps,
            (
                *_operands(x, w, bias, norm, y_ptr, outputs),
                np.int32(w.group_size.bit_length() - 1),
                np.int32(tokens),
                best_ptr,
            ),
            shmem=smem,
        )

    def _launch_mma(self, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, infix: str, y_ptr: int,
                    outputs: int, tokens: int, norm: Norm | None, best_ptr: int) -> None:
        """One tensor-core launch in mode ``infix`` (the GEMV's infix; int8_mma.cu): the
        tokens staged in one CTA's shared memory, else (plain and residual modes) read
        directly, else in as many launch rows as it takes; never more CTAs than are
        resident (each stages its tokens once for all the units it takes)."""
        cols = w.in_features
        if self._prestaged(infix, tokens):
            self._launch_prestaged(x, w, bias, infix, y_ptr, outputs, tokens, norm, best_ptr)
            return
        units = _units(outputs, infix, _tiles(infix))
        sums, row = _tile_sums_bytes(cols), _staged_row_bytes(cols)
        room = self._mma_smem - sums
        chunk = min(tokens, max(room, 0) // row)
        if (chunk < tokens or self.tuning.mma_direct) and infix in MMA_DIRECT_MODES:
            name, chunk, shmem = f"int8_mma_direct_{infix}{_DTYPE_NAME[x.dtype]}", tokens, 0
        elif chunk < 1:
            raise UnplannedArguments(f"int8 tensor-core GEMV: a staged row of {row} B and {sums} B of sums exceed "
                                     f"{self._mma_smem} B")
        else:
            name, shmem = f"int8_mma_{infix}{_DTYPE_NAME[x.dtype]}", sums + chunk * row
        kernel = self._k[name]
        threads = 32 * self.tuning.warps_of(infix)
        resident = self.launcher.resident_per_sm(kernel, threads, shmem) * self._sms
        self.launcher.launch(
            kernel,
            (min(units, resident), -(-tokens // chunk)),
            threads,
            (
                *_operands(x, w, bias, norm, y_ptr, outputs),
                np.int32(w.group_size.bit_length() - 7),  # log2(group / 64)
                np.int32(tokens),
                np.int32(chunk),
                best_ptr,
            ),
            shmem=shmem,
        )

    def _prestaged(self, infix: str, tokens: int) -> bool:
        """Whether a tensor-core launch of ``tokens`` tokens in mode ``infix`` takes them
        prestaged: where the tuning prestages the mode, from 2 tokens (one token measured
        no gain), and one token too where the mode runs in pairs of row tiles (only their
        prestaged kernel has them)."""
        t = self.tuning
        return infix in t.mma_prestage and (tokens >= MIN_MMA_TOKENS or infix in t.mma_pair_tiles)

    def _launch_prestaged(self, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, infix: str, y_ptr: int,
                          outputs: int, tokens: int, norm: Norm | None, best_ptr: int) -> None:
        """A tensor-core launch in mode ``infix`` of tokens prestaged (int8_mma.cu:
        int8_stage, a few CTAs a token, then int8_mma_pre): the norm folded in and the
        tokens scaled for the byte chain once, into a buffer that every CTA of a two-tile
        mode copies into its shared memory where it fits (``int8_mma_pre_``), else reads
        with each batch (``int8_mma_pre_direct_``; a one-tile mode of the tuning's
        ``mma_pair_tiles`` in units of two row tiles, ``int8_mma_pre_pair_``)."""
        cols, dt = w.in_features, _DTYPE_NAME[x.dtype]
        stage_threads, warps = 32 * self.tuning.mma_warps, self.tuning.warps_of(infix)
        # Two 8-element chunks a thread; each stage CTA leaves one share of a token's sum
        # of squares, which the consumer holds in one of its warps' slots.
        chunks = min(self.tuning.mma_warps, warps, MAX_MMA_TOKENS, max(1, -(-cols // (16 * stage_threads))))
        pre = torch.empty(prestaged_bytes(cols, tokens), dtype=torch.uint8, device=x.device)
        self.launcher.launch(
            self._k[f"int8_stage_{'norm_' if norm is not None else ''}{dt}"],
            (tokens, chunks),
            stage_threads,
            (pre.data_ptr(), x.data_ptr(), *(() if norm is None else (norm[0].data_ptr(),)), np.int32(cols)),
        )
        # One-tile modes (paired or not) read the tokens with each batch; the two-tile ones
        # share each read between their tiles and copy them into shared memory where they fit.
        copied = _tile_sums_bytes(cols) + tokens * _staged_row_bytes(cols)  # the staged layout
        if infix in self.tuning.mma_pair_tiles:
            tiles, shmem, kind = 2, 0, "pre_pair_"
        elif _tiles(infix) == 1 or copied > self._mma_smem:
            tiles, shmem, kind = _tiles(infix), 0, "pre_direct_"
        else:
            tiles, shmem, kind = 2, copied, "pre_"
        kernel = self._k[f"int8_mma_{kind}{infix}{dt}"]
        units = _units(outputs, infix, tiles)
        resident = self.launcher.resident_per_sm(kernel, 32 * warps, shmem) * self._sms
        self.launcher.launch(
            kernel,
            (min(units, resident), 1),
            32 * warps,
            (
                y_ptr,
                pre.data_ptr(),
                w.weight.data_ptr(),
                w.scale.data_ptr(),
                0 if bias is None else bias.data_ptr(),
                np.float32(0.0 if norm is None else norm[1]),
                np.int32(outputs),
                np.int32(cols),
                np.int32(w.group_size.bit_length() - 7),  # log2(group / 64)
                np.int32(tokens),
                np.int32(chunks),
                best_ptr,
            ),
            shmem=shmem,
        )

    def _best(self, device: torch.device) -> torch.Tensor:
        """The current stream's argmax slots (int64 ``[MAX_MMA_TOKENS]``, zeroed when
        made; ``int8_argmax_take`` empties each slot it reads)."""
        return self.launcher.scratch(
            "argmax",
            lambda _slots: True,
            lambda _old: torch.zeros(MAX_MMA_TOKENS, dtype=torch.int64, device=device),
        )

    def argmax(
        self,
        x: torch.Tensor,
        w: Int8Weight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
    ) -> torch.Tensor | None:
        """Greedy token ids ``[tokens]`` (int64) of ``x @ dequant(w).T + bias`` without the
        logits: ``torch.argmax`` of the logits rounded to ``x``'s dtype (the first of
        equal maxima), in two launches, the GEMV with its argmax epilogue and the take.
        With ``norm`` the input is RMSNorm'd inside the GEMV. ``out`` (contiguous int64
        ``[tokens]``) receives them. None for a prefill chunk: the caller computes the
        logits instead."""
        if not self._gemv(x, w):
            return None
        self._check(x, w, bias, norm, None, False)
        tokens = x.numel() // w.in_features
        if out is None:
            out = torch.empty(tokens, dtype=torch.int64, device=x.device)
        elif out.dtype != torch.int64 or out.numel() != tokens or not out.is_contiguous() or out.device != x.device:
            raise ValueError(f"out must be a contiguous int64 tensor of {tokens} elements on {x.device}")
        best = self._best(x.device)
        self._launch(x, w, bias, ARGMAX_MODES[norm is not None], 0, w.out_features, norm=norm, best_ptr=best.data_ptr())
        self.launcher.launch(self._k["take"], 1, 32, (best.data_ptr(), out.data_ptr(), np.int32(tokens)))
        return out


def _operands(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, norm: Norm | None, y_ptr: int,
              outputs: int) -> tuple:
    """The leading kernel arguments both int8 kernels take: y, x, q, scale, bias, norm_w,
    eps, out, in."""
    return (
        y_ptr,
        x.data_ptr(),
        w.weight.data_ptr(),
        w.scale.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        0 if norm is None else norm[0].data_ptr(),
        np.float32(0.0 if norm is None else norm[1]),
        np.int32(outputs),
        np.int32(w.in_features),
    )


def _tiles(infix: str) -> int:
    """Row tiles a tensor-core unit takes in mode ``infix``: a gate tile and its up tile
    (SwiGLU), two for argmax (32 outputs a warp), else one."""
    return 2 if infix.endswith(("swiglu_", "argmax_")) else 1


def _units(outputs: int, infix: str, tiles: int) -> int:
    """Units of a tensor-core launch of ``outputs`` outputs in mode ``infix``, ``tiles``
    row tiles a unit (SwiGLU: a gate tile and its up tile give 16 outputs)."""
    return outputs // 16 if infix.endswith("swiglu_") else -(-outputs // (16 * tiles))


def _tile_sums_bytes(cols: int) -> int:
    """Bytes of each 64-column tile's scale and activation sum (a float2 a token slot),
    ahead of the staged rows in shared memory and in the prestaged buffer."""
    return (cols // 64) * MAX_MMA_TOKENS * 8


def _staged_row_bytes(cols: int) -> int:
    """Bytes of one token staged in a CTA's shared memory (float16, padded)."""
    return (cols + MMA_PAD) * 2


def prestaged_bytes(cols: int, tokens: int) -> int:
    """Bytes of int8_mma.cu's prestaged tokens: the tile sums, MAX_MMA_TOKENS x
    MAX_MMA_TOKENS float sums of squares, the float16 rows (unpadded)."""
    return _tile_sums_bytes(cols) + MAX_MMA_TOKENS * MAX_MMA_TOKENS * 4 + tokens * cols * 2


def _mode(norm: Norm | None, residual: torch.Tensor | None, swiglu: bool) -> tuple[str, tuple[int, ...]] | None:
    return MODES.get((norm is not None, residual is not None, bool(swiglu)))


def _norm_smem(x: torch.Tensor, cols: int) -> int:
    """Dynamic shared memory of a norm-mode launch: the norm weight."""
    return cols * x.element_size()


