"""The prefill chunk of quantized models (edge.runtime.budget.default_prefill_chunk), its wiring
into the engine, the KV budget and the scheduler, and the chunked expand-then-multiply
of edge.kernels.dequant_cuda.expanded_linear, all on the CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edge.runtime.backend import reference_backend
from edge.runtime.budget import (
    EXPANDED_PREFILL_CHUNK,
    FLOAT_PREFILL_CHUNK,
    PREFILL_MEMORY_SHARE,
    MemoryInfo,
    chunk_activation_bytes,
    default_prefill_chunk,
    estimate_activation_bytes,
    plan_kv_budget,
)
from edge.model.config import ModelConfig
from edge.runtime.engine import Engine
from edge.quant.int4 import DEQUANT_CHUNK_ELEMENTS as INT4_CHUNK_ELEMENTS
from edge.quant.int4 import Int4ReferenceLinear, Int4Weight, pack_weight, quantize_rtn
from edge.kernels.dequant_cuda import expanded_linear
from edge.quant.linear import Int8ReferenceLinear, Linears
from edge.model.decoder import Model
from edge.quant.q8_0 import Int8Weight, quantize_tensor
from edge.model.random_model import make_model, model_config
from edge.scheduling.loop import Scheduler
from edge.scheduling.pacing import Pacing
from tests.test_scheduler_policy import Device, run_chunks

GiB = 1 << 30


def _cfg(preset: str) -> ModelConfig:
    return ModelConfig.from_dict(model_config(preset=preset))


# -- the policy -------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"])
@pytest.mark.parametrize("available_gib", [0.5, 1.5, 4, 80])
def test_quantized_chunk_is_the_longest_whose_activations_fit_the_share(preset: str, available_gib: float) -> None:
    cfg = _cfg(preset)
    mem = MemoryInfo("integrated", 64 * GiB, int(available_gib * GiB))
    chunk = default_prefill_chunk(cfg, torch.bfloat16, 4096, True, mem)
    assert FLOAT_PREFILL_CHUNK <= chunk <= EXPANDED_PREFILL_CHUNK
    share = mem.available * PREFILL_MEMORY_SHARE
    if chunk > FLOAT_PREFILL_CHUNK:
        assert chunk_activation_bytes(cfg, chunk, torch.bfloat16) <= share
    if chunk < EXPANDED_PREFILL_CHUNK:
        assert chunk_activation_bytes(cfg, 2 * chunk, torch.bfloat16) > share


def test_chunk_follows_the_weights_and_the_context() -> None:
    cfg = _cfg("qwen3-8b")
    big = MemoryInfo("discrete", 80 * GiB, 70 * GiB)
    assert default_prefill_chunk(cfg, torch.bfloat16, 4096, False, big) == FLOAT_PREFILL_CHUNK
    assert default_prefill_chunk(cfg, torch.bfloat16, 4096, True, big) == EXPANDED_PREFILL_CHUNK
    assert default_prefill_chunk(cfg, torch.bfloat16, 4096, True, None) == EXPANDED_PREFILL_CHUNK
    assert default_prefill_chunk(cfg, torch.bfloat16, 1000, True, big) == 1000  # no longer than a context
    assert default_prefill_chunk(cfg, torch.bfloat16, 100, True, big) == FLOAT_PREFILL_CHUNK
    # Activations scale with the tokens and the element size.
    one = chunk_activation_bytes(cfg, 1, torch.bfloat16)
    assert chunk_activation_bytes(cfg, 2048, torch.bfloat16) == 2048 * one
    assert chunk_activation_bytes(cfg, 1, torch.float32) == 2 * one
    # The MLP's intermediates at least: gate_up and the SwiGLU product.
    assert one >= 3 * cfg.intermediate_size * 2


# -- the engine, its budget and the scheduler ------------------------------------------


class ExpandingInt8(Int8ReferenceLinear):
    """The int8 reference linear declared as one that expands its weights per forward
    (as the CUDA int8 / int4 prefill does), so the CPU engine takes the longer chunk."""

    expands_weights = True


def _expanding_backend():
    ref = reference_backend("cpu")
    impls = dict(ref.eager.linears.impls)
    impls["q8_0"] = ExpandingInt8(ref.eager.layer)
    return dataclasses.replace(ref, eager=dataclasses.replace(ref.eager, linears=Linears(impls)))


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = make_model(tmp_path_factory.mktemp("chunk-model"), preset="tiny", seed=0, num_hidden_layers=2)
    cfg = ModelConfig.from_pretrained(path)
    return Model.load(path, cfg, torch.device("cpu"), torch.float32, 4096, quantize="int8", quant_group_size=32)


def test_linears_say_which_weights_expand(int8_model: Model) -> None:
    layers = [w for n, w in int8_model.w.items() if n.startswith("model.layers.") and isinstance(w, Int8Weight)]
    assert layers
    assert not reference_backend("cpu").eager.linears.expands(layers)
    assert _expanding_backend().eager.linears.expands(layers)
    assert not _expanding_backend().eager.linears.expands([torch.zeros(4, 4)])


def test_engine_takes_the_longer_chunk_and_budgets_its_activations(int8_model: Model) -> None:
    mem = MemoryInfo("cpu", 64 * GiB, 8 * GiB, "fake")
    plain = Engine(int8_model, None, Path("."), max_seq_len=4096, memory_info=mem)
    assert plain.prefill_chunk == FLOAT_PREFILL_CHUNK  # the reference does not expand once a chunk
    e = Engine(int8_model, None, Path("."), max_seq_len=4096, memory_info=mem, backend=_expanding_backend())
    want = default_prefill_chunk(int8_model.cfg, torch.float32, 4096, True, mem)
    assert e.prefill_chunk == want == EXPANDED_PREFILL_CHUNK and e.info()["prefill_chunk"] == want
    # The KV budget counts the activations of the chunk the engine runs.
    assert e.budget.activations > plain.budget.activations
    assert Engine(int8_model, None, Path("."), max_seq_len=4096, memory_info=mem, prefill_chunk=64,
                  backend=_expanding_backend()).prefill_chunk == 64  # an explicit chunk wins
    # Memory too small for the long chunk's activations: back to the float chunk.
    small = MemoryInfo("cpu", 64 * GiB, 16 * chunk_activation_bytes(int8_model.cfg, 1024, torch.float32) - 1, "fake")
    e_small = Engine(int8_model, None, Path("."), max_seq_len=4096, memory_info=small, kv_blocks=300,
                     backend=_expanding_backend())
    assert e_small.prefill_chunk == FLOAT_PREFILL_CHUNK


def test_a_prompt_in_one_long_chunk_matches_short_chunks(int8_model: Model) -> None:
    mem = MemoryInfo("cpu", 64 * GiB, 8 * GiB, "fake")
    long = Engine(int8_model, None, Path("."), max_seq_len=4096, memory_info=mem, backend=_expanding_backend())
    short = Engine(int8_model, None, Path("."), max_seq_len=4096, memory_info=mem, prefill_chunk=96)
    ids = torch.randint(3, int8_model.cfg.vocab_size, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    a, b = long.score(ids), short.score(ids)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_background_prefill_stays_paced_with_the_longer_chunk(int8_model: Model) -> None:
    """The scheduler's background chunks are time-budgeted whatever the engine's chunk:
    with an expansion paid once a chunk (the fixed cost) they settle on the largest
    chunk that fits the budget, far below the foreground chunk. (Where the expansion
    alone takes more than half the budget, chunks grow past it to amortise it:
    test_scheduler_policy.py, fixed cost.)"""
    mem = MemoryInfo("cpu", 64 * GiB, 8 * GiB, "fake")
    e = Engine(int8_model, None, Path("."), max_seq_len=4096, memory_info=mem, backend=_expanding_backend())
    sched = Scheduler(e)
    assert sched.policy.foreground_chunk == e.prefill_chunk == EXPANDED_PREFILL_CHUNK
    assert sched.policy.pacing.max_chunk == e.prefill_chunk
    device = Device(a=0.004, b=0.00003)  # the expansion, then a per-token cost
    pacing = Pacing(max_chunk=e.prefill_chunk, budget_s=0.012)
    sizes = run_chunks(pacing, device, 20)
    assert sizes[0] == pacing.granule
    final = sizes[-1]
    assert sizes[-3:] == [final] * 3
    fits = (0.012 - device.a) / device.b  # the chunk that takes the budget
    assert device.chunk(final) <= 0.012 and final > fits / 2
    assert final < e.prefill_chunk


# -- budgets of the expansion temporaries ------------------------------------------------


def test_cpu_budget_counts_the_int4_expansion(int8_model: Model) -> None:
    """The CPU estimate adds the largest reference expansion of int8 and int4 weights."""
    cfg = int8_model.cfg
    w4 = {}
    for name, w in int8_model.w.items():
        if isinstance(w, Int8Weight):
            w4[name] = pack_weight([quantize_rtn(w.dequantize(), 32)], "cpu", name)
        else:
            w4[name] = w
    m4 = Model(cfg, w4, 4096)
    mem = MemoryInfo("cpu", 64 * GiB, 8 * GiB, "fake")
    got = plan_kv_budget(m4, None, page_size=16, max_seq_len=4096, prefill_chunk=512, memory=mem).activations
    largest = max(w.packed.shape[0] * 16 * w.in_features for w in w4.values() if isinstance(w, Int4Weight))
    elements = min(largest, INT4_CHUNK_ELEMENTS)
    assert got == estimate_activation_bytes(cfg, 512, 4096, torch.float32, elements)
    assert got > estimate_activation_bytes(cfg, 512, 4096, torch.float32, 0)


# -- expanded_linear -----------------------------------------------------------------------


@pytest.mark.parametrize("step", [16, 48, 4096])
@pytest.mark.parametrize("bias", [False, True])
def test_expanded_linear_is_the_linear_of_the_expanded_weight(step: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(step)
    q, s = quantize_tensor(torch.randn(200, 128, generator=g), 32)
    w = Int8Weight(q, s, 32)
    full = w.dequantize()
    stored = torch.cat([full, torch.full((8, 128), float("nan"))])  # padding rows past out_features
    x = torch.randn(2, 37, 128, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    calls = []

    def expand(r0: int, r1: int, buf: torch.Tensor) -> torch.Tensor:
        calls.append((r0, r1))
        assert buf.shape == (r1 - r0, 128) and buf.dtype == x.dtype
        return buf.copy_(stored[r0:r1])

    y = expanded_linear(x, 200, 208, step, expand, b)
    assert torch.allclose(y, F.linear(x, full, b), rtol=1e-5, atol=1e-5)
    rows = [r for r0, r1 in calls for r in range(r0, r1)]
    assert rows[: 200] == list(range(200))  # every row expanded once, in order
    assert len(calls) == (1 if step >= 208 else -(-200 // step))


def test_int4_reference_and_expanded_linear_agree() -> None:
    g = torch.Generator().manual_seed(5)
    w = pack_weight([quantize_rtn(torch.randn(100, 256, generator=g), 64)], "cpu")
    x = torch.randn(9, 256, generator=g)
    deq = w.dequantize_blocks(0, w.packed.shape[0])

    def expand(r0: int, r1: int, buf: torch.Tensor) -> torch.Tensor:
        return buf.copy_(deq[r0:r1])

    y = expanded_linear(x, w.out_features, w.packed.shape[0] * 16, 32, expand)
    ref = Int4ReferenceLinear().linear(x, w)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
