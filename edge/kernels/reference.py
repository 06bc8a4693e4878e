"""Paged-attention and fused decoder-layer kernels in plain torch.

This is the CPU path and the oracle every CUDA kernel is tested against. Pools hold
one layer each here: ``k_pool``/``v_pool`` are ``[num_blocks, page_size, kv_heads,
head_dim]`` and a block table is ``[max_blocks_per_seq]`` int32. A token at position
``p`` lives in block ``table[p // page_size]`` at row ``p % page_size``.

Nothing here reads a pool row at or beyond ``kv_len``: pools are never cleared
(lazy memset), so anything past the sequence is stale or NaN-poisoned memory.

A pool may also be an :class:`~edge.kernels.kv_int8.Int8KV` (int8 codes and a float32
scale a row, ``[num_blocks, page_size, kv_heads]``): stores quantize, reads see the
rows dequantized to float32 (edge/kernels/kv_int8.py defines both).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from edge.kernels.kv_int8 import Int8KV

# A layer's K or V pool: rows in the model's dtype, or int8 codes with their scales.
Pool = torch.Tensor | Int8KV


class PagedKV(NamedTuple):
    """Where one layer's K/V live: the pools and the sequence's device block table. A
    kernel that produces K/V can write them here itself (see ``qk_norm_rope``)."""

    k_pool: Pool
    v_pool: Pool
    table: torch.Tensor


class Rope(NamedTuple):
    """What a layer's ``qk_norm_rope`` needs beside qkv and positions: the per-head
    q/k norm weights ``[heads + kv_heads, D]`` (Qwen3) or None, the whole cos and
    signed-sin tables ``[max_seq_len, D]``, the head counts and the norm's epsilon."""

    qk_norm: torch.Tensor | None
    cos: torch.Tensor
    sin_signed: torch.Tensor
    heads: int
    kv_heads: int
    eps: float


def slot_indices(block_table: torch.Tensor, start: int, count: int, page_size: int) -> torch.Tensor:
    """Flat row indices (block * page_size + offset) of positions [start, start + count)."""
    pos = torch.arange(start, start + count, device=block_table.device, dtype=torch.long)
    return position_slots(block_table, pos, page_size)


