"""The CUDA W8A16 decode GEMV (edge/kernels/int8_gemv.cu) vs the torch reference.

Fresh random int8 weights and scales for every case, NaN-poisoned outputs, shapes of
real models (Qwen3-0.6B / 8B projections and lm_heads), float16 and bfloat16, group
sizes 64 and 128, with and without bias; each result is compared with a float32
oracle (dequantize in float32, multiply in float32: the kernel differs from it only by
accumulation order and the final rounding) and with ``int8_linear_reference``. The
kernels run through :class:`edge.kernels.int8_cuda.Int8CudaLinear` objects (one per
tuning) whose layer ops are the torch reference; which kernel ran is read from their
launcher's counts.

Run as a script for the kernel microbenchmark (needs a GPU):

    python tests/test_int8_cuda.py [--sweep]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)",
    ),
]

from edge.quant import q8_0 as quant
from edge.kernels import reference
from edge.kernels.int8_cuda import (
    MAX_GEMV_TOKENS,
    MAX_MMA_TOKENS,
    MIN_MMA_TOKENS,
    Int8CudaLinear,
    Int8Tuning,
    mma_support,
    weight_support,
)
from edge.kernels.nvrtc import UnplannedArguments
from edge.quant.linear import Int8ReferenceLinear, Linears
from edge.quant.q8_0 import QUANT_METHOD, Int8Weight, int8_linear_reference, quantize_tensor

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
def int8_linear() -> Callable[..., Int8CudaLinear]:
    """Builds (once per tuning) the int8 linear of a backend on one launcher, with the
    torch reference as its layer ops; unset knobs are the GPU's default
    (:meth:`Int8Tuning.for_sms`, so a few-SM run tests the few-SM tuning)."""
    from edge.kernels.launcher import Launcher
    from edge.kernels.nvrtc import KernelsUnavailable

    launcher = Launcher(torch.cuda.current_device())
    made: dict[Int8Tuning, Int8CudaLinear] = {}

    def make(**tuning: Any) -> Int8CudaLinear:
        t = dataclasses.replace(Int8Tuning.for_sms(launcher.sm_count()), **tuning)
        if t not in made:
            try:
                made[t] = Int8CudaLinear(launcher, reference, t)
            except KernelsUnavailable as exc:  # pragma: no cover - reported, not hidden
                pytest.fail(f"GPU present but the int8 kernels are unavailable: {exc}")
        return made[t]

    return make


@pytest.fixture(scope="module")
def ic(int8_linear) -> Int8CudaLinear:
    """The default tuning."""
    return int8_linear()


_GEMV_NAME = re.compile(r"int8_(gemv|mma|stage)_(.*?)(?:bf16|f16)(?:_r\d)?")


def gate_up_kind(tuning: Int8Tuning) -> str:
    """The kernel kind of a decode token's gate_up (norm + SwiGLU) under ``tuning``: the
    tensor-core kernel where it asks (few SMs, :meth:`Int8Tuning.for_sms`), else the GEMV."""
    return "int8_mma_norm_swiglu_" if "norm_swiglu_" in tuning.mma_one_token else "int8_gemv_norm_swiglu_"


def qkv_kinds(tuning: Int8Tuning) -> dict[str, int]:
    """The launch kinds of a decode token's qkv (norm) under ``tuning``: the tensor-core
    kernel prestaged in pairs of row tiles where it asks (few SMs), after its stage
    launch, else the GEMV."""
    if "norm_" in tuning.mma_one_token and "norm_" in tuning.mma_pair_tiles and "norm_" in tuning.mma_prestage:
        return {"int8_stage_norm_": 1, "int8_mma_pre_pair_norm_": 1}
    assert "norm_" not in tuning.mma_one_token, "a one-token qkv on tensor cores staged by each CTA: no such default"
    return {"int8_gemv_norm_": 1}


def by_kind(counts: dict[str, int]) -> Counter[str]:
    """Launch counts with each int8 GEMV keyed by its kernel and mode (``int8_gemv_<infix>``
    or, the tensor-core kernel, ``int8_mma_<infix>``, e.g. ``int8_gemv_norm_``; the
    prestaging launch ``int8_stage_`` or ``int8_stage_norm_``): dtypes and rows-per-warp
    variants summed."""
    out: Counter[str] = Counter()
    for name, n in counts.items():
        m = _GEMV_NAME.fullmatch(name)
        out[f"int8_{m.group(1)}_{m.group(2)}" if m else name] += n
    return out


def launched(ic: Int8CudaLinear, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Counter[str]]:
    """``fn(*args, **kwargs)`` and the kernels it launched through ``ic``'s launcher, by name."""
    before = Counter(ic.launcher.counts)
    out = fn(*args, **kwargs)
    return out, Counter(ic.launcher.counts) - before


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


def kernel_of(x: torch.Tensor, w: Int8Weight, ic: Int8CudaLinear | None = None, infix: str | None = None) -> str:
    """The kernel a decode input runs on: 2..8 tokens of a weight of whole 64-column
    tiles (and 32-row pairs of tiles) on tensor cores, else the per-token GEMV. Given
    ``ic`` alone, the plain mode's: its tensor-core launch reads the tokens directly when
    ``ic``'s tuning says so; with a fused mode's ``infix`` too, one token takes the
    tensor-core kernel where the tuning lists that mode (few SMs: norm + SwiGLU). Several
    tokens of a mode the tuning prestages run ``int8_mma_pre_`` (after an ``int8_stage_``
    launch), as does one token of a mode in pairs of row tiles."""
    tokens = x.numel() // w.in_features
    low = 1 if ic is not None and infix in ic.tuning.mma_one_token else MIN_MMA_TOKENS
    if not (low <= tokens <= MAX_MMA_TOKENS and mma_support(w) is None):
        return "int8_gemv_"
    if ic is not None and ic._prestaged(infix or "", tokens):
        return "int8_mma_pre_"
    return "int8_mma_direct_" if ic is not None and infix is None and ic.tuning.mma_direct else "int8_mma_"


def expected_launches(kernel: str, mode: str) -> list[set[str]]:
    """The launch kinds (by_kind) a call of ``mode`` on ``kernel`` (kernel_of) may make:
    one kernel (the staged tensor-core modes may read directly instead), or the
    prestaging launch and the prestaged kernel."""
    if kernel == "int8_mma_pre_":
        stage = f"int8_stage_{'norm_' * mode.startswith('norm_')}"
        return [{stage, f"int8_mma_pre_{kind}{mode}"} for kind in ("", "direct_", "pair_")]
    return [{f"{kernel}{mode}"}] + ([{f"int8_mma_direct_{mode}"}] if kernel == "int8_mma_" else [])


