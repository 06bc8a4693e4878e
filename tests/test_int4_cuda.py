"""The CUDA W4A16 kernels (edge/kernels/int4_gemv.cu) vs the torch reference.

Fresh random int4 codes, scales, zero points and act-order permutations for every
case, NaN-poisoned outputs, shapes of real models (Qwen3-8B projections, a 0.6B
lm_head), float16 and bfloat16 activations, float16 / bfloat16 / float32 scales. The
GEMV multiplies the exact ``q - z`` on tensor cores in float32 and scales the group
sums, so it is compared elementwise with a float64 oracle (dequantize and multiply in
float64: only the output rounding and float32 summation order separate them), and
as a vector with :class:`edge.quant.int4.Int4ReferenceLinear` (weights rounded to the
activation dtype first)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]

from edge.quant.int4 import Int4Codes, Int4ReferenceLinear, Int4Weight, pack_weight  # noqa: E402
from edge.kernels import reference  # noqa: E402

# (out, in): 8B qkv, 8B o, 8B gate_up, 8B down, 0.6B lm_head, a ragged row count.
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 1024), (1000, 512)]
DTYPES16 = (torch.float16, torch.bfloat16)
RTOL_ORACLE = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
TOL_REF = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
_seed = [977]


def _gen() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator(device="cuda").manual_seed(_seed[0])


SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def make_linear(tuning=None):
    from edge.kernels.int4_cuda import Int4CudaLinear, Int4Tuning
    from edge.kernels.launcher import Launcher

    return Int4CudaLinear(Launcher(torch.cuda.current_device()), reference, tuning or Int4Tuning(), SCALE_DTYPES)


@pytest.fixture(scope="module")
def lin():
    from edge.kernels.nvrtc import KernelsUnavailable

    try:
        return make_linear()
    except KernelsUnavailable as exc:  # pragma: no cover - reported, not hidden
        pytest.fail(f"GPU present but the int4 kernels are unavailable: {exc}")


def random_weight(out: int, inp: int, group: int, g: torch.Generator, *, zero: bool = True, act_order: bool = False,
                  scale_dtype: torch.dtype = torch.float16) -> Int4Weight:
    q = torch.randint(0, 16, (out, inp), generator=g, device="cuda", dtype=torch.uint8)
    groups = inp // group
    scale = ((torch.rand(out, groups, generator=g, device="cuda") + 0.5) * 2e-2).to(scale_dtype)
    z = torch.randint(0, 17, (out, groups), generator=g, device="cuda", dtype=torch.uint8) if zero else None
    g_idx = None
    if act_order:
        perm = torch.randperm(inp, generator=g, device="cuda")
        g_idx = torch.empty(inp, dtype=torch.int64, device="cuda")
        g_idx[perm] = torch.arange(inp, device="cuda") // group
    return pack_weight([Int4Codes(q, scale, z, group, g_idx)], "cuda")


def oracle(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64: x @ dequant(w).T (+ bias), rows in chunks."""
    xd = x.double().reshape(-1, w.in_features)
    if w.perm is not None:
        xd = xd[:, w.perm.long()]
    outs = []
    step = max(1, (1 << 24) // (16 * w.in_features))
    blocks = w.packed.shape[0]
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        outs.append(xd @ w.dequantize_blocks(b0, b1, torch.float64).T)
    y = torch.cat(outs, dim=-1)[:, : w.out_features]
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], w.out_features)


def check(y: torch.Tensor, x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None, label: str) -> None:
    assert y.dtype == x.dtype and tuple(y.shape) == (*x.shape[:-1], w.out_features), label
    assert torch.isfinite(y).all(), f"{label}: non-finite outputs (unwritten NaN poison?)"
    o = oracle(x, w, bias)
    err = (y.double() - o).abs()
    bound = RTOL_ORACLE[x.dtype] * o.abs() + 1e-5 * o.abs().max()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{label}: max |y - oracle| {err.max().item():.3g} exceeds the bound by {worst:.3g}"
    ref = Int4ReferenceLinear().linear(x, w, bias).double()
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < TOL_REF[x.dtype], f"{label}: relative error vs reference {rel:.3g}"


