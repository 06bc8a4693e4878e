"""GGUF tensors as llama.cpp stores them: the block formats, their torch dequantization,
the weight container and its reference linear.

Layout. A GGUF tensor of ggml type ``t`` and shape ``[out, in]`` (``in`` the fastest
axis) is ``out`` rows of ``in / block_size(t)`` blocks of ``type_size(t)`` bytes; every
block is self-contained (its scales and codes). :class:`GGUFWeight` keeps these bytes
exactly as stored, one ``uint8 [rows, row_bytes]`` tensor per part, the parts stacked
along the output dimension (fused q/k/v and gate/up, whose parts may have different
types in a mixed file such as Q4_K_M). Nothing is converted at load, so the weight's
bytes are the file's bytes.

Meaning of one block (ggml-common.h; ``d``, ``dmin`` float16, computed in float32):

* Q8_0 (32 values, 34 bytes): ``d``, int8 ``q[32]``: ``d * q``.
* Q4_0 (32, 18): ``d``, ``qs[16]``: value ``j`` is the low nibble of ``qs[j]`` (j < 16)
  or the high nibble of ``qs[j - 16]``, minus 8, times ``d``.
* Q4_K (256, 144): ``d``, ``dmin``, 12 bytes of eight 6-bit (scale, min) pairs, ``qs[128]``;
  sub-block ``s`` (32 values) is ``(d * scale_s) * q - (dmin * min_s)``; its codes are
  the low (s even) or high (s odd) nibbles of ``qs[32 (s // 2) :][:32]``.
* Q5_K (256, 176): Q4_K plus ``qh[32]``: bit ``s`` of ``qh[l]`` is bit 4 of code ``l``
  of sub-block ``s``.
* Q6_K (256, 210): ``ql[128]``, ``qh[64]``, int8 ``scales[16]``, ``d``; value
  ``(d * scale_k) * (q - 32)`` per 16 values, q 4 bits from ``ql`` and 2 from ``qh``.
* F32 / F16 / BF16: plain values.

The dequantizations below are bit for bit those of gguf-py (``gguf.quants``): the same
float32 operations in the same order (``d * q - dm``, the products exact).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from edge.kernels import reference
from edge.quant.linear import ComposedLinear
from edge.quant.q8_0 import QuantError

FORMAT = "gguf"
QK_K = 256
# Elements dequantized at once by the reference linear and the embedding (bounds the
# float32 temporary: 64 MiB).
DEQUANT_CHUNK_ELEMENTS = 1 << 24


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """``qs [n, groups * width]`` -> ``[n, 2 groups, width]``: each group's low nibbles,
    then its high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, groups, 1, width)
    return torch.cat((q & 0x0F, q >> 4), dim=2).reshape(n, 2 * groups, width)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of Q4_K / Q5_K blocks, each ``[n, 8]`` uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _dequant_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _half(b, 0)


def _dequant_q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1, 16).reshape(-1, 32).to(torch.int8) - 8
    return _half(b, 0) * q.float()


