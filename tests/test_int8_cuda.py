"""The CUDA W8A16 decode GEMV (edge/kernels/int8_gemv.cu) vs the torch reference.

Fresh random int8 weights and scales for every case, NaN-poisoned outputs, shapes of
real models (Qwen3-0.6B / 8B projections and lm_heads), float16 and bfloat16, group
sizes 64 and 128, with and without bias; each result is compared with a float32
oracle (dequantize in float32, multiply in float32: the kernel differs from it only by
accumulation order and the final rounding) and with ``int8_linear_reference``.

Run as a script for the kernel microbenchmark (needs a GPU):

    python tests/test_int8_cuda.py [--sweep]
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

from edge import quant
from edge.quant import Int8Weight, int8_linear_reference, quantize_tensor

# (out, in): 0.6B o_proj-like, qkv-like, down-like, 0.6B lm_head, 8B o_proj, 8B
# gate_up, 8B down.
SHAPES = [
    (1024, 1024),
    (3072, 1024),
    (1024, 3072),
    (151936, 1024),
    (4096, 4096),
    (24576, 4096),
    (4096, 12288),
]
DTYPES16 = (torch.float16, torch.bfloat16)
# Kernel vs the float32 oracle: only the rounding of the output (half an ulp: 2^-9 /
# 2^-12 relative) and float32 summation order; elementwise bounds.
RTOL_ORACLE = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Kernel vs int8_linear_reference (weights rounded to x's dtype, matmul in x's dtype):
# relative error of the whole vector, as in test_kernels_cuda.
TOL_REF = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
_seed = [4321]


@pytest.fixture(scope="module")
def ic():
    from edge.kernels import int8_cuda

    try:
        int8_cuda.load("cuda")
    except (
        int8_cuda.KernelsUnavailable
    ) as exc:  # pragma: no cover - reported, not hidden
        pytest.fail(f"GPU present but the int8 kernels are unavailable: {exc}")
    return int8_cuda


@pytest.fixture
def registry():
    """Restore the int8 linear registry after a test that changes it."""
    saved = [(d, dict(d)) for d in (quant._INT8_LINEAR, quant._INT8_FUSES)]
    yield
    for d, items in saved:
        d.clear()
        d.update(items)


def _gen() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator(device="cuda").manual_seed(_seed[0])


def random_weight(out: int, inp: int, group: int, g: torch.Generator) -> Int8Weight:
    q = torch.randint(
        -127, 128, (out, inp), generator=g, device="cuda", dtype=torch.int8
    )
    scale = (torch.rand(out, inp // group, generator=g, device="cuda") + 0.5) * 1e-3
    return Int8Weight(q, scale, group)


def oracle(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 result (dequantize and multiply in float32, row chunks for lm_heads)."""
    rows = w.out_features
    xf = x.float().reshape(-1, w.in_features)
    outs = []
    step = max(1, (1 << 26) // w.in_features)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        deq = Int8Weight(w.weight[r0:r1], w.scale[r0:r1], w.group_size).dequantize(
            torch.float32
        )
        outs.append(xf @ deq.T)
    y = torch.cat(outs, dim=-1)
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], rows)


def check(
    y: torch.Tensor,
    x: torch.Tensor,
    w: Int8Weight,
    bias: torch.Tensor | None,
    label: str,
) -> None:
    assert y.dtype == x.dtype and tuple(y.shape) == (*x.shape[:-1], w.out_features), (
        label
    )
    assert torch.isfinite(y).all(), (
        f"{label}: non-finite outputs (unwritten NaN poison?)"
    )
    o = oracle(x, w, bias)
    err = (y.float() - o).abs()
    bound = RTOL_ORACLE[x.dtype] * o.abs() + 1e-5 * o.abs().max()
    worst = (err - bound).max().item()
    assert worst <= 0, (
        f"{label}: max |y - oracle| {err.max().item():.3g} exceeds the bound by {worst:.3g}"
    )
    ref = int8_linear_reference(x, w, bias).float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < TOL_REF[x.dtype], f"{label}: relative error vs reference {rel:.3g}"


