"""The fused decoder-layer kernels (edge/kernels/fused.cu) vs the torch reference.

Fresh random inputs for every case; outputs come from torch's caching allocator right
after a NaN-filled block was freed (so an element the kernel forgets stays NaN);
relative error ||out - oracle|| / ||oracle|| against the reference run in float32 on
the same (rounded) inputs, and against the reference in the kernel's own dtype; the
in-place residual update is checked bit for bit; everything again inside a captured
CUDA graph replayed with new inputs and positions.
"""

from __future__ import annotations

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

DTYPES = (torch.float16, torch.bfloat16)
# vs the float32 oracle: output rounding (plus, for qk_norm_rope, the roundings HF does
# between the q/k norm and its weight).
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
TOKENS = (1, 7, 512)
HIDDEN = (1024, 4096)
EPS = 1e-6
_seed = [777]


@pytest.fixture(scope="module")
def fc():
    from edge.kernels.fused_cuda import FusedCuda
    from edge.kernels.launcher import Launcher
    from edge.kernels.nvrtc import KernelsUnavailable

    try:
        return FusedCuda(Launcher(torch.cuda.current_device()))
    except KernelsUnavailable as exc:  # pragma: no cover - reported, not hidden
        pytest.fail(f"GPU present but the fused kernels are unavailable: {exc}")


def _gen() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator(device="cuda").manual_seed(_seed[0])


