"""Int4 weight-only group quantization (W4A16): the one internal layout, the torch
reference linear and round-to-nearest quantization.

Meaning. A linear weight ``W [out, in]`` is held as unsigned 4-bit codes ``q`` (0..15),
one ``scale`` and one ``zero`` (0..16) per row and group of ``group_size`` consecutive
input columns: ``W[o, k] = (q[o, k] - zero[o, k // G]) * scale[o, k // G]``. Published
checkpoints (AWQ, GPTQ, compressed-tensors, :mod:`edge.quant.int4_checkpoints`) are converted
to this meaning once at load and packed into the layout below; nothing else is kept.

Act order. GPTQ's ``desc_act`` (and compressed-tensors' ``actorder``) quantize the input
columns in a permuted order, so a group is not a run of consecutive columns. The loader
sorts the columns by group once (``perm``: physical column j is input column
``perm[j]``); the linear then reads ``x[..., perm]``. ``perm`` is None when the groups
are already runs.

Layout (``packed``, int32 ``[out_pad / 16, 2 in]``, read by ``int4_gemv.cu``). Rows are
padded to a multiple of 16. The weight is cut into tiles of 16 rows x 64 columns, row
block by row block; a tile is 128 words, 4 per lane of a warp: word ``4 * lane + s``
holds the 8 codes that lane needs as its A fragment of the ``s``-th
``mma.m16n8k16`` of the tile. With ``lane = 4 g + t`` nibble ``j = rh + 2 kh + 4 e``
(bits ``4 j .. 4 j + 3``) holds row ``16 rb + 8 rh + g``, column
``64 kb + 16 s + 4 t + 2 kh + e``. So ``(word >> 4 p) & 0x000F000F`` is the register
pair ``p = rh + 2 kh`` of the fragment (two 16-bit lanes), a warp's 16-byte loads cover a
tile's 512 contiguous bytes, and lane ``t`` of a k16 step multiplies the 4 consecutive
activations at ``16 s + 4 t`` (one 8-byte load). ``scale`` ``[out_pad / 16, groups, 16]``
and ``zero`` (uint8, same shape; None means 8, the symmetric zero point) are stored per
row block, so a warp streaming a row block reads its scales in order too.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from edge.kernels import reference
from edge.quant.linear import ComposedLinear
from edge.quant.formats import INT4_BLOCK_ROWS, INT4_DEQUANT_CHUNK_ELEMENTS
from edge.quant.q8_0 import QuantError

BLOCK_ROWS = INT4_BLOCK_ROWS
BLOCK_COLS = 64
WORDS_PER_TILE = BLOCK_ROWS * BLOCK_COLS // 8
QMAX = 15
SYMMETRIC_ZERO = 8
DEFAULT_GROUP_SIZE = 128
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements unpacked at once by the reference (bounds its int32 and float temporaries).
DEQUANT_CHUNK_ELEMENTS = INT4_DEQUANT_CHUNK_ELEMENTS

# Nibble j of a word <-> (e, kh, rh) with j = rh + 2 kh + 4 e; lane = 4 g + t.
# Codes [RB, 2 rh, 8 g, KB, 4 s, 4 t, 2 kh, 2 e] <-> words' nibbles [RB, KB, 8 g, 4 t, 4 s, 2 e, 2 kh, 2 rh].
_PACK_ORDER = (0, 3, 2, 5, 4, 7, 6, 1)
# Bit offsets of the nibbles in (rh, kh, e) order.
_UNPACK_SHIFTS = torch.tensor([4 * (rh + 2 * kh + 4 * e) for rh in (0, 1) for kh in (0, 1) for e in (0, 1)],
                              dtype=torch.int32)


def check_int4_shape(out_features: int, in_features: int, group_size: int, name: str = "tensor") -> None:
    """Shapes the layout holds: ``in`` a multiple of 64 and of ``group_size``, which is a
    multiple of 16 (a k16 step of the kernel lies in one group)."""
    if group_size < 16 or group_size % 16:
        raise QuantError(f"{name}: int4 group_size must be a positive multiple of 16, got {group_size}")
    if in_features % BLOCK_COLS or in_features % group_size:
        raise QuantError(
            f"{name}: in_features {in_features} must be a multiple of {BLOCK_COLS} and of group_size {group_size}"
        )
    if out_features < 1:
        raise QuantError(f"{name}: no output rows")


def _padded(rows: int) -> int:
    return -(-rows // BLOCK_ROWS) * BLOCK_ROWS


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[rows, in]`` (rows a multiple of 16, values 0..15) -> the int32
    words ``[rows / 16, 2 in]`` of the layout."""
    rows, cols = q.shape
    rb, kb = rows // BLOCK_ROWS, cols // BLOCK_COLS
    nib = q.view(rb, 2, 8, kb, 4, 4, 2, 2).permute(*_PACK_ORDER).reshape(rb, kb * 32 * 4, 8).to(torch.int32)
    words = nib[..., 0].clone()
    for j in range(1, 8):
        words |= nib[..., j] << (4 * j)  # int32 wraps into the sign bit like the kernel's words
    return words