def _dequant_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_half(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_half(b, 2) * mn.float()).unsqueeze(-1)
    q = _nibbles(b[:, 16:], 4, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _dequant_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_half(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_half(b, 2) * mn.float()).unsqueeze(-1)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1
    q = (_nibbles(b[:, 48:], 4, 32) | (high << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def _dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    low = _nibbles(b[:, :128], 2, 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda b: b.contiguous().view(dtype).float()


@dataclass(frozen=True)
class BlockType:
    """One ggml tensor type edge reads: its id (``gguf.GGMLQuantizationType``), name,
    values and bytes per block, and ``dequantize`` (uint8 ``[n, type_size]`` -> float32
    ``[n, block_size]``)."""

    qtype: int
    name: str
    block_size: int
    type_size: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]

    @property
    def quantized(self) -> bool:
        return self.block_size > 1

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_size * self.type_size


# ggml type ids (ggml.h); the sizes are checked against gguf-py's table in the tests.
BLOCK_TYPES: dict[int, BlockType] = {
    t.qtype: t
    for t in (
        BlockType(0, "F32", 1, 4, _plain(torch.float32)),
        BlockType(1, "F16", 1, 2, _plain(torch.float16)),
        BlockType(2, "Q4_0", 32, 18, _dequant_q4_0),
        BlockType(8, "Q8_0", 32, 34, _dequant_q8_0),
        BlockType(12, "Q4_K", QK_K, 144, _dequant_q4_k),
        BlockType(13, "Q5_K", QK_K, 176, _dequant_q5_k),
        BlockType(14, "Q6_K", QK_K, 210, _dequant_q6_k),
        BlockType(30, "BF16", 1, 2, _plain(torch.bfloat16)),
    )
}
SUPPORTED_TYPE_NAMES = tuple(t.name for t in BLOCK_TYPES.values())


def block_type(qtype: int, what: str = "tensor") -> BlockType:
    try:
        return BLOCK_TYPES[int(qtype)]
    except KeyError:
        raise QuantError(
            f"{what}: ggml type {qtype} is not supported (supported: {', '.join(SUPPORTED_TYPE_NAMES)})"
        ) from None


def dequantize_rows(data: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of stored blocks ``uint8 [rows, row_bytes]`` -> ``[rows, in]``, computed in
    float32 and rounded once to ``dtype``."""
    t = block_type(qtype)
    rows, row_bytes = data.shape
    if row_bytes % t.type_size:
        raise QuantError(f"{t.name}: {row_bytes} bytes a row is not whole {t.type_size}-byte blocks")
    blocks = data.reshape(-1, t.type_size)
    return t.dequantize(blocks).reshape(rows, row_bytes // t.type_size * t.block_size).to(dtype)


@dataclass(frozen=True)
class GGUFPart:
    """``rows`` consecutive output rows of one ggml type: ``data`` uint8 ``[rows, row_bytes]``."""

    qtype: int
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def type(self) -> BlockType:
        return BLOCK_TYPES[self.qtype]


class GGUFWeight:
    """A linear weight ``[out, in]`` held as GGUF blocks (module docstring): ``parts``
    stacked along the output rows, each of one ggml type."""

    FORMAT = FORMAT  # the backend's key for this weight format
    __slots__ = ("parts", "out_features", "in_features")

    def __init__(self, parts: Sequence[GGUFPart], in_features: int) -> None:
        if not parts:
            raise QuantError("GGUFWeight needs at least one part")
        for p in parts:
            t = block_type(p.qtype)
            if p.data.dtype != torch.uint8 or p.data.dim() != 2:
                raise QuantError(f"GGUFWeight {t.name} part must be uint8 [rows, row_bytes], got {p.data.dtype}")
            if in_features % t.block_size or p.data.shape[1] != t.row_bytes(in_features):
                raise QuantError(
                    f"GGUFWeight {t.name} part: {p.data.shape[1]} bytes a row do not hold {in_features} values"
                )
        devices = {p.data.device for p in parts}
        if len(devices) != 1:
            raise QuantError(f"GGUFWeight parts on several devices: {sorted(map(str, devices))}")
        self.parts = tuple(parts)
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.parts[0].data.device

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(p.type.name for p in self.parts)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.data for p in self.parts)

    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def to(self, device: torch.device | str) -> "GGUFWeight":
        return GGUFWeight([GGUFPart(p.qtype, p.data.to(device)) for p in self.parts], self.in_features)

    def row_chunks(self) -> list[tuple[int, GGUFPart, int, int]]:
        """``(first output row, part, r0, r1)``: the weight's rows in chunks of at most
        :data:`DEQUANT_CHUNK_ELEMENTS` values, each within one part."""
        step = max(1, DEQUANT_CHUNK_ELEMENTS // self.in_features)
        out, row = [], 0
        for p in self.parts:
            for r0 in range(0, p.rows, step):
                r1 = min(p.rows, r0 + step)
                out.append((row + r0, p, r0, r1))
            row += p.rows
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]``, each value computed in float32 and rounded
        once to ``dtype``."""
        w = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.device)
        for row, p, r0, r1 in self.row_chunks():
            w[row : row + r1 - r0].copy_(dequantize_rows(p.data[r0:r1], p.qtype, dtype))
        return w

    def __repr__(self) -> str:
        parts = ", ".join(f"{p.type.name}x{p.rows}" for p in self.parts)
        return f"GGUFWeight(shape={tuple(self.shape)}, parts=[{parts}], device={self.device})"


def gguf_linear_reference(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T + bias`` in ``x``'s dtype: each chunk of rows dequantized in
    float32, rounded once to ``x``'s dtype, ``F.linear``. No host synchronisation and
    shapes-only control flow (graph-safe); the float temporary is bounded by
    :data:`DEQUANT_CHUNK_ELEMENTS`."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the GGUF weight {w.in_features}")
    outs = []
    for row, p, r0, r1 in w.row_chunks():
        deq = dequantize_rows(p.data[r0:r1], p.qtype, x.dtype)
        outs.append(F.linear(x, deq, None if bias is None else bias[row : row + r1 - r0]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class GGUFReferenceLinear(ComposedLinear):
    """The torch implementation of GGUF linears (dequantize block-wise, then
    ``F.linear``): the CPU path and the oracle of the CUDA kernels. Composes every fusion."""

    name = "gguf torch reference (dequantize + F.linear)"

    def __init__(self, layer_ops: ModuleType | Any = reference) -> None:
        super().__init__(layer_ops)

    def matmul(self, x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_linear_reference(x, w, bias)


class GGUFEmbedding:
    """An embedding table held as GGUF blocks (``table``, a one-part :class:`GGUFWeight`
    ``[vocab, hidden]``), looked up as rows of ``dtype``: only the rows asked for are
    dequantized. A tied lm_head multiplies by the same ``table``."""

    __slots__ = ("table", "dtype")

    def __init__(self, table: GGUFWeight, dtype: torch.dtype) -> None:
        if len(table.parts) != 1:
            raise QuantError("a GGUF embedding is one tensor")
        self.table = table
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def shape(self) -> torch.Size:
        return self.table.shape

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.table.tensors()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]`` rows of ``dtype`` (no host synchronisation)."""
        part = self.table.parts[0]
        return dequantize_rows(part.data.index_select(0, ids.long()), part.qtype, self.dtype)

    def __repr__(self) -> str:
        return f"GGUFEmbedding(shape={tuple(self.shape)}, type={self.table.type_names[0]}, dtype={self.dtype})"