def _randn(*shape: int, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


def _poison(nbytes: int) -> None:
    """Leave NaNs in the caching allocator's free blocks the next outputs come from."""
    blocks = [torch.full((nbytes // 4 + 64,), float("nan"), device="cuda") for _ in range(3)]
    del blocks


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "kernel left NaN/inf (unwritten output?)"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- embedding -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("ids_dtype", (torch.int64, torch.int32))
@pytest.mark.parametrize("t", TOKENS)
def test_embedding_gathers_rows_bit_for_bit(fc, dtype, ids_dtype, t):
    g = _gen()
    vocab, hidden = 1000, 4096 if dtype != torch.float32 else 1028
    table = _randn(vocab, hidden, dtype=dtype, g=g)
    ids = torch.randint(0, vocab, (t,), generator=g, device="cuda").to(ids_dtype)
    ids[0] = vocab - 1
    _poison(t * hidden * 4)
    out = fc.embedding(ids, table)
    assert torch.equal(out, table[ids.long()])
    # An id outside the table reads nothing: its row is zero, the others are right.
    bad = ids.clone()
    bad[-1] = vocab
    out = fc.embedding(bad, table)
    assert torch.equal(out[-1], torch.zeros_like(out[-1])) and torch.equal(out[:-1], table[ids[:-1].long()])


def test_decode_step_end_publishes_into_the_pinned_ring(fc):
    """Each launch writes the token into slot ring_pos % len of the pinned host ring
    (readable once the stream has passed it) and advances ring_pos and pos."""
    ring = torch.full((4,), -1, dtype=torch.int64, pin_memory=True)
    ring_pos = torch.tensor([2], dtype=torch.int32, device="cuda")
    pos = torch.tensor([100], dtype=torch.int32, device="cuda")
    for i, tok in enumerate((7, 11, 13)):
        token = torch.tensor([tok], dtype=torch.int64, device="cuda")
        fc.decode_step_end(token, ring, ring_pos, pos)
        torch.cuda.current_stream().synchronize()
        assert int(ring[(2 + i) % 4]) == tok
    assert ring.tolist() == [13, -1, 7, 11]
    assert int(ring_pos) == 5 and int(pos) == 103
    with pytest.raises(ValueError):
        fc.decode_step_end(token, ring.cuda(), ring_pos, pos)  # not host memory
    with pytest.raises(ValueError):
        fc.decode_step_end(token, ring, ring_pos.long(), pos)


# ---- rms_norm / add_rms_norm ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hidden", (*HIDDEN, 8192))
def test_rms_norm(fc, dtype, t, hidden):
    g = _gen()
    x = _randn(t, hidden, dtype=dtype, g=g, scale=3.0)
    w = _randn(hidden, dtype=dtype, g=g, scale=0.5) + 1
    x0 = x.clone()
    _poison(x.numel() * x.element_size())
    out = fc.rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(x, x0), "rms_norm modified its input"
    oracle = reference.rms_norm(x.float(), w.float(), EPS)
    assert rel_err(out, oracle) < TOL[dtype]
    assert rel_err(out, reference.rms_norm(x, w, EPS)) < TOL[dtype]


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hidden", (*HIDDEN, 8192))
def test_add_rms_norm_updates_residual_in_place(fc, dtype, t, hidden):
    g = _gen()
    x = _randn(t, hidden, dtype=dtype, g=g, scale=4.0)
    r = _randn(t, hidden, dtype=dtype, g=g)
    w = _randn(hidden, dtype=dtype, g=g, scale=0.5) + 1
    r0 = r.clone()
    expect_x = x.clone().add_(r)  # torch's add: float math, one rounding, as the kernel
    ptr = x.data_ptr()
    _poison(x.numel() * x.element_size())
    out = fc.add_rms_norm(x, r, w, EPS)
    assert x.data_ptr() == ptr and torch.equal(x, expect_x), "residual stream not updated in place"
    assert torch.equal(r, r0)
    assert out.shape == x.shape and out.data_ptr() not in (x.data_ptr(), r.data_ptr())
    oracle = reference.rms_norm(expect_x.float(), w.float(), EPS)
    assert rel_err(out, oracle) < TOL[dtype]


def test_shapes_outside_the_plan_are_errors_not_fallbacks(fc):
    """A shape the kernels cannot take is refused when the backend is planned
    (shape_support names why) and raises if called anyway: never a silent reference."""
    from edge.kernels.fused_cuda import shape_support
    from edge.kernels.nvrtc import UnplannedArguments

    g = _gen()
    x = _randn(3, 100, dtype=torch.bfloat16, g=g)  # 200 bytes per row: not 16-byte vectors
    w = _randn(100, dtype=torch.bfloat16, g=g)
    with pytest.raises(UnplannedArguments):
        fc.rms_norm(x, w, EPS)
    xs = _randn(4, 2048, dtype=torch.bfloat16, g=g)[:, :1024]  # strided rows
    ws = _randn(1024, dtype=torch.bfloat16, g=g)
    with pytest.raises(UnplannedArguments):
        fc.rms_norm(xs, ws, EPS)
    why = shape_support(torch.bfloat16, 100, 256, 96)
    assert why["rms_norm"] and why["qk_norm_rope"] and why["silu_mul"] is None


# ---- silu_mul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("inter", (3072, 12288))
def test_silu_mul(fc, dtype, t, inter):
    g = _gen()
    gu = _randn(t, 2 * inter, dtype=dtype, g=g, scale=3.0)
    gu0 = gu.clone()
    _poison(t * inter * gu.element_size())
    out = fc.silu_mul(gu)
    assert out.shape == (t, inter) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(gu, gu0)
    oracle = reference.silu_mul(gu.float())
    assert rel_err(out, oracle) < TOL[dtype]
    # elementwise: one rounding of the float32 value, plus __expf's error (CUDA's math
    # documentation: at most 2 + floor(|1.173 x|) ulps, which float32 outputs see)
    err = (out.float() - oracle).abs()
    gate = gu[:, :inter].float().abs()
    expf_ulps = 2 + 1.2 * gate
    bound = oracle.abs() * (2 * torch.finfo(dtype).eps + expf_ulps * torch.finfo(torch.float32).eps) + 1e-6
    assert (err <= bound).all(), f"max elementwise excess {(err - bound).max().item()}"


# ---- qk_norm_rope -----------------------------------------------------------------------------

QK_SHAPES = [(16, 8, 128), (32, 8, 128), (16, 8, 64)]  # (heads, kv_heads, head_dim)


def _rope_tables(max_pos: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    emb = torch.cat((ang, ang), dim=-1)
    half = d // 2
    sin = emb.sin()
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return emb.cos().to("cuda", dtype), sin_signed.to("cuda", dtype)


def _qk_case(t, heads, kv_heads, d, dtype, g, norm: bool, max_pos: int = 4096):
    qkv = _randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, g=g, scale=2.0)
    w = (_randn(heads + kv_heads, d, dtype=dtype, g=g, scale=0.3) + 1) if norm else None
    cos, sin = _rope_tables(max_pos, d, dtype)
    pos = torch.randint(0, max_pos, (t,), generator=g, device="cuda", dtype=torch.long)
    return qkv, w, cos, sin, pos


def _qk_oracle(qkv, w, cos, sin, pos, heads, kv_heads, d):
    """Float32 reference on the kernel's inputs; the q/k-norm product is rounded to the
    model dtype first, as HF (and the kernel) do."""
    if w is None:
        return reference.qk_norm_rope(qkv.float(), None, cos.float(), sin.float(), pos, heads, kv_heads, d, EPS)
    t = qkv.shape[0]
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    normed = (reference.rms_norm(qk, None, EPS) * w).float()  # HF order, in the model dtype
    flat = torch.cat((normed.reshape(t, -1), qkv[:, (heads + kv_heads) * d :].float()), dim=1)
    return reference.qk_norm_rope(flat, None, cos.float(), sin.float(), pos, heads, kv_heads, d, EPS)


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("shape", QK_SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("norm", (True, False), ids=("qk_norm", "no_norm"))
def test_qk_norm_rope(fc, dtype, t, shape, norm):
    heads, kv_heads, d = shape
    g = _gen()
    qkv, w, cos, sin, pos = _qk_case(t, heads, kv_heads, d, dtype, g, norm)
    qkv0 = qkv.clone()
    _poison(qkv.numel() * qkv.element_size())
    q, k = fc.qk_norm_rope(qkv, w, cos, sin, pos, heads, kv_heads, d, EPS)
    assert q.shape == (t, heads, d) and k.shape == (t, kv_heads, d)
    assert q.is_contiguous() and k.is_contiguous() and q.dtype == k.dtype == dtype
    assert torch.equal(qkv, qkv0)
    oq, ok = _qk_oracle(qkv, w, cos, sin, pos, heads, kv_heads, d)
    assert rel_err(q, oq) < TOL[dtype] and rel_err(k, ok) < TOL[dtype]
    rq, rk = reference.qk_norm_rope(qkv, w, cos, sin, pos, heads, kv_heads, d, EPS)
    assert rel_err(q, rq) < TOL[dtype] and rel_err(k, rk) < TOL[dtype]
    # int32 positions (a device pos buffer) give the same bits
    q32, k32 = fc.qk_norm_rope(qkv, w, cos, sin, pos.int(), heads, kv_heads, d, EPS)
    assert torch.equal(q32, q) and torch.equal(k32, k)


def test_qk_norm_rope_reads_a_strided_qkv_view(fc):
    """q/k taken from a wider row (e.g. a view past other columns) with its row stride."""
    heads, kv_heads, d, t, dtype = 32, 8, 128, 7, torch.bfloat16
    g = _gen()
    qkv, w, cos, sin, pos = _qk_case(t, heads, kv_heads, d, dtype, g, True)
    wide = torch.cat((qkv, _randn(t, 256, dtype=dtype, g=g)), dim=1)[:, : qkv.shape[1]]
    assert not wide.is_contiguous()
    q, k = fc.qk_norm_rope(wide, w, cos, sin, pos, heads, kv_heads, d, EPS)
    q2, k2 = fc.qk_norm_rope(qkv, w, cos, sin, pos, heads, kv_heads, d, EPS)
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("t", (1, 5, 37))
@pytest.mark.parametrize("shape", QK_SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("page", (8, 16))
def test_qk_norm_rope_writes_kv_into_the_pool(fc, dtype, t, shape, page):
    """With a pool the launch stores rotated k and raw v at each token's paged row (same
    bits as the separate launches), returns no k, and touches no other row."""
    heads, kv_heads, d = shape
    g = _gen()
    qkv, w, cos, sin, _ = _qk_case(t, heads, kv_heads, d, dtype, g, True)
    num_blocks = 64
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(t))[: 4096 // page]
    table = torch.cat((table, torch.zeros(4096 // page - table.numel(), dtype=table.dtype)))
    table = table.to("cuda", torch.int32)
    # distinct positions inside the mapped blocks: a random prefill chunk start
    start = int(torch.randint(0, (num_blocks * page) - t, (1,), generator=torch.Generator().manual_seed(7)))
    start = min(start, (table.numel() * page) - t)
    pos = torch.arange(start, start + t, device="cuda", dtype=torch.int32)
    pools = [torch.full((num_blocks, page, kv_heads, d), float("nan"), device="cuda", dtype=dtype) for _ in range(2)]
    cache = reference.PagedKV(pools[0], pools[1], table)
    q, k = fc.qk_norm_rope(qkv, w, cos, sin, pos, heads, kv_heads, d, EPS, cache)
    assert k is None
    eq, ek = fc.qk_norm_rope(qkv, w, cos, sin, pos, heads, kv_heads, d, EPS)
    assert torch.equal(q, eq)
    slots = reference.position_slots(table, pos, page)
    flat_k = pools[0].view(-1, kv_heads, d)
    flat_v = pools[1].view(-1, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].reshape(t, kv_heads, d)
    assert torch.equal(flat_k[slots], ek) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


# ---- inside a CUDA graph -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", (True, False), ids=("qk_norm", "no_norm"))
def test_fused_ops_in_a_cuda_graph(fc, dtype, norm):
    """A layer-shaped chain captured once, replayed with new inputs and a device position
    advanced by the graph itself: same results as eager calls, residual updated."""
    heads, kv_heads, d, hidden, inter = 32, 8, 128, 4096, 12288
    g = _gen()
    qkv, w, cos, sin, _ = _qk_case(1, heads, kv_heads, d, dtype, g, norm)
    x = _randn(1, hidden, dtype=dtype, g=g, scale=4.0)
    r = _randn(1, hidden, dtype=dtype, g=g)
    gu = _randn(1, 2 * inter, dtype=dtype, g=g, scale=3.0)
    ln = _randn(hidden, dtype=dtype, g=g, scale=0.5) + 1
    pos = torch.tensor([5], dtype=torch.int32, device="cuda")

    def body():
        h0 = fc.rms_norm(x, ln, EPS)
        q, k = fc.qk_norm_rope(qkv, w, cos, sin, pos.long(), heads, kv_heads, d, EPS)
        h = fc.add_rms_norm(x, r, ln, EPS)
        a = fc.silu_mul(gu)
        pos.add_(1)
        return h0, q, k, h, a

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()
    for step in range(3):
        for t_ in (qkv, x, r, gu):
            t_.copy_(_randn(*t_.shape, dtype=dtype, g=g, scale=2.0))
        p = 100 + 37 * step
        pos.fill_(p)
        x_before = x.clone()
        graph.replay()
        torch.cuda.synchronize()
        h0, q, k, h, a = outs
        assert int(pos.item()) == p + 1
        assert torch.equal(x, x_before.clone().add_(r)), "residual not updated in the graph"
        assert torch.equal(h0, fc.rms_norm(x_before, ln, EPS))
        assert torch.equal(h, fc.rms_norm(x, ln, EPS))
        pt = torch.tensor([p], device="cuda")
        eq, ek = fc.qk_norm_rope(qkv, w, cos, sin, pt, heads, kv_heads, d, EPS)
        assert torch.equal(q, eq) and torch.equal(k, ek)
        assert torch.equal(a, fc.silu_mul(gu))
        oq, ok = _qk_oracle(qkv, w, cos, sin, pt, heads, kv_heads, d)
        assert rel_err(q, oq) < TOL[dtype] and rel_err(k, ok) < TOL[dtype]


# ---- the model -----------------------------------------------------------------------------


def test_engine_uses_fused_ops_and_matches_the_reference():
    """The CUDA backend plans the fused ops; the model's logits stay close to the same
    model on an engine with the reference backend (bf16), and neither engine changes
    the other."""
    from edge.runtime.engine import Engine

    engine = Engine.from_pretrained(device="cuda", dtype="bfloat16", page_size=16, cuda_graph=False, kernels="cuda")
    assert set(engine.backend.eager.layer.names.values()) == {"cuda"}
    ref_engine = Engine(engine.model, engine.tokenizer, engine.model_dir, page_size=16, kernels="reference", num_blocks=64)
    ids = list(range(3, 40))
    before = engine.backend.launch_counts()
    fused = engine.score(ids)
    assert engine.backend.launch_counts() != before, "the CUDA engine launched no kernel"
    ref = ref_engine.score(ids)
    assert ref_engine.backend.kind == "reference" and engine.backend.kind == "cuda"
    assert rel_err(fused, ref) < 3e-2
