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
    saved = dict(quant._INT8_LINEAR)
    yield
    quant._INT8_LINEAR.clear()
    quant._INT8_LINEAR.update(saved)


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
]
SWEEP = [
    {},
    {"EDGE_INT8_WARPS": 8},
    {"EDGE_INT8_UNROLL_R1": 8, "EDGE_INT8_UNROLL_R2": 4, "EDGE_INT8_UNROLL_R4": 4},
    {"EDGE_INT8_UNROLL_R1": 2, "EDGE_INT8_UNROLL_R2": 2, "EDGE_INT8_UNROLL_R4": 1},
    {"EDGE_INT8_MIN_BLOCKS": 6},
    {
        "EDGE_INT8_WARPS": 8,
        "EDGE_INT8_UNROLL_R1": 2,
        "EDGE_INT8_UNROLL_R2": 2,
        "EDGE_INT8_UNROLL_R4": 1,
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


def _graph_us(fn, launches: int, replays: int = 20) -> float:
    """Median microseconds per launch of ``fn`` (which launches once per call) over
    replays of a CUDA graph of ``launches`` calls: no Python or launch overhead, only
    the kernels and the graph's node-to-node gaps, as in captured decode."""
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
    sweep: bool,
) -> dict:
    from edge.kernels import int8_cuda

    g = torch.Generator(device="cuda").manual_seed(out * 7 + inp)
    # Enough copies of the weight, cycled, that no launch finds its weight in L2.
    copies = max(2, min(16, (512 << 20) // (out * inp)))
    ws = [random_weight(out, inp, group, g) for _ in range(copies)]
    x = torch.randn(1, inp, generator=g, device="cuda").to(dtype)
    y = torch.empty(1, out, dtype=dtype, device="cuda")
    moved = out * inp + ws[0].scale.numel() * 4 + (inp + out) * x.element_size()
    it = [0]

    def call() -> None:
        int8_cuda.int8_linear(x, ws[it[0] % copies], out=y)
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
    for label, out, inp in BENCH_SHAPES:
        rows.append(_bench_shape(label, out, inp, dtype, group, copy_bw, sweep))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print(f"fraction of copy bandwidth ({dtype}, group {group}, default tuning):")
    for row in rows:
        print(
            f"  {row['shape']:<14} {row['out']:>6}x{row['in']:<6} {row['us']:>8.1f} us "
            f"{row['GBps']:>7.0f} GB/s  {row['t0']:.3f}  (r{row['rows_per_warp']}; reference {row['ref_us']} us)"
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
