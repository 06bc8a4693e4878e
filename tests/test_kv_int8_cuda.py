"""The int8-KV kernels vs the torch oracle, on a GPU (skipped without one).

Pools of int8 codes and float32 scales (edge/kernels/kv_int8.py) are poisoned where
nothing wrote (codes -128, NaN scales), outputs start NaN, inputs are fresh random,
tables shuffled. Every writer must store exactly the codes and scales
``kv_int8.quantize_rows`` gives for its input rows (bit for bit where the input rows are
the reference's: KV write, values; the rotated keys within a code); every reader is
compared with the reference over the same pools (rows dequantized in float32) by
relative error: the float32 CUDA-core kernel as float32, the tensor-core kernels (their
probabilities in float16) at the model dtype's bound.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]

from edge.kernels import reference  # noqa: E402
from edge.kernels.kv_int8 import Int8KV, quantize_rows  # noqa: E402
from tests.test_kernels_cuda import rope_tables  # noqa: E402

TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128)
GQA = ((8, 8), (32, 8), (16, 2), (28, 4))
_seed = [4321]


def _gen() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator(device="cuda").manual_seed(_seed[0])


def randn(*shape, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(), device="cuda") * scale).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output (unwritten element or stale pool row read)"
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm()).item()


@pytest.fixture(scope="module")
def attention():
    """The paged attention (with the CUDA layer ops) of one tuning, int8 kernels loaded."""
    from edge.kernels.fused_cuda import FusedCuda
    from edge.kernels.launcher import Launcher
    from edge.kernels.paged_cuda import DecodeTuning, PagedAttentionCuda

    launcher = Launcher(torch.cuda.current_device())
    fused = FusedCuda(launcher)
    made: dict = {}

    def make(**tuning):
        sms = tuning.pop("sms", None)
        key = (tuple(sorted(tuning.items())), sms)
        if key not in made:
            made[key] = PagedAttentionCuda(
                launcher, fused, DecodeTuning(**tuning), dtypes=DTYPES, sms=sms, kv_int8=True
            )
        return made[key]

    return make


@pytest.fixture(params=("tc", "simt"))
def impl(request):
    return request.param


def poisoned_pools(num_blocks: int, page: int, kvh: int, d: int) -> tuple[Int8KV, Int8KV]:
    """Int8 pools whose every row is what no store writes."""
    shape = (num_blocks, page, kvh, d)
    k, v = Int8KV.empty(shape, "cuda"), Int8KV.empty(shape, "cuda")
    everything = torch.arange(num_blocks, device="cuda")
    k.poison(0, everything)
    v.poison(0, everything)
    return k, v


def make_cache(seq_len: int, page: int, kvh: int, d: int, dtype: torch.dtype, table_extra: int = 3):
    """Poisoned int8 pools holding random K/V of positions [0, seq_len) (stored by the
    reference) in shuffled blocks; the table's extra entries point at poisoned blocks."""
    nblk = max(1, -(-seq_len // page))
    num_blocks = nblk + table_extra + 5
    k_pool, v_pool = poisoned_pools(num_blocks, page, kvh, d)
    table = torch.randperm(num_blocks, generator=_gen(), device="cuda").to(torch.int32)[: nblk + table_extra].contiguous()
    if seq_len:
        # Keys with an outlier channel: the per-row scale follows it (what real models have).
        k = randn(seq_len, kvh, d, dtype=dtype)
        k[..., 3] *= 8
        reference.write_kv(k_pool, v_pool, table, k, randn(seq_len, kvh, d, dtype=dtype), 0)
    return k_pool, v_pool, table


def _assert_rows_equal(a: Int8KV, b: Int8KV, what: str) -> None:
    assert torch.equal(a.codes, b.codes), f"{what}: codes differ"
    torch.testing.assert_close(a.scales, b.scales, rtol=0, atol=0, equal_nan=True, msg=what)


def _clone(p: Int8KV) -> Int8KV:
    return Int8KV(p.codes.clone(), p.scales.clone())


# -- writers ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("page", (8, 16))
def test_write_kv_stores_the_reference_codes_and_scales(attention, dtype, d, page):
    pc = attention()
    kvh = 4
    for start, t in ((0, 1), (0, 37), (page - 1, 2), (300, 129)):
        k_pool, v_pool, table = make_cache(0, page, kvh, d, dtype, table_extra=-(-(start + t) // page))
        k_ref, v_ref = _clone(k_pool), _clone(v_pool)
        k = randn(t, kvh, d, dtype=dtype, scale=3.0)
        v = randn(t, kvh, d, dtype=dtype)
        k[0] = 0  # an all-zero row: scale 0, codes 0
        pc.write_kv(k_pool, v_pool, table, k, v, start)
        reference.write_kv(k_ref, v_ref, table, k, v, start)
        _assert_rows_equal(k_pool, k_ref, f"k start={start} t={t}")
        _assert_rows_equal(v_pool, v_ref, f"v start={start} t={t}")
    codes, scales = quantize_rows(k[1:2])
    assert int(codes.abs().max()) == 127 and scales.dtype == torch.float32


def test_write_kv_at_the_device_position_from_a_strided_view(attention):
    """The decode write of a graph: start from the device `pos`, k and v views into a
    fused qkv projection."""
    pc = attention()
    dtype, kvh, d, page = torch.bfloat16, 8, 128, 16
    k_pool, v_pool, table = make_cache(0, page, kvh, d, dtype, table_extra=4)
    k_ref, v_ref = _clone(k_pool), _clone(v_pool)
    qkv = randn(3, (32 + 2 * kvh) * d, dtype=dtype)
    k = qkv[:, 32 * d : (32 + kvh) * d].view(3, kvh, d)
    v = qkv[:, (32 + kvh) * d :].view(3, kvh, d)
    pos = torch.tensor([17], dtype=torch.int32, device="cuda")
    pc.write_kv(k_pool, v_pool, table, k, v, 0, pos=pos)
    reference.write_kv(k_ref, v_ref, table, k, v, 17)
    _assert_rows_equal(k_pool, k_ref, "k")
    _assert_rows_equal(v_pool, v_ref, "v")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("qk_norm", (True, False), ids=("qk_norm", "no_norm"))
def test_qk_norm_rope_stores_int8_rows(dtype, d, qk_norm):
    """The prefill chunk's store (fused.cu): values bit for bit as the reference
    quantizes them; keys (rotated in T by both) within a code of the reference's; no
    other row touched; q as with a float pool."""
    from edge.kernels.fused_cuda import FusedCuda
    from edge.kernels.launcher import Launcher

    fc = FusedCuda(Launcher(torch.cuda.current_device()))
    qh, kvh, page, t = 16, 4, 16, 45
    cos, sin = rope_tables(4096, d, dtype)
    norm = randn(qh + kvh, d, dtype=dtype) * 0.2 + 1 if qk_norm else None
    k_pool, v_pool, table = make_cache(0, page, kvh, d, dtype, table_extra=8)
    k_ref, v_ref = _clone(k_pool), _clone(v_pool)
    qkv = randn(t, (qh + 2 * kvh) * d, dtype=dtype)
    positions = torch.arange(30, 30 + t, device="cuda")
    q, k = fc.qk_norm_rope(qkv, norm, cos, sin, positions, qh, kvh, d, 1e-6, reference.PagedKV(k_pool, v_pool, table))
    assert k is None
    q_ref, _ = reference.qk_norm_rope(qkv, norm, cos, sin, positions, qh, kvh, d, 1e-6,
                                      reference.PagedKV(k_ref, v_ref, table))
    assert rel_err(q, q_ref) < TOL[dtype]
    _assert_rows_equal(v_pool, v_ref, "values")
    slots = reference.position_slots(table, positions, page)
    kc, kr = k_pool.codes.view(-1, kvh, d), k_ref.codes.view(-1, kvh, d)
    assert (kc[slots].int() - kr[slots].int()).abs().max() <= 1, "keys more than a code apart"
    torch.testing.assert_close(k_pool.scales.view(-1, kvh)[slots], k_ref.scales.view(-1, kvh)[slots], rtol=1e-2, atol=0)
    other = torch.ones(kc.shape[0], dtype=torch.bool, device="cuda")
    other[slots] = False
    assert torch.equal(kc[other], kr[other]) and torch.isnan(k_pool.scales.view(-1, kvh)[other]).all()


# -- readers ------------------------------------------------------------------------------


def _ref_decode(q, k_pool, v_pool, table, kv_len, scale):
    return reference.decode_attention(q.float(), k_pool, v_pool, table, kv_len, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("page", (8, 16, 64))
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_matches_reference(attention, impl, dtype, d, page, heads):
    pc = attention(impl=impl)
    qh, kvh = heads
    lens = sorted({1, page - 1, page, page + 1, 1000, 8191} - {0})
    k_pool, v_pool, table = make_cache(max(lens), page, kvh, d, dtype)
    for kv_len in lens:
        q = randn(qh, d, dtype=dtype, scale=2.0)
        out = torch.full_like(q, float("nan"))
        assert pc.decode_attention(q, k_pool, v_pool, table, kv_len, d**-0.5, out=out) is out
        err = rel_err(out, _ref_decode(q, k_pool, v_pool, table, kv_len, d**-0.5))
        assert err < TOL[dtype], f"kv_len={kv_len}: rel err {err:.2e}"


@pytest.mark.parametrize("splits", (1, 2, 7, 64))
def test_decode_any_split_count(attention, impl, splits):
    pc = attention(impl=impl)
    dtype, qh, kvh, d, page = torch.bfloat16, 32, 8, 128, 16
    k_pool, v_pool, table = make_cache(5000, page, kvh, d, dtype)
    for kv_len in (1, 700, 5000):
        q = randn(qh, d, dtype=dtype)
        out = pc.decode_attention(q, k_pool, v_pool, table, kv_len, 0.1, num_splits=splits)
        assert rel_err(out, _ref_decode(q, k_pool, v_pool, table, kv_len, 0.1)) < TOL[dtype]


def test_decode_value_scales_far_apart(attention, impl):
    """Rows whose value scales span 10^6 (the warps' float16 unit moves with the largest):
    no underflow to a wrong answer, no overflow."""
    pc = attention(impl=impl)
    dtype, qh, kvh, d, page = torch.bfloat16, 32, 8, 128, 16
    k_pool, v_pool, table = make_cache(0, page, kvh, d, dtype, table_extra=-(-3000 // page))
    k = randn(3000, kvh, d, dtype=dtype)
    spread = torch.logspace(-3, 3, 3000, device="cuda")[torch.randperm(3000, generator=_gen(), device="cuda")]
    v = randn(3000, kvh, d, dtype=dtype) * spread.to(dtype).view(-1, 1, 1)
    reference.write_kv(k_pool, v_pool, table, k, v, 0)
    for kv_len in (1, 100, 3000):
        q = randn(qh, d, dtype=dtype, scale=0.1)
        out = pc.decode_attention(q, k_pool, v_pool, table, kv_len, 0.1)
        assert rel_err(out, _ref_decode(q, k_pool, v_pool, table, kv_len, 0.1)) < TOL[dtype], kv_len


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", ((32, 8), (40, 2)), ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("qk_norm", (True, False), ids=("qk_norm", "no_norm"))
def test_decode_rope_stores_and_attends(attention, impl, dtype, d, heads, qk_norm):
    """The decode token from its qkv row: the newest row starts poisoned and must be
    stored (codes of its rotated key within one of the reference's, value codes exact);
    no other row changes; the output matches the reference composition over the pools
    as the reference stores them; the device-pos launch equals the host-length one."""
    pc = attention(impl=impl)
    qh, kvh = heads
    page, scale = 16, 0.09
    cos, sin = rope_tables(8192, d, dtype)
    norm = randn(qh + kvh, d, dtype=dtype) * 0.2 + 1 if qk_norm else None
    rope = reference.Rope(norm, cos, sin, qh, kvh, 1e-6)
    k_pool, v_pool, table = make_cache(8191, page, kvh, d, dtype)
    graph = pc.graph_decode_options(dtype, d, qh, kvh, page, kv_int8=True)
    for kv_len in (1, 16, 17, 1000, 2148, 8191):
        slot = reference.position_slots(table, torch.tensor([kv_len - 1], device="cuda"), page)
        for p in (k_pool, v_pool):  # the newest row: poisoned until the launch stores it
            p.codes.view(-1, kvh, d)[slot] = -128
            p.scales.view(-1, kvh)[slot] = float("nan")
        k_ref, v_ref = _clone(k_pool), _clone(v_pool)
        qkv = randn(1, (qh + 2 * kvh) * d, dtype=dtype)
        out = torch.full((qh, d), float("nan"), dtype=dtype, device="cuda")
        assert pc.decode_attention_rope(qkv, rope, k_pool, v_pool, table, kv_len, scale, out=out) is out
        want = reference.decode_attention_rope(qkv, rope, k_ref, v_ref, table, kv_len, scale)
        err = rel_err(out, want)
        assert err < TOL[dtype], f"kv_len={kv_len}: rel err {err:.2e}"
        _assert_rows_equal(v_pool, v_ref, f"kv_len={kv_len}: values")
        kc, kr = k_pool.codes.view(-1, kvh, d), k_ref.codes.view(-1, kvh, d)
        assert (kc.int() - kr.int()).abs().max() <= 1, f"kv_len={kv_len}: stored key"
        pos = torch.tensor([kv_len - 1], dtype=torch.int32, device="cuda")
        eager = pc.decode_attention_rope(qkv, rope, k_pool, v_pool, table, kv_len, scale, **graph)
        dev = pc.decode_attention_rope(qkv, rope, k_pool, v_pool, table, 8191, scale, pos=pos)
        assert torch.equal(dev, eager), f"kv_len={kv_len}: device-pos and host-length launches differ"


def test_decode_cuda_graph_replay(attention, impl):
    """write_kv + decode_attention + pos += 1 on int8 pools, captured once and replayed
    across page crossings: identical to eager launches, close to the reference, and the
    pools written exactly as the eager path writes them."""
    pc = attention(impl=impl)
    dtype, d, page, qh, kvh = torch.bfloat16, 128, 16, 32, 8
    prefix, steps = 90, 40
    k_pool, v_pool, table = make_cache(prefix - 1, page, kvh, d, dtype, table_extra=-(-(prefix + steps) // page))
    k_eager, v_eager = _clone(k_pool), _clone(v_pool)
    q_s, k_s, v_s = randn(qh, d, dtype=dtype), randn(1, kvh, d, dtype=dtype), randn(1, kvh, d, dtype=dtype)
    out_s = torch.full_like(q_s, float("nan"))
    pos = torch.tensor([prefix - 1], dtype=torch.int32, device="cuda")
    options = pc.graph_decode_options(dtype, d, qh, kvh, page, kv_int8=True)
    scratch_k, scratch_v = _clone(k_pool), _clone(v_pool)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pc.write_kv(scratch_k, scratch_v, table, k_s, v_s, 0, pos=pos)
        pc.decode_attention(q_s, scratch_k, scratch_v, table, prefix + steps, 0.1, pos=pos)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pc.write_kv(k_pool, v_pool, table, k_s, v_s, 0, pos=pos)
        pc.decode_attention(q_s, k_pool, v_pool, table, prefix + steps, 0.1, pos=pos, out=out_s)
        pos.add_(1)
    for i in range(steps):
        p = prefix - 1 + i
        q_s.copy_(randn(qh, d, dtype=dtype))
        k_s.copy_(randn(1, kvh, d, dtype=dtype))
        v_s.copy_(randn(1, kvh, d, dtype=dtype))
        out_s.fill_(float("nan"))
        graph.replay()
        pc.write_kv(k_eager, v_eager, table, k_s, v_s, p)
        eager = pc.decode_attention(q_s, k_eager, v_eager, table, p + 1, 0.1, **options)
        torch.cuda.synchronize()
        assert torch.equal(out_s, eager), f"step {i}: graph replay differs from eager"
        assert rel_err(out_s, _ref_decode(q_s, k_eager, v_eager, table, p + 1, 0.1)) < TOL[dtype]
    _assert_rows_equal(k_pool, k_eager, "k")
    _assert_rows_equal(v_pool, v_eager, "v")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_prefill_matches_reference(attention, dtype, d, heads):
    """A chunk against the paged prefix and itself: tensor cores for float16 / bfloat16,
    the CUDA-core kernel (token t a decode) for float32."""
    pc = attention()
    qh, kvh = heads
    page = 16
    for start, t in ((0, 1), (0, 15), (0, 300), (15, 2), (1000, 37), (8000, 191)):
        k_pool, v_pool, table = make_cache(start + t, page, kvh, d, dtype)
        q = randn(t, qh, d, dtype=dtype, scale=2.0)
        out = torch.full_like(q, float("nan"))
        pc.prefill_attention(q, k_pool, v_pool, table, start, d**-0.5, out=out)
        want = reference.prefill_attention(q.float(), k_pool, v_pool, table, start, d**-0.5)
        err = rel_err(out, want)
        assert err < TOL[dtype], f"start={start} t={t}: rel err {err:.2e}"


VERIFY_TILES = ({"verify_tiles": 1}, {"verify_tiles": 2, "sms": 1})


@pytest.mark.parametrize("dtype,heads,kvh,d", [(torch.bfloat16, 32, 8, 128), (torch.float16, 16, 8, 64),
                                               (torch.float32, 8, 2, 64), (torch.bfloat16, 14, 2, 64)])
@pytest.mark.parametrize("tiles", VERIFY_TILES, ids=str)
def test_verify_attention_matches_reference(attention, dtype, heads, kvh, d, tiles):
    pc = attention(**tiles)
    for tokens in (1, 2, 5, 9):
        for start in (0, 7, 300, 900):
            k_pool, v_pool, table = make_cache(start + tokens, 16, kvh, d, dtype)
            q = randn(tokens, heads, d, dtype=dtype)
            pos = torch.tensor([start], dtype=torch.int32, device="cuda")
            out = torch.full_like(q, float("nan"))
            before = Counter(pc.launcher.counts)
            pc.verify_attention(q, k_pool, v_pool, table, pos, d**-0.5, out=out)
            ran = Counter(pc.launcher.counts) - before
            assert len(ran) == 1 and "_q8" in next(iter(ran)), dict(ran)
            want = reference.verify_attention(q.float(), k_pool, v_pool, table, pos, d**-0.5)
            err = rel_err(out, want)
            assert err < TOL[dtype], f"tokens={tokens} start={start}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype,heads,kvh,d", [(torch.bfloat16, 32, 8, 128), (torch.float16, 14, 2, 64),
                                               (torch.float32, 8, 2, 64)])
@pytest.mark.parametrize("tiles", VERIFY_TILES, ids=str)
def test_verify_attention_rope_stores_and_attends(attention, dtype, heads, kvh, d, tiles):
    """The verify step from its qkv rows: the T rows start poisoned and are stored (value
    codes exact, keys within a code), nothing else changes, the output matches the
    reference composition; more tokens than one launch holds go through qk_norm_rope."""
    pc = attention(**tiles)
    cos, sin = rope_tables(2048, d, dtype)
    rope = reference.Rope(randn(heads + kvh, d, dtype=dtype) * 0.2 + 1, cos, sin, heads, kvh, 1e-6)
    fused_max = pc.verify_rope_tokens()
    for tokens in (1, 5, 9, fused_max, fused_max + 1):
        for start in (0, 120, 900):
            k_pool, v_pool, table = make_cache(start, 16, kvh, d, dtype, table_extra=-(-(tokens + 16) // 16))
            k_ref, v_ref = _clone(k_pool), _clone(v_pool)
            qkv = randn(tokens, (heads + 2 * kvh) * d, dtype=dtype)
            pos = torch.tensor([start], dtype=torch.int32, device="cuda")
            out = torch.full((tokens, heads, d), float("nan"), dtype=dtype, device="cuda")
            pc.verify_attention_rope(qkv, rope, k_pool, v_pool, table, pos, d**-0.5, out=out)
            want = reference.verify_attention_rope(qkv, rope, k_ref, v_ref, table, pos, d**-0.5)
            info = f"tokens={tokens} start={start}"
            err = rel_err(out, want)
            assert err < TOL[dtype], f"{info}: rel err {err:.2e}"
            _assert_rows_equal(v_pool, v_ref, f"{info}: values")
            assert (k_pool.codes.int() - k_ref.codes.int()).abs().max() <= 1, f"{info}: keys"


def test_engine_decodes_an_int8_cache_with_graphs_as_eagerly():
    """The whole path on the embedded model's shape: int8 pools, the production graph
    decode and eager decode give the same tokens, poisoned pools included."""
    from edge.runtime.engine import Engine

    tokens = {}
    for graph in (False, True):
        engine = Engine.from_pretrained(dtype="bfloat16", max_seq_len=512, kv_blocks=80, kv_dtype="int8",
                                        poison_kv=True, cuda_graph=graph)
        assert engine.kv.pool.kv_dtype == "int8" and engine.info()["kv_dtype"] == "int8"
        tokens[graph] = engine.generate(list(range(3, 60)), max_tokens=100, ignore_eos=True).token_ids
    assert tokens[True] == tokens[False]