def run_kernel(ic, x, w, bias):
    assert ic.supports(x, w, bias), "these arguments should take the kernel path"
    out = torch.full(
        (*x.shape[:-1], w.out_features), float("nan"), dtype=x.dtype, device="cuda"
    )
    y = ic.int8_linear(x, w, bias, out=out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    return y


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_matches_reference(ic, shape, dtype, group, with_bias) -> None:
    out, inp = shape
    g = _gen()
    w = random_weight(out, inp, group, g)
    x = torch.randn(1, inp, generator=g, device="cuda").to(dtype)
    bias = torch.randn(out, generator=g, device="cuda").to(dtype) if with_bias else None
    y = run_kernel(ic, x, w, bias)
    check(y, x, w, bias, f"{shape} {dtype} g{group} bias={with_bias}")


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize(
    "shape,group",
    [
        ((5, 48), 16),
        ((33, 512), 32),
        ((1027, 1024), 64),
        ((4099, 2048), 256),
        ((300, 12288), 128),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_every_variant_and_ragged_shapes(ic, shape, group, rows) -> None:
    """Each rows-per-warp variant, row counts that leave a short last warp and CTA,
    rows shorter than one warp-wide load, group sizes 16..256."""
    prev = ic.set_tuning(rows_per_warp=rows)
    try:
        for dtype in DTYPES16:
            g = _gen()
            w = random_weight(*shape, group, g)
            x = torch.randn(1, shape[1], generator=g, device="cuda").to(dtype)
            bias = torch.randn(shape[0], generator=g, device="cuda").to(dtype)
            check(
                run_kernel(ic, x, w, bias),
                x,
                w,
                bias,
                f"{shape} g{group} r{rows} {dtype}",
            )
    finally:
        ic.set_tuning(prev[1], **prev[0])


@pytest.mark.parametrize("tokens", [None, 1, 2, 3, 4])
def test_input_shapes_and_a_few_tokens(ic, tokens) -> None:
    """``[in]``, ``[T, in]`` (T <= 4 in one launch) and ``[1, T, in]``."""
    g = _gen()
    w = random_weight(3072, 1024, 128, g)
    bias = torch.randn(3072, generator=g, device="cuda").to(torch.bfloat16)
    shape = (1024,) if tokens is None else (tokens, 1024)
    x = torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)
    check(run_kernel(ic, x, w, bias), x, w, bias, f"x {shape}")
    if tokens is not None:
        x3 = x.unsqueeze(0)
        check(run_kernel(ic, x3, w, bias), x3, w, bias, f"x {tuple(x3.shape)}")


def test_realistic_weights_track_the_float_linear(ic) -> None:
    """Weights quantized from float (quantize_tensor): the kernel's output is the
    dequantized linear, and close to the float one."""
    torch.manual_seed(7)
    wf = torch.randn(4096, 4096, device="cuda") * 0.02
    w = Int8Weight(*quantize_tensor(wf, 128), 128)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y = run_kernel(ic, x, w, None)
    check(y, x, w, None, "quantized 4096x4096")
    yf = x.float() @ wf.T
    assert ((y.float() - yf).norm() / yf.norm()).item() < 2e-2


def test_fallbacks_to_the_reference(ic) -> None:
    """What the kernel does not cover gives the reference's result."""
    g = _gen()
    cases = []
    w48 = random_weight(64, 480, 48, g)  # group not a power of two
    cases.append(
        (
            torch.randn(1, 480, generator=g, device="cuda").to(torch.bfloat16),
            w48,
            "group 48",
        )
    )
    w = random_weight(256, 512, 128, g)
    cases.append((torch.randn(1, 512, generator=g, device="cuda"), w, "float32 x"))
    cases.append(
        (
            torch.randn(5, 512, generator=g, device="cuda").to(torch.float16),
            w,
            "5 tokens",
        )
    )
    cases.append(
        (
            torch.randn(512, 2, generator=g, device="cuda").to(torch.float16)[:, 0],
            w,
            "strided x",
        )
    )
    w16 = Int8Weight(w.weight, w.scale.half(), 128)
    cases.append(
        (
            torch.randn(1, 512, generator=g, device="cuda").to(torch.float16),
            w16,
            "float16 scale",
        )
    )
    for x, wt, label in cases:
        assert not ic.supports(x, wt), label
        y = ic.int8_linear(x, wt)
        assert torch.equal(y, int8_linear_reference(x, wt)), label
    # A bias the kernel does not take (another dtype) is left to the reference.
    x = torch.randn(1, 512, generator=g, device="cuda").to(torch.float16)
    assert not ic.supports(x, w, torch.randn(256, generator=g, device="cuda"))


def test_graph_capture_matches_eager(ic) -> None:
    """Captured in a CUDA graph, a replay on new inputs equals the eager launch."""
    g = _gen()
    w1 = random_weight(24576, 4096, 128, g)
    w2 = random_weight(4096, 12288, 128, g)
    bias = torch.randn(24576, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, 4096, generator=g, device="cuda").to(torch.bfloat16)

    def step() -> torch.Tensor:
        h = ic.int8_linear(x, w1, bias)
        gate, up = h.chunk(2, dim=-1)
        return ic.int8_linear(torch.nn.functional.silu(gate) * up, w2)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(2):
        x.copy_(torch.randn(1, 4096, generator=g, device="cuda").to(torch.bfloat16))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, step())


def test_enable_routes_int8_weights(ic, registry) -> None:
    g = _gen()
    w = random_weight(1024, 1024, 128, g)
    x = torch.randn(1, 1024, generator=g, device="cuda").to(torch.float16)
    ic.enable("cuda")
    assert quant._INT8_LINEAR["cuda"] is ic.int8_linear
    assert torch.equal(quant.linear(x, w), ic.int8_linear(x, w))
    ic.disable()
    assert "cuda" not in quant._INT8_LINEAR
    assert torch.equal(quant.linear(x, w), int8_linear_reference(x, w))


def test_engine_enables_the_gemv_for_int8_models(ic, registry) -> None:
    """An int8 engine on CUDA decodes through the kernel; its decode logits agree with
    the reference path's."""
    from edge.engine import Engine

    quant.register_int8_linear("cuda", None)
    engine = Engine.from_pretrained(
        None, device="cuda", dtype="float16", quantize="int8", cuda_graph=False
    )
    assert quant._INT8_LINEAR.get("cuda") is ic.int8_linear
    ids = list(range(3, 40))

    def decode_logits() -> torch.Tensor:
        seq = engine.new_sequence()
        try:
            nxt = int(torch.argmax(engine.prefill(seq, ids)))
            return engine.forward(seq, [nxt])
        finally:
            seq.release()

    with_kernel = decode_logits()
    ic.disable()
    ref = decode_logits()
    rel = ((with_kernel - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


# ---------------------------------------------------------------------------------------
# fused modes: RMSNorm prologue, residual and SwiGLU epilogues (int8_cuda.MODES)
# ---------------------------------------------------------------------------------------

EPS = 1e-6
# (mode, weight rows, in, group): Qwen3-8B's qkv, o, down and gate_up, and small odd
# shapes (a short last warp, rows shorter than one warp-wide load, group 16).
FUSED_CASES = [
    ("norm", 6144, 4096, 128),
    ("norm", 1027, 1024, 64),
    ("norm", 5, 48, 16),
    ("residual", 4096, 4096, 128),
    ("residual", 4096, 12288, 128),
    ("residual", 33, 512, 32),
    ("residual", 5, 48, 16),
    ("norm_swiglu", 2 * 12288, 4096, 128),
    ("norm_swiglu", 2 * 1027, 1024, 64),
    ("norm_swiglu", 2 * 5, 48, 16),
]


def fused_inputs(mode: str, rows: int, inp: int, group: int, dtype: torch.dtype, tokens: int, bias: bool) -> dict:
    """Fresh random arguments of one fused call; outputs poisoned with NaN (the residual
    is real data: NaN rows around it, which must survive)."""
    g = _gen()
    w = random_weight(rows, inp, group, g)
    kw: dict = {}
    if "norm" in mode:
        kw["norm"] = ((1 + 0.2 * torch.randn(inp, generator=g, device="cuda")).to(dtype), EPS)
    if "swiglu" in mode:
        kw["swiglu"] = True
    x = (torch.randn(tokens, inp, generator=g, device="cuda") * 3).to(dtype)
    b = torch.randn(rows, generator=g, device="cuda").to(dtype) if bias else None
    outputs = rows // 2 if "swiglu" in mode else rows
    if mode == "residual":
        buf = torch.full((tokens + 2, rows), float("nan"), dtype=dtype, device="cuda")
        buf[1:-1] = (torch.randn(tokens, rows, generator=g, device="cuda") * 4).to(dtype)
        kw["residual"] = buf[1:-1]
        out = None
    else:
        buf = None
        out = torch.full((tokens, outputs), float("nan"), dtype=dtype, device="cuda")
    return {"x": x, "w": w, "bias": b, "kw": kw, "out": out, "buf": buf}


def check_fused(ic, case: dict, label: str) -> None:
    """Run the kernel on ``case`` and compare with a float32 oracle (elementwise bound)
    and with the torch reference composition (relative error of the whole output)."""
    from edge.kernels import reference

    x, w, bias, kw = case["x"], case["w"], case["bias"], case["kw"]
    dtype, rtol = x.dtype, RTOL_ORACLE[x.dtype]
    assert ic.supports(x, w, bias, **kw), f"{label}: should take the kernel path"
    residual_before = kw["residual"].clone() if "residual" in kw else None
    ref = quant.fused_linear_reference(
        x, w, bias, ops=reference, **{**kw, **({"residual": residual_before.clone()} if "residual" in kw else {})}
    ).float()
    y = ic.int8_linear(x, w, bias, out=case["out"], **kw)
    torch.cuda.synchronize()
    if "residual" in kw:
        assert y is kw["residual"], f"{label}: the residual is the result, updated in place"
        buf = case["buf"]
        assert torch.isnan(buf[0]).all() and torch.isnan(buf[-1]).all(), f"{label}: wrote outside the residual"
    else:
        assert y.data_ptr() == case["out"].data_ptr()
    assert torch.isfinite(y).all(), f"{label}: non-finite outputs (unwritten NaN poison?)"

    # The norm modes scale the dot product with x * norm_w by 1/rms (int8_gemv.cu): the
    # oracle is the linear of the unrounded float32 normalised row.
    h = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), kw["norm"][0].float(), EPS) if "norm" in kw else x
    o = oracle(h, w, bias)
    err_lin = rtol * o.abs() + 1e-5 * o.abs().max()  # bound on |round(dot) - o| per output row
    if "swiglu" in kw:
        half = w.out_features // 2
        gate, up = o[:, :half], o[:, half:]
        eg, eu = err_lin[:, :half], err_lin[:, half:]
        want = torch.nn.functional.silu(gate) * up
        # |silu'| <= 1.1; the product of the two errors; the rounding of the output.
        bound = 1.1 * up.abs() * eg + torch.nn.functional.silu(gate).abs() * eu + eg * eu
        bound = bound + rtol * want.abs() + 1e-6 * want.abs().max()
    elif "residual" in kw:
        want = residual_before.float() + o
        bound = err_lin + rtol * want.abs()
    else:
        want, bound = o, err_lin
    err = (y.float() - want).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{label}: max |y - oracle| {err.max().item():.3g} exceeds the bound by {worst:.3g}"
    if y.shape[-1] >= 32:  # fewer outputs make the whole-vector error too noisy
        # SwiGLU compounds the reference's errors in gate and up.
        tol = TOL_REF[dtype] * (2 if "swiglu" in kw else 1)
        rel = ((y.float() - ref).norm() / ref.norm()).item()
        assert rel < tol, f"{label}: relative error vs the reference composition {rel:.3g}"


def _case_id(c: tuple) -> str:
    return f"{c[0]}-{c[1]}x{c[2]}-g{c[3]}"


@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", FUSED_CASES, ids=_case_id)
def test_fused_modes_match_reference(ic, case, dtype, tokens) -> None:
    mode, rows, inp, group = case
    for bias in (False, True):
        c = fused_inputs(mode, rows, inp, group, dtype, tokens, bias)
        check_fused(ic, c, f"{_case_id(case)} {dtype} T{tokens} bias={bias}")


@pytest.mark.parametrize("rows_per_warp", [1, 2, 4])
@pytest.mark.parametrize("mode", ["norm", "residual", "norm_swiglu"])
def test_fused_modes_every_variant(ic, mode, rows_per_warp) -> None:
    """Each rows-per-warp variant of each mode (SwiGLU takes at least a pair: 1 runs
    as 2) on ragged shapes, both dtypes, 1 and 3 tokens."""
    prev = ic.set_tuning(rows_per_warp=rows_per_warp)
    try:
        for rows, inp, group in ((66, 512, 32), (2 * 301, 256, 16), (8, 2048, 256)):
            for dtype in DTYPES16:
                for tokens in (1, 3):
                    c = fused_inputs(mode, rows, inp, group, dtype, tokens, bias=True)
                    check_fused(ic, c, f"{mode} r{rows_per_warp} {rows}x{inp} g{group} {dtype} T{tokens}")
    finally:
        ic.set_tuning(prev[1], **prev[0])


def test_fused_fallbacks_compose(ic) -> None:
    """Fusions the kernel does not take compose the unfused ops around the plain
    linear (the plain kernel where it applies): exactly fused_linear_reference."""
    from edge.kernels import reference

    g = _gen()
    dt = torch.bfloat16
    w = random_weight(512, 512, 128, g)
    ln = (1 + 0.1 * torch.randn(512, generator=g, device="cuda")).to(dt)
    x1 = torch.randn(1, 512, generator=g, device="cuda").to(dt)
    x5 = torch.randn(5, 512, generator=g, device="cuda").to(dt)
    cases = [
        (x5, {"norm": (ln, EPS)}, "5 tokens, norm"),
        (x5, {"norm": (ln, EPS), "swiglu": True}, "5 tokens, norm + swiglu"),
        (x5, {"residual": torch.ones(5, 512, device="cuda", dtype=dt)}, "5 tokens, residual"),
        (x1, {"norm": (ln.float(), EPS)}, "float32 norm weight"),
        (x1, {"swiglu": True}, "swiglu without norm"),
        (x1, {"norm": (ln, EPS), "residual": torch.ones(1, 512, device="cuda", dtype=dt)}, "norm + residual"),
        (x1, {"residual": x1}, "residual aliasing the input"),
    ]
    for x, kw, label in cases:
        assert not ic.supports(x, w, **kw), label
        res = kw.get("residual")
        kw_ref = dict(kw, residual=res.clone()) if res is not None else kw
        want = quant.fused_linear_reference(x.clone(), w, ops=reference, matmul=ic.int8_linear, **kw_ref)
        got = ic.int8_linear(x, w, **kw)
        assert torch.equal(got, want), label
        if res is not None:
            assert got is res, label
    with pytest.raises(ValueError, match="exclusive"):
        ic.int8_linear(x1, w, out=torch.empty(1, 512, device="cuda", dtype=dt), residual=torch.zeros_like(x1))


def test_fused_modes_graph_capture(ic) -> None:
    """One decoder layer's int8 projections with their fusions, captured in a CUDA graph:
    a replay on new inputs equals the eager launches (residual updated in place)."""
    g = _gen()
    dt = torch.bfloat16
    hidden, inter = 1024, 3072
    qkv, o = random_weight(2048, hidden, 128, g), random_weight(hidden, 1024, 128, g)
    gate_up, down = random_weight(2 * inter, hidden, 128, g), random_weight(hidden, inter, 128, g)
    ln1, ln2 = ((1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(dt) for _ in range(2))
    x = torch.randn(1, hidden, generator=g, device="cuda").to(dt)

    def layer(x: torch.Tensor) -> torch.Tensor:
        a = ic.int8_linear(x, qkv, norm=(ln1, EPS))[:, :1024]
        ic.int8_linear(a, o, residual=x)
        act = ic.int8_linear(x, gate_up, norm=(ln2, EPS), swiglu=True)
        return ic.int8_linear(act, down, residual=x)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x.clone())  # warm-up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        layer(static_x)
    for _ in range(2):
        x = torch.randn(1, hidden, generator=g, device="cuda").to(dt)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_x, layer(x.clone()))


