"""Overlapped launches (programmatic dependent launch, sm_90+) in a captured decode step.

Through a launcher's ``overlapped()`` sibling each kernel may start while the previous
one is finishing, so it must read nothing the previous kernel writes before its
grid-dependency wait. An int8 decoder layer (norm + qkv GEMV, q/k norm + RoPE storing k
and v in the pool, attention over the pool, o GEMV + residual, norm + gate_up GEMV +
SwiGLU, down GEMV + residual) is captured with the overlapped sibling's kernels and
replayed at positions on and around page boundaries; every replay must equal the same
launches made eagerly through the serial launcher, one after the other, bit for bit:
the residual stream, the attention output and the pool rows.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from edge.kernels import reference
from edge.kernels.reference import PagedKV
from edge.quant.q8_0 import Int8Weight, quantize_tensor

HEADS, KV_HEADS, D, HIDDEN, INTER, PAGE, MAX_LEN = 32, 8, 128, 2048, 4096, 16, 8192
EPS = 1e-6
DT = torch.bfloat16


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    """One backend's layer kernels on a serial launcher, and the same kernels on its
    overlapped sibling (what ``select_backend`` builds for the captured step)."""
    from edge.kernels.fused_cuda import FusedCuda
    from edge.kernels.int8_cuda import Int8CudaLinear
    from edge.kernels.launcher import Launcher
    from edge.kernels.nvrtc import KernelsUnavailable
    from edge.kernels.paged_cuda import DecodeTuning, PagedAttentionCuda

    try:
        launcher = Launcher(torch.cuda.current_device())
        fc = FusedCuda(launcher)
        ic = Int8CudaLinear(launcher, reference)
        pc = PagedAttentionCuda(launcher, reference, DecodeTuning(), dtypes=(DT,), head_dims=(D,))
    except KernelsUnavailable as exc:  # pragma: no cover - reported, not hidden
        pytest.fail(f"GPU present but the CUDA kernels are unavailable: {exc}")
    ol = launcher.overlapped()
    return {
        "launcher": launcher,
        "serial": (fc, ic, pc),
        "overlapped": (fc.with_launcher(ol), ic.with_launcher(ol, reference), pc.with_launcher(ol, reference)),
    }


def test_overlap_is_used_where_the_gpu_has_it(kernels) -> None:
    from edge.kernels import nvrtc

    major, _ = torch.cuda.get_device_capability()
    try:
        nvrtc.core().LaunchConfig(grid=(1,), block=(32,), programmatic_stream_serialization=True)
        cuda_core_has_it = True
    except TypeError:
        cuda_core_has_it = False
    assert nvrtc.overlap_supported(0) == (major >= 9 and cuda_core_has_it)
    launcher = kernels["launcher"]
    assert not launcher.overlap, "eager launches never overlap"
    assert launcher.overlapped().overlap == nvrtc.overlap_supported(torch.cuda.current_device())
    for serial, overlapped in zip(kernels["serial"], kernels["overlapped"]):
        assert serial.launcher is launcher and overlapped.launcher is not launcher
        assert overlapped.launcher.overlap == launcher.overlapped().overlap
        assert overlapped.launcher.counts is launcher.counts, "siblings share one launch count"


def _weight(out: int, inp: int, g: torch.Generator) -> Int8Weight:
    w = torch.randn(out, inp, generator=g, device="cuda") / inp**0.5
    q, s = quantize_tensor(w, 128)
    return Int8Weight(q, s, 128)


def test_overlapped_layer_step_equals_serial_launches(kernels) -> None:
    counts = kernels["launcher"].counts
    g = torch.Generator(device="cuda").manual_seed(11)
    w_qkv = _weight((HEADS + 2 * KV_HEADS) * D, HIDDEN, g)
    w_o = _weight(HIDDEN, HEADS * D, g)
    w_gu = _weight(2 * INTER, HIDDEN, g)
    w_down = _weight(HIDDEN, INTER, g)
    ln1, ln2 = ((1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).to(DT) for _ in range(2))
    qk_w = (1 + 0.1 * torch.randn(HEADS + KV_HEADS, D, generator=g, device="cuda")).to(DT)
    cos, sin = (torch.rand(MAX_LEN, D, generator=g, device="cuda").to(DT) for _ in range(2))  # any table
    blocks = MAX_LEN // PAGE
    table = torch.randperm(blocks, generator=g, device="cuda").to(torch.int32)
    pool = torch.randn(2, blocks, PAGE, KV_HEADS, D, generator=g, device="cuda").to(DT)

    def state() -> dict[str, torch.Tensor]:
        return {
            "h": torch.zeros(1, HIDDEN, device="cuda", dtype=DT),
            "pos": torch.zeros(1, device="cuda", dtype=torch.int32),
            "k": pool[0].clone(),
            "v": pool[1].clone(),
            "attn": torch.empty(HEADS, D, device="cuda", dtype=DT),
        }

    def step(ops: tuple, s: dict[str, torch.Tensor]) -> Counter[str]:
        """One layer through ``ops`` (fused, int8 linear, attention); the launches by name."""
        fc, ic, pc = ops
        before = Counter(counts)
        h = s["h"]
        positions = s["pos"].long()
        qkv = ic.linear(h, w_qkv, norm=(ln1, EPS))
        q, _ = fc.qk_norm_rope(qkv, qk_w, cos, sin, positions, HEADS, KV_HEADS, D, EPS, PagedKV(s["k"], s["v"], table))
        pc.decode_attention(q[0], s["k"], s["v"], table, MAX_LEN, D**-0.5, pos=s["pos"], out=s["attn"])
        ic.linear(s["attn"].view(1, -1), w_o, residual=h)
        act = ic.linear(h, w_gu, norm=(ln2, EPS), swiglu=True)
        ic.linear(act, w_down, residual=h)
        return Counter(counts) - before

    serial, overlapped = state(), state()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(kernels["overlapped"], state())  # warm-up on the capture stream: its workspaces exist before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = step(kernels["overlapped"], overlapped)
    assert sum(captured.values()) == 6, f"one launch per op, nothing composed: {captured}"

    # 6299: the newest row lies in the second stage of its split (8-warp CTAs; 2147 and
    # 6299 at 4 warps: second / third), which attention issues before its
    # grid-dependency wait (all but that row)
    for p in (0, 1, 15, 16, 17, 63, 64, 65, 300, 511, 512, 2147, 6299, MAX_LEN - 1):
        h = torch.randn(1, HIDDEN, generator=g, device="cuda").to(DT)
        for s in (serial, overlapped):
            s["h"].copy_(h)
            s["pos"].fill_(p)
            s["attn"].fill_(float("nan"))
        assert step(kernels["serial"], serial) == captured, "the serial step launches other kernels"
        graph.replay()
        torch.cuda.synchronize()
        for name in ("h", "attn", "k", "v"):
            assert torch.equal(serial[name], overlapped[name]), f"{name} differs at position {p}"
        assert not torch.isnan(overlapped["h"]).any()