def unpack_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 ``[rb, 2 in]`` -> int32 codes ``[rb * 16, in]``."""
    rb, nwords = words.shape
    kb = nwords // WORDS_PER_TILE
    # Words to [RB, g, KB, s, t] first (an eighth of the elements), then the nibbles in
    # (rh, kh, e) order, so only rh moves in the last copy.
    w = words.view(rb, kb, 8, 4, 4).permute(0, 2, 1, 4, 3).unsqueeze(-1)
    nib = (w >> _UNPACK_SHIFTS.to(words.device)) & QMAX  # [RB, g, KB, s, t, (rh, kh, e)]
    return nib.view(rb, 8, kb, 4, 4, 2, 4).permute(0, 5, 1, 2, 3, 4, 6).reshape(rb * BLOCK_ROWS, kb * BLOCK_COLS)


class Int4Weight:
    """A W4A16 linear weight in the layout of this module's docstring: ``packed``,
    ``scale``, ``zero`` (or None: 8), ``perm`` (or None), ``out_features``,
    ``group_size``."""

    FORMAT = "int4"  # the backend's key for this weight format
    __slots__ = ("packed", "scale", "zero", "perm", "out_features", "in_features", "group_size")

    def __init__(
        self,
        packed: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        out_features: int,
        group_size: int,
        perm: torch.Tensor | None = None,
    ) -> None:
        if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] % WORDS_PER_TILE:
            raise QuantError(f"Int4Weight needs int32 words [out/16, 2 in], got {packed.dtype} {tuple(packed.shape)}")
        in_features = packed.shape[1] // 2
        check_int4_shape(out_features, in_features, group_size, "Int4Weight")
        rb = packed.shape[0]
        if _padded(out_features) != rb * BLOCK_ROWS:
            raise QuantError(f"Int4Weight: {rb} row blocks do not hold {out_features} rows")
        want = (rb, in_features // group_size, BLOCK_ROWS)
        if tuple(scale.shape) != want or scale.dtype not in SCALE_DTYPES:
            raise QuantError(f"Int4Weight scale must be float {want}, got {scale.dtype} {tuple(scale.shape)}")
        if zero is not None and (tuple(zero.shape) != want or zero.dtype != torch.uint8):
            raise QuantError(f"Int4Weight zero must be uint8 {want}, got {zero.dtype} {tuple(zero.shape)}")
        if perm is not None and (perm.dtype != torch.int32 or tuple(perm.shape) != (in_features,)):
            raise QuantError(f"Int4Weight perm must be int32 [{in_features}], got {perm.dtype} {tuple(perm.shape)}")
        devices = {t.device for t in (packed, scale, zero, perm) if t is not None}
        if len(devices) != 1:
            raise QuantError(f"Int4Weight tensors on several devices: {sorted(map(str, devices))}")
        self.packed, self.scale, self.zero, self.perm = packed, scale, zero, perm
        self.out_features, self.in_features, self.group_size = out_features, in_features, group_size

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.packed, self.scale, self.zero, self.perm) if t is not None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str) -> "Int4Weight":
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Int4Weight(
            self.packed.to(device), self.scale.to(device), mv(self.zero), self.out_features, self.group_size,
            mv(self.perm),
        )

    def dequantize_blocks(self, rb0: int, rb1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``[16 rb0, 16 rb1)`` (padding included) in the physical column order
        (``perm`` applied), computed in float32 and rounded once to ``dtype``."""
        q = unpack_codes(self.packed[rb0:rb1]).view(rb1 - rb0, BLOCK_ROWS, -1, self.group_size)
        s = self.scale[rb0:rb1].float().transpose(1, 2).unsqueeze(-1)  # [n, 16, groups, 1]
        if self.zero is None:
            w = (q - SYMMETRIC_ZERO).float()
        else:
            w = (q - self.zero[rb0:rb1].transpose(1, 2).unsqueeze(-1).int()).float()
        return (w * s).view((rb1 - rb0) * BLOCK_ROWS, self.in_features).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]`` in the original column order."""
        w = self.dequantize_blocks(0, self.packed.shape[0], dtype)[: self.out_features]
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm.long()] = w
        return out

    def __repr__(self) -> str:
        return (
            f"Int4Weight(shape={tuple(self.shape)}, group_size={self.group_size}, scale_dtype={self.scale.dtype}, "
            f"zero={'yes' if self.zero is not None else 'symmetric'}, act_order={self.perm is not None}, "
            f"device={self.device})"
        )


def int4_linear_reference(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T + bias`` in ``x``'s dtype: each chunk of rows dequantized in
    float32, rounded once to ``x``'s dtype, ``F.linear``. No host synchronisation and
    shapes-only control flow (graph-safe); the float temporary is bounded by
    :data:`DEQUANT_CHUNK_ELEMENTS`."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the int4 weight {w.in_features}")
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    blocks = w.packed.shape[0]
    step = max(1, DEQUANT_CHUNK_ELEMENTS // (BLOCK_ROWS * w.in_features))
    outs = []
    for rb0 in range(0, blocks, step):
        rb1 = min(blocks, rb0 + step)
        r0, r1 = rb0 * BLOCK_ROWS, min(w.out_features, rb1 * BLOCK_ROWS)
        deq = w.dequantize_blocks(rb0, rb1, x.dtype)[: r1 - r0]
        outs.append(F.linear(x, deq, None if bias is None else bias[r0:r1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class Int4ReferenceLinear(ComposedLinear):
    """The torch implementation of int4 linears (dequantize, then ``F.linear``): the CPU
    path and the oracle of the CUDA kernels. Composes every fusion."""

    name = "int4 torch reference (dequantize + F.linear)"

    def __init__(self, layer_ops: ModuleType | Any = reference) -> None:
        super().__init__(layer_ops)

    def matmul(self, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int4_linear_reference(x, w, bias)


# -- building weights -----------------------------------------------------------------


@dataclass
class Int4Codes:
    """One linear in the module's meaning before packing: ``q`` uint8 ``[out, in]``
    (0..15), ``scale`` float ``[out, groups]``, ``zero`` uint8 ``[out, groups]`` (0..16)
    or None (8), ``g_idx`` (group of each input column) or None (runs of G)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    g_idx: torch.Tensor | None = None