def run(lin, x, w, bias=None, **kw):
    assert lin.fuses(x, w), "a decode input: the GEMV"
    rows = w.out_features // 2 if kw.get("swiglu") else w.out_features
    out = None
    if kw.get("residual") is None:
        out = torch.full((*x.shape[:-1], rows), float("nan"), dtype=x.dtype, device="cuda")
        kw = dict(kw, out=out)
    y = lin.linear(x, w, bias, **kw)
    torch.cuda.synchronize()
    if out is not None:
        assert y.data_ptr() == out.data_ptr()
    return y


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_matches_oracle(lin, shape, dtype) -> None:
    g = _gen()
    out, inp = shape
    w = random_weight(out, inp, 128, g)
    x = torch.randn(1, inp, generator=g, device="cuda").to(dtype)
    bias = torch.randn(out, generator=g, device="cuda").to(dtype)
    check(run(lin, x, w, bias), x, w, bias, f"{shape} {dtype}")
    check(run(lin, x, w), x, w, None, f"{shape} {dtype} no bias")


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
def test_several_tokens_take_the_resident_ctas_only(dtype, monkeypatch) -> None:
    """More than one token: the grid is at most the resident CTAs, each staging its
    tokens once and taking unit after unit (the large shapes give each several); one
    token keeps a CTA per unit group. Every mode against its reference."""
    lin = make_linear()
    grids: list[tuple[int, ...]] = []
    launch = lin.launcher.launch
    monkeypatch.setattr(lin.launcher, "launch", lambda k, grid, *a, **kw: (grids.append(grid), launch(k, grid, *a, **kw))[1])
    g = _gen()
    # Shapes with more units than any GPU holds CTAs of them (768 and 4748 units).
    hidden, inter, wide = 4096, 12288, 24576
    norm = ((torch.rand(hidden, generator=g, device="cuda") + 0.5).to(dtype), 1e-6)
    plain_w = random_weight(wide, hidden, 128, g)
    gate_up = random_weight(2 * inter, hidden, 128, g)
    down_w = random_weight(wide, inter, 128, g)
    head = random_weight(151936, hidden, 128, g)
    tol = TOL_REF[dtype]

    def close(y, ref, label):
        assert torch.isfinite(y).all(), label
        rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel < tol, f"{label}: {rel:.3g}"

    for tokens in (5, 1):
        x = (torch.randn(tokens, hidden, generator=g, device="cuda") * 3).to(dtype)
        a = torch.randn(tokens, inter, generator=g, device="cuda").to(dtype)
        r0 = torch.randn(tokens, wide, generator=g, device="cuda").to(dtype)
        cases = [
            ("plain", plain_w, False, False, lambda: check(run(lin, x, plain_w), x, plain_w, None, f"plain t{tokens}")),
            ("norm+swiglu", gate_up, False, True, lambda: close(
                run(lin, x, gate_up, norm=norm, swiglu=True), _fused_ref(x, gate_up, norm=norm, swiglu=True),
                f"norm+swiglu t{tokens}")),
            ("residual", down_w, False, False, lambda: close(
                run(lin, a, down_w, residual=r0.clone()), _fused_ref(a, down_w, residual=r0.clone()), f"residual t{tokens}")),
            ("norm+argmax", head, True, False, lambda: torch.testing.assert_close(
                lin.argmax(x, head, None, None, norm=norm), torch.argmax(lin.linear(x, head, norm=norm), dim=-1),
                rtol=0, atol=0)),
        ]
        for label, w, two, swiglu, go in cases:
            grids.clear()
            go()
            ctas = lin.plan(w.out_features // 2 if swiglu else w.out_features, two or swiglu, swiglu)[2]
            if tokens == 1:
                assert grids[0][0] == ctas, (label, grids[0], ctas)
            else:
                assert grids[0][0] < ctas, f"{label}: {grids[0]} CTAs for {ctas} unit groups; the case must loop"


@pytest.mark.parametrize("scale_dtype", (torch.float16, torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("zero", [True, False], ids=["zero", "symmetric"])
@pytest.mark.parametrize("act_order", [False, True], ids=["runs", "act_order"])
@pytest.mark.parametrize("group", [64, 128, 1024])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_every_layout_and_token_count(lin, scale_dtype, zero, act_order, group, tokens) -> None:
    g = _gen()
    w = random_weight(528, 1024, group, g, zero=zero, act_order=act_order, scale_dtype=scale_dtype)
    x = torch.randn(tokens, 1024, generator=g, device="cuda").to(torch.bfloat16)
    check(run(lin, x, w), x, w, None, f"{scale_dtype} zero={zero} act={act_order} g{group} t{tokens}")


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("split", [1, 2, 8])
def test_every_tile_count_and_column_split(tiles, split) -> None:
    from edge.kernels.int4_cuda import Int4Tuning

    lin = make_linear(Int4Tuning(tiles=tiles, split=split))
    assert lin.plan(1040, False)[:2] == (tiles, split)
    g = _gen()
    w = random_weight(1040, 2048, 128, g, act_order=True)
    x = torch.randn(2, 2048, generator=g, device="cuda").to(torch.float16)
    check(run(lin, x, w), x, w, None, f"tiles {tiles} split {split}")
    ln = ((torch.rand(2048, generator=g, device="cuda") + 0.5).half(), 1e-6)
    gu = random_weight(1056, 2048, 128, g)
    ref = _fused_ref(x, gu, norm=ln, swiglu=True)
    y = run(lin, x, gu, norm=ln, swiglu=True)
    assert ((y.double() - ref.double()).norm() / ref.double().norm()).item() < TOL_REF[x.dtype]
    ids = lin.argmax(x, w, None, None, norm=ln)
    assert torch.equal(ids, torch.argmax(lin.linear(x, w, norm=ln), dim=-1))


def _fused_ref(x, w, bias=None, **kw):
    return Int4ReferenceLinear(reference).linear(x, w, bias, **kw)


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("act_order", [False, True], ids=["runs", "act_order"])
@pytest.mark.parametrize("many_sms", [False, True], ids=["base", "many_sms_tuning"])
def test_fused_modes_match_the_composition(lin, dtype, tokens, act_order, many_sms) -> None:
    """Every fused mode against the composition, at the base tuning and at a many-SM
    GPU's default (one row tile, one-token launches of at most the resident CTAs, each
    taking unit after unit)."""
    from edge.kernels.int4_cuda import Int4Tuning

    if many_sms:
        lin = make_linear(Int4Tuning.for_sms(132))
        assert lin.tuning.resident_grid
    g = _gen()
    hidden, inter = 2048, 1536
    x = (torch.randn(tokens, hidden, generator=g, device="cuda") * 3).to(dtype)
    ln = (torch.rand(hidden, generator=g, device="cuda") + 0.5).to(dtype)
    norm = (ln, 1e-6)
    qkv = random_weight(3072, hidden, 128, g, act_order=act_order)
    gate_up = random_weight(2 * inter, hidden, 128, g, act_order=act_order)
    down = random_weight(hidden, inter, 128, g, act_order=act_order)
    tol = TOL_REF[dtype]

    def close(a, b, label):
        assert torch.isfinite(a).all(), label
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert rel < tol, f"{label}: {rel:.3g}"

    close(run(lin, x, qkv, norm=norm), _fused_ref(x, qkv, norm=norm), "norm")
    close(run(lin, x, gate_up, norm=norm, swiglu=True), _fused_ref(x, gate_up, norm=norm, swiglu=True), "norm+swiglu")
    close(run(lin, x, gate_up, swiglu=True), _fused_ref(x, gate_up, swiglu=True), "swiglu")
    a = torch.randn(tokens, inter, generator=g, device="cuda").to(dtype)
    r0 = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    r1 = r0.clone()
    y = run(lin, a, down, residual=r1)
    assert y.data_ptr() == r1.data_ptr()
    close(r1, _fused_ref(a, down, residual=r0.clone()), "residual")
    ids = lin.argmax(x, qkv, norm=norm)
    assert torch.equal(ids, torch.argmax(run(lin, x, qkv, norm=norm), dim=-1)), "argmax"


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("act_order", [False, True], ids=["runs", "act_order"])
@pytest.mark.parametrize("few_sms", [False, True], ids=["base", "few_sms_tuning"])
def test_tokens_beyond_the_staged_rows(act_order, dtype, few_sms) -> None:
    """More tokens than a CTA's shared memory stages: the plain and residual modes read
    them directly (one launch row) unless act order gathers them; the other modes, and
    act order, give each launch row its own tokens (the argmax included). With the small
    and the default stage, at the base tuning and an Orin's (4 warps, direct kernels
    one column tile a stage)."""
    import dataclasses

    from edge.kernels.int4_cuda import Int4Tuning, staged_row_bytes

    g = _gen()
    hidden, inter, tokens = 2048, 1536, 7
    tuning = Int4Tuning.for_sms(16) if few_sms else Int4Tuning()
    small = make_linear(dataclasses.replace(tuning, stage_bytes=16 << 10))
    assert (16 << 10) // staged_row_bytes(hidden, dtype) < tokens, "the case must need several rows"
    assert (16 << 10) // staged_row_bytes(inter, dtype) < tokens, "the case must need several rows"
    x = (torch.randn(tokens, hidden, generator=g, device="cuda") * 3).to(dtype)
    norm = ((torch.rand(hidden, generator=g, device="cuda") + 0.5).to(dtype), 1e-6)
    qkv = random_weight(3072, hidden, 128, g, act_order=act_order)
    gate_up = random_weight(2 * inter, hidden, 128, g, act_order=act_order)
    down = random_weight(hidden, inter, 128, g, act_order=act_order)
    a = torch.randn(tokens, inter, generator=g, device="cuda").to(dtype)
    r0 = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    for lin in (small, make_linear(tuning)):
        direct = lin is small and not act_order

        def ran(fn, mode):
            before = Counter(lin.launcher.counts)
            out = fn()
            names = Counter(lin.launcher.counts) - before
            kind = f"int4_gemv_{'direct_' if direct and mode in ('', 'residual_') else ''}{mode}"
            assert len(names) == 1 and re.fullmatch(kind + r"(bf16|f16)_t[12]", next(iter(names))), dict(names)
            return out

        check(ran(lambda: run(lin, x, qkv), ""), x, qkv, None, "plain")

        def close(y, ref, label):
            assert torch.isfinite(y).all(), label
            rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
            assert rel < TOL_REF[dtype], f"{label}: {rel:.3g}"

        close(ran(lambda: run(lin, x, qkv, norm=norm), "norm_"), _fused_ref(x, qkv, norm=norm), "norm")
        close(ran(lambda: run(lin, x, gate_up, norm=norm, swiglu=True), "norm_swiglu_"),
              _fused_ref(x, gate_up, norm=norm, swiglu=True), "norm+swiglu")
        r1 = r0.clone()
        ran(lambda: run(lin, a, down, residual=r1), "residual_")
        close(r1, _fused_ref(a, down, residual=r0.clone()), "residual")
        ids = lin.argmax(x, qkv, None, None, norm=norm)
        assert torch.equal(ids, torch.argmax(lin.linear(x, qkv, norm=norm), dim=-1))


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_argmax_is_argmax_of_the_logits(lin, norm, tokens) -> None:
    g = _gen()
    w = random_weight(151936, 1024, 128, g)
    x = torch.randn(tokens, 1024, generator=g, device="cuda").to(torch.bfloat16)
    nm = ((torch.rand(1024, generator=g, device="cuda") + 0.5).to(torch.bfloat16), 1e-6) if norm else None
    logits = lin.linear(x, w, norm=nm)
    ids = lin.argmax(x, w, None, torch.full((tokens,), -1, dtype=torch.int64, device="cuda"), norm=nm)
    assert torch.equal(ids, torch.argmax(logits, dim=-1))
    again = lin.argmax(x, w, None, None, norm=nm)
    assert torch.equal(again, ids), "the take kernel must leave the slots empty"


def test_dequantize_kernel_is_the_reference_bit_for_bit(lin) -> None:
    g = _gen()
    for scale_dtype in (torch.float16, torch.bfloat16):
        w = random_weight(1000, 1024, 128, g, scale_dtype=scale_dtype, act_order=True)
        for dtype in DTYPES16:
            out = torch.full((16 * 20, 1024), float("nan"), dtype=dtype, device="cuda")
            lin.dequantize_blocks(w, 30, 50, out)
            assert torch.equal(out, w.dequantize_blocks(30, 50, dtype))


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
def test_prefill_chunks(dtype) -> None:
    from edge.kernels.int4_cuda import Int4Tuning

    lin = make_linear(Int4Tuning(dequant_chunk=1 << 20))
    g = _gen()
    w = random_weight(3000, 1024, 128, g, act_order=True)
    x = torch.randn(77, 1024, generator=g, device="cuda").to(dtype)
    bias = torch.randn(3000, generator=g, device="cuda").to(dtype)
    y = lin.linear(x, w, bias)
    ref = Int4ReferenceLinear().linear(x, w, bias)
    rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < TOL_REF[dtype] / 4, rel


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("zero", [True, False], ids=["zero", "symmetric"])
@pytest.mark.parametrize("act_order", [False, True], ids=["runs", "act_order"])
def test_prefill_gemm_matches_oracle(dtype, zero, act_order) -> None:
    """The int4 GEMM (codes dequantized in its tile loop): ragged rows and tokens."""
    from edge.kernels.int4_cuda import Int4Tuning

    lin = make_linear(Int4Tuning(prefill="gemm"))
    g = _gen()
    for out, inp, tokens in ((1000, 1024, 77), (4096, 4096, 512), (6144, 256, 9)):
        w = random_weight(out, inp, 128 if inp > 256 else 64, g, zero=zero, act_order=act_order)
        x = torch.randn(tokens, inp, generator=g, device="cuda").to(dtype)
        bias = torch.randn(out, generator=g, device="cuda").to(dtype)
        y = lin.linear(x, w, bias)
        check(y, x, w, bias, f"gemm {out}x{inp} t{tokens} {dtype}")


def test_graph_capture_matches_eager(lin) -> None:
    g = _gen()
    w = random_weight(4096, 4096, 128, g, act_order=True)
    gu = random_weight(4096, 4096, 128, g)
    x = torch.randn(1, 4096, generator=g, device="cuda").to(torch.bfloat16)
    ln = (torch.rand(4096, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    eager = (lin.linear(x, w, norm=(ln, 1e-6)), lin.linear(x, gu, swiglu=True), lin.argmax(x, w, None, None))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            lin.linear(x, w, norm=(ln, 1e-6))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = (lin.linear(x, w, norm=(ln, 1e-6)), lin.linear(x, gu, swiglu=True), lin.argmax(x, w, None, None))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)


def test_unplanned_arguments_raise(lin) -> None:
    from edge.kernels.nvrtc import UnplannedArguments

    g = _gen()
    w = random_weight(64, 256, 64, g)
    x = torch.randn(1, 256, generator=g, device="cuda").to(torch.bfloat16)
    with pytest.raises(UnplannedArguments):
        lin.linear(x, w, torch.zeros(63, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(UnplannedArguments):
        lin.linear(x.float(), w)


def test_int4_engine_on_the_gpu_tracks_the_reference(tmp_path) -> None:
    """A random model quantized to int4 while loading: the CUDA engine (GEMV decode with
    the fused plan, dequantize + cuBLAS prefill, graphs, launches serialised by default)
    against the same weights on the torch reference."""
    from edge.runtime.engine import Engine
    from edge.sampling import SamplingParams
    from tests.conftest import build_hf_model

    build_hf_model("Qwen3ForCausalLM", tmp_path, hidden_size=256, intermediate_size=512, tie_word_embeddings=False)
    cuda = Engine.from_pretrained(tmp_path, device="cuda", dtype="bfloat16", quantize="int4", quant_group_size=64)
    ref = Engine.from_pretrained(tmp_path, device="cuda", dtype="bfloat16", quantize="int4", quant_group_size=64,
                                 kernels="reference")
    assert cuda.info()["backend"]["linears"]["int4"] == "int4 GEMV (decode, tensor cores), dequantize + cuBLAS (prefill)"
    assert not cuda.backend.overlap_launches, "int4 graphs launch serialised unless asked (docs/benchmarks.md)"
    ids = list(range(3, 60))
    a, b = cuda.score(ids), ref.score(ids)
    assert ((a - b).norm() / b.norm()).item() < 2e-2
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert cuda.generate(ids[:9], params).token_ids[:8] == ref.generate(ids[:9], params).token_ids[:8]