# ---- the model's fused int8 plan -------------------------------------------------------


def _unfused(ic) -> None:
    """Register the int8 GEMV without its fusions: the model runs its unfused plan with
    the same GEMV kernel for every projection."""
    quant.register_int8_linear("cuda", ic.int8_linear)


def _decode(engine, ids: list[int], steps: int, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the float32 logits of ``steps`` eager decode steps; with
    ``forced``, those tokens are fed instead of the greedy ones (teacher forcing)."""
    seq = engine.new_sequence()
    try:
        logits = [engine.prefill(seq, ids)]
        tokens = []
        for i in range(steps):
            tokens.append(int(torch.argmax(logits[-1])))
            logits.append(engine.forward(seq, [tokens[-1] if forced is None else forced[i]]))
        return tokens, torch.stack(logits[:-1])
    finally:
        seq.release()


def test_int8_model_fused_plan_matches_unfused_plan(ic, registry, hf_checkpoint, tmp_path) -> None:
    """A random int8 model (non-flat logits: initializer_range 0.1; llama, qwen2 with
    qkv bias, qwen3 with an untied int8 lm_head) in bf16, fused and unfused plans,
    against the same int8 weights run in float32 (the torch reference path).

    The fused plan's norm GEMVs skip one bf16 rounding of the unfused plan (the
    normalised row), so the plans are not bit-equal any more, but teacher-forced on
    the float32 model's greedy tokens the fused plan is at least as close to it as
    the unfused one, picks the same tokens but for near-ties, and graph decode with
    the fused plan gives exactly the eager fused plan's tokens."""
    from edge.engine import Engine
    from edge.sampling import SamplingParams

    name, _, src = hf_checkpoint
    path = quant.quantize_checkpoint(src, tmp_path / "q8")["dst"]
    graph = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", cuda_graph=None, max_seq_len=256, num_blocks=64)
    eager = Engine(graph.model, None, graph.model_dir, max_seq_len=256, num_blocks=64, cuda_graph=False)
    exact = Engine.from_pretrained(path, device="cuda", dtype="float32", cuda_graph=False, max_seq_len=256, num_blocks=64)
    # head_dim 32 (the llama3 fixture) has no CUDA attention kernel: eager reference attention
    assert graph.cuda_graph == (graph.cfg.head_dim in (64, 128))
    assert graph.model.int8_projections
    ids = list(range(3, 30))
    x = torch.zeros(1, graph.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert quant.fuses(x, graph.model.layers[0]["qkv"]), "decode should take the fused plan"
    steps = 24
    fused_free, _ = _decode(eager, ids, steps)
    graph_tokens = graph.generate(ids, SamplingParams(max_tokens=steps, ignore_eos=True)).token_ids
    assert graph_tokens == fused_free, name
    tokens, want = _decode(exact, ids, steps)
    fused_picks, fused = _decode(eager, ids, steps, forced=tokens)
    _unfused(ic)
    assert not quant.fuses(x, graph.model.layers[0]["qkv"])
    _, unfused = _decode(eager, ids, steps, forced=tokens)

    def rel(a: torch.Tensor) -> float:
        return ((a - want).norm() / want.norm()).item()

    assert rel(unfused) < 5e-2, f"{name}: unfused bf16 plan vs float32 rel err {rel(unfused):.3g}"
    assert rel(fused) <= 1.1 * rel(unfused), f"{name}: fused {rel(fused):.3g} vs unfused {rel(unfused):.3g}"
    for i, (a, b) in enumerate(zip(fused_picks, tokens)):
        if a != b:  # a near-tie: the two candidates closer than the plan's error there
            gap = (want[i, b] - want[i, a]).abs()
            assert gap <= 2 * (fused[i] - want[i]).abs().max(), f"{name}: step {i} picks {a}, not {b}"


def test_int8_decode_runs_the_fused_kernels(ic, registry, monkeypatch) -> None:
    """The fused plan really runs on CUDA: a decode step launches each layer's four
    GEMVs in their fused modes and nothing falls back to the composition, and it runs
    3 kernels per layer fewer than the unfused plan (10 -> 7)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from edge.engine import Engine
    from edge.kernels import fused_cuda, int8_cuda

    engine = Engine.from_pretrained(
        None, device="cuda", dtype="bfloat16", quantize="int8", cuda_graph=False, kernels="cuda", num_blocks=64
    )
    assert engine.model.ops is fused_cuda and quant._INT8_LINEAR["cuda"] is ic.int8_linear
    layers = engine.cfg.num_layers
    seq = engine.new_sequence()
    try:
        tok = int(torch.argmax(engine.prefill(seq, list(range(3, 20)))))

        def step() -> None:
            nonlocal tok
            tok = int(torch.argmax(engine.forward(seq, [tok])))

        launched: list[str] = []
        kernel = int8_cuda._kernel

        def spy(dev, dtype, rows, infix=""):  # noqa: ANN001, ANN202
            launched.append(infix)
            return kernel(dev, dtype, rows, infix)

        def no_fallback(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise AssertionError("a fused int8 linear fell back to the composition")

        with monkeypatch.context() as m:
            m.setattr(int8_cuda, "_kernel", spy)
            m.setattr(int8_cuda, "fused_linear_reference", no_fallback)
            step()
        counts = {infix: launched.count(infix) for infix in set(launched)}
        assert counts == {"norm_": layers, "residual_": 2 * layers, "norm_swiglu_": layers}, counts

        def kernels_per_step() -> int:
            step()  # warm
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)

        fused = kernels_per_step()
        _unfused(ic)
        unfused = kernels_per_step()
        assert unfused - fused == 3 * layers, (fused, unfused)
    finally:
        seq.release()


# ---------------------------------------------------------------------------------------
# microbenchmark (python tests/test_int8_cuda.py)
# ---------------------------------------------------------------------------------------

BENCH_SHAPES = [
    ("0.6b o_proj", 1024, 2048),
    ("0.6b qkv", 4096, 1024),
    ("0.6b gate_up", 6144, 1024),
    ("0.6b down", 1024, 3072),
    ("0.6b lm_head", 151936, 1024),
    ("8b qkv", 6144, 4096),
    ("8b o_proj", 4096, 4096),
    ("8b gate_up", 24576, 4096),
    ("8b down", 4096, 12288),
    ("8b lm_head", 151936, 4096),
    # the fused modes of the 8B decoder layer (int8_cuda.MODES)
    ("8b qkv+norm", 6144, 4096, "norm"),
    ("8b o+residual", 4096, 4096, "residual"),
    ("8b gate_up+norm+swiglu", 24576, 4096, "norm_swiglu"),
    ("8b down+residual", 4096, 12288, "residual"),
]
SWEEP = [
    {},
    {"CFG_INT8_WARPS": 8},
    {"CFG_INT8_UNROLL_R1": 8, "CFG_INT8_UNROLL_R2": 4, "CFG_INT8_UNROLL_R4": 4},
    {"CFG_INT8_UNROLL_R1": 2, "CFG_INT8_UNROLL_R2": 2, "CFG_INT8_UNROLL_R4": 1},
    {"CFG_INT8_MIN_BLOCKS": 6},
    {
        "CFG_INT8_WARPS": 8,
        "CFG_INT8_UNROLL_R1": 2,
        "CFG_INT8_UNROLL_R2": 2,
        "CFG_INT8_UNROLL_R4": 1,
    },
]


def _median_us(fn, reps: int = 50, warmup: int = 5) -> float:
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _copy_bandwidth(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (_median_us(lambda: dst.copy_(src), reps=20) * 1e-6)


def _graph_us(fn, launches: int, replays: int = 20, overlap: bool = False) -> float:
    """Median microseconds per launch of ``fn`` (which launches once per call) over
    replays of a CUDA graph of ``launches`` calls: no Python or launch overhead, only
    the kernels and the graph's node-to-node gaps, as in captured decode (``overlap``:
    captured as overlapped launches, as the decode graph is on sm_90+)."""
    import statistics

    from edge.kernels import nvrtc

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # compiles and loads outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), nvrtc.overlapped(overlap):
        for _ in range(launches):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    del graph
    return statistics.median(times)


def _bench_shape(
    label: str,
    out: int,
    inp: int,
    dtype: torch.dtype,
    group: int,
    copy_bw: float,
    sweep: bool,
    mode: str = "",
) -> dict:
    from edge.kernels import int8_cuda

    g = torch.Generator(device="cuda").manual_seed(out * 7 + inp)
    # Enough copies of the weight, cycled, that no launch finds its weight in L2.
    copies = max(2, min(16, (512 << 20) // (out * inp)))
    ws = [random_weight(out, inp, group, g) for _ in range(copies)]
    x = torch.randn(1, inp, generator=g, device="cuda").to(dtype)
    outputs = out // 2 if "swiglu" in mode else out
    y = torch.zeros(1, outputs, dtype=dtype, device="cuda")
    moved = out * inp + ws[0].scale.numel() * 4 + (inp + outputs) * x.element_size()
    kw: dict = {}
    if "norm" in mode:
        kw["norm"] = (torch.ones(inp, dtype=dtype, device="cuda"), EPS)
        moved += inp * x.element_size()
    if "swiglu" in mode:
        kw["swiglu"] = True
    if mode == "residual":
        kw["residual"] = y  # in place: y is read and written
        moved += outputs * x.element_size()
    it = [0]

    def call() -> None:
        int8_cuda.int8_linear(x, ws[it[0] % copies], out=None if mode == "residual" else y, **kw)
        it[0] += 1

    launches = copies * max(1, 32 // copies)
    row: dict = {"shape": label, "out": out, "in": inp}
    for i, knobs in enumerate(SWEEP if sweep else SWEEP[:1]):
        for r in (None, 1, 2, 4) if sweep else (None,):
            int8_cuda.set_tuning(rows_per_warp=r, **knobs)
            us = _graph_us(call, launches)
            frac = moved / (us * 1e-6) / copy_bw
            row[f"t{i}" + ("" if r is None else f"r{r}")] = round(frac, 3)
            if i == 0 and r is None:
                row["us"] = round(us, 2)
                row["GBps"] = round(moved / (us * 1e-6) / 1e9, 1)
                row["rows_per_warp"] = int8_cuda.plan(
                    out, 1, torch.cuda.current_device()
                )[0]
                row["us_overlapped"] = round(_graph_us(call, launches, overlap=True), 2)
    int8_cuda.set_tuning()

    # The reference (dequantize + matmul) on the same weights, for scale.
    def ref() -> None:
        int8_linear_reference(x, ws[it[0] % copies])
        it[0] += 1

    row["ref_us"] = round(_graph_us(ref, copies, 5), 1)
    return row


def bench(
    sweep: bool = False, dtype: torch.dtype = torch.bfloat16, group: int = 128
) -> list[dict]:
    import json

    copy_bw = _copy_bandwidth()
    torch.cuda.empty_cache()
    print(
        f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)"
    )
    rows = []
    for label, out, inp, *mode in BENCH_SHAPES:
        rows.append(_bench_shape(label, out, inp, dtype, group, copy_bw, sweep, *mode))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print(f"fraction of copy bandwidth ({dtype}, group {group}, default tuning):")
    for row in rows:
        print(
            f"  {row['shape']:<24} {row['out']:>6}x{row['in']:<6} {row['us']:>8.1f} us "
            f"{row['GBps']:>7.0f} GB/s  {row['t0']:.3f}  overlapped {row['us_overlapped']:>7.1f} us "
            f"(r{row['rows_per_warp']}; reference {row['ref_us']} us)"
        )
    if sweep:
        print(
            "sweep: t<i> = SWEEP[i] with the default rows choice, t<i>r<R> = rows forced to R"
        )
        for i, knobs in enumerate(SWEEP):
            fr = [row[f"t{i}"] for row in rows]
            big = [row[f"t{i}"] for row in rows if row["out"] * row["in"] >= 16 << 20]
            print(
                f"  t{i} {knobs}: mean {sum(fr) / len(fr):.3f}, >=16M weights mean {sum(big) / len(big):.3f}, "
                f"geomean {math.exp(sum(math.log(v) for v in fr) / len(fr)):.3f}"
            )
            for r in (1, 2, 4):
                fr = [row[f"t{i}r{r}"] for row in rows]
                print(f"     rows {r}: " + " ".join(f"{v:.2f}" for v in fr))
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="int8 GEMV microbenchmark")
    ap.add_argument(
        "--sweep", action="store_true", help="also time the tunings in SWEEP"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--group", type=int, default=128)
    a = ap.parse_args()
    bench(a.sweep, getattr(torch, a.dtype), a.group)


# ---- the greedy lm_head: argmax in the GEMV's epilogue ---------------------------------


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows, inp, group", [(32003, 1024, 128), (1027, 512, 32), (5, 48, 16)])
def test_argmax_matches_torch_argmax_of_the_logits(ic, dtype, rows, inp, group) -> None:
    """int8_argmax gives torch.argmax of the kernel's own logits for 1-4 tokens, with
    and without bias and with the RMSNorm folded in: ties go to the first row,
    all-negative logits work, and the per-stream slot is emptied after every call
    (repeated calls stay right)."""
    g = _gen()
    w = random_weight(rows, inp, group, g)
    norm_w = (torch.rand(inp, generator=g, device="cuda") + 0.5).to(dtype)
    for tokens in (1, 2, 4):
        for bias in (None, torch.randn(rows, generator=g, device="cuda").to(dtype)):
            for shift in (0.0, -1e4):  # -1e4: every logit negative
                for norm in (None, (norm_w, 1e-6)):
                    x = (torch.randn(tokens, inp, generator=g, device="cuda") * 3).to(dtype)
                    b = None if bias is None else bias + shift
                    if b is None and shift:
                        continue
                    want = torch.argmax(ic.int8_linear(x, w, b, norm=norm), dim=-1)
                    out = torch.full((tokens,), -7, dtype=torch.int64, device="cuda")
                    got = ic.int8_argmax(x, w, b, out=out, norm=norm)
                    case = f"T{tokens} bias={b is not None} shift={shift} norm={norm is not None}"
                    assert got is out and torch.equal(out, want), case
    # A tie: the winning row copied to a lower and a higher row; the lowest one wins.
    x = (torch.randn(1, inp, generator=g, device="cuda") * 3).to(dtype)
    win = int(torch.argmax(ic.int8_linear(x, w)))
    rows_tied = sorted({win, max(0, win - 3), min(rows - 1, win + 2)})
    for r in rows_tied:
        w.weight[r].copy_(w.weight[win])
        w.scale[r].copy_(w.scale[win])
    assert int(ic.int8_argmax(x, w)[0]) == rows_tied[0] == int(torch.argmax(ic.int8_linear(x, w)))
    assert ic.int8_argmax(x.float(), w) is None, "float32 activations: the caller's logits"


def test_greedy_graph_decode_takes_the_token_from_the_lm_head(ic, tmp_path) -> None:
    """An int8 model with its own (int8) lm_head decodes greedily through the graph
    with the argmax epilogue: the replay runs the argmax GEMV (the final norm folded
    in) and its take, not torch's argmax, no separate norm and no fill (the kernels'
    workspaces are made before capture); the tokens equal eager decode's, which takes
    the argmax of the logits."""
    from torch.profiler import ProfilerActivity, profile

    from edge.engine import Engine
    from edge.random_model import make_model
    from edge.sampling import SamplingParams

    path = make_model(tmp_path / "m", preset="tiny", tie_word_embeddings=False, dtype="bfloat16")
    graph = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", quantize="int8", cuda_graph=True, kernels="cuda")
    eager = Engine(graph.model, graph.tokenizer, graph.model_dir, cuda_graph=False, kernels="cuda")
    assert isinstance(graph.model.lm_head, Int8Weight)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompt = "The kiosk robot greets every visitor"
    tokens = graph.generate(prompt, params).token_ids
    assert tokens == eager.generate(prompt, params).token_ids
    decoder = graph._decoders[0]
    (step,) = decoder.graphs.values()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("int8_gemv_norm_argmax" in n for n in names) == 1, names
    assert sum("int8_argmax_take" in n for n in names) == 1, names
    assert not [n for n in names if "reduce_kernel" in n or "Fill" in n or "rms_norm" in n], names
