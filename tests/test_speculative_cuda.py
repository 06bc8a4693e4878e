"""Speculative decoding on the GPU (skipped without one).

- ``verify_attention`` (the multi-token decode kernel at a device-resident position)
  and ``verify_attention_rope`` (the same from the qkv rows, with the q/k norms, RoPE
  and the K/V store in the launch) against the torch reference: fresh inputs,
  NaN-poisoned pools past the length and poisoned outputs, eager and replayed from one
  CUDA graph at other positions; the kernel that ran is asserted.
- Greedy speculative decoding through the verify graphs (prompt lookup and draft models,
  k = 1..8, bf16, int8 and float32) gives exactly the tokens of plain graph decoding,
  with no capture while serving and the graph path reported; sampled runs repeat with a
  seed; rollback across page crossings gives every block back.

The bf16 / int8 models are ``qwen3-peaked``-shaped (edge/model/random_model.py), built on the
GPU: their greedy tokens win by wide margins, so the multi-token path's other rounding
(GEMM instead of GEMV, the CUDA-core attention) cannot flip a near-tie.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from edge.model.config import ModelConfig
from edge.runtime.engine import Engine
from edge.kernels import reference
from edge.model.loader import fuse_weights
from edge.model.decoder import Model
from edge.model.random_model import iter_random_tensors, model_config
from edge.sampling import SamplingParams
from edge.scheduling import Scheduler
from edge.speculative.params import SpeculativeParams
from tests.test_kernels_cuda import rope_tables

pytestmark = pytest.mark.cuda

MAX_SEQ = 1024


# -- the kernel --------------------------------------------------------------------------------


# Verify row tiles one a CTA, or in pairs: planned for one SM, where one CTA a tile fills
# a wave whenever a KV head has two tiles (the kernels run on the whole GPU all the same).
VERIFY_TILES = ({"verify_tiles": 1}, {"verify_tiles": 2, "sms": 1})


def _attention_ops(dtype: torch.dtype, head_dim: int, verify_tiles: int = 2, sms: int | None = None):
    from edge.kernels.launcher import Launcher
    from edge.kernels.paged_cuda import DecodeTuning, PagedAttentionCuda

    tuning = DecodeTuning(verify_tiles=verify_tiles)
    launcher = Launcher(torch.cuda.current_device())
    return PagedAttentionCuda(launcher, None, tuning, dtypes=(dtype,), head_dims=(head_dim,), sms=sms)


def _verify_kernel(tokens: int, heads: int, kv_heads: int, verify_tiles: int, rope: bool) -> str:
    """The tensor-core verify kernel a launch of ``tokens`` takes under VERIFY_TILES: row
    tiles in pairs a CTA where a KV head has more than one (16 rows a tile)."""
    pair = verify_tiles == 2 and tokens * (heads // kv_heads) > 16
    return "paged_verify_tc" + ("_pair" if pair else "") + ("_rope" if rope else "")


def _case(dtype, heads, kv_heads, d, page, kv_len, g):
    """Pools with every row NaN but those of positions [0, kv_len), a shuffled table."""
    blocks = -(-MAX_SEQ // page) + 3
    pool_shape = (blocks, page, kv_heads, d)
    k_pool = torch.full(pool_shape, float("nan"), dtype=dtype, device="cuda")
    v_pool = torch.full(pool_shape, float("nan"), dtype=dtype, device="cuda")
    table = torch.randperm(blocks, generator=g)[: -(-MAX_SEQ // page)].to(torch.int32).cuda()
    k = torch.randn(kv_len, kv_heads, d, generator=g).to(dtype).cuda()
    v = torch.randn(kv_len, kv_heads, d, generator=g).to(dtype).cuda()
    reference.write_kv(k_pool, v_pool, table, k, v, 0)
    return k_pool, v_pool, table


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,d",
    [(torch.bfloat16, 32, 8, 128), (torch.float16, 16, 8, 64), (torch.float32, 8, 2, 64), (torch.bfloat16, 14, 2, 64)],
)
@pytest.mark.parametrize("tiles", VERIFY_TILES, ids=str)
def test_verify_attention_matches_the_reference(dtype, heads, kv_heads, d, tiles) -> None:
    ops = _attention_ops(dtype, d, **tiles)
    verify_tiles = tiles["verify_tiles"]
    g = torch.Generator().manual_seed(0)
    page = 16
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # float16 / bfloat16 on tensor cores (a KV head's token x head rows in m16 tiles:
    # group 7 and 5 tokens straddle tiles, 35 rows leave a pair's second tile empty),
    # float32 on the CUDA-core decode kernel.
    for tokens in (1, 2, 5, 9):
        kernel = "paged_decode_g" if dtype == torch.float32 else _verify_kernel(tokens, heads, kv_heads, verify_tiles, False)
        for start in (0, 7, 16, 300, 900):
            k_pool, v_pool, table = _case(dtype, heads, kv_heads, d, page, start + tokens, g)
            q = torch.randn(tokens, heads, d, generator=g).to(dtype).cuda()
            pos = torch.tensor([start], dtype=torch.int32, device="cuda")
            out = torch.full_like(q, float("nan"))
            before = Counter(ops.launcher.counts)
            got = ops.verify_attention(q, k_pool, v_pool, table, pos, d**-0.5, out=out)
            ran = Counter(ops.launcher.counts) - before
            name = next(iter(ran))
            assert len(ran) == 1 and (name.startswith(kernel) if dtype == torch.float32 else name == kernel), dict(ran)
            want = reference.verify_attention(q, k_pool, v_pool, table, pos, d**-0.5)
            assert got.data_ptr() == out.data_ptr()
            assert torch.isfinite(got).all(), (tokens, start)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("tiles", VERIFY_TILES, ids=str)
def test_verify_attention_replays_from_a_graph_at_any_position(tiles: dict) -> None:
    dtype, heads, kv_heads, d, tokens = torch.bfloat16, 32, 8, 128, 5
    ops = _attention_ops(dtype, d, **tiles)
    g = torch.Generator().manual_seed(1)
    k_pool, v_pool, table = _case(dtype, heads, kv_heads, d, 16, 700, g)
    q = torch.randn(tokens, heads, d, generator=g).to(dtype).cuda()
    pos = torch.tensor([3], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.verify_attention(q, k_pool, v_pool, table, pos, d**-0.5, out=out)  # workspaces before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        ops.verify_attention(q, k_pool, v_pool, table, pos, d**-0.5, out=out)
    for start in (0, 31, 250, 690):
        pos.fill_(start)
        out.fill_(float("nan"))
        graph.replay()
        want = reference.verify_attention(q, k_pool, v_pool, table, pos, d**-0.5)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def _rope_ops(dtype: torch.dtype, head_dim: int, verify_tiles: int = 2, sms: int | None = None):
    """The attention with CUDA layer ops: the unfused path launches their qk_norm_rope."""
    from edge.kernels.fused_cuda import FusedCuda
    from edge.kernels.launcher import Launcher
    from edge.kernels.paged_cuda import DecodeTuning, PagedAttentionCuda

    launcher = Launcher(torch.cuda.current_device())
    tuning = DecodeTuning(verify_tiles=verify_tiles)
    return PagedAttentionCuda(launcher, FusedCuda(launcher), tuning, dtypes=(dtype,), head_dims=(head_dim,), sms=sms)


def _rope_case(dtype, heads, kv_heads, d, qk_norm, g):
    cos, sin = rope_tables(MAX_SEQ, d, dtype)
    norm = (torch.randn(heads + kv_heads, d, generator=g) * 0.2 + 1).to(dtype).cuda() if qk_norm else None
    rope = reference.Rope(norm, cos, sin, heads, kv_heads, 1e-6)
    rope32 = reference.Rope(None if norm is None else norm.float(), cos.float(), sin.float(), heads, kv_heads, 1e-6)
    return rope, rope32


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,d,qk_norm",
    [
        (torch.bfloat16, 32, 8, 128, True),
        (torch.float16, 16, 8, 64, False),
        (torch.bfloat16, 14, 2, 64, True),
        (torch.float32, 8, 2, 64, True),
    ],
)
@pytest.mark.parametrize("tiles", VERIFY_TILES, ids=str)
def test_verify_attention_rope_matches_the_reference(dtype, heads, kv_heads, d, qk_norm, tiles) -> None:
    """The step's T keys and values start NaN in the pools and must be written (normalised,
    rotated; values as projected), every other row stays as it was; the output matches
    the float32 composition of qk_norm_rope and verify_attention. New rows land in a
    split's first stages, later ones (start 900 with long splits), across page and split
    edges; group 7 straddles head tiles (and leaves a pair's second tile empty)."""
    ops = _rope_ops(dtype, d, **tiles)
    verify_tiles = tiles["verify_tiles"]
    g = torch.Generator().manual_seed(2)
    page, scale = 16, d**-0.5
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    rope, rope32 = _rope_case(dtype, heads, kv_heads, d, qk_norm, g)
    fused_max = ops.verify_rope_tokens()
    for tokens in (1, 2, 5, 9, fused_max, fused_max + 1):
        for start in (0, 7, 120, 250, 900):
            k_pool, v_pool, table = _case(dtype, heads, kv_heads, d, page, start, g)
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype).cuda()
            pos = torch.tensor([start], dtype=torch.int32, device="cuda")
            out = torch.full((tokens, heads, d), float("nan"), dtype=dtype, device="cuda")
            k_before, v_before = k_pool.clone(), v_pool.clone()
            before = Counter(ops.launcher.counts)
            got = ops.verify_attention_rope(qkv, rope, k_pool, v_pool, table, pos, scale, out=out)
            ran = Counter(ops.launcher.counts) - before
            if dtype != torch.float32 and tokens <= fused_max:
                assert dict(ran) == {_verify_kernel(tokens, heads, kv_heads, verify_tiles, True): 1}, (tokens, dict(ran))
            else:
                names = sorted(ran)
                assert len(names) == 2 and sum(ran.values()) == 2, (tokens, dict(ran))
                assert any(n.startswith("qk_norm_rope") for n in names), (tokens, dict(ran))
                if dtype == torch.float32:
                    assert any(n.startswith("paged_decode_g") for n in names), (tokens, dict(ran))
                else:
                    assert _verify_kernel(tokens, heads, kv_heads, verify_tiles, False) in names, (tokens, dict(ran))
            assert got.data_ptr() == out.data_ptr()
            k32, v32 = k_before.float(), v_before.float()
            want = reference.verify_attention_rope(qkv.float(), rope32, k32, v32, table, pos, scale)
            info = (tokens, start)
            assert torch.isfinite(got).all(), info
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=str(info))
            slots = reference.slot_indices(table, start, tokens, page)
            kf, vf = k_pool.view(-1, kv_heads, d), v_pool.view(-1, kv_heads, d)
            torch.testing.assert_close(kf[slots].float(), k32.view(-1, kv_heads, d)[slots], atol=tol, rtol=tol)
            width = (heads + kv_heads) * d
            assert torch.equal(vf[slots], qkv[:, width:].reshape(tokens, kv_heads, d)), info
            k_before.view(-1, kv_heads, d)[slots] = kf[slots]
            v_before.view(-1, kv_heads, d)[slots] = vf[slots]
            torch.testing.assert_close(k_pool, k_before, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(v_pool, v_before, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("tiles", VERIFY_TILES, ids=str)
def test_verify_attention_rope_replays_from_a_graph_at_any_position(tiles: dict) -> None:
    dtype, heads, kv_heads, d, tokens = torch.bfloat16, 32, 8, 128, 5
    ops = _rope_ops(dtype, d, **tiles)
    g = torch.Generator().manual_seed(3)
    rope, rope32 = _rope_case(dtype, heads, kv_heads, d, True, g)
    k_pool, v_pool, table = _case(dtype, heads, kv_heads, d, 16, MAX_SEQ, g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype).cuda()
    pos = torch.tensor([3], dtype=torch.int32, device="cuda")
    out = torch.full((tokens, heads, d), float("nan"), dtype=dtype, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.verify_attention_rope(qkv, rope, k_pool, v_pool, table, pos, d**-0.5, out=out)  # workspaces first
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        ops.verify_attention_rope(qkv, rope, k_pool, v_pool, table, pos, d**-0.5, out=out)
    for start in (0, 31, 250, 690, 1000):
        k32, v32 = k_pool.float(), v_pool.float()
        pos.fill_(start)
        out.fill_(float("nan"))
        graph.replay()
        want = reference.verify_attention_rope(qkv.float(), rope32, k32, v32, table, pos, d**-0.5)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_verify_row_tiles_pair_only_where_one_tile_a_cta_fills_a_wave() -> None:
    """qwen3-8b's shape (8 KV heads, group 4): 5 tokens are two row tiles a KV head, 16
    CTAs one a tile. Planned for 8 or 16 SMs (one 8-warp CTA an SM) that fills a wave, so
    the tiles go in pairs; for 132 SMs the single tiles take several splits; 4 tokens are
    one tile anywhere; verify_tiles=1 never pairs. At 16 SMs the pairs take two splits
    (600 keys), whose merge the output checks against the reference."""
    dtype, heads, kv_heads, d = torch.bfloat16, 32, 8, 128
    g = torch.Generator().manual_seed(4)
    rope, rope32 = _rope_case(dtype, heads, kv_heads, d, True, g)
    pos = torch.tensor([600], dtype=torch.int32, device="cuda")
    for sms, tiles, tokens, want in ((8, 2, 5, "paged_verify_tc_pair_rope"), (16, 2, 5, "paged_verify_tc_pair_rope"),
                                     (16, 2, 8, "paged_verify_tc_pair_rope"), (132, 2, 5, "paged_verify_tc_rope"),
                                     (8, 2, 4, "paged_verify_tc_rope"), (8, 1, 5, "paged_verify_tc_rope")):
        ops = _rope_ops(dtype, d, tiles, sms)
        k_pool, v_pool, table = _case(dtype, heads, kv_heads, d, 16, 600, g)
        k32, v32 = k_pool.float(), v_pool.float()
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype).cuda()
        out = torch.full((tokens, heads, d), float("nan"), dtype=dtype, device="cuda")
        before = Counter(ops.launcher.counts)
        ops.verify_attention_rope(qkv, rope, k_pool, v_pool, table, pos, d**-0.5, out=out)
        assert dict(Counter(ops.launcher.counts) - before) == {want: 1}, (sms, tiles, tokens)
        want_out = reference.verify_attention_rope(qkv.float(), rope32, k32, v32, table, pos, d**-0.5)
        torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2, msg=str((sms, tiles, tokens)))


# -- end to end --------------------------------------------------------------------------------


def _engine(weights: dict, cfg: ModelConfig, blocks: int) -> Engine:
    model = Model(cfg, weights, MAX_SEQ)
    return Engine(model, None, Path("preset:qwen3-peaked"), page_size=16, max_seq_len=MAX_SEQ, num_blocks=blocks)


def _weights(raw: dict, cfg: ModelConfig, dtype: torch.dtype, seed: int, quantize: bool) -> dict:
    weights = fuse_weights(iter_random_tensors(raw, seed, dtype, "cuda"), cfg, torch.device("cuda"), dtype)
    if quantize:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
        from bench_decode import quantize_projections

        quantize_projections(weights, cfg)
    return weights


def _models(dtype: torch.dtype, quantize: bool = False) -> tuple[Engine, Engine, Engine]:
    """(target, twin draft: the target's weights, stranger draft: other weights)."""
    raw = model_config(preset="qwen3-peaked", vocab_size=4096, num_hidden_layers=4)
    cfg = ModelConfig.from_dict(raw)
    weights = _weights(raw, cfg, dtype, 0, quantize)
    target = _engine(weights, cfg, 256)
    twin = _engine(weights, cfg, 160)
    stranger = _engine(_weights(raw, cfg, dtype, 1, False), cfg, 160)
    for e in (target, twin, stranger):
        assert e.cuda_graph
    return target, twin, stranger


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, length in enumerate((3, 9, 17, 40, 130, 333)[:n]):
        period = (0, 4, 0, 7, 13, 0)[i]
        ids = torch.randint(3, 4000, (period or length,), generator=g).tolist()
        out.append((ids * (length // len(ids) + 1))[:length])
    return out


def _graph_count(engine: Engine) -> int:
    return sum(len(d.graphs) for d in engine._verifiers.values()) + sum(len(d.graphs) for d in engine._decoders.values())


@pytest.mark.parametrize("dtype,quantize", [("bfloat16", False), ("bfloat16", True), ("float32", False)])
def test_greedy_speculation_through_graphs_matches_plain_graph_decode(dtype: str, quantize: bool) -> None:
    target, twin, stranger = _models(getattr(torch, dtype), quantize)
    prompts = _prompts()
    tokens = 48
    wants = [target.generate(ids, max_tokens=tokens, ignore_eos=True).token_ids for ids in prompts]
    # Prompts holding the model's own continuation of their end: prompt lookup finds it
    # (the peaked model's next token depends mostly on the current one), so its
    # proposals stand and graphs of every k are exercised with acceptances.
    copies = [want[:40] + ids for ids, want in zip(prompts[1:3], wants[1:3])]
    prompts += copies
    wants += [target.generate(ids, max_tokens=tokens, ignore_eos=True).token_ids for ids in copies]
    assert target.capture_graphs(speculative_tokens=8) > 0
    for d in (twin, stranger):
        d.capture_graphs()
    captured = [_graph_count(e) for e in (target, twin, stranger)]
    runs = [(SpeculativeParams("ngram", k), None) for k in (1, 2, 3, 5, 8)]
    runs += [(SpeculativeParams("draft", k), twin) for k in (2, 8)] + [(SpeculativeParams("draft", 4), stranger)]
    for spec, draft in runs:
        sched = Scheduler(target, speculative=spec, draft=draft)
        sched.start()
        accepted = 0
        try:
            for ids, want in zip(prompts, wants):
                got = sched.submit(ids, SamplingParams(max_tokens=tokens, ignore_eos=True)).result(timeout=120)
                info = (spec, draft is twin, len(ids))
                assert got.token_ids == want, info
                stats = got.usage.speculative
                assert stats["verify"] == "graph", info
                if draft is not None:
                    assert stats["draft"] == "graph", info
                if draft is twin:
                    assert stats["acceptance_rate"] == 1.0, info
                accepted += stats["accepted_tokens"]
        finally:
            sched.stop()
        if draft is not stranger:  # the stranger's proposals stand by chance only
            assert accepted > 0, spec
        assert target.kv.pool.num_free == target.kv.pool.num_blocks
    # Nothing was captured while serving; the greedy readbacks went through the step wait.
    assert [_graph_count(e) for e in (target, twin, stranger)] == captured
    assert any(d.waits.polls > 0 for d in target._verifiers.values())
    # Verify graphs (int8 and float models) launch as the decode graph does: overlapped
    # where the GPU has it.
    assert all(d.kernels is target.backend.graph for d in target._verifiers.values())
    # Every layer's attention took its q/k norms, RoPE and K/V store (float16 / bfloat16:
    # the tensor-core verify kernel from the qkv rows, in pairs of row tiles a CTA where a
    # KV head has more than one; float32: qk_norm_rope, then the CUDA-core kernel).
    layers, group = target.cfg.num_layers, target.cfg.num_heads // target.cfg.num_kv_heads
    for d in target._verifiers.values():
        for (t, argmax), ran in d.captured_kernels.items():
            norm_rope = sum(n for name, n in ran.items() if name.startswith("qk_norm_rope"))
            fused = sum(ran.get(name, 0) for name in ("paged_verify_tc_rope", "paged_verify_tc_pair_rope"))
            assert t * group > 16 or "paged_verify_tc_pair_rope" not in ran, (t, ran)  # pairs need two tiles
            assert (fused, norm_rope) == ((0, layers) if dtype == "float32" else (layers, 0)), (t, ran)
    for d in (twin, stranger):
        assert d.kv.pool.num_free == d.kv.pool.num_blocks


def test_sampled_speculation_through_graphs_repeats_with_a_seed() -> None:
    target, twin, _ = _models(torch.bfloat16)
    target.capture_graphs(speculative_tokens=8)
    twin.capture_graphs()
    ids = _prompts()[3]
    for spec, draft in ((SpeculativeParams("ngram", 4), None), (SpeculativeParams("draft", 4), twin)):
        sched = Scheduler(target, speculative=spec, draft=draft)
        sched.start()
        try:
            # The peaked model's logits are tens apart: a high temperature gives the
            # seeds something to choose between.
            runs = [
                sched.submit(ids, SamplingParams(max_tokens=40, temperature=20.0, seed=s, ignore_eos=True)).result(
                    timeout=120
                )
                for s in (3, 3, 4, 5)
            ]
        finally:
            sched.stop()
        assert runs[0].token_ids == runs[1].token_ids
        assert any(r.token_ids != runs[0].token_ids for r in runs[2:]), "other seeds must give other draws"
        assert runs[0].usage.speculative["verify"] == "graph"
    assert target.kv.pool.num_free == target.kv.pool.num_blocks


def test_verify_graph_rolls_back_across_page_crossings() -> None:
    """Every proposal wrong at every step, lengths crossing pages: the device position and
    table follow the host's rollback (the next steps would read garbage otherwise)."""
    target, _, _ = _models(torch.bfloat16)
    from edge.sampling import SamplerState
    from edge.speculative.verify import verify_step

    ids = _prompts()[2]
    want = target.generate(ids, max_tokens=40, ignore_eos=True).token_ids
    seq = target.new_sequence(slot=0)
    state = SamplerState(target.cfg.vocab_size, target.device)
    state.load(SamplingParams(), ids)
    decoder = target.verify_decoder(seq)
    assert decoder.path == "graph"
    got = [int(target.prefill(seq, ids).argmax())]
    while len(got) < 40:
        wrong = [(got[-1] * 7 + i + 1) % 4096 for i in range(7)]
        verdict = verify_step(decoder, seq, got[-1], wrong, state, greedy=True)
        got += verdict.tokens
        assert seq.length == len(ids) + len(got) - 1
        assert int(decoder.pos) == seq.length
    assert got[:40] == want
    decoder.unbind()
    seq.release()
    assert target.kv.pool.num_free == target.kv.pool.num_blocks
