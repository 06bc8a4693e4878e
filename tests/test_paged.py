"""Block pool, block tables, incremental sync, lazy memset and paged attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.model.config import ModelConfig
from edge.runtime.engine import Engine
from edge.kernels import reference
from edge.model.kv import KVOutOfMemory
from edge.runtime.kv_paged import BlockPool, PagedKVCache
from edge.sampling import SamplingParams

CFG = ModelConfig.from_dict(
    {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
)


def make_cache(num_blocks: int, page: int, max_seq_len: int = 256, poison: bool = False) -> PagedKVCache:
    pool = BlockPool(CFG, num_blocks, page, torch.device("cpu"), torch.float32, poison=poison)
    return PagedKVCache(pool, max_seq_len, CFG.head_dim**-0.5)


def check_invariants(cache: PagedKVCache, seqs: list) -> None:
    pool = cache.pool
    held: dict[int, int] = {}
    for s in seqs:
        for b in s.blocks:
            held[b] = held.get(b, 0) + 1
    free = set(pool._free)
    assert len(free) == len(pool._free), "a block is on the free list twice"
    for b in range(pool.num_blocks):
        assert pool.refcount[b] == held.get(b, 0), f"block {b}: refcount {pool.refcount[b]} != {held.get(b, 0)}"
        assert (b in free) == (held.get(b, 0) == 0), f"block {b} free/used mismatch"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.integers(0, 0)),
        st.tuples(st.just("append"), st.integers(1, 40)),
        st.tuples(st.just("share"), st.integers(0, 10)),
        st.tuples(st.just("free"), st.integers(0, 10)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, page=st.sampled_from([1, 4, 16]), num_blocks=st.integers(1, 24))
def test_pool_never_leaks_or_double_frees(ops, page: int, num_blocks: int) -> None:
    cache = make_cache(num_blocks, page, max_seq_len=10_000)
    seqs = []
    for op, arg in ops:
        if op == "new" or not seqs:
            seqs.append(cache.new_sequence())
        elif op == "append":
            s = seqs[-1]
            before = (list(s.blocks), s.length, cache.pool.num_free)
            try:
                s.reserve(arg)
                s.advance(arg)
            except KVOutOfMemory:
                assert (list(s.blocks), s.length, cache.pool.num_free) == before, "failed reserve had side effects"
        elif op == "share":
            src = seqs[arg % len(seqs)]
            full = src.blocks[: src.length // page]
            dst = cache.new_sequence()
            dst.share_prefix(full)
            seqs.append(dst)
        elif op == "free":
            seqs.pop(arg % len(seqs)).release()
        check_invariants(cache, seqs)
    for s in seqs:
        s.release()
    assert cache.pool.num_free == num_blocks
    assert cache.pool.allocations == cache.pool.frees


def test_logical_oom_leaves_sequence_untouched() -> None:
    cache = make_cache(num_blocks=4, page=4)
    seq = cache.new_sequence()
    seq.reserve(10)
    seq.advance(10)
    with pytest.raises(KVOutOfMemory, match="pool exhausted: 2 more blocks needed, 1 free of 4"):
        seq.reserve(10)
    assert seq.length == 10 and len(seq.blocks) == 3 and cache.pool.num_free == 1
    seq.reserve(2)  # still fits the last free block
    seq.release()
    assert cache.pool.num_free == 4


def test_sync_copies_nothing_inside_a_page_and_four_bytes_at_a_crossing() -> None:
    page = 8
    cache = make_cache(num_blocks=16, page=page)
    seq = cache.new_sequence()
    synced = cache.bytes_synced
    seq.reserve(5)  # prefill of 5 tokens: one block, one entry
    seq.advance(5)
    assert cache.bytes_synced - synced == 4
    per_step = []
    for _ in range(3 * page):
        before = cache.bytes_synced
        seq.reserve(1)
        seq.advance(1)
        per_step.append(cache.bytes_synced - before)
    crossings = [i for i, b in enumerate(per_step) if b]
    assert all(b in (0, 4) for b in per_step)
    # positions 8, 16, 24 open a new block; they are steps 3, 11, 19 after 5 prefilled tokens
    assert crossings == [3, 11, 19]
    assert torch.equal(seq.table.device[: len(seq.blocks)], torch.tensor(seq.blocks, dtype=torch.int32))


def test_release_is_lazy_and_only_touches_its_blocks() -> None:
    cache = make_cache(num_blocks=8, page=4)
    a, b = cache.new_sequence(), cache.new_sequence()
    a.reserve(8)
    b.reserve(4)
    cache.pool.k[:, a.blocks] = 7.0
    frees = cache.pool.frees
    a.release()
    assert cache.pool.frees - frees == 2
    assert torch.all(cache.pool.k[:, [0, 1]] == 7.0), "release cleared the pool"
    b.release()


def test_poison_fills_new_blocks_with_nan() -> None:
    cache = make_cache(num_blocks=4, page=4, poison=True)
    seq = cache.new_sequence()
    seq.reserve(4)
    assert torch.isnan(cache.pool.k[:, seq.blocks[0]]).all()


def test_page_size_must_be_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        make_cache(num_blocks=4, page=12)


@pytest.mark.parametrize("start,t", [(0, 1), (0, 13), (5, 1), (7, 9), (31, 1)])
def test_reference_paged_attention_matches_dense(start: int, t: int) -> None:
    torch.manual_seed(start * 100 + t)
    page, kv_heads, q_heads, d = 4, 2, 6, 8
    num_blocks = 16
    k_pool = torch.full((num_blocks, page, kv_heads, d), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    table = torch.randperm(num_blocks).to(torch.int32)
    k = torch.randn(start + t, kv_heads, d)
    v = torch.randn(start + t, kv_heads, d)
    reference.write_kv(k_pool, v_pool, table, k, v, 0)
    q = torch.randn(t, q_heads, d)
    scale = d**-0.5
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(3, dim=1).transpose(0, 1),
        v.repeat_interleave(3, dim=1).transpose(0, 1),
        attn_mask=torch.ones(t, start + t, dtype=torch.bool).tril(start),
    ).transpose(0, 1)
    if t == 1:
        out = reference.decode_attention(q[0], k_pool, v_pool, table, start + 1, scale).unsqueeze(0)
    else:
        out = reference.prefill_attention(q, k_pool, v_pool, table, start, scale)
    assert not torch.isnan(out).any(), "read a poisoned row past kv_len"
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(kv_cache="paged", page_size=8, max_seq_len=512)


def test_prefill_writes_each_chunk_with_one_operation_per_layer(engine: Engine, monkeypatch) -> None:
    """K/V of a chunk go into the pool in one scatter per layer (through the q/k RoPE op
    that produces them, or write_kv: both end in reference.scatter_kv on the CPU)."""
    calls: list[int] = []
    scatter = reference.scatter_kv

    def counting_scatter(k_pool, v_pool, slots, k, v):
        calls.append(k.shape[0])
        return scatter(k_pool, v_pool, slots, k, v)

    monkeypatch.setattr(reference, "scatter_kv", counting_scatter)
    seq = engine.new_sequence()
    engine.prefill(seq, list(range(10, 50)))
    seq.release()
    assert calls == [40] * engine.cfg.num_layers


def test_decode_oom_ends_with_length_and_a_message(engine: Engine) -> None:
    small = Engine(engine.model, engine.tokenizer, engine.model_dir, page_size=8, max_seq_len=512, num_blocks=3)
    r = small.generate(list(range(10, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    assert r.finish_reason == "length"
    assert "pool exhausted" in r.message
    assert len(r.token_ids) == 3 * 8 - 20 + 1  # the last block fills, then one more token is sampled
    assert small.kv.pool.num_free == 3


def test_prompt_larger_than_pool_is_a_clear_error(engine: Engine) -> None:
    small = Engine(engine.model, engine.tokenizer, engine.model_dir, page_size=8, max_seq_len=512, num_blocks=2)
    with pytest.raises(KVOutOfMemory, match="pool exhausted"):
        small.generate(list(range(10, 40)), SamplingParams(max_tokens=5))
    assert small.kv.pool.num_free == 2


def test_poisoned_pool_gives_identical_tokens(engine: Engine) -> None:
    poisoned = Engine(engine.model, engine.tokenizer, engine.model_dir, page_size=8, max_seq_len=512, poison_kv=True)
    prompt = "Every answer streams token by token."
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert poisoned.generate(prompt, params).token_ids == engine.generate(prompt, params).token_ids
