"""Prefix cache: hash chain, collision safety, LRU eviction leaves-first, refcounts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from edge.scheduling import prefix as prefix_mod
from edge.runtime.kv_paged import BlockPool, PagedKVCache
from edge.scheduling.prefix import ROOT_KEY, PrefixCache, block_hash

PS = 4


def make_pool(num_blocks: int = 16) -> BlockPool:
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=2)
    return BlockPool(cfg, num_blocks, PS, torch.device("cpu"), torch.float32)


def seq_with(pool: BlockPool, cache: PrefixCache, tokens: list[int]):
    """A sequence that reuses what is cached of ``tokens`` and allocates the rest."""
    kv = PagedKVCache(pool, 1024, 1.0)
    seq = kv.new_sequence()
    seq.share_prefix(cache.match(tokens))
    seq.reserve(len(tokens) - seq.length)
    seq.advance(len(tokens) - seq.length)
    return seq


def toks(*blocks: int) -> list[int]:
    """Token ids: one full block of PS copies of each given value."""
    return [b for b in blocks for _ in range(PS)]


def test_hash_chain_keys_whole_prefix() -> None:
    a, b = tuple(toks(1)), tuple(toks(2))
    k_a = block_hash(ROOT_KEY, a)
    # The key of block i folds in the key of block i-1: same tokens, other prefix, other key.
    assert block_hash(k_a, b) != block_hash(ROOT_KEY, b)
    assert block_hash(k_a, b) == block_hash(block_hash(ROOT_KEY, a), b)  # deterministic
    assert block_hash(block_hash(ROOT_KEY, a), b) != block_hash(block_hash(ROOT_KEY, b), a)


def test_match_longest_full_block_prefix() -> None:
    pool = make_pool()
    cache = PrefixCache(pool)
    seq = seq_with(pool, cache, toks(1, 2, 3) + [9, 9])  # 3 full blocks + 2 tokens
    assert cache.insert(toks(1, 2, 3) + [9, 9], seq.blocks) == 3  # partial block never cached
    assert len(cache) == 3
    assert cache.match(toks(1, 2, 3)) == seq.blocks[:3]
    assert cache.match(toks(1, 2, 7)) == seq.blocks[:2]
    assert cache.match(toks(1, 2)[:-1]) == seq.blocks[:1]  # only whole blocks
    assert cache.match(toks(2, 1)) == []  # same blocks, other order: other chain
    assert cache.match([]) == []
    seq.release()


def test_refcounts_share_release_evict_clear() -> None:
    pool = make_pool(8)
    cache = PrefixCache(pool)
    prompt = toks(1, 2)
    s1 = seq_with(pool, cache, prompt)
    cache.insert(prompt, s1.blocks)
    b0, b1 = s1.blocks
    assert pool.refcount[b0] == 2 and pool.refcount[b1] == 2  # sequence + cache
    s2 = seq_with(pool, cache, prompt + [5])
    assert s2.blocks[:2] == [b0, b1]
    assert pool.refcount[b0] == 3
    assert cache.evict(8) == 0  # all in use
    s1.release()
    s2.release()
    assert pool.refcount[b0] == 1 and pool.refcount[b1] == 1  # the cache's reference
    assert cache.num_evictable() == 2
    assert pool.num_free + len(cache) == pool.num_blocks
    assert cache.evict(1) == 1 and pool.refcount[b1] == 0 and pool.refcount[b0] == 1  # leaf first
    assert cache.clear() == 1
    assert pool.num_free == pool.num_blocks and len(cache) == 0


def test_lru_eviction_order_leaves_first() -> None:
    pool = make_pool(16)
    cache = PrefixCache(pool)
    sa = seq_with(pool, cache, toks(1, 2, 3))
    cache.insert(toks(1, 2, 3), sa.blocks)
    sd = seq_with(pool, cache, toks(4, 5))
    cache.insert(toks(4, 5), sd.blocks)
    a, b, c = sa.blocks
    d, e = sd.blocks
    sa.release()
    sd.release()
    # Touch only the root of the older chain: its children stay older than it.
    assert cache.match(toks(1)) == [a]
    assert cache.lru_blocks() == [c, b, e, d, a]
    order = []
    while len(cache):
        before = set(cache.blocks())
        assert cache.evict(1) == 1
        (gone,) = before - set(cache.blocks())
        order.append(gone)
    assert order == [c, b, e, d, a]
    assert pool.num_free == pool.num_blocks


def test_parent_with_cached_child_is_not_evicted_before_it() -> None:
    pool = make_pool(16)
    cache = PrefixCache(pool)
    s = seq_with(pool, cache, toks(1, 2))
    cache.insert(toks(1, 2), s.blocks)
    a, b = s.blocks
    s.release()
    # Make the parent the least recently used entry by hand: leaves still go first.
    cache._lru.move_to_end(cache._by_block[b].key)
    assert cache.lru_blocks() == [a, b]
    assert cache.evict(1) == 1
    assert cache.blocks() == [a]
    # A child in use pins its parent (a sequence holds both).
    s2 = seq_with(pool, cache, toks(1, 2))
    cache.insert(toks(1, 2), s2.blocks)
    assert cache.evict(4) == 0
    s2.release()
    assert cache.evict(4) == 2


def test_reclaimer_evicts_when_pool_is_short() -> None:
    pool = make_pool(4)
    cache = PrefixCache(pool)  # installs itself as pool.reclaimer
    assert pool.reclaimer is cache
    s = seq_with(pool, cache, toks(1, 2, 3))
    cache.insert(toks(1, 2, 3), s.blocks)
    a, b, c = s.blocks
    s.release()
    assert pool.num_free == 1
    got = pool.alloc_many(3)  # takes the free block and evicts the two leaves
    assert got is not None and sorted(got) == sorted([b, c] + [x for x in range(4) if x not in (a, b, c)])
    assert cache.blocks() == [a]
    assert pool.alloc_many(2) is None  # the root is evicted, but 2 blocks are still not there
    assert len(cache) == 0 and pool.num_free == 1
    for blk in got:
        pool.decref(blk)
    assert pool.num_free == pool.num_blocks


def test_collision_never_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(16)
    cache = PrefixCache(pool)
    monkeypatch.setattr(prefix_mod, "block_hash", lambda parent, tokens: 42)
    s1 = seq_with(pool, cache, toks(1, 2))
    # Block 1 collides with block 0's key: only block 0 can be cached.
    assert cache.insert(toks(1, 2), s1.blocks) == 1
    assert cache.match(toks(3)) == []  # same key, other tokens: a miss, not a share
    assert cache.match(toks(1, 2)) == s1.blocks[:1]
    assert cache.collisions >= 2
    s2 = seq_with(pool, cache, toks(3, 2))
    assert cache.insert(toks(3, 2), s2.blocks) == 0
    s1.release()
    s2.release()
    cache.clear()
    assert pool.num_free == pool.num_blocks


def test_collision_with_other_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key that ignores the parent: the parent check still refuses the share."""
    pool = make_pool(16)
    cache = PrefixCache(pool)
    monkeypatch.setattr(prefix_mod, "block_hash", lambda parent, tokens: hash(tokens))
    s1 = seq_with(pool, cache, toks(1, 2))
    cache.insert(toks(1, 2), s1.blocks)
    s3 = seq_with(pool, cache, toks(3))
    cache.insert(toks(3), s3.blocks)
    # [3, 2]: block 0 hits, block 1's key finds the entry of [1, 2]'s second block,
    # whose parent is not [3]: no false sharing.
    assert cache.match(toks(3, 2)) == s3.blocks
    for s in (s1, s3):
        s.release()
    cache.clear()


def test_duplicate_blocks_follow_only_when_asked() -> None:
    pool = make_pool(16)
    cache = PrefixCache(pool)
    s1 = seq_with(pool, cache, toks(1, 2))
    cache.insert(toks(1, 2), s1.blocks)
    kv = PagedKVCache(pool, 1024, 1.0)
    s2 = kv.new_sequence()  # computed [1, 2, 3] itself, without the cache
    s2.reserve(3 * PS)
    s2.advance(3 * PS)
    assert cache.insert(toks(1, 2, 3), s2.blocks) == 0  # stops at the duplicate root
    assert cache.insert(toks(1, 2, 3), s2.blocks, follow_duplicates=True) == 1
    assert cache.match(toks(1, 2, 3)) == s1.blocks + [s2.blocks[2]]
    s1.release()
    s2.release()
    assert pool.num_free + len(cache) == pool.num_blocks
    cache.clear()
    assert pool.num_free == pool.num_blocks