def position_slots(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat row indices (block * page_size + offset) of the given positions."""
    pos = positions.to(device=block_table.device, dtype=torch.long)
    blocks = block_table.index_select(0, pos // page_size).long()
    return blocks * page_size + pos % page_size


def write_kv(
    k_pool: Pool,
    v_pool: Pool,
    block_table: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
) -> None:
    """Write K/V ``[T, kv_heads, head_dim]`` of positions [start, start+T) in one scatter."""
    slots = slot_indices(block_table, start, k.shape[0], k_pool.shape[1])
    scatter_kv(k_pool, v_pool, slots, k, v)


def scatter_kv(k_pool: Pool, v_pool: Pool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K/V ``[T, kv_heads, head_dim]`` at flat pool rows ``slots`` (quantized in an
    int8 pool)."""
    if isinstance(k_pool, Int8KV):
        k_pool.store(slots, k)
        v_pool.store(slots, v)
        return
    rows = k_pool.shape[0] * k_pool.shape[1]
    k_pool.view(rows, *k_pool.shape[2:]).index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.view(rows, *v_pool.shape[2:]).index_copy_(0, slots, v.to(v_pool.dtype))


def gather_kv(
    k_pool: Pool, v_pool: Pool, block_table: torch.Tensor, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, kv_len) as contiguous ``[kv_len, kv_heads, head_dim]``
    (float32 from an int8 pool)."""
    num_blocks, page_size = k_pool.shape[0], k_pool.shape[1]
    slots = slot_indices(block_table, 0, kv_len, page_size)
    if isinstance(k_pool, Int8KV):
        return k_pool.load(slots), v_pool.load(slots)
    k = k_pool.view(num_blocks * page_size, *k_pool.shape[2:]).index_select(0, slots)
    v = v_pool.view(num_blocks * page_size, *v_pool.shape[2:]).index_select(0, slots)
    return k, v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Grouped-query causal attention of queries at positions [start, start+T).

    q: ``[T, q_heads, D]``; k, v: ``[kv_len, kv_heads, D]`` with kv_len = start + T.
    Query i sees keys [0, start + i]. Softmax runs in float32 whatever the input dtype,
    as the CUDA kernels do.
    """
    t, q_heads, d = q.shape
    kv_len, kv_heads = k.shape[0], k.shape[1]
    group = q_heads // kv_heads
    qf = q.float().view(t, kv_heads, group, d).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
    kf = k.float().permute(1, 2, 0)  # [Hkv, D, S]
    vf = v.float().permute(1, 0, 2)  # [Hkv, S, D]
    scores = torch.matmul(qf.reshape(kv_heads, group * t, d), kf).view(kv_heads, group, t, kv_len) * scale
    q_pos = torch.arange(start, start + t, device=q.device).view(t, 1)
    k_pos = torch.arange(kv_len, device=q.device).view(1, kv_len)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(kv_heads, group * t, kv_len), vf).view(kv_heads, group, t, d)
    return out.permute(2, 0, 1, 3).reshape(t, q_heads, d).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_pool: Pool,
    v_pool: Pool,
    block_table: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk ``q [T, q_heads, D]`` at positions [start, start+T)
    against the paged prefix and itself (its K/V must already be written)."""
    k, v = gather_kv(k_pool, v_pool, block_table, start + q.shape[0])
    return causal_attention(q, k, v, start, scale)


def decode_attention(
    q: torch.Tensor,
    k_pool: Pool,
    v_pool: Pool,
    block_table: torch.Tensor,
    kv_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token ``q [q_heads, D]`` against positions [0, kv_len) → ``[q_heads, D]``."""
    k, v = gather_kv(k_pool, v_pool, block_table, kv_len)
    return causal_attention(q.unsqueeze(0), k, v, kv_len - 1, scale).squeeze(0)