def run_kernel(ic: Int8CudaLinear, x, w, bias, rows_per_warp: int | None = None):
    """The GEMV's result in a NaN-poisoned ``out``; checks that the plain GEMV (of
    ``rows_per_warp`` rows a warp, when given) was the one launch."""
    assert weight_support(w, x.dtype) is None, "the GEMV should take this weight"
    assert x.numel() // w.in_features <= MAX_GEMV_TOKENS, "a decode input"
    out = torch.full(
        (*x.shape[:-1], w.out_features), float("nan"), dtype=x.dtype, device="cuda"
    )
    y, names = launched(ic, ic.linear, x, w, bias, out=out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    kinds = by_kind(names)
    assert set(kinds) in expected_launches(kernel_of(x, w, ic), "") and set(kinds.values()) == {1}, names
    if rows_per_warp is not None:
        assert next(iter(names)).endswith(f"_r{rows_per_warp}"), names
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
def test_every_variant_and_ragged_shapes(int8_linear, shape, group, rows) -> None:
    """Each rows-per-warp variant, row counts that leave a short last warp and CTA,
    rows shorter than one warp-wide load, group sizes 16..256."""
    ic = int8_linear(rows_per_warp=rows)
    assert ic.plan(shape[0], 1)[0] == rows
    for dtype in DTYPES16:
        g = _gen()
        w = random_weight(*shape, group, g)
        x = torch.randn(1, shape[1], generator=g, device="cuda").to(dtype)
        bias = torch.randn(shape[0], generator=g, device="cuda").to(dtype)
        check(
            run_kernel(ic, x, w, bias, rows_per_warp=rows),
            x,
            w,
            bias,
            f"{shape} g{group} r{rows} {dtype}",
        )


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


def test_unplanned_arguments_are_reported_not_replaced(ic) -> None:
    """What the GEMV does not take is never silently given to the reference: weights
    are reported by weight_support (the backend asks once per weight when it plans),
    decode inputs it cannot read raise, and a prefill chunk runs the planned GEMM
    (the expansion kernel, then the reference's matmul: int8_linear_reference's result)."""
    g = _gen()
    w48 = random_weight(64, 480, 48, g)  # group not a power of two
    assert "group size 48" in (weight_support(w48, torch.bfloat16) or "")
    w = random_weight(256, 512, 128, g)
    assert weight_support(w, torch.float16) is None and weight_support(w, torch.bfloat16) is None
    assert weight_support(w, torch.float32) is not None, "float32 activations"
    assert weight_support(Int8Weight(w.weight, w.scale.half(), 128), torch.float16) is not None, "float16 scale"
    assert weight_support(w.to("cpu"), torch.float16) is not None, "weights on the CPU"

    unplanned = [
        (torch.randn(1, 512, generator=g, device="cuda"), None, "float32 x"),
        (torch.randn(512, 2, generator=g, device="cuda").to(torch.float16)[:, 0], None, "strided x"),
        (
            torch.randn(1, 512, generator=g, device="cuda").to(torch.float16),
            torch.randn(256, generator=g, device="cuda"),
            "float32 bias for float16 x",
        ),
    ]
    for x, bias, label in unplanned:
        for call in (ic.linear, ic.argmax):
            try:
                call(x, w, bias)
            except UnplannedArguments:
                continue
            pytest.fail(f"{label}: {call.__name__} ran instead of raising UnplannedArguments")

    x5 = torch.randn(MAX_MMA_TOKENS + 1, 512, generator=g, device="cuda").to(torch.float16)
    y, names = launched(ic, ic.linear, x5, w)
    assert names == {"int8_dequant_f16": 1}, f"a prefill chunk expands, then the GEMM; no GEMV launch: {names}"
    assert torch.equal(y, int8_linear_reference(x5, w))
    assert ic.argmax(x5, w) is None, "prefill: the caller computes the logits"


def test_graph_capture_matches_eager(ic) -> None:
    """Captured in a CUDA graph, a replay on new inputs equals the eager launch."""
    g = _gen()
    w1 = random_weight(24576, 4096, 128, g)
    w2 = random_weight(4096, 12288, 128, g)
    bias = torch.randn(24576, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, 4096, generator=g, device="cuda").to(torch.bfloat16)

    def step() -> torch.Tensor:
        h = ic.linear(x, w1, bias)
        gate, up = h.chunk(2, dim=-1)
        return ic.linear(torch.nn.functional.silu(gate) * up, w2)

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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_engine_enables_the_gemv_for_int8_models() -> None:
    """An int8 engine on CUDA plans the GEMV for its q8_0 weights and decodes through
    it; its logits agree with an engine on the reference backend (same model)."""
    from edge.runtime.engine import Engine

    engine = Engine.from_pretrained(None, device="cuda", dtype="float16", quantize="int8", cuda_graph=False, num_blocks=64)
    assert engine.model.int8_projections
    assert isinstance(engine.backend.eager.linears.impls[QUANT_METHOD], Int8CudaLinear)
    assert engine.backend.describe()["linears"][QUANT_METHOD] == Int8CudaLinear.name
    ref = Engine(engine.model, engine.tokenizer, engine.model_dir, kernels="reference", cuda_graph=False, num_blocks=64)
    ids = list(range(3, 40))
    before = Counter(engine.backend.launch_counts())
    tokens, with_kernel = _decode(engine, ids, 3)
    grown = by_kind(Counter(engine.backend.launch_counts()) - before)
    tuning = engine.backend.int8_tuning
    assert all(grown[k] for k in (*qkv_kinds(tuning), "int8_gemv_residual_", gate_up_kind(tuning))), grown
    _, want = _decode(ref, ids, 3, forced=tokens)
    assert _rel(with_kernel, want) < 1e-2, _rel(with_kernel, want)


def test_reference_engine_after_a_cuda_int8_engine_runs_the_reference() -> None:
    """Backends are per engine: a reference engine built on a CUDA int8 engine's model,
    in the same process, runs the torch reference (no kernel of the first engine's
    launcher, logits of the reference computed on the CPU from the same weights), and
    the first engine still runs its GEMV afterwards."""
    from edge.runtime.engine import Engine
    from edge.model.decoder import Model

    first = Engine.from_pretrained(None, device="cuda", dtype="bfloat16", quantize="int8", num_blocks=64)
    assert first.backend.kind == "cuda" and first.cuda_graph
    ids = list(range(3, 40))
    graph_tokens = first.generate(ids, max_tokens=8, ignore_eos=True).token_ids  # graph decode
    tokens, first_logits = _decode(first, ids, 4)

    second = Engine(first.model, first.tokenizer, first.model_dir, kernels="reference", num_blocks=64)
    assert second.backend.kind == "reference" and not second.cuda_graph
    assert isinstance(second.backend.eager.linears.impls[QUANT_METHOD], Int8ReferenceLinear)
    assert first.model.backend is first.backend and second.model.backend is second.backend
    before = first.backend.launch_counts()
    _, second_logits = _decode(second, ids, 4, forced=tokens)
    torch.cuda.synchronize()
    assert first.backend.launch_counts() == before, "the reference engine launched the first engine's kernels"

    # The oracle: the same weights on the CPU (reference backend, contiguous cache).
    weights = {name: w.to("cpu") for name, w in first.model.w.items()}
    cpu = Engine(Model(first.cfg, weights, first.max_seq_len), None, first.model_dir, kv_cache="contiguous")
    assert cpu.backend.kind == "reference"
    _, want = _decode(cpu, ids, 4, forced=tokens)
    assert _rel(second_logits.cpu(), want) < 1e-2, _rel(second_logits.cpu(), want)
    # The GEMV plan is close to the reference, not equal to it (it folds the norms; the
    # bf16 bound of test_int8_model_fused_plan_matches_unfused_plan).
    assert _rel(first_logits.cpu(), want) < 5e-2, _rel(first_logits.cpu(), want)

    before = Counter(first.backend.launch_counts())
    _, again = _decode(first, ids, 4, forced=tokens)
    grown = by_kind(Counter(first.backend.launch_counts()) - before)
    tuning = first.backend.int8_tuning
    assert all(grown[k] for k in (*qkv_kinds(tuning), "int8_gemv_residual_", gate_up_kind(tuning))), grown
    assert torch.equal(again, first_logits), "the first engine changed after the second was built"
    assert first.generate(ids, max_tokens=8, ignore_eos=True).token_ids == graph_tokens


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


def check_fused(ic: Int8CudaLinear, case: dict, label: str) -> str:
    """Run the kernel on ``case`` and compare with a float32 oracle (elementwise bound)
    and with the torch reference composition (relative error of the whole output).
    Returns the name of the one kernel it launched (that of its mode)."""
    x, w, bias, kw = case["x"], case["w"], case["bias"], case["kw"]
    dtype, rtol = x.dtype, RTOL_ORACLE[x.dtype]
    assert weight_support(w, dtype) is None and ic.fuses(x, w), f"{label}: should take the fused GEMV"
    residual_before = kw["residual"].clone() if "residual" in kw else None
    ref = quant.fused_linear_reference(
        x, w, bias, ops=reference, **{**kw, **({"residual": residual_before.clone()} if "residual" in kw else {})}
    ).float()
    y, names = launched(ic, ic.linear, x, w, bias, out=case["out"], **kw)
    torch.cuda.synchronize()
    mode = "norm_" * ("norm" in kw) + "residual_" * ("residual" in kw) + "swiglu_" * bool(kw.get("swiglu"))
    kernel = kernel_of(x, w, ic, mode)
    kinds = by_kind(names)
    assert set(kinds) in expected_launches(kernel, mode) and set(kinds.values()) == {1}, (
        f"{label}: launched {dict(names)}")
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
    if "norm" in kw and kernel in ("int8_mma_", "int8_mma_pre_"):
        # The tensor-core kernel stages x * norm_w rounded to x's dtype (as the unfused
        # rms_norm -> linear rounds its row): at most half an ulp of each input more.
        wabs = Int8Weight(w.weight.abs(), w.scale, w.group_size)
        err_lin = err_lin + 2 * rtol * oracle(h.abs(), wabs, None)
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
    return next(n for n in names if not n.startswith("int8_stage_"))


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
def test_fused_modes_every_variant(int8_linear, mode, rows_per_warp) -> None:
    """Each rows-per-warp variant of each mode (SwiGLU takes at least a pair: 1 runs
    as 2) on ragged shapes, both dtypes, 1 and 3 tokens (every mode on the GEMV)."""
    ic = int8_linear(rows_per_warp=rows_per_warp, mma_one_token=())
    r = max(rows_per_warp, 2) if "swiglu" in mode else rows_per_warp
    for rows, inp, group in ((66, 512, 32), (2 * 301, 256, 16), (8, 2048, 256)):
        for dtype in DTYPES16:
            for tokens in (1, 3):
                c = fused_inputs(mode, rows, inp, group, dtype, tokens, bias=True)
                label = f"{mode} r{rows_per_warp} {rows}x{inp} g{group} {dtype} T{tokens}"
                assert check_fused(ic, c, label).endswith(f"_r{r}"), label


MMA_CASES = [  # (mode, rows, in, group): 8B qkv / down / gate_up shapes, ragged tile counts, big groups
    ("plain", 6144, 4096, 128),
    ("plain", 20480, 1024, 128),  # more units than CTAs that fit the GPU at once: a CTA takes several
    ("norm", 1056, 576, 64),
    ("residual", 4096, 12288, 128),
    ("residual", 96, 704, 64),
    ("norm_swiglu", 2 * 1024, 1024, 256),
    ("norm_swiglu", 2 * 48, 320, 64),
]


@pytest.mark.parametrize("tuning", [{"mma_unroll": 1, "mma_direct": True, "mma_prestage": ()},
                                    {"mma_unroll": 2, "mma_direct": False, "mma_prestage": ()}],
                         ids=["unroll1-direct", "unroll2-staged"])
@pytest.mark.parametrize("tokens", [2, 3, 5, 7, 8])
@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", MMA_CASES, ids=_case_id)
def test_tensor_core_kernel_for_a_few_tokens(int8_linear, case, dtype, tokens, tuning) -> None:
    """2..8 tokens (the speculative verify step) run on the tensor-core kernel
    (int8_mma.cu), one launch for all of them, every mode, both column-tile stages (1:
    few SMs, 2: many) and both ways of the plain and residual modes (read directly, the
    default; staged), each CTA staging its own tokens (nothing prestaged), against the
    float32 oracle and the reference composition. More than 3 tokens of a 12288-column
    input do not fit a CTA's staging (96 KiB): those modes read them directly either way."""
    ic = int8_linear(**tuning)
    mode, rows, inp, group = case
    direct = (tuning["mma_direct"] or (inp == 12288 and tokens > 3)) and mode in ("plain", "residual")
    for bias in (False, True):
        c = fused_inputs("" if mode == "plain" else mode, rows, inp, group, dtype, tokens, bias)
        name = check_fused(ic, c, f"{_case_id(case)} {dtype} T{tokens} bias={bias}")
        assert name.startswith("int8_mma_direct_" if direct else "int8_mma_"), name
        assert direct or not name.startswith("int8_mma_direct_"), name


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
def test_one_token_gate_up_on_the_tensor_core_kernel(int8_linear, dtype) -> None:
    """A decode token's norm + SwiGLU on the tensor-core kernel where the tuning asks it
    (few SMs), against the float32 oracle and the reference composition; the other modes
    keep the GEMV."""
    ic = int8_linear(mma_one_token=("norm_swiglu_",))
    for case in MMA_CASES:
        mode, rows, inp, group = case
        for bias in (False, True):
            c = fused_inputs("" if mode == "plain" else mode, rows, inp, group, dtype, 1, bias)
            name = check_fused(ic, c, f"{_case_id(case)} {dtype} T1 bias={bias}")
            assert name.startswith("int8_mma_norm_swiglu_" if mode == "norm_swiglu" else "int8_gemv_"), name


PRESTAGE_ALL = ("", "norm_", "residual_", "norm_swiglu_", "argmax_", "norm_argmax_")


@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", MMA_CASES, ids=_case_id)
def test_prestaged_tensor_core_kernel(int8_linear, case, dtype, tokens) -> None:
    """Every mode with its tokens prestaged (``Int8Tuning.mma_prestage``: int8_stage once,
    then int8_mma_pre, the plain and residual modes on the byte chain too): the one-tile
    modes read them with each batch, the two-tile ones copy them into each CTA's shared
    memory where they fit; against the float32 oracle and the reference composition,
    outputs NaN-poisoned; the stage and the prestaged kernel are the two launches
    (check_fused). One token stays unprestaged, on the GEMV or (``mma_one_token``) the
    tensor-core kernel staging it itself."""
    ic = int8_linear(mma_prestage=PRESTAGE_ALL, mma_one_token=("norm_swiglu_", "residual_"), mma_pair_tiles=())
    mode, rows, inp, group = case
    infix = {"plain": ""}.get(mode, f"{mode}_")
    copied = mode == "norm_swiglu" and (inp // 64) * 64 + tokens * (inp + 16) * 2 <= ic._mma_smem
    for bias in (False, True):
        c = fused_inputs("" if mode == "plain" else mode, rows, inp, group, dtype, tokens, bias)
        name = check_fused(ic, c, f"{_case_id(case)} {dtype} T{tokens} bias={bias}")
        if tokens > 1:
            assert name.startswith(f"int8_mma_pre_{'' if copied else 'direct_'}{infix}"), name
        elif infix in ic.tuning.mma_one_token:
            assert name.startswith(f"int8_mma_{'direct_' * (infix == 'residual_')}{infix}"), name
        else:
            assert name.startswith("int8_gemv_"), name


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
def test_prestaged_pairs_of_row_tiles(int8_linear, dtype) -> None:
    """The one-tile modes (plain, norm, residual) prestaged in units of two row tiles
    (``Int8Tuning.mma_pair_tiles``; few SMs take it for the norm and residual modes, and
    for a decode token's qkv): against the float32 oracle and the reference composition,
    outputs NaN-poisoned, at 1 token (``mma_one_token``: prestaged too) and 2..8 tokens,
    on more units than resident CTAs, with the norm mode in CTAs of 4 and 8 warps; the
    stage and ``int8_mma_pre_pair_`` are the two launches."""
    pairs = ("", "norm_", "residual_")
    cases = [("plain", 6144, 4096, 128), ("plain", 20480, 1024, 128), ("norm", 1056, 576, 64),
             ("norm", 6144, 4096, 128), ("residual", 4096, 4096, 128), ("residual", 4096, 12288, 128),
             ("residual", 96, 704, 64)]
    for norm_warps in (4, 8):
        ic = int8_linear(mma_prestage=pairs, mma_pair_tiles=pairs, mma_norm_warps=norm_warps, mma_one_token=pairs)
        for case in cases:
            mode, rows, inp, group = case
            if norm_warps == 4 and mode != "norm":
                continue
            for tokens in (1, 2, 5, 8):
                c = fused_inputs("" if mode == "plain" else mode, rows, inp, group, dtype, tokens, bias=tokens == 5)
                name = check_fused(ic, c, f"{_case_id(case)} {dtype} T{tokens} {norm_warps}-warp norm")
                assert name.startswith(f"int8_mma_pre_pair_{'' if mode == 'plain' else mode + '_'}"), name


@pytest.mark.parametrize("prestage", [False, True], ids=["staged", "prestaged"])
@pytest.mark.parametrize("warps", [2, 4])
def test_norm_mode_with_its_own_warps(int8_linear, warps, prestage) -> None:
    """The one-tile norm mode (qkv) in CTAs of their own warp count
    (``Int8Tuning.mma_norm_warps``: few SMs take 4), staged by each CTA or prestaged (the
    stage's CTAs a token never more than the consumer's warps), against the float32 oracle
    and the reference composition, both dtypes, 2..8 tokens."""
    ic = int8_linear(mma_norm_warps=warps, mma_prestage=("norm_",) if prestage else (), mma_pair_tiles=())
    for rows, inp, group in ((1056, 576, 64), (6144, 4096, 128), (512, 12288, 128)):
        for dtype in DTYPES16:
            for tokens in (2, 5, 8):
                c = fused_inputs("norm", rows, inp, group, dtype, tokens, bias=tokens == 5)
                name = check_fused(ic, c, f"norm {rows}x{inp} {dtype} T{tokens} {warps} warps")
                assert name.startswith("int8_mma_pre_direct_norm_" if prestage else "int8_mma_norm_"), name


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
def test_prestaged_argmax_and_scaling(int8_linear, dtype) -> None:
    """Prestaged greedy lm_head (with and without the norm; two tiles a unit: copied into
    shared memory) equals torch.argmax of the prestaged logits (one tile: read with each
    batch); bfloat16 tokens far outside float16's range both ways, an all-zero
    one and an ordinary one, prestaged in one launch, each within the oracle's bound."""
    ic = int8_linear(mma_prestage=PRESTAGE_ALL, mma_pair_tiles=())
    g = _gen()
    rows, inp = 32000, 1024
    w = random_weight(rows, inp, 128, g)
    norm_w = (torch.rand(inp, generator=g, device="cuda") + 0.5).to(dtype)
    for tokens in (2, 7):
        for norm in (None, (norm_w, 1e-6)):
            x = (torch.randn(tokens, inp, generator=g, device="cuda") * 3).to(dtype)
            logits, lnames = launched(ic, ic.linear, x, w, norm=norm)
            got, names = launched(ic, ic.argmax, x, w, norm=norm)
            mode = "norm_" if norm is not None else ""
            assert by_kind(lnames) == {f"int8_stage_{mode}": 1, f"int8_mma_pre_direct_{mode}": 1}, dict(lnames)
            assert by_kind(names) == {f"int8_stage_{mode}": 1, f"int8_mma_pre_{mode}argmax_": 1,
                                      "int8_argmax_take": 1}, dict(names)
            assert torch.equal(got, torch.argmax(logits, dim=-1)), (tokens, norm is not None)
    if dtype != torch.bfloat16:
        return
    w = random_weight(1056, 576, 64, g)
    mags = torch.tensor([1e6, 1e-6, 0.0, 1.0, 3e4], device="cuda")
    x = (torch.randn(len(mags), 576, generator=g, device="cuda") * mags[:, None]).to(dtype)
    out = torch.full((len(mags), 1056), float("nan"), dtype=dtype, device="cuda")
    y, names = launched(ic, ic.linear, x, w, out=out)
    torch.cuda.synchronize()
    assert by_kind(names) == {"int8_stage_": 1, "int8_mma_pre_direct_": 1}, dict(names)
    o = oracle(x.float(), w, None)
    bound = RTOL_ORACLE[dtype] * o.abs() + 1e-5 * o.abs().amax(dim=-1, keepdim=True)
    err = (y.float() - o).abs()
    assert torch.isfinite(y).all()
    for n in range(len(mags)):
        assert (err[n] <= bound[n]).all(), f"token of magnitude {mags[n].item():g}: max error {err[n].max().item():.3g}"
    assert not y[2].any(), "an all-zero token gives zeros"


@pytest.mark.parametrize("carveout", [72, 100])
def test_tensor_core_kernels_prefer_the_tuned_carveout(int8_linear, carveout) -> None:
    """Every staging tensor-core kernel (the ones given dynamic shared memory, prestaged
    copies included; the direct and paired ones stage nothing) is loaded with the carveout its
    tuning asks (the default leaves L1 room for the loads in flight), as the driver
    reports it."""
    from edge.kernels.nvrtc import function_attribute

    ic = int8_linear(mma_carveout=carveout)
    mma = [n for n in ic._k if n.startswith("int8_mma_") and "direct_" not in n and "_pair_" not in n]
    assert mma, "no tensor-core kernels loaded"
    for name in mma:
        got = function_attribute(ic._k[name], ic.launcher.device_index, "PREFERRED_SHARED_MEMORY_CARVEOUT")
        assert got == carveout, (name, got)


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
def test_tensor_core_argmax_for_a_few_tokens(int8_linear, dtype) -> None:
    """The verify step's greedy lm_head: argmax of 2..8 tokens' logits on the tensor-core
    kernel (each CTA staging its tokens), with and without the norm folded in, equal to
    torch.argmax of the kernel's own logits; the per-stream slots are emptied for the next
    call."""
    ic = int8_linear(mma_prestage=())
    g = _gen()
    rows, inp = 32000, 1024
    w = random_weight(rows, inp, 128, g)
    norm_w = (torch.rand(inp, generator=g, device="cuda") + 0.5).to(dtype)
    for tokens in (2, 5, 8):
        for norm in (None, (norm_w, 1e-6)):
            x = (torch.randn(tokens, inp, generator=g, device="cuda") * 3).to(dtype)
            logits, lnames = launched(ic, ic.linear, x, w, norm=norm)
            want = torch.argmax(logits, dim=-1)
            got, names = launched(ic, ic.argmax, x, w, norm=norm)
            mode = "norm_" if norm is not None else ""
            plain = "int8_mma_direct_" if norm is None and ic.tuning.mma_direct else f"int8_mma_{mode}"
            assert by_kind(lnames) == {plain: 1}, dict(lnames)
            assert by_kind(names) == {f"int8_mma_{mode}argmax_": 1, "int8_argmax_take": 1}, dict(names)
            assert torch.equal(got, want), (tokens, norm is not None)


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_tensor_core_kernel_scales_each_bfloat16_token(int8_linear, norm) -> None:
    """The tensor-core kernel stages bfloat16 tokens in float16, each 64-column tile of a
    token times a power of two of its own (int8_mma.cu): tokens far outside float16's
    range both ways, an all-zero one and an ordinary one, in one launch, each within the
    oracle's bound for that token alone."""
    ic = int8_linear(mma_direct=False, mma_prestage=())  # the plain mode staged too, by each CTA
    g = _gen()
    rows, inp, group = 1056, 576, 64
    w = random_weight(rows, inp, group, g)
    mags = torch.tensor([1e6, 1e-6, 0.0, 1.0, 3e4], device="cuda")
    x = (torch.randn(len(mags), inp, generator=g, device="cuda") * mags[:, None]).to(torch.bfloat16)
    kw = {"norm": ((1 + 0.2 * torch.randn(inp, generator=g, device="cuda")).to(torch.bfloat16), EPS)} if norm else {}
    out = torch.full((len(mags), rows), float("nan"), dtype=torch.bfloat16, device="cuda")
    y, names = launched(ic, ic.linear, x, w, out=out, **kw)
    torch.cuda.synchronize()
    assert by_kind(names) == {f"int8_mma_{'norm_' * norm}": 1}, dict(names)
    h = torch.nn.functional.rms_norm(x.float(), (inp,), kw["norm"][0].float(), EPS) if norm else x.float()
    o = oracle(h, w, None)
    rtol = RTOL_ORACLE[torch.bfloat16]
    bound = rtol * o.abs() + 1e-5 * o.abs().amax(dim=-1, keepdim=True)
    if norm:  # x * norm_w staged rounded to bfloat16 (check_fused)
        bound = bound + 2 * rtol * oracle(h.abs(), Int8Weight(w.weight.abs(), w.scale, w.group_size), None)
    err = (y.float() - o).abs()
    assert torch.isfinite(y).all()
    for n in range(len(mags)):
        assert (err[n] <= bound[n]).all(), f"token of magnitude {mags[n].item():g}: max error {err[n].max().item():.3g}"
    if not norm:
        assert not y[2].any(), "an all-zero token gives zeros"


def test_weights_without_whole_tiles_keep_the_per_token_kernel(ic) -> None:
    """A group of 32 (tiles would straddle groups) or rows not in 32-row pairs: 3..4
    tokens run the per-token GEMV, 5..8 are a prefill (expanded weights), and each is
    still right."""
    g = _gen()
    for rows, inp, group in ((512, 512, 32), (48, 512, 64)):
        w = random_weight(rows, inp, group, g)
        assert mma_support(w) is not None
        for tokens, kind in ((3, "int8_gemv_"), (4, "int8_gemv_"), (6, "int8_dequant_bf16")):
            x = torch.randn(tokens, inp, generator=g, device="cuda").to(torch.bfloat16)
            y, names = launched(ic, ic.linear, x, w)
            assert by_kind(names)[kind] == 1, dict(names)
            if kind == "int8_gemv_":
                check(y, x, w, None, f"{rows}x{inp} g{group} T{tokens}")
            else:  # the prefill plan: the reference's expansion and GEMM
                assert torch.equal(y, int8_linear_reference(x, w))


def test_unplanned_fusions_compose_or_raise(ic) -> None:
    """Fusions the GEMV has no mode for (MODES), and prefill chunks, compose the layer
    ops around the plain linear (the plain GEMV for decode inputs, the GEMM for
    prefill): exactly fused_linear_reference with that matmul. Decode arguments a
    mode's kernel cannot read raise instead of running anything else."""
    g = _gen()
    dt = torch.bfloat16
    w = random_weight(512, 512, 32, g)  # group 32: no tensor-core kernel, so 5 tokens are a prefill
    ln = (1 + 0.1 * torch.randn(512, generator=g, device="cuda")).to(dt)
    x1 = torch.randn(1, 512, generator=g, device="cuda").to(dt)
    x5 = torch.randn(5, 512, generator=g, device="cuda").to(dt)
    expand = {"int8_dequant_bf16": 1}
    composed = [  # (x, fusions, launches: the plain GEMV for decode, the expansion for prefill)
        (x5, {"norm": (ln, EPS)}, expand, "5 tokens, norm"),
        (x5, {"norm": (ln, EPS), "swiglu": True}, expand, "5 tokens, norm + swiglu"),
        (x5, {"residual": torch.ones(5, 512, device="cuda", dtype=dt)}, expand, "5 tokens, residual"),
        (x1, {"swiglu": True}, {"int8_gemv_": 1}, "swiglu without norm"),
        (
            x1,
            {"norm": (ln, EPS), "residual": torch.ones(1, 512, device="cuda", dtype=dt)},
            {"int8_gemv_": 1},
            "norm + residual",
        ),
    ]
    for x, kw, launches, label in composed:
        res = kw.get("residual")
        kw_ref = dict(kw, residual=res.clone()) if res is not None else kw
        want = quant.fused_linear_reference(x.clone(), w, ops=reference, matmul=ic.linear, **kw_ref)
        got, names = launched(ic, ic.linear, x, w, **kw)
        assert by_kind(names) == launches, f"{label}: launched {dict(names)}"
        assert torch.equal(got, want), label
        if res is not None:
            assert got is res, label
    unplanned = [
        (x1, {"residual": x1}, "residual aliasing the input"),
        (x1, {"norm": (ln.float(), EPS)}, "float32 norm weight"),
        (x1, {"residual": torch.ones(1, 512, device="cuda")}, "float32 residual"),
    ]
    for x, kw, label in unplanned:
        before = x.clone()
        try:
            ic.linear(x, w, **kw)
        except UnplannedArguments:
            assert torch.equal(x, before), f"{label}: the input changed"
            continue
        pytest.fail(f"{label}: ran instead of raising UnplannedArguments")
    with pytest.raises(ValueError, match="exclusive"):
        ic.linear(x1, w, out=torch.empty(1, 512, device="cuda", dtype=dt), residual=torch.zeros_like(x1))


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
        a = ic.linear(x, qkv, norm=(ln1, EPS))[:, :1024]
        ic.linear(a, o, residual=x)
        act = ic.linear(x, gate_up, norm=(ln2, EPS), swiglu=True)
        return ic.linear(act, down, residual=x)

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


class _NotFusing:
    """A backend's int8 GEMV whose ``fuses`` says no: the model then takes its unfused
    plan (add_rms_norm, silu_mul) with the same plain GEMV for every projection; a
    fusion is the layer ops composed around it."""

    def __init__(self, gemv: Int8CudaLinear, layer_ops: Any) -> None:
        self.gemv, self.ops = gemv, layer_ops
        self.name = f"{gemv.name}, not fusing"
        self.expands_weights = gemv.expands_weights

    def linear(self, x, w, bias=None, *, norm=None, residual=None, swiglu=False):
        if norm is None and residual is None and not swiglu:
            return self.gemv.linear(x, w, bias)
        return quant.fused_linear_reference(
            x, w, bias, norm=norm, residual=residual, swiglu=swiglu, ops=self.ops, matmul=self.gemv.linear
        )

    def fuses(self, x: torch.Tensor, w: Int8Weight) -> bool:
        return False

    def argmax(self, x, w, bias, out, *, norm=None):
        return None


def _unfused(engine, **options):
    """An eager engine on ``engine``'s model whose backend is ``engine``'s with the q8_0
    linear replaced by the same GEMV, not fusing (no captured step: the graph kernels
    would still fuse)."""
    from edge.runtime.engine import Engine

    b = engine.backend
    gemv = b.eager.linears.impls[QUANT_METHOD]
    assert isinstance(gemv, Int8CudaLinear)
    linears = Linears({**b.eager.linears.impls, QUANT_METHOD: _NotFusing(gemv, b.eager.layer)})
    backend = dataclasses.replace(b, eager=dataclasses.replace(b.eager, linears=linears), graph=None)
    return Engine(engine.model, engine.tokenizer, engine.model_dir, backend=backend, cuda_graph=False, **options)


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


def test_int8_model_fused_plan_matches_unfused_plan(hf_checkpoint, tmp_path) -> None:
    """A random int8 model (non-flat logits: initializer_range 0.1; llama, qwen2 with
    qkv bias, qwen3 with an untied int8 lm_head) in bf16, fused and unfused plans,
    against the same int8 weights run in float32 (the torch reference path).

    The fused plan's norm GEMVs skip one bf16 rounding of the unfused plan (the
    normalised row), so the plans are not bit-equal any more, but teacher-forced on
    the float32 model's greedy tokens the fused plan is at least as close to it as
    the unfused one, picks the same tokens but for near-ties, and graph decode with
    the fused plan gives exactly the eager fused plan's tokens."""
    from edge.runtime.engine import Engine
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
    qkv = graph.model.layers[0]["qkv"]
    assert eager.backend.eager.linears.fuses(x, qkv), "decode should take the fused plan"
    steps = 24
    fused_free, _ = _decode(eager, ids, steps)
    graph_tokens = graph.generate(ids, SamplingParams(max_tokens=steps, ignore_eos=True)).token_ids
    assert graph_tokens == fused_free, name
    tokens, want = _decode(exact, ids, steps)
    fused_picks, fused = _decode(eager, ids, steps, forced=tokens)
    plain = _unfused(eager, max_seq_len=256, num_blocks=64)
    assert not plain.backend.eager.linears.fuses(x, qkv) and eager.backend.eager.linears.fuses(x, qkv)
    _, unfused = _decode(plain, ids, steps, forced=tokens)

    def rel(a: torch.Tensor) -> float:
        return ((a - want).norm() / want.norm()).item()

    assert rel(unfused) < 5e-2, f"{name}: unfused bf16 plan vs float32 rel err {rel(unfused):.3g}"
    assert rel(fused) <= 1.1 * rel(unfused), f"{name}: fused {rel(fused):.3g} vs unfused {rel(unfused):.3g}"
    for i, (a, b) in enumerate(zip(fused_picks, tokens)):
        if a != b:  # a near-tie: the two candidates closer than the plan's error there
            gap = (want[i, b] - want[i, a]).abs()
            assert gap <= 2 * (fused[i] - want[i]).abs().max(), f"{name}: step {i} picks {a}, not {b}"


def test_int8_decode_runs_the_fused_kernels(monkeypatch) -> None:
    """The fused plan really runs on CUDA: a decode step launches each layer's four
    GEMVs in their fused modes and nothing is composed, and it runs 3 kernels per
    layer fewer than the unfused plan (8 -> 5: the norms, residual adds and SwiGLU
    inside the GEMVs; few SMs launch the qkv's stage too: 6), counted by the backend's
    launcher and by the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from edge.kernels import int8_cuda

    engine = _int8_engine(cuda_graph=False, kernels="cuda", num_blocks=64)
    assert set(engine.backend.eager.layer.names.values()) == {"cuda"}
    assert isinstance(engine.backend.eager.linears.impls[QUANT_METHOD], Int8CudaLinear)
    assert not isinstance(engine.model.lm_head, Int8Weight), "the default model's lm_head is its (float) embedding"
    plain = _unfused(engine, num_blocks=64)
    layers = engine.cfg.num_layers
    # Per layer: attention with q/k norm + RoPE + K/V store inside; once: the embedding
    # and the final norm the float lm_head's linear applies (cuBLAS and torch's argmax:
    # not launcher kernels).
    want_fused = {
        "embedding": 1,
        **{kind: n * layers for kind, n in qkv_kinds(engine.backend.int8_tuning).items()},
        "paged_decode_tc_rope": layers,
        "int8_gemv_residual_": 2 * layers,
        gate_up_kind(engine.backend.int8_tuning): layers,
        "rms_norm_bf16": 1,
    }
    # Unfused: the first norm, add_rms_norm after o and down (the last one is the
    # final norm), silu_mul, the plain GEMV for every projection.
    want_plain = {
        "embedding": 1,
        "rms_norm_bf16": 1,
        "int8_gemv_": 4 * layers,
        "paged_decode_tc_rope": layers,
        "add_rms_norm_bf16": 2 * layers,
        "silu_mul_bf16": layers,
    }
    ids = list(range(3, 20))
    seqs = {e: e.new_sequence() for e in (engine, plain)}
    try:
        toks = {e: int(torch.argmax(e.prefill(seq, ids))) for e, seq in seqs.items()}

        def step(e) -> Counter[str]:
            before = Counter(e.backend.launch_counts())
            toks[e] = int(torch.argmax(e.forward(seqs[e], [toks[e]])))
            return by_kind(Counter(e.backend.launch_counts()) - before)

        def no_composition(*args, **kwargs):
            raise AssertionError("a fused int8 linear was composed from the layer ops")

        with monkeypatch.context() as m:
            m.setattr(int8_cuda, "fused_linear_reference", no_composition)
            assert step(engine) == want_fused
        assert step(plain) == want_plain

        def kernels_per_step(e) -> int:
            step(e)  # warm
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(e)
                torch.cuda.synchronize()
            return sum(1 for ev in prof.events() if ev.device_type == DeviceType.CUDA)

        fused, unfused = kernels_per_step(engine), kernels_per_step(plain)
        staged = len(qkv_kinds(engine.backend.int8_tuning)) - 1  # the qkv's stage launch, where prestaged
        assert unfused - fused == (3 - staged) * layers, (fused, unfused)
    finally:
        for seq in seqs.values():
            seq.release()


def _int8_engine(**options):
    """The embedded default model (tied float lm_head), bf16, int8 projections, on CUDA."""
    from edge.runtime.engine import Engine

    return Engine.from_pretrained(None, device="cuda", dtype="bfloat16", quantize="int8", **options)


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
# Int8Tuning fields (int8_gemv.cu's CFG_INT8_* defines) of each swept tuning.
SWEEP = [
    {},
    {"warps": 8},
    {"unroll_r1": 8, "unroll_r2": 4, "unroll_r4": 4},
    {"unroll_r1": 2, "unroll_r2": 2, "unroll_r4": 1},
    {"min_blocks": 6},
    {"warps": 8, "unroll_r1": 2, "unroll_r2": 2, "unroll_r4": 1},
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


def _graph_us(fn, launches: int, replays: int = 20) -> float:
    """Median microseconds per launch of ``fn`` (which launches once per call) over
    replays of a CUDA graph of ``launches`` calls: no Python or launch overhead, only
    the kernels and the graph's node-to-node gaps, as in captured decode (overlapped
    when ``fn`` launches through an overlapped launcher, as the decode graph does on
    sm_90+)."""
    import statistics

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # compiles and loads outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
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
    linears: dict[tuple[int, int | None], Int8CudaLinear],
    mode: str = "",
) -> dict:
    """One shape through every tuning of ``linears`` ((SWEEP index, forced rows per
    warp or None) -> the int8 linear of that tuning)."""
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

    def caller(lin: Int8CudaLinear) -> Callable[[], None]:
        def call() -> None:
            lin.linear(x, ws[it[0] % copies], out=None if mode == "residual" else y, **kw)
            it[0] += 1

        return call

    launches = copies * max(1, 32 // copies)
    row: dict = {"shape": label, "out": out, "in": inp}
    for (i, r), lin in linears.items():
        us = _graph_us(caller(lin), launches)
        frac = moved / (us * 1e-6) / copy_bw
        row[f"t{i}" + ("" if r is None else f"r{r}")] = round(frac, 3)
        if i == 0 and r is None:
            row["us"] = round(us, 2)
            row["GBps"] = round(moved / (us * 1e-6) / 1e9, 1)
            row["rows_per_warp"] = lin.plan(out, 1, 2 if "swiglu" in mode else 1)[0]
            overlapped = lin.with_launcher(lin.launcher.overlapped(), reference)
            row["us_overlapped"] = round(_graph_us(caller(overlapped), launches), 2)

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

    from edge.kernels.launcher import Launcher

    launcher = Launcher(torch.cuda.current_device())  # one kernel cache for every tuning
    linears = {
        (i, r): Int8CudaLinear(launcher, reference, Int8Tuning(rows_per_warp=r, **knobs))
        for i, knobs in enumerate(SWEEP if sweep else SWEEP[:1])
        for r in ((None, 1, 2, 4) if sweep else (None,))
    }
    copy_bw = _copy_bandwidth()
    torch.cuda.empty_cache()
    print(
        f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)"
    )
    rows = []
    for label, out, inp, *mode in BENCH_SHAPES:
        rows.append(_bench_shape(label, out, inp, dtype, group, copy_bw, linears, *mode))
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
                    want = torch.argmax(ic.linear(x, w, b, norm=norm), dim=-1)
                    out = torch.full((tokens,), -7, dtype=torch.int64, device="cuda")
                    got, names = launched(ic, ic.argmax, x, w, b, out=out, norm=norm)
                    case = f"T{tokens} bias={b is not None} shift={shift} norm={norm is not None}"
                    assert got is out and torch.equal(out, want), case
                    mode = "int8_gemv_norm_argmax_" if norm is not None else "int8_gemv_argmax_"
                    assert by_kind(names) == {mode: 1, "int8_argmax_take": 1}, f"{case}: {dict(names)}"
    # A tie: the winning row copied to a lower and a higher row; the lowest one wins.
    x = (torch.randn(1, inp, generator=g, device="cuda") * 3).to(dtype)
    win = int(torch.argmax(ic.linear(x, w)))
    rows_tied = sorted({win, max(0, win - 3), min(rows - 1, win + 2)})
    for r in rows_tied:
        w.weight[r].copy_(w.weight[win])
        w.scale[r].copy_(w.scale[win])
    assert int(ic.argmax(x, w)[0]) == rows_tied[0] == int(torch.argmax(ic.linear(x, w)))
    # float32 activations: no GEMV is planned for them (the backend's plan takes the
    # reference linear, whose logits the caller reduces), and asking anyway raises.
    assert weight_support(w, torch.float32) is not None
    with pytest.raises(UnplannedArguments):
        ic.argmax(x.float(), w)


def test_greedy_graph_decode_takes_the_token_from_the_lm_head(tmp_path) -> None:
    """An int8 model with its own (int8) lm_head decodes greedily through the graph
    with the argmax epilogue: the replay runs the argmax GEMV (the final norm folded
    in) and its take, not torch's argmax, no separate norm and no fill (the kernels'
    workspaces are made before capture); the tokens equal eager decode's, which takes
    the argmax of the logits. The kernels the captured step launches, recorded at
    capture, are exactly the fused int8 plan's."""
    from torch.profiler import ProfilerActivity, profile

    from edge.runtime.engine import Engine
    from edge.model.random_model import make_model
    from edge.sampling import SamplingParams

    path = make_model(tmp_path / "m", preset="tiny", tie_word_embeddings=False, dtype="bfloat16")
    graph = Engine.from_pretrained(
        path, device="cuda", dtype="bfloat16", quantize="int8", cuda_graph=True, kernels="cuda", num_blocks=64
    )
    eager = Engine(graph.model, graph.tokenizer, graph.model_dir, cuda_graph=False, kernels="cuda", num_blocks=64)
    assert isinstance(graph.model.lm_head, Int8Weight)
    assert isinstance(graph.backend.graph.linears.impls[QUANT_METHOD], Int8CudaLinear)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompt = "The kiosk robot greets every visitor"
    tokens = graph.generate(prompt, params).token_ids
    assert tokens == eager.generate(prompt, params).token_ids
    decoder = graph._decoders[0]
    (step,) = decoder.graphs.values()
    layers = graph.cfg.num_layers
    # Per layer: the qkv GEMV with the norm (few SMs: its stage and the paired tensor-core
    # kernel), attention with q/k norm + RoPE + K/V store,
    # o and down GEMVs adding into the residual, the gate_up GEMV with norm + SwiGLU;
    # then the lm_head's argmax GEMV (final norm folded in), its take, and the step end.
    assert set(decoder.captured_kernels) == {(True, False)}
    assert by_kind(decoder.captured_kernels[(True, False)]) == {
        "embedding": 1,
        **{kind: n * layers for kind, n in qkv_kinds(graph.backend.int8_tuning).items()},
        "paged_decode_tc_rope": layers,
        "int8_gemv_residual_": 2 * layers,
        gate_up_kind(graph.backend.int8_tuning): layers,
        "int8_gemv_norm_argmax_": 1,
        "int8_argmax_take": 1,
        "decode_step_end": 1,
    }
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("int8_gemv_norm_argmax" in n for n in names) == 1, names
    assert sum("int8_argmax_take" in n for n in names) == 1, names
    assert not [n for n in names if "reduce_kernel" in n or "Fill" in n or "rms_norm" in n], names