def act_order(g_idx: torch.Tensor | None, in_features: int, group_size: int, name: str) -> torch.Tensor | None:
    """The column permutation that makes groups runs (None when they already are)."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64).flatten()
    if g.numel() != in_features:
        raise QuantError(f"{name}: g_idx has {g.numel()} entries, in_features is {in_features}")
    groups = in_features // group_size
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise QuantError(f"{name}: g_idx values outside 0..{groups - 1}")
    if torch.equal(g, torch.arange(in_features, device=g.device) // group_size):
        return None
    if not torch.equal(torch.bincount(g, minlength=groups), torch.full((groups,), group_size, device=g.device)):
        raise QuantError(f"{name}: g_idx does not give every group exactly {group_size} columns")
    return torch.argsort(g, stable=True)


def pack_weight(parts: list[Int4Codes], device: torch.device | str, name: str = "tensor") -> Int4Weight:
    """Stack ``parts`` along the output dimension (fused q/k/v, gate/up) and pack them
    into one :class:`Int4Weight` on ``device``, row block chunk by row block chunk.
    The parts must share group size and act order."""
    g = parts[0].group_size
    in_features = parts[0].q.shape[1]
    out_features = sum(p.q.shape[0] for p in parts)
    check_int4_shape(out_features, in_features, g, name)
    perms = [act_order(p.g_idx, in_features, g, name) for p in parts]
    for p, perm in zip(parts, perms):
        if p.group_size != g or p.q.shape[1] != in_features:
            raise QuantError(f"{name}: fused parts differ in group size or input features")
        if (perm is None) != (perms[0] is None) or (perm is not None and not torch.equal(perm, perms[0])):
            raise QuantError(f"{name}: fused parts have different act-order permutations (g_idx); cannot fuse them")
    perm = perms[0]
    symmetric = all(p.zero is None for p in parts)
    scale_dtype = parts[0].scale.dtype if all(p.scale.dtype == parts[0].scale.dtype for p in parts) else torch.float32
    rows = _padded(out_features)
    groups = in_features // g
    rb = rows // BLOCK_ROWS
    # All codes of the destination once (uint8, a quarter of the float weight), padded
    # rows at zero weight (their code is the zero point 8, scale 0).
    codes = torch.full((rows, in_features), SYMMETRIC_ZERO, dtype=torch.uint8, device=device)
    scale = torch.zeros(rows, groups, dtype=scale_dtype, device=device)
    zero = None if symmetric else torch.full((rows, groups), SYMMETRIC_ZERO, dtype=torch.uint8, device=device)
    dev_perm = None if perm is None else perm.to(device)
    row = 0
    for p in parts:
        n = p.q.shape[0]
        if p.q.dtype != torch.uint8 or tuple(p.scale.shape) != (n, groups):
            raise QuantError(f"{name}: codes must be uint8 and scales [{n}, {groups}]")
        q = p.q.to(device)
        codes[row : row + n].copy_(q if dev_perm is None else q.index_select(1, dev_perm))
        del q
        scale[row : row + n].copy_(p.scale)
        if zero is not None and p.zero is not None:
            zero[row : row + n].copy_(p.zero)
        row += n
    packed = torch.empty(rb, 2 * in_features, dtype=torch.int32, device=device)
    step = max(1, DEQUANT_CHUNK_ELEMENTS // (BLOCK_ROWS * in_features))
    for b0 in range(0, rb, step):
        b1 = min(rb, b0 + step)
        packed[b0:b1].copy_(pack_codes(codes[b0 * BLOCK_ROWS : b1 * BLOCK_ROWS]))
    del codes
    if dev_perm is not None:
        dev_perm = dev_perm.to(torch.int32)
    blocks = (rb, groups, BLOCK_ROWS)
    scale = scale.view(rb, BLOCK_ROWS, groups).transpose(1, 2).contiguous().view(blocks)
    if zero is not None:
        zero = zero.view(rb, BLOCK_ROWS, groups).transpose(1, 2).contiguous().view(blocks)
    return Int4Weight(packed, scale, zero, out_features, g, dev_perm)


def quantize_rtn(
    w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, scale_dtype: torch.dtype = torch.float16, name: str = "tensor"
) -> Int4Codes:
    """Round-to-nearest asymmetric int4 codes of a float weight ``[out, in]``: per group
    the range [min(w, 0), max(w, 0)] over 15 steps, ``scale`` rounded to ``scale_dtype``
    first and the zero point and codes computed against it, so ``|w - (q - z) s|``
    stays within ``s / 2`` wherever the group's range fits in 15 steps of the stored
    scale. The arithmetic runs on ``w``'s device in float32."""
    if w.dim() != 2:
        raise QuantError(f"{name}: only 2-D weights are quantized, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    if group_size < 1 or cols % group_size:
        raise QuantError(f"{name}: in_features {cols} is not a multiple of group_size {group_size}")
    wf = w.float().view(rows, cols // group_size, group_size)
    if not bool(torch.isfinite(wf).all()):
        raise QuantError(f"{name}: holds NaN or infinite values")
    lo = wf.amin(-1).clamp(max=0)
    hi = wf.amax(-1).clamp(min=0)
    tiny = torch.finfo(scale_dtype).tiny
    scale = ((hi - lo) / QMAX).clamp(min=tiny).to(scale_dtype)
    s = scale.float()
    zero = torch.round(-lo / s).clamp(0, QMAX)
    q = (torch.round(wf / s.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, QMAX)
    return Int4Codes(q.view(rows, cols).to(torch.uint8), scale, zero.to(torch.uint8), group_size)


def codes_dequantize(c: Int4Codes) -> torch.Tensor:
    """Float32 ``[out, in]`` of codes in the module's meaning (g_idx honoured)."""
    cols = c.q.shape[1]
    gi = c.g_idx.long() if c.g_idx is not None else torch.arange(cols, device=c.q.device) // c.group_size
    z = torch.full_like(c.scale, SYMMETRIC_ZERO, dtype=torch.float32) if c.zero is None else c.zero.float()
    return (c.q.float() - z[:, gi]) * c.scale.float()[:, gi]
