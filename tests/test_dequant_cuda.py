"""The prefill expansion kernels (edge/kernels/dequant.cu) against the torch references'
dequantization, bit for bit, into NaN-poisoned buffers; the int8 and int4 prefill
linears built on them against the reference linears; the engine's longer prefill chunk
for quantized weights on the GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]

from edge.kernels import reference  # noqa: E402
from edge.quant.q8_0 import Int8Weight, int8_linear_reference, quantize_tensor  # noqa: E402
from tests.test_int4_cuda import random_weight  # noqa: E402

DTYPES16 = (torch.float16, torch.bfloat16)
TOL_REF = {torch.float16: 7.5e-4, torch.bfloat16: 3.75e-3}  # cuBLAS kernels may differ per output width


@pytest.fixture(scope="module")
def dq():
    from edge.kernels.dequant_cuda import DequantCuda
    from edge.kernels.launcher import Launcher
    from edge.kernels.nvrtc import KernelsUnavailable

    try:
        return DequantCuda(Launcher(torch.cuda.current_device()))
    except KernelsUnavailable as exc:  # pragma: no cover - reported, not hidden
        pytest.fail(f"GPU present but the dequant kernels are unavailable: {exc}")


@pytest.mark.parametrize("scale_dtype", (torch.float16, torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("zero", [True, False], ids=["zero", "symmetric"])
def test_int4_expansion_is_the_reference_bit_for_bit(dq, scale_dtype, zero) -> None:
    g = torch.Generator(device="cuda").manual_seed(11)
    for out, inp, group, act_order in ((1000, 1024, 128, True), (4096, 4096, 128, False), (40, 64, 64, False),
                                       (300, 768, 256, False)):
        w = random_weight(out, inp, group, g, zero=zero, act_order=act_order, scale_dtype=scale_dtype)
        blocks = w.packed.shape[0]
        for rb0, rb1 in ((0, blocks), (1, min(blocks, 7)), (blocks - 1, blocks)):
            rows = 16 * (rb1 - rb0)
            for dtype in DTYPES16:
                # One poisoned row past the range: the kernel must write exactly its rows.
                buf = torch.full((rows + 1, inp), float("nan"), dtype=dtype, device="cuda")
                dq.int4(w, rb0, rb1, buf[:rows])
                torch.cuda.synchronize()
                assert torch.equal(buf[:rows], w.dequantize_blocks(rb0, rb1, dtype)), (out, inp, rb0, rb1, dtype)
                assert torch.isnan(buf[rows]).all()


@pytest.mark.parametrize("group", [16, 32, 128])
def test_int8_expansion_is_the_reference_bit_for_bit(dq, group) -> None:
    g = torch.Generator(device="cuda").manual_seed(group)
    for rows, cols in ((1000, 1024), (4096, 4096), (24, 512), (151936 // 8, 1024)):
        q, s = quantize_tensor(torch.randn(rows, cols, generator=g, device="cuda"), group)
        w = Int8Weight(q, s, group)
        for r0, r1 in ((0, rows), (3, rows - 5), (rows - 1, rows)):
            for dtype in DTYPES16:
                buf = torch.full((r1 - r0 + 1, cols), float("nan"), dtype=dtype, device="cuda")
                dq.int8(w, r0, r1, buf[: r1 - r0])
                torch.cuda.synchronize()
                # The reference linear's expansion: int8 x float32 scale in float32, one rounding.
                want = torch.empty(r1 - r0, cols, dtype=dtype, device="cuda")
                torch.mul(q[r0:r1].view(r1 - r0, cols // group, group), s[r0:r1].unsqueeze(-1),
                          out=want.view(r1 - r0, cols // group, group))
                assert torch.equal(buf[: r1 - r0], want), (rows, cols, r0, r1, dtype)
                assert torch.equal(buf[: r1 - r0], w.dequantize(torch.float32)[r0:r1].to(dtype))
                assert torch.isnan(buf[r1 - r0]).all()


def test_expansion_rejects_bad_buffers(dq) -> None:
    q, s = quantize_tensor(torch.randn(64, 256, device="cuda"), 32)
    w = Int8Weight(q, s, 32)
    with pytest.raises(ValueError, match="out must be"):
        dq.int8(w, 0, 64, torch.empty(64, 256, dtype=torch.float32, device="cuda"))
    with pytest.raises(ValueError, match="out must be"):
        dq.int8(w, 0, 64, torch.empty(32, 256, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="outside"):
        dq.int8(w, 10, 65, torch.empty(55, 256, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("chunk_rows", [None, 96], ids=["one-piece", "row-chunks"])
def test_int8_prefill_matches_the_reference(dtype, chunk_rows) -> None:
    from edge.kernels.int8_cuda import Int8CudaLinear, Int8Tuning
    from edge.kernels.launcher import Launcher

    # chunk_rows: the row chunks of a large weight, on a small one.
    tuning = Int8Tuning() if chunk_rows is None else Int8Tuning(dequant_chunk=chunk_rows * 1024)
    lin = Int8CudaLinear(Launcher(torch.cuda.current_device()), reference, tuning)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, s = quantize_tensor(torch.randn(1000, 1024, generator=g, device="cuda"), 128)
    w = Int8Weight(q, s, 128)
    x = torch.randn(77, 1024, generator=g, device="cuda").to(dtype)
    bias = torch.randn(1000, generator=g, device="cuda").to(dtype)
    for b in (None, bias):
        y = lin.linear(x, w, b)
        ref = int8_linear_reference(x, w, b)
        assert y.shape == ref.shape and y.dtype == dtype and torch.isfinite(y).all()
        rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel < TOL_REF[dtype], rel


def test_quantized_engines_prefill_in_one_long_chunk(tmp_path) -> None:
    """On the GPU a quantized model's engine takes the longer chunk and its prompts
    score as on the torch reference (512-token chunks)."""
    from edge.runtime.budget import EXPANDED_PREFILL_CHUNK, FLOAT_PREFILL_CHUNK
    from edge.runtime.engine import Engine
    from tests.conftest import build_hf_model

    build_hf_model("Qwen3ForCausalLM", tmp_path, hidden_size=256, intermediate_size=512, tie_word_embeddings=False)
    ids = torch.randint(3, 200, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    for quantize in ("int8", "int4"):
        # Explicit pools: the first engine's default pool would leave the second little memory
        # to plan its chunk from when the process has a share of the GPU.
        kw = dict(device="cuda", dtype="bfloat16", quantize=quantize, quant_group_size=64, max_seq_len=2048,
                  num_blocks=2 * 2048 // 16)
        cuda = Engine.from_pretrained(tmp_path, **kw)
        ref = Engine.from_pretrained(tmp_path, kernels="reference", **kw)
        assert cuda.prefill_chunk == EXPANDED_PREFILL_CHUNK and ref.prefill_chunk == FLOAT_PREFILL_CHUNK
        a, b = cuda.score(ids), ref.score(ids)
        assert ((a - b).norm() / b.norm()).item() < 2e-2, quantize
