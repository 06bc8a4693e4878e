"""Prefix cache: reuse the K/V of full blocks whose tokens a new request starts with.

A full block is keyed by a hash chain of its tokens: the key of block ``i`` is
``block_hash(key of block i-1, tokens of block i)``, so one key names a whole prefix
and a lookup of a prompt walks the chain block by block. A hit is trusted
only after comparing the block's tokens *and* its parent entry, so by induction the
whole prefix is identical: a hash collision can cost a miss, never false sharing.

The cache holds one pool reference per cached block. A sequence that reuses a block
takes its own reference (``PagedSequence.share_prefix``), so a cached block is in use
while its refcount is above one. Blocks only the cache holds are evicted least
recently used when the pool runs short (the cache is installed as the pool's
``reclaimer``), leaves before their parents: an entry is evictable only when no
cached child hangs below it, and a lookup touches a chain from its leaf up to its
root so that parents are always more recent than their children.

Cached blocks are immutable: only full blocks (every slot written) are inserted,
and sequences only ever append after their last block.

Single-threaded: the scheduler's loop thread owns the cache; other threads may read
the counters (``len``, ``num_evictable``) for statistics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from edge.runtime.kv_paged import BlockPool

ROOT_KEY = 0x9E3779B97F4A7C15  # the "parent key" of a sequence's first block


def block_hash(parent_key: int, tokens: tuple[int, ...]) -> int:
    """Key of a full block of ``tokens`` that follows the block keyed ``parent_key``.

    Python's tuple hash of ints is deterministic (no per-process salt) and fast; a
    collision is harmless (entries are verified on lookup), so no cryptographic hash
    is needed. Tests monkeypatch this function to force collisions.
    """
    return hash((parent_key, tokens))


class _Entry:
    __slots__ = ("key", "block", "tokens", "parent", "children")

    def __init__(self, key: int, block: int, tokens: tuple[int, ...], parent: "_Entry | None") -> None:
        self.key = key
        self.block = block
        self.tokens = tokens
        self.parent = parent
        self.children = 0

    def __repr__(self) -> str:
        return f"_Entry(block={self.block}, tokens={len(self.tokens)}, children={self.children})"


class PrefixCache:
    """Full KV blocks keyed by the hash chain of their tokens, with LRU eviction."""

    def __init__(self, pool: BlockPool, install: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # key -> entry, least recent first
        self._by_block: dict[int, _Entry] = {}
        self._cached = np.zeros(pool.num_blocks, dtype=bool)
        self.hits = 0  # blocks handed out by ``match``
        self.inserted = 0
        self.evicted = 0
        self.collisions = 0
        if install:
            pool.reclaimer = self

    # -- lookup -------------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int]) -> list[_Entry]:
        ps = self.page_size
        chain: list[_Entry] = []
        key, parent = ROOT_KEY, None
        for i in range(len(tokens) // ps):
            toks = tuple(tokens[i * ps : (i + 1) * ps])
            key = block_hash(key, toks)
            entry = self._lru.get(key)
            if entry is None:
                break
            if entry.tokens != toks or entry.parent is not parent:
                self.collisions += 1
                break
            chain.append(entry)
            parent = entry
        return chain

    def _touch(self, chain: list[_Entry]) -> None:
        # Leaf first, root last: a parent is always more recent than its children, so
        # LRU order visits leaves before the blocks they hang from.
        for entry in reversed(chain):
            self._lru.move_to_end(entry.key)

    def match(self, tokens: Sequence[int], touch: bool = True) -> list[int]:
        """Block ids of the longest cached prefix of ``tokens`` (whole blocks only).

        The caller takes its own references (``PagedSequence.share_prefix``).
        """
        chain = self._walk(tokens)
        if touch and chain:
            self._touch(chain)
            self.hits += len(chain)
        return [e.block for e in chain]

    # -- insertion ------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], follow_duplicates: bool = False) -> int:
        """Cache the full blocks of a sequence: ``blocks[i]`` holds the K/V of
        ``tokens[i*page : (i+1)*page]`` (every slot written). Returns how many blocks
        were newly cached (the cache takes one reference to each).

        Where a block's prefix is already cached in a *different* block (two sequences
        computed the same tokens), the existing entry is kept. With
        ``follow_duplicates`` the rest of the chain is still cached below it (right when
        the sequence is about to be released); without, insertion stops there, so a live
        sequence never has a cached block whose cached parent it does not hold.
        """
        ps = self.page_size
        n = min(len(blocks), len(tokens) // ps)
        key, parent = ROOT_KEY, None
        chain: list[_Entry] = []
        added = 0
        for i in range(n):
            toks = tuple(tokens[i * ps : (i + 1) * ps])
            block = int(blocks[i])
            key = block_hash(key, toks)
            entry = self._lru.get(key)
            if entry is not None:
                if entry.tokens != toks or entry.parent is not parent:
                    self.collisions += 1  # a different prefix owns this key: stop here
                    break
                if entry.block != block and not follow_duplicates:
                    break
            else:
                if self._cached[block]:
                    break  # defensive: a block is cached under one key only
                self.pool.incref(block)
                entry = _Entry(key, block, toks, parent)
                self._lru[key] = entry
                self._by_block[block] = entry
                self._cached[block] = True
                if parent is not None:
                    parent.children += 1
                added += 1
            chain.append(entry)
            parent = entry
        if chain:
            self._touch(chain)
        self.inserted += added
        return added

    # -- eviction -------------------------------------------------------------------------

    def _remove(self, entry: _Entry) -> None:
        del self._lru[entry.key]
        del self._by_block[entry.block]
        self._cached[entry.block] = False
        if entry.parent is not None:
            entry.parent.children -= 1
        self.pool.decref(entry.block)

    def evict(self, n: int) -> int:
        """Free up to ``n`` blocks that no sequence uses, least recently used leaves
        first; returns how many went back to the pool."""
        freed = 0
        refcount = self.pool.refcount
        while freed < n:
            progress = False
            for entry in list(self._lru.values()):
                if freed >= n:
                    break
                if entry.children == 0 and refcount[entry.block] == 1:
                    self._remove(entry)
                    freed += 1
                    progress = True
            if not progress:
                break
        self.evicted += freed
        return freed

    __call__ = evict  # BlockPool.reclaimer

    def clear(self) -> int:
        """Drop every entry (blocks still used by a sequence stay with it)."""
        n = len(self._lru)
        # Children before parents keeps the counts consistent throughout.
        for entry in sorted(self._lru.values(), key=self._depth, reverse=True):
            self._remove(entry)
        return n

    @staticmethod
    def _depth(entry: _Entry) -> int:
        d = 0
        while entry.parent is not None:
            entry, d = entry.parent, d + 1
        return d

    # -- accounting -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block: int) -> bool:
        return bool(self._cached[block])

    def blocks(self) -> list[int]:
        return list(self._by_block)

    def lru_blocks(self) -> list[int]:
        """Cached block ids, least recently used first."""
        return [e.block for e in list(self._lru.values())]

    def num_evictable(self) -> int:
        """Cached blocks that no sequence uses (what eviction can give back)."""
        return int(np.count_nonzero(self._cached & (self.pool.refcount == 1)))

    def stats(self) -> dict:
        return {
            "blocks": len(self),
            "evictable": self.num_evictable(),
            "hits": self.hits,
            "inserted": self.inserted,
            "evicted": self.evicted,
            "collisions": self.collisions,
        }
