"""The CUDA GGUF kernels (edge/kernels/gguf_gemv.cu) vs the torch reference.

Random blocks of every type the kernels read (random codes and scale bytes, float16
scales of a chosen magnitude), shapes of real models, float16 and bfloat16
activations. The GEMV multiplies every weight's exact value in float32, so it is
compared elementwise with a float64 oracle (the reference's float32 dequantization,
multiplied in float64) and as a vector with :class:`edge.quant.gguf.GGUFReferenceLinear`
(weights rounded to the activation dtype first); the prefill dequantization is the
reference's bit for bit. An engine on random GGUF weights (mixed types, as in a
Q4_K_M file) runs its decode graphs against the same model on the torch reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]

from gguf import GGMLQuantizationType  # noqa: E402
from gguf_support import random_rows  # noqa: E402

from edge.kernels import reference  # noqa: E402
from edge.quant.gguf import GGUFPart, GGUFReferenceLinear, GGUFWeight, dequantize_rows  # noqa: E402

TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
DTYPES16 = (torch.float16, torch.bfloat16)
# (out, in): 8B o, 8B down, a 0.6B-wide projection with a ragged row count.
SHAPES = [(4096, 4096), (4096, 12288), (1000, 1024)]
RTOL_ORACLE = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
TOL_REF = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
_seed = [4242]


def _gen() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator(device="cuda").manual_seed(_seed[0])


def part(name: str, rows: int, cols: int) -> GGUFPart:
    _seed[0] += 1
    # Scales small enough that 6-bit sub-scales times codes stay near unit weights.
    scale = 1e-3 if name in ("Q4_K", "Q5_K", "Q6_K") else 2e-2
    data = torch.from_numpy(random_rows(name, rows, cols, seed=_seed[0], scale=scale)).cuda()
    return GGUFPart(int(GGMLQuantizationType[name]), data)


def weight(names: str | tuple[str, ...], rows: int | tuple[int, ...], cols: int) -> GGUFWeight:
    names = (names,) if isinstance(names, str) else names
    rows = (rows,) * len(names) if isinstance(rows, int) else rows
    return GGUFWeight([part(n, r, cols) for n, r in zip(names, rows)], cols)


@pytest.fixture(scope="module")
def lin():
    from edge.kernels.gguf_cuda import GGUFCudaLinear
    from edge.kernels.launcher import Launcher
    from edge.kernels.nvrtc import KernelsUnavailable

    try:
        return GGUFCudaLinear(Launcher(torch.cuda.current_device()), reference)
    except KernelsUnavailable as exc:  # pragma: no cover - reported, not hidden
        pytest.fail(f"GPU present but the GGUF kernels are unavailable: {exc}")


def oracle(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double().reshape(-1, w.in_features) @ w.dequantize(torch.float32).double().T
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], w.out_features)


def check(y: torch.Tensor, x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None, label: str) -> None:
    assert y.dtype == x.dtype and tuple(y.shape) == (*x.shape[:-1], w.out_features), label
    assert torch.isfinite(y).all(), f"{label}: non-finite outputs (unwritten NaN poison?)"
    o = oracle(x, w, bias)
    err = (y.double() - o).abs()
    bound = RTOL_ORACLE[x.dtype] * o.abs() + 1e-5 * o.abs().max()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{label}: max |y - oracle| {err.max().item():.3g} exceeds the bound by {worst:.3g}"
    ref = GGUFReferenceLinear().linear(x, w, bias).double()
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < TOL_REF[x.dtype], f"{label}: relative error vs reference {rel:.3g}"


def run(lin, x, w, bias=None, **kw):  # noqa: ANN001, ANN201
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
@pytest.mark.parametrize("name", TYPES)
def test_gemv_matches_oracle(lin, name, shape, dtype) -> None:
    g = _gen()
    out, inp = shape
    w = weight(name, out, inp)
    for tokens in (1, 3, 8):
        x = torch.randn(tokens, inp, generator=g, device="cuda").to(dtype)
        bias = torch.randn(out, generator=g, device="cuda").to(dtype)
        check(run(lin, x, w, bias), x, w, bias, f"{name} {shape} t{tokens} {dtype}")
        check(run(lin, x, w), x, w, None, f"{name} {shape} t{tokens} {dtype} no bias")


def _fused_ref(x, w, bias=None, **kw):  # noqa: ANN001, ANN201
    from edge.quant.q8_0 import fused_linear_reference

    return fused_linear_reference(x, w, bias, matmul=GGUFReferenceLinear().matmul, **kw)


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("name", TYPES)
def test_fused_modes_match_the_composition(lin, name, dtype, tokens) -> None:
    g = _gen()
    hidden, inter = 2048, 1536
    x = (torch.randn(tokens, hidden, generator=g, device="cuda") * 3).to(dtype)
    ln = (torch.rand(hidden, generator=g, device="cuda") + 0.5).to(dtype)
    norm = (ln, 1e-6)
    qkv = weight(name, 3072, hidden)
    gate_up = weight(name, 2 * inter, hidden)
    down = weight(name, hidden, inter)
    tol = TOL_REF[dtype]

    def close(a, b, label):  # noqa: ANN001
        assert torch.isfinite(a).all(), label
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert rel < tol, f"{name} {label}: {rel:.3g}"

    close(run(lin, x, qkv, norm=norm), _fused_ref(x, qkv, norm=norm), "norm")
    close(run(lin, x, gate_up, norm=norm, swiglu=True), _fused_ref(x, gate_up, norm=norm, swiglu=True), "norm+swiglu")
    close(run(lin, x, gate_up, swiglu=True), _fused_ref(x, gate_up, swiglu=True), "swiglu")
    a = torch.randn(tokens, inter, generator=g, device="cuda").to(dtype)
    r0 = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    r1 = r0.clone()
    y = run(lin, a, down, residual=r1)
    assert y.data_ptr() == r1.data_ptr()
    close(r1, _fused_ref(a, down, residual=r0.clone()), "residual")
    for nm in (None, norm):
        ids = lin.argmax(x, qkv, norm=nm)
        assert torch.equal(ids, torch.argmax(run(lin, x, qkv, norm=nm), dim=-1)), f"{name} argmax norm={nm is not None}"


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
def test_parts_of_several_types(lin, dtype) -> None:
    """q/k/v of a Q4_K_M layer: Q4_K, Q4_K, Q6_K parts, a launch each into its columns;
    residual and SwiGLU over such a weight are composed."""
    g = _gen()
    w = weight(("Q4_K", "Q4_K", "Q6_K"), (4096, 1024, 1024), 4096)
    x = torch.randn(2, 4096, generator=g, device="cuda").to(dtype)
    bias = torch.randn(w.out_features, generator=g, device="cuda").to(dtype)
    check(run(lin, x, w, bias), x, w, bias, "mixed parts")
    ln = (torch.rand(4096, generator=g, device="cuda") + 0.5).to(dtype)
    y = run(lin, x, w, norm=(ln, 1e-6))
    ref = _fused_ref(x, w, norm=(ln, 1e-6))
    assert ((y.double() - ref.double()).norm() / ref.double().norm()).item() < TOL_REF[dtype]
    gu = weight(("Q4_K", "Q5_K"), (1024, 1024), 4096)
    y = lin.linear(x, gu, swiglu=True)
    ref = _fused_ref(x, gu, swiglu=True)
    assert ((y.double() - ref.double()).norm() / ref.double().norm()).item() < TOL_REF[dtype]
    assert lin.argmax(x, w) is None, "the logits of several parts are composed"


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_kernel_is_the_reference_bit_for_bit(lin, name) -> None:
    w = weight(name, 300, 1024)
    p = w.parts[0]
    for dtype in DTYPES16:
        out = torch.full((200, 1024), float("nan"), dtype=dtype, device="cuda")
        lin.dequantize(p, 1024, 50, 250, out)
        assert torch.equal(out, dequantize_rows(p.data[50:250], p.qtype, dtype)), f"{name} {dtype}"


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
def test_prefill_chunks(dtype) -> None:
    from edge.kernels.gguf_cuda import GGUFCudaLinear, GGUFTuning
    from edge.kernels.launcher import Launcher

    lin = GGUFCudaLinear(Launcher(torch.cuda.current_device()), reference, GGUFTuning(dequant_chunk=1 << 20))
    g = _gen()
    w = weight(("Q4_K", "Q6_K"), (3000, 1000), 2048)
    x = torch.randn(40, 2048, generator=g, device="cuda").to(dtype)
    bias = torch.randn(w.out_features, generator=g, device="cuda").to(dtype)
    y = lin.linear(x, w, bias)
    ref = GGUFReferenceLinear().linear(x, w, bias)
    assert ((y.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-3


def test_graph_capture_matches_eager(lin) -> None:
    g = _gen()
    w = weight(("Q4_K", "Q6_K"), (2048, 2048), 4096)
    gu = weight("Q5_K", 4096, 4096)
    x = torch.randn(1, 4096, generator=g, device="cuda").to(torch.bfloat16)
    ln = (torch.rand(4096, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    head = weight("Q6_K", 5000, 4096)

    def step():  # noqa: ANN202
        return lin.linear(x, w, norm=(ln, 1e-6)), lin.linear(x, gu, swiglu=True), lin.argmax(x, head, None, None)

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)


def test_unplanned_arguments_raise(lin) -> None:
    from edge.kernels.nvrtc import UnplannedArguments

    w = weight("Q4_K", 64, 256)
    x = torch.randn(1, 256, device="cuda").to(torch.bfloat16)
    with pytest.raises(UnplannedArguments):
        lin.linear(x, w, torch.zeros(63, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(UnplannedArguments):
        lin.linear(x.float(), w)


def test_gguf_engine_on_the_gpu_tracks_the_reference(tmp_path) -> None:
    """A random model on GGUF blocks mixed as in a Q4_K_M file (q/k Q4_K with v Q6_K,
    gate/up Q5_K, down Q6_K, Q6_K embedding tied to the lm_head): the CUDA engine
    (fused GEMV decode, graphs, dequantize + cuBLAS prefill) against the same weights on
    the torch reference."""
    from gguf_support import random_gguf_model

    from edge.runtime.engine import Engine
    from edge.sampling import SamplingParams

    model = random_gguf_model(tmp_path, torch.device("cuda"), torch.bfloat16)
    cuda = Engine(model, None, tmp_path, max_seq_len=256)
    ref = Engine(model, None, tmp_path, max_seq_len=256, kernels="reference")
    assert cuda.info()["backend"]["linears"]["gguf"].startswith("GGUF GEMV")
    assert cuda.cuda_graph
    ids = list(range(3, 60))
    a, b = cuda.score(ids), ref.score(ids)
    assert ((a - b).norm() / b.norm()).item() < 2e-2
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert cuda.generate(ids[:9], params).token_ids[:8] == ref.generate(ids[:9], params).token_ids[:8]
