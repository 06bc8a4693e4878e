"""CUDA kernels vs the torch oracle (edge.kernels.reference), on a GPU.

Fresh random inputs for every case, NaN-poisoned outputs and pools (every unused
page and every row at or past the sequence length), shuffled non-contiguous block
tables; relative error ||out - ref|| / ||ref|| with the reference in float32.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)",
    ),
]

from edge.kernels import reference

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}
PAGES = (8, 16, 64)
HEAD_DIMS = (64, 128)
GQA = ((8, 8), (32, 8), (16, 2))  # (q_heads, kv_heads): ratios 1, 4, 8
DTYPES16 = (torch.float16, torch.bfloat16)
_seed = [1234]


@pytest.fixture(scope="module")
def attention():
    """Builds (once per tuning) the paged attention of a backend for every dtype and head_dim."""
    from edge.kernels.fused_cuda import FusedCuda
    from edge.kernels.launcher import Launcher
    from edge.kernels.nvrtc import KernelsUnavailable
    from edge.kernels.paged_cuda import DecodeTuning, PagedAttentionCuda

    try:
        launcher = Launcher(torch.cuda.current_device())
        fused = FusedCuda(launcher)
    except KernelsUnavailable as exc:  # pragma: no cover - reported, not hidden
        pytest.fail(f"GPU present but kernels unavailable: {exc}")
    made: dict = {}

    def make(**tuning) -> PagedAttentionCuda:
        t = DecodeTuning(**tuning)
        if t not in made:
            made[t] = PagedAttentionCuda(launcher, fused, t, dtypes=(torch.float16, torch.bfloat16, torch.float32))
        return made[t]

    return make


@pytest.fixture(params=("tc", "simt"))
def impl(request):
    """Run a decode test against both float16/bfloat16 decode kernels."""
    return request.param


@pytest.fixture
def pc(request, attention):
    """The attention under test: the default tuning, or the ``impl`` the test asks for."""
    impl = request.getfixturevalue("impl") if "impl" in request.fixturenames else "tc"
    return attention(impl=impl)


def _gen() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator(device="cuda").manual_seed(_seed[0])


def _lengths(page: int) -> list[int]:
    return sorted({1, page - 1, page, page + 1, 1000, 8191} - {0})


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), (
        "NaN in kernel output (unwritten element or stale pool row read)"
    )
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm()).item()


def make_cache(
    seq_len: int,
    page: int,
    kv_heads: int,
    d: int,
    dtype: torch.dtype,
    *,
    spare_blocks: int = 5,
    table_extra: int = 3,
):
    """NaN pools holding random K/V for positions [0, seq_len) in shuffled blocks; the
    table has extra entries pointing at NaN blocks; rows past seq_len stay NaN."""
    g = _gen()
    nblk = max(1, -(-seq_len // page))
    num_blocks = nblk + table_extra + spare_blocks
    k_pool = torch.full(
        (num_blocks, page, kv_heads, d), float("nan"), dtype=dtype, device="cuda"
    )
    v_pool = torch.full_like(k_pool, float("nan"))
    perm = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    table = perm[: nblk + table_extra].contiguous()
    if seq_len:
        k = torch.randn(seq_len, kv_heads, d, generator=g, device="cuda").to(dtype)
        v = torch.randn(seq_len, kv_heads, d, generator=g, device="cuda").to(dtype)
        reference.write_kv(k_pool, v_pool, table, k, v, 0)
    return k_pool, v_pool, table


def randn(*shape, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(), device="cuda").to(dtype)


def ref_decode(q, k_pool, v_pool, table, kv_len, scale):
    return reference.decode_attention(
        q.float(), k_pool.float(), v_pool.float(), table, kv_len, scale
    )


def ref_prefill(q, k_pool, v_pool, table, start, scale):
    return reference.prefill_attention(
        q.float(), k_pool.float(), v_pool.float(), table, start, scale
    )


# ---------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_matches_reference(pc, impl, dtype, d, page, heads):
    qh, kvh = heads
    lens = _lengths(page)
    k_pool, v_pool, table = make_cache(max(lens), page, kvh, d, dtype)
    scale = 1.0 / math.sqrt(d)
    for kv_len in lens:
        q = randn(qh, d, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        res = pc.decode_attention(q, k_pool, v_pool, table, kv_len, scale, out=out)
        assert res is out
        err = rel_err(out, ref_decode(q, k_pool, v_pool, table, kv_len, scale))
        assert err < TOL[dtype], f"kv_len={kv_len}: rel err {err:.2e}"


@pytest.mark.parametrize(
    "heads",
    ((28, 4), (14, 2), (16, 1), (12, 4), (6, 2), (40, 2), (32, 1)),
    ids=lambda h: f"q{h[0]}kv{h[1]}",
)
def test_decode_odd_gqa_ratios(pc, impl, heads):
    qh, kvh = heads
    dtype, d, page = torch.bfloat16, 128, 16
    k_pool, v_pool, table = make_cache(3000, page, kvh, d, dtype)
    for kv_len in (1, 17, 3000):
        q = randn(qh, d, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        pc.decode_attention(q, k_pool, v_pool, table, kv_len, 0.1, out=out)
        err = rel_err(out, ref_decode(q, k_pool, v_pool, table, kv_len, 0.1))
        assert err < TOL[dtype], f"kv_len={kv_len}: {err:.2e}"


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_float32(pc, d, heads):
    qh, kvh = heads
    k_pool, v_pool, table = make_cache(8191, 16, kvh, d, torch.float32)
    for kv_len in _lengths(16):
        q = randn(qh, d, dtype=torch.float32)
        out = pc.decode_attention(q, k_pool, v_pool, table, kv_len, 1 / math.sqrt(d))
        err = rel_err(
            out, ref_decode(q, k_pool, v_pool, table, kv_len, 1 / math.sqrt(d))
        )
        assert err < TOL[torch.float32], f"kv_len={kv_len}: {err:.2e}"


TC_TUNINGS = (
    {"tc_warps": 1, "tc_stages": 4, "verify_tiles": 1},  # one warp holds one row tile
    {"tc_warps": 2, "tc_stages": 1},
    {"tc_warps": 2, "tc_stages": 2, "max_splits": 128},
    {"tc_warps": 4, "tc_stages": 2, "max_splits": 16},
    {"tc_warps": 4, "tc_stages": 3},
    {"tc_warps": 4, "tc_stages": 4, "tc_min_blocks": 1},
    {"tc_warps": 4},
    {"tc_warps": 8, "tc_stages": 3},
)


@pytest.mark.parametrize(
    "tuning", TC_TUNINGS, ids=lambda t: "-".join(f"{v}" for v in t.values())
)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_tc_tunings(attention, tuning, d):
    pc = attention(impl="tc", **tuning)
    for dtype, heads, page in (
        (torch.bfloat16, (32, 8), 16),
        (torch.float16, (16, 2), 8),
    ):
        k_pool, v_pool, table = make_cache(8191, page, heads[1], d, dtype)
        # 2148, 4300, 6300 (4 warps) and 6300 (8 warps, 16 splits): the newest row
        # in the second or third stage of its split, which the kernel issues
        # before its grid-dependency wait
        for kv_len in (1, 31, 33, 1000, 2148, 4300, 6300, 8191):
            q = randn(heads[0], d, dtype=dtype)
            out = torch.full_like(q, float("nan"))
            pc.decode_attention(q, k_pool, v_pool, table, kv_len, 0.1, out=out)
            err = rel_err(out, ref_decode(q, k_pool, v_pool, table, kv_len, 0.1))
            assert err < TOL[dtype], f"{dtype} kv_len={kv_len}: {err:.2e}"
            pos = torch.tensor([kv_len - 1], dtype=torch.int32, device="cuda")
            a = pc.decode_attention(q, k_pool, v_pool, table, 0, 0.1, pos=pos)
            assert rel_err(a, out) < TOL[dtype]


@pytest.mark.parametrize("splits", (1, 2, 3, 7, 64, 128))
def test_decode_any_split_count(pc, impl, splits):
    dtype, d, page, qh, kvh = torch.float16, 128, 16, 32, 8
    k_pool, v_pool, table = make_cache(8191, page, kvh, d, dtype)
    for kv_len in (1, 15, 1000, 8191):  # many splits are empty at short lengths
        q = randn(qh, d, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        pc.decode_attention(
            q, k_pool, v_pool, table, kv_len, 0.09, out=out, num_splits=splits
        )
        err = rel_err(out, ref_decode(q, k_pool, v_pool, table, kv_len, 0.09))
        assert err < TOL[dtype], f"kv_len={kv_len} splits={splits}: {err:.2e}"


@pytest.mark.parametrize("mergers", (1, 2, 3, 8))
@pytest.mark.parametrize("heads", ((32, 8), (32, 2)), ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_merger_ctas_share_the_split_merge(attention, impl, mergers, heads):
    """The last `mergers` splits of a KV head each merge a share of its outputs (waiting
    for every split): any count, more mergers than non-empty splits, and shares that
    split a head's row (group 16 on tensor cores: 512 outputs over 3 mergers). Run
    three times: the split words and arrival counters are ready for the next launch."""
    dtype, d, page = torch.bfloat16, 128, 16
    qh, kvh = heads
    pc = attention(impl=impl, mergers=mergers)
    plan = pc._plan(dtype, d, qh, kvh, page)
    splits = max(1, min(32, plan.wave // plan.ctas))  # the whole grid resident: mergers > 1 allowed
    # Below 16 splits (few SMs: an Orin's 8 or 16) one merger serves a group.
    assert plan.mergers(splits, 1) == (1 if splits < 16 else min(mergers, splits // 2))
    k_pool, v_pool, table = make_cache(8191, page, kvh, d, dtype)
    for kv_len in (1, 100, 2049, 8191):  # 1 and 100: most splits empty
        q = randn(qh, d, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        for _ in range(3):  # counters and words are ready for the next launch
            pc.decode_attention(q, k_pool, v_pool, table, kv_len, 0.09, out=out, num_splits=splits)
            err = rel_err(out, ref_decode(q, k_pool, v_pool, table, kv_len, 0.09))
            assert err < TOL[dtype], f"kv_len={kv_len}: {err:.2e}"


@pytest.mark.parametrize("heads", ((32, 8), (40, 2)), ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_split_words_are_left_clear(pc, heads):
    """The tensor-core kernel's mergers poll the splits' words and write them back as
    not yet written: a word left behind would let a later launch merge it before its
    split stored the new one. Launches whose mergers wait (one wave) and launches merged
    by the last arrival (more splits than a wave) alternate on one stream at several
    lengths; every output matches the reference and the workspace is all ones after
    every launch."""
    dtype, d, page = torch.bfloat16, 128, 16
    qh, kvh = heads
    plan = pc._plan(dtype, d, qh, kvh, page)
    wave = plan.wave // plan.ctas
    k_pool, v_pool, table = make_cache(8191, page, kvh, d, dtype)
    for splits in (wave, 2 * wave + 1, min(32, wave), 3, 2 * wave + 1):
        assert (plan.mergers(splits, 1) == 0) == (splits > wave)
        for kv_len in (100, 2049, 8191):
            q = randn(qh, d, dtype=dtype)
            out = torch.full_like(q, float("nan"))
            pc.decode_attention(q, k_pool, v_pool, table, kv_len, 0.09, out=out, num_splits=splits)
            err = rel_err(out, ref_decode(q, k_pool, v_pool, table, kv_len, 0.09))
            assert err < TOL[dtype], f"splits={splits} kv_len={kv_len}: {err:.2e}"
            words, _ = pc._workspace(k_pool.device, 0, 0)
            assert bool((words == -1).all()), f"splits={splits} kv_len={kv_len}: words left behind"


@pytest.mark.parametrize("min_rows", (64, 128))
def test_decode_graph_launch_runs_only_the_splits_the_length_fills(pc, impl, min_rows):
    """A device-length launch carries the most splits; with ``min_split_rows`` only
    ceil(kv_len / min_rows) of them get keys and merge (lengths around the cut)."""
    dtype, d, page, qh, kvh = torch.bfloat16, 128, 16, 32, 8
    k_pool, v_pool, table = make_cache(8191, page, kvh, d, dtype)
    for kv_len in (1, min_rows - 1, min_rows, min_rows + 1, 200, 2049, 8191):
        q = randn(qh, d, dtype=dtype)
        pos = torch.tensor([kv_len - 1], dtype=torch.int32, device="cuda")
        out = torch.full_like(q, float("nan"))
        for _ in range(2):  # the arrival counters of fewer splits reset too
            pc.decode_attention(q, k_pool, v_pool, table, 0, 0.09, pos=pos, out=out, num_splits=32,
                                min_split_rows=min_rows)
            err = rel_err(out, ref_decode(q, k_pool, v_pool, table, kv_len, 0.09))
            assert err < TOL[dtype], f"kv_len={kv_len}: {err:.2e}"


def rope_tables(max_pos: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    emb = torch.cat((ang, ang), dim=-1)
    sin = emb.sin()
    signed = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
    return emb.cos().to("cuda", dtype), signed.to("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", ((32, 8), (16, 2), (8, 8), (40, 2)), ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("qk_norm", (True, False), ids=("qk_norm", "no_norm"))
def test_decode_rope_matches_reference(pc, impl, dtype, d, heads, qk_norm):
    """Attention from the qkv row (q/k norm, RoPE and the K/V store in the launch) vs
    the float32 reference composition; the newest row starts NaN and must be written
    (into the first stage of its split, a later one, or one that is not the first
    CTA's: group 20 spans two head tiles), every other pool row must stay as it was,
    and the device-pos launch equals the host-length one with the graph's options."""
    qh, kvh = heads
    page, scale, eps = 16, 0.09, 1e-6
    cos, sin = rope_tables(8192, d, dtype)
    norm = randn(qh + kvh, d, dtype=dtype) * 0.2 + 1 if qk_norm else None
    rope = reference.Rope(norm, cos, sin, qh, kvh, eps)
    rope32 = reference.Rope(None if norm is None else norm.float(), cos.float(), sin.float(), qh, kvh, eps)
    k_pool, v_pool, table = make_cache(8191, page, kvh, d, dtype)
    graph = pc.graph_decode_options(dtype, d, qh, kvh, page)
    for kv_len in (1, 15, 16, 17, 1000, 2148, 8191):
        slot = reference.position_slots(table, torch.tensor([kv_len - 1], device="cuda"), page)
        kf, vf = k_pool.view(-1, kvh, d), v_pool.view(-1, kvh, d)
        kf[slot] = float("nan")
        vf[slot] = float("nan")
        k_before, v_before = k_pool.clone(), v_pool.clone()
        qkv = randn(1, (qh + 2 * kvh) * d, dtype=dtype)
        out = torch.full((qh, d), float("nan"), dtype=dtype, device="cuda")
        res = pc.decode_attention_rope(qkv, rope, k_pool, v_pool, table, kv_len, scale, out=out)
        assert res is out
        k32, v32 = k_before.float(), v_before.float()
        ref = reference.decode_attention_rope(qkv.float(), rope32, k32, v32, table, kv_len, scale)
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"kv_len={kv_len}: rel err {err:.2e}"
        k_new, v_new = k_pool.view(-1, kvh, d)[slot], v_pool.view(-1, kvh, d)[slot]
        assert rel_err(k_new, k32.view(-1, kvh, d)[slot]) < TOL[dtype], f"kv_len={kv_len}: stored key"
        assert torch.equal(v_new, qkv.view(-1)[(qh + kvh) * d :].view(1, kvh, d)), f"kv_len={kv_len}: stored value"
        k_before.view(-1, kvh, d)[slot] = k_new
        v_before.view(-1, kvh, d)[slot] = v_new
        torch.testing.assert_close(k_pool, k_before, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_pool, v_before, rtol=0, atol=0, equal_nan=True)
        pos = torch.tensor([kv_len - 1], dtype=torch.int32, device="cuda")
        eager = pc.decode_attention_rope(qkv, rope, k_pool, v_pool, table, kv_len, scale, **graph)
        dev = pc.decode_attention_rope(qkv, rope, k_pool, v_pool, table, 8191, scale, pos=pos)
        assert torch.equal(dev, eager), f"kv_len={kv_len}: device-pos and host-length launches differ"


def test_decode_q_with_token_dim(pc, impl):
    k_pool, v_pool, table = make_cache(100, 16, 8, 128, torch.bfloat16)
    q = randn(1, 32, 128, dtype=torch.bfloat16)
    out = pc.decode_attention(q, k_pool, v_pool, table, 100, 0.1)
    assert out.shape == (1, 32, 128)
    assert rel_err(out[0], ref_decode(q[0], k_pool, v_pool, table, 100, 0.1)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
def test_decode_device_pos_equals_host_len(pc, impl, dtype):
    d, page, qh, kvh = 128, 16, 32, 8
    k_pool, v_pool, table = make_cache(8191, page, kvh, d, dtype)
    graph = pc.graph_decode_options(dtype, d, qh, kvh, page)
    for kv_len in (1, 15, 16, 17, 1000, 8191):
        q = randn(qh, d, dtype=dtype)
        pos = torch.tensor([kv_len - 1], dtype=torch.int32, device="cuda")
        a = pc.decode_attention(
            q, k_pool, v_pool, table, 8191, 0.1, pos=pos
        )  # host len ignored
        b = pc.decode_attention(q, k_pool, v_pool, table, kv_len, 0.1, **graph)
        assert torch.equal(a, b), (
            f"kv_len={kv_len}: device-pos and host-length launches differ"
        )
        c = pc.decode_attention(
            q, k_pool, v_pool, table, kv_len, 0.1
        )  # host-chosen splits
        assert rel_err(c, b) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
def test_decode_cuda_graph_replay(pc, impl, dtype):
    """write_kv + decode_attention + pos += 1 captured once, replayed across page
    boundaries with fresh inputs: identical to eager launches, close to the reference."""
    d, page, qh, kvh = 128, 16, 32, 8
    prefix, steps = 90, 40
    max_len = prefix + steps
    nblk = -(-max_len // page)
    # Every step's block is allocated (NaN-filled) before capture.
    k_pool, v_pool, table = make_cache(
        prefix - 1, page, kvh, d, dtype, table_extra=nblk
    )
    assert table.numel() >= nblk
    k_eager, v_eager = k_pool.clone(), v_pool.clone()

    q_s = randn(qh, d, dtype=dtype)
    k_s = randn(1, kvh, d, dtype=dtype)
    v_s = randn(1, kvh, d, dtype=dtype)
    out_s = torch.full_like(q_s, float("nan"))
    pos = torch.tensor([prefix - 1], dtype=torch.int32, device="cuda")
    graph_options = pc.graph_decode_options(dtype, d, qh, kvh, page)

    # Warm up on a side stream, as torch recommends before capture.
    scratch_k, scratch_v = k_pool.clone(), v_pool.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pc.write_kv(scratch_k, scratch_v, table, k_s, v_s, 0, pos=pos)
        pc.decode_attention(q_s, scratch_k, scratch_v, table, max_len, 0.1, pos=pos)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pc.write_kv(k_pool, v_pool, table, k_s, v_s, 0, pos=pos)
        pc.decode_attention(
            q_s, k_pool, v_pool, table, max_len, 0.1, pos=pos, out=out_s
        )
        pos.add_(1)
    torch.cuda.synchronize()
    assert pos.item() == prefix - 1  # capture ran nothing

    for i in range(steps):
        p = prefix - 1 + i
        q_s.copy_(randn(qh, d, dtype=dtype))
        k_s.copy_(randn(1, kvh, d, dtype=dtype))
        v_s.copy_(randn(1, kvh, d, dtype=dtype))
        out_s.fill_(float("nan"))
        graph.replay()
        pc.write_kv(k_eager, v_eager, table, k_s, v_s, p)
        eager = pc.decode_attention(q_s, k_eager, v_eager, table, p + 1, 0.1, **graph_options)
        torch.cuda.synchronize()
        assert pos.item() == p + 1
        assert torch.equal(out_s, eager), f"step {i}: graph replay differs from eager"
        err = rel_err(out_s, ref_decode(q_s, k_eager, v_eager, table, p + 1, 0.1))
        assert err < TOL[dtype], f"step {i}: {err:.2e}"
    # The graph wrote exactly what the eager path wrote, and nothing else.
    assert torch.equal(k_pool.view(torch.int16), k_eager.view(torch.int16))
    assert torch.equal(v_pool.view(torch.int16), v_eager.view(torch.int16))


# ---------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------


def _chunks(page: int) -> list[tuple[int, int]]:
    return [
        (0, 1),
        (0, page - 1),
        (0, page),
        (0, page + 1),
        (0, 300),
        (page - 1, 2),
        (1000, 37),
        (8000, 191),
    ]


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_prefill_matches_reference(pc, dtype, d, page, heads):
    qh, kvh = heads
    scale = 1.0 / math.sqrt(d)
    k_pool, v_pool, table = make_cache(8191, page, kvh, d, dtype)
    for start, t in _chunks(page):
        if t <= 0:
            continue
        q = randn(t, qh, d, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        pc.prefill_attention(q, k_pool, v_pool, table, start, scale, out=out)
        err = rel_err(out, ref_prefill(q, k_pool, v_pool, table, start, scale))
        assert err < TOL[dtype], f"start={start} T={t}: rel err {err:.2e}"


@pytest.mark.parametrize(
    "heads", ((28, 4), (12, 4), (16, 1)), ids=lambda h: f"q{h[0]}kv{h[1]}"
)
def test_prefill_odd_gqa_ratios(pc, heads):
    qh, kvh = heads
    k_pool, v_pool, table = make_cache(700, 16, kvh, 128, torch.float16)
    for start, t in ((0, 700), (650, 50), (3, 5)):
        q = randn(t, qh, 128, dtype=torch.float16)
        out = pc.prefill_attention(q, k_pool, v_pool, table, start, 0.08)
        assert rel_err(out, ref_prefill(q, k_pool, v_pool, table, start, 0.08)) < 2e-3


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_prefill_float32(pc, d):
    k_pool, v_pool, table = make_cache(1100, 16, 8, d, torch.float32)
    for start, t in ((0, 1), (0, 17), (1000, 100)):
        q = randn(t, 32, d, dtype=torch.float32)
        out = torch.full_like(q, float("nan"))
        pc.prefill_attention(q, k_pool, v_pool, table, start, 0.1, out=out)
        assert (
            rel_err(out, ref_prefill(q, k_pool, v_pool, table, start, 0.1))
            < TOL[torch.float32]
        )


def test_prefill_after_cuda_write_kv_matches_reference(pc):
    """Chunked prefill as the engine runs it: write the chunk with write_kv, attend."""
    dtype, d, page, qh, kvh = torch.bfloat16, 128, 16, 32, 8
    total = 777
    k_pool, v_pool, table = make_cache(
        0, page, kvh, d, dtype, spare_blocks=60, table_extra=-(-total // page)
    )
    ks, vs = randn(total, kvh, d, dtype=dtype), randn(total, kvh, d, dtype=dtype)
    for start, t in ((0, 256), (256, 256), (512, 265)):
        pc.write_kv(
            k_pool, v_pool, table, ks[start : start + t], vs[start : start + t], start
        )
        q = randn(t, qh, d, dtype=dtype)
        out = pc.prefill_attention(q, k_pool, v_pool, table, start, 0.1)
        assert (
            rel_err(out, ref_prefill(q, k_pool, v_pool, table, start, 0.1)) < TOL[dtype]
        )


# ---------------------------------------------------------------------------------------
# KV write
# ---------------------------------------------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


@pytest.mark.parametrize(
    "dtype", (torch.float16, torch.bfloat16, torch.float32), ids=str
)
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_write_kv_matches_reference(pc, dtype, page, d):
    kvh = 4
    for start, t in (
        (0, 1),
        (page - 1, 1),
        (page - 1, 2),
        (0, 1000),
        (1000, 37),
        (8100, 91),
    ):
        k_pool, v_pool, table = make_cache(
            0, page, kvh, d, dtype, spare_blocks=4, table_extra=-(-(start + t) // page)
        )
        k, v = randn(t, kvh, d, dtype=dtype), randn(t, kvh, d, dtype=dtype)
        k_ref, v_ref = k_pool.clone(), v_pool.clone()
        reference.write_kv(k_ref, v_ref, table, k, v, start)
        pc.write_kv(k_pool, v_pool, table, k, v, start)
        assert torch.equal(_bits(k_pool), _bits(k_ref)) and torch.equal(
            _bits(v_pool), _bits(v_ref)
        ), (start, t)


def test_write_kv_device_pos_strided_and_converted(pc):
    dtype, page, kvh, d = torch.bfloat16, 16, 8, 128
    k_pool, v_pool, table = make_cache(
        0, page, kvh, d, dtype, spare_blocks=2, table_extra=8
    )
    # K and V as views into a fused [T, q + 2 kv heads, D] projection output.
    qkv = randn(3, 32 + 2 * kvh, d, dtype=dtype)
    k, v = qkv[:, 32 : 32 + kvh], qkv[:, 32 + kvh :]
    assert not k.is_contiguous()
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    reference.write_kv(k_ref, v_ref, table, k, v, 30)
    pos = torch.tensor([30], dtype=torch.int32, device="cuda")
    pc.write_kv(k_pool, v_pool, table, k, v, 0, pos=pos)  # host start ignored
    assert torch.equal(_bits(k_pool), _bits(k_ref)) and torch.equal(
        _bits(v_pool), _bits(v_ref)
    )
    # float32 sources are converted to the pool dtype, as the reference does.
    k32, v32 = (
        randn(2, kvh, d, dtype=torch.float32),
        randn(2, kvh, d, dtype=torch.float32),
    )
    reference.write_kv(k_ref, v_ref, table, k32, v32, 50)
    pc.write_kv(k_pool, v_pool, table, k32, v32, 50)
    assert torch.equal(_bits(k_pool), _bits(k_ref)) and torch.equal(
        _bits(v_pool), _bits(v_ref)
    )


def test_layer_slice_pools(pc):
    """Per-layer pools as slices of one [layers, blocks, page, kv_heads, D] tensor."""
    layers, nb, page, kvh, d = 3, 20, 16, 8, 64
    kp = torch.full(
        (layers, nb, page, kvh, d), float("nan"), dtype=torch.float16, device="cuda"
    )
    vp = torch.full_like(kp, float("nan"))
    table = torch.randperm(nb, generator=_gen(), device="cuda").to(torch.int32)
    for layer in range(layers):
        k, v = (
            randn(200, kvh, d, dtype=torch.float16),
            randn(200, kvh, d, dtype=torch.float16),
        )
        pc.write_kv(kp[layer], vp[layer], table, k, v, 0)
        q = randn(32, d, dtype=torch.float16)
        out = pc.decode_attention(q, kp[layer], vp[layer], table, 200, 0.125)
        assert (
            rel_err(out, ref_decode(q, kp[layer], vp[layer], table, 200, 0.125)) < 2e-3
        )


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------


def test_validation_errors(pc):
    k_pool, v_pool, table = make_cache(40, 16, 8, 128, torch.bfloat16)
    q = randn(32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        pc.decode_attention(q.half(), k_pool, v_pool, table, 40, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        pc.decode_attention(
            randn(30, 128, dtype=torch.bfloat16), k_pool, v_pool, table, 40, 0.1
        )
    with pytest.raises(ValueError, match="block_table"):
        pc.decode_attention(q, k_pool, v_pool, table.long(), 40, 0.1)
    with pytest.raises(ValueError, match="blocks"):
        pc.decode_attention(q, k_pool, v_pool, table, 16 * table.numel() + 1, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        pc.decode_attention(
            randn(32, 64, dtype=torch.bfloat16), k_pool, v_pool, table, 40, 0.1
        )
    with pytest.raises(ValueError, match="pos"):
        pc.decode_attention(
            q, k_pool, v_pool, table, 40, 0.1, pos=torch.tensor([3], device="cuda")
        )
    with pytest.raises(ValueError, match="out"):
        pc.decode_attention(
            q,
            k_pool,
            v_pool,
            table,
            40,
            0.1,
            out=torch.empty(32, 64, dtype=torch.bfloat16, device="cuda"),
        )
    with pytest.raises(ValueError, match="power of two"):
        bad = torch.empty(4, 12, 8, 128, dtype=torch.bfloat16, device="cuda")
        pc.decode_attention(q, bad, bad, table, 40, 0.1)
    with pytest.raises(ValueError, match="k must be"):
        pc.write_kv(
            k_pool,
            v_pool,
            table,
            randn(2, 4, 128, dtype=torch.bfloat16),
            randn(2, 4, 128, dtype=torch.bfloat16),
            0,
        )