def verify_attention(
    q: torch.Tensor,
    k_pool: Pool,
    v_pool: Pool,
    block_table: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The speculative verify step's attention: ``q [T, q_heads, D]`` of the tokens at
    positions [pos, pos + T) (``pos``: int32 ``[1]``), token i against keys
    [0, pos + i] (their K/V already written) -> ``[T, q_heads, D]``. The CUDA kernel
    reads ``pos`` on the device; here it is read on the host (a prefill chunk)."""
    res = prefill_attention(q, k_pool, v_pool, block_table, int(pos.reshape(-1)[0]), scale)
    return res if out is None else out.copy_(res)


def verify_attention_rope(
    qkv: torch.Tensor,
    rope: Rope,
    k_pool: Pool,
    v_pool: Pool,
    block_table: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The verify step's attention straight from its qkv projection rows ``[T, (heads +
    2 kv_heads) * D]`` at positions [pos, pos + T): ``qk_norm_rope`` storing the T keys
    and values into the pools, then :func:`verify_attention` -> ``[T, heads, D]`` (what
    the CUDA kernel does in one launch)."""
    t, d = qkv.shape[0], rope.cos.shape[1]
    positions = pos.reshape(1).long() + torch.arange(t, device=qkv.device)  # on the device: no copy
    q, _ = qk_norm_rope(
        qkv, rope.qk_norm, rope.cos, rope.sin_signed, positions, rope.heads, rope.kv_heads, d, rope.eps,
        PagedKV(k_pool, v_pool, block_table),
    )
    return verify_attention(q, k_pool, v_pool, block_table, pos, scale, out)


# ---------------------------------------------------------------------------------------
# Fused decoder-layer ops (edge/kernels/fused.cu): float32 math, one rounding to the
# input dtype per output (float32 tensors are never converted: the CPU path computes
# exactly what Hugging Face does in float32).
# ---------------------------------------------------------------------------------------


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows ``table[ids]``: token ids ``[T]`` (int64 or int32) -> ``[T, hidden]``. A
    quantized table (:class:`edge.quant.embedding.Int8Embedding`) dequantizes its rows."""
    if not isinstance(table, torch.Tensor):
        return table.rows(ids)
    return F.embedding(ids, table)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, times ``weight`` (if given): statistics and the
    weight multiply in float32, rounded once to ``x``'s dtype."""
    w = None if weight is None else weight.float()
    fused = getattr(F, "rms_norm", None)
    if fused is None:  # torch < 2.4 (JetPack 6.0 ships 2.3)
        return _rms_norm(x.float(), w, eps).to(x.dtype)
    return fused(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.rms_norm`` of float32 rows, as torch composes it."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += residual`` IN PLACE (the residual stream, rounded to its dtype), then
    ``rms_norm(x, weight, eps)``."""
    x.add_(residual)
    return rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension
    (``[..., 2 * I]`` -> ``[..., I]``), in float32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def qk_norm_rope(
    qkv: torch.Tensor,
    qk_norm_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float = 1e-6,
    cache: PagedKV | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries and keys of a fused projection ``qkv [T, (heads + 2 kv_heads) * D]``
    (q, k, v side by side), normalised and rotated: ``(q [T, heads, D], k [T, kv_heads,
    D])``, both contiguous. With ``cache``, k and v are written into the pool rows of
    ``positions`` instead and the k returned is None.

    - ``qk_norm_weight`` ``[heads + kv_heads, D]`` (Qwen3's q_norm / k_norm stacked per
      head) or None: per-head RMSNorm in Hugging Face's order -- normalise in float32,
      cast to the model dtype, multiply by the weight in the model dtype.
    - RoPE, rotate_half layout: ``x * cos + rotate_half(x) * sin`` with the sign of
      rotate_half folded into ``sin_signed`` (``cat(-sin[:D/2], sin[D/2:])``); ``cos``
      and ``sin_signed`` are whole tables ``[max_seq_len, D]``, rows picked by
      ``positions`` (int64 or int32 ``[T]``, on the tables' device). Float32 math,
      one rounding.
    """
    t = qkv.shape[0]
    qk = qkv[:, : (heads + kv_heads) * head_dim].reshape(t, heads + kv_heads, head_dim)
    if qk_norm_weight is not None:
        qk = rms_norm(qk, None, eps) * qk_norm_weight
    c = cos.index_select(0, positions).unsqueeze(1).float()
    s = sin_signed.index_select(0, positions).unsqueeze(1).float()
    x = qk.float()
    half = head_dim // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = (x * c + swapped * s).to(qkv.dtype)
    q, k = out[:, :heads].contiguous(), out[:, heads:].contiguous()
    if cache is None:
        return q, k
    v = qkv[:, (heads + kv_heads) * head_dim : (heads + 2 * kv_heads) * head_dim].reshape(t, kv_heads, head_dim)
    slots = position_slots(cache.table, positions, cache.k_pool.shape[1])
    scatter_kv(cache.k_pool, cache.v_pool, slots, k, v)
    return q, None


def decode_attention_rope(
    qkv: torch.Tensor,
    rope: Rope,
    k_pool: Pool,
    v_pool: Pool,
    block_table: torch.Tensor,
    kv_len: int,
    scale: float,
) -> torch.Tensor:
    """The decode token at position kv_len - 1 straight from its qkv projection row
    ``[1, (heads + 2 kv_heads) * D]``: ``qk_norm_rope`` storing its key and value into the
    pools, then :func:`decode_attention` -> ``[heads, D]`` (what the CUDA kernel does in
    one launch)."""
    positions = torch.full((1,), kv_len - 1, dtype=torch.long, device=qkv.device)  # no host-to-device copy
    d = rope.cos.shape[1]
    q, _ = qk_norm_rope(
        qkv, rope.qk_norm, rope.cos, rope.sin_signed, positions, rope.heads, rope.kv_heads, d, rope.eps,
        PagedKV(k_pool, v_pool, block_table),
    )
    return decode_attention(q[0], k_pool, v_pool, block_table, kv_len, scale)
