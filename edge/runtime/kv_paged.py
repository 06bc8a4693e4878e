"""Paged KV cache: one block pool per engine, one block table per sequence.

A block id names the same page in every layer, so a sequence needs a single table
shared by all layers. The host table is the truth; only entries changed since the
last sync travel to the device (4 bytes at a page crossing, 0 inside a page).
Pools are never cleared: correctness rests on kernels not reading past ``kv_len``,
and ``poison=True`` fills every newly allocated block with NaN to prove it. An int8
pool (``kv_dtype="int8"``, edge/kernels/kv_int8.py) holds codes and a scale a row;
poisoning fills its codes with -128 and its scales with NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edge.model.config import ModelConfig
from edge.runtime.budget import parse_kv_dtype
from edge.kernels import reference
from edge.kernels.kv_int8 import Int8KV
from edge.kernels.reference import PagedKV, Rope
from edge.model.kv import KVOutOfMemory

Reclaimer = Callable[[int], int]


class BlockPool:
    """K/V pools ``[layers, num_blocks, page_size, kv_heads, head_dim]`` (in ``dtype``, or
    :class:`Int8KV` codes and scales with ``kv_dtype="int8"``) with a free stack and
    reference counts. Allocation never raises for lack of room: it returns None
    (logical OOM) after asking the reclaimer (the prefix cache) to give blocks back."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        poison: bool = False,
        kv_dtype: str = "auto",
    ) -> None:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        shape = (cfg.num_layers, num_blocks, page_size, cfg.num_kv_heads, cfg.head_dim)
        # Uninitialized on purpose (lazy memset): clearing gigabytes at start buys nothing.
        self.kv_dtype = parse_kv_dtype(kv_dtype)
        if self.kv_dtype == "int8":
            self.k: torch.Tensor | Int8KV = Int8KV.empty(shape, device)
            self.v: torch.Tensor | Int8KV = Int8KV.empty(shape, device)
        else:
            self.k = torch.empty(shape, device=device, dtype=dtype)
            self.v = torch.empty(shape, device=device, dtype=dtype)
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.poison = poison
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        # Stack: the most recently freed block is reused first (it is warm in cache).
        self._free = list(range(num_blocks - 1, -1, -1))
        self.reclaimer: Reclaimer | None = None
        self.allocations = 0
        self.frees = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (codes and scales of an int8 pool)."""
        k = self.k[:, 0]
        per = k.nbytes() if isinstance(k, Int8KV) else k.numel() * k.element_size()
        return 2 * per

    def alloc_many(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (refcount 1), or None with nothing taken."""
        if n <= 0:
            return []
        if len(self._free) < n and self.reclaimer is not None:
            self.reclaimer(n - len(self._free))
        if len(self._free) < n:
            return None
        blocks = [self._free.pop() for _ in range(n)]
        self.refcount[blocks] = 1
        self.allocations += n
        if self.poison:
            idx = torch.tensor(blocks, device=self.k.device)
            if isinstance(self.k, Int8KV):
                self.k.poison(1, idx)
                self.v.poison(1, idx)
            else:
                self.k.index_fill_(1, idx, float("nan"))
                self.v.index_fill_(1, idx, float("nan"))
        return blocks

    def incref(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise AssertionError(f"incref of free block {block}")
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise AssertionError(f"double free of block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
            self.frees += 1


class BlockTable:
    """Host block table (truth) mirrored on the device by incremental sync.

    Only the range of entries written since the last sync is copied, from a pinned
    staging buffer with a non-blocking copy on the current stream, which is the
    stream whose kernels read the table next.
    """

    def __init__(self, max_blocks: int, device: torch.device) -> None:
        self.host = np.zeros(max_blocks, dtype=np.int32)
        self.device = torch.zeros(max_blocks, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self._staging = torch.zeros(max_blocks, dtype=torch.int32, pin_memory=pinned)
        self._staging_np = self._staging.numpy()
        self._copied: torch.cuda.Event | None = None
        self._lo = max_blocks
        self._hi = 0
        self.bytes_synced = 0

    def __setitem__(self, index: int, block: int) -> None:
        self.host[index] = block
        self._lo = min(self._lo, index)
        self._hi = max(self._hi, index + 1)

    def sync(self) -> int:
        """Copy the dirty range to the device; returns the bytes copied."""
        if self._hi <= self._lo:
            return 0
        lo, hi = self._lo, self._hi
        if self._copied is not None:
            # The previous non-blocking copy may still read the staging buffer.
            self._copied.synchronize()
        self._staging_np[lo:hi] = self.host[lo:hi]
        self.device[lo:hi].copy_(self._staging[lo:hi], non_blocking=True)
        if self.device.device.type == "cuda":
            self._copied = torch.cuda.Event(blocking=True)  # a wait on it sleeps, not spins
            self._copied.record()
        nbytes = (hi - lo) * 4
        self.bytes_synced += nbytes
        self._lo, self._hi = len(self.host), 0
        return nbytes


@dataclass
class PagedKVCache:
    """The engine-wide paged cache: pool, attention (the backend's ``AttentionOps``, or
    anything with the same functions, such as the reference module), and sequence
    factory."""

    pool: BlockPool
    max_seq_len: int
    scale: float
    ops: Any = reference
    bytes_synced: int = 0  # block-table bytes copied host -> device, all sequences
    # Extra decode-kernel arguments. On CUDA: the split count graph replays use, so
    # eager decode runs the identical launch and both produce the same tokens.
    decode_options: dict = field(default_factory=dict)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.pool.page_size)

    def new_sequence(self) -> "PagedSequence":
        return PagedSequence(self, BlockTable(self.max_blocks_per_seq, self.pool.k.device))


class PagedSequence:
    """One sequence's blocks and table; implements ``edge.model.kv.SequenceKV``."""

    def __init__(self, cache: PagedKVCache, table: BlockTable) -> None:
        self.cache = cache
        self.pool = cache.pool
        self.table = table
        self.blocks: list[int] = []
        self.length = 0

    def blocks_needed(self, n: int) -> int:
        return -(-(self.length + n) // self.pool.page_size) - len(self.blocks)

    def reserve(self, n: int) -> None:
        total = self.length + n
        if total > self.cache.max_seq_len:
            raise KVOutOfMemory(f"sequence of {total} tokens exceeds max_seq_len {self.cache.max_seq_len}")
        need = self.blocks_needed(n)
        if need > 0:
            fresh = self.pool.alloc_many(need)
            if fresh is None:
                raise KVOutOfMemory(
                    f"KV block pool exhausted: {need} more blocks needed, {self.pool.num_free} free "
                    f"of {self.pool.num_blocks}"
                )
            for b in fresh:
                self.table[len(self.blocks)] = b
                self.blocks.append(b)
        self.cache.bytes_synced += self.table.sync()

    def share_prefix(self, blocks: list[int]) -> None:
        """Start an empty sequence on cached full blocks (reference-counted, not copied)."""
        if self.blocks or self.length:
            raise AssertionError("share_prefix on a non-empty sequence")
        for b in blocks:
            self.pool.incref(b)
            self.table[len(self.blocks)] = b
            self.blocks.append(b)
        self.length = len(blocks) * self.pool.page_size

    def pages(self, layer: int) -> PagedKV:
        return PagedKV(self.pool.k[layer], self.pool.v[layer], self.table.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        pool, ops, start = self.pool, self.cache.ops, self.length
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        if k is not None:
            ops.write_kv(k_pool, v_pool, self.table.device, k, v, start)
        if q.shape[0] == 1:
            out = ops.decode_attention(
                q[0], k_pool, v_pool, self.table.device, start + 1, self.cache.scale, **self.cache.decode_options
            )
            return out.unsqueeze(0)
        return ops.prefill_attention(q, k_pool, v_pool, self.table.device, start, self.cache.scale)

    def attend_rope(self, layer: int, qkv: torch.Tensor, rope: Rope) -> torch.Tensor | None:
        if qkv.shape[0] != 1:
            return None  # prefill chunks: qk_norm_rope, then attend
        pool, ops = self.pool, self.cache.ops
        out = ops.decode_attention_rope(
            qkv, rope, pool.k[layer], pool.v[layer], self.table.device, self.length + 1, self.cache.scale,
            **self.cache.decode_options,
        )
        return out.unsqueeze(0)

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens (rejected speculative tokens): the length drops and
        pages left empty go back to the pool; nothing is copied or cleared."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        self.length -= n
        self.truncate_blocks()

    def truncate_blocks(self) -> None:
        """Return blocks beyond ``length`` (reserved for tokens never written)."""
        keep = -(-self.length // self.pool.page_size)
        while len(self.blocks) > keep:
            self.pool.decref(self.blocks.pop())

    def release(self) -> None:
        for b in self.blocks:
            self.pool.decref(b)
        self.blocks.clear()
        self.length = 0
