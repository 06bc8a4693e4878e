"""CUDA-graph decode against eager decode on the GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from edge.runtime.engine import Engine
from edge.sampling import SamplingParams

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    graph = Engine.from_pretrained(device="cuda", dtype="bfloat16", page_size=16, cuda_graph=True, kernels="cuda")
    eager = Engine(graph.model, graph.tokenizer, graph.model_dir, page_size=16, cuda_graph=False, kernels="cuda")
    return graph, eager


PROMPT = "The kiosk robot greets every visitor and explains the paged cache"
TIE_GAP = 5e-2  # bf16: a top-2 logit gap under this may flip between two kernel plans


def assert_same_or_tie(engine: Engine, prompt: list[int], got: list[int], want: list[int]) -> None:
    """``got == want``, or they part where the model's top two logits are a bf16 near tie
    (the embedded model's random weights have some; the graph's fused kernels round
    differently from eager's). A real fault parts at a clear winner."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if at is None:
        assert got == want
        return
    logits = engine.score(prompt + want[:at])[-1]
    top2 = torch.topk(logits.float(), 2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < TIE_GAP, f"graph and eager part at token {at} ({got[at]} vs {want[at]}) with a top-2 gap of {gap:.3g}"


def test_graph_matches_eager_across_many_page_crossings(engines) -> None:
    graph, eager = engines
    params = SamplingParams(max_tokens=320, ignore_eos=True)
    synced = graph.kv.bytes_synced
    g = graph.generate(PROMPT, params)
    e = eager.generate(PROMPT, params)
    assert len(g.token_ids) == 320
    assert_same_or_tie(eager, graph.encode(PROMPT), g.token_ids, e.token_ids)
    prompt_len = len(graph.encode(PROMPT))
    crossings = (prompt_len + 320 - 1) // 16 + 1  # blocks the request touched, one 4-byte entry each
    # one entry per block, never a whole-table resend; +1 block for the speculative step past the end
    assert graph.kv.bytes_synced - synced <= 4 * (crossings + 1)


def test_back_to_back_requests_reuse_the_captured_graph(engines) -> None:
    graph, eager = engines
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = ["First question", "Second, longer question about the cache", "Third"]
    outs = [graph.generate(p, params).token_ids for p in prompts]
    decoder = graph._decoders[0]
    captured = dict(decoder.graphs)
    outs2 = [graph.generate(p, params).token_ids for p in prompts]
    assert outs == outs2
    assert decoder.graphs == captured, "graph recaptured between requests"
    assert outs == [eager.generate(p, params).token_ids for p in prompts]


@pytest.mark.parametrize("kw", [dict(temperature=0.8, seed=7), dict(temperature=1.0, top_k=20, top_p=0.9, seed=3, repetition_penalty=1.2)])
def test_seeded_sampling_is_reproducible_across_graph_and_eager(engines, kw) -> None:
    graph, eager = engines
    params = SamplingParams(max_tokens=64, ignore_eos=True, **kw)
    a = graph.generate(PROMPT, params).token_ids
    b = graph.generate(PROMPT, params).token_ids
    c = eager.generate(PROMPT, params).token_ids
    assert a == b == c


def test_stop_inside_pipelined_steps_frees_everything(engines) -> None:
    graph, _ = engines
    free = graph.kv.pool.num_free
    r = graph.generate(PROMPT, SamplingParams(max_tokens=17, ignore_eos=True))
    assert len(r.token_ids) == 17
    assert graph.kv.pool.num_free == free


def test_overlapped_and_serialised_launches_decode_the_same_tokens(engines) -> None:
    """``overlap_launches`` gives another backend: the captured step's kernels launch
    through the overlapped sibling launcher (where the GPU has it) or the eager one;
    both decode the same tokens and capture the same kernels."""
    from edge.kernels import nvrtc

    graph, _ = engines
    supported = nvrtc.overlap_supported(graph.device.index or 0)
    serial = Engine(
        graph.model, graph.tokenizer, graph.model_dir, page_size=16, cuda_graph=True, kernels="cuda",
        overlap_launches=False, num_blocks=64,
    )
    assert graph.backend.overlap_launches == supported == graph.info()["overlapped_launches"]
    assert not serial.backend.overlap_launches and not serial.info()["overlapped_launches"]
    assert serial.backend.graph is serial.backend.eager, "no overlap: the captured step runs the eager kernels"

    def launcher(kernels):
        return kernels.layer.decode_step_end.__self__.launcher

    assert launcher(graph.backend.graph).overlap == supported
    assert launcher(graph.backend.graph).counts is graph.backend.launcher.counts
    assert not launcher(graph.backend.eager).overlap and not launcher(serial.backend.graph).overlap
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    overlapped = graph.generate(PROMPT, params).token_ids
    assert overlapped == serial.generate(PROMPT, params).token_ids
    key = (True, False)  # greedy, no repetition penalty
    assert serial._decoders[0].captured_kernels[key] == graph._decoders[0].captured_kernels[key]


def test_the_captured_step_launches_the_planned_kernels(engines) -> None:
    """The kernels one replay of a bf16 (float weights) decode step launches, recorded
    at capture: per layer the attention with the q/k norm + RoPE + K/V store inside,
    two add_rms_norm (after o and after down, the next norm folded in) and silu_mul;
    once the embedding, the first layer's rms_norm and decode_step_end. The
    projections and the lm_head are cuBLAS and the greedy argmax / sampling torch:
    not NVRTC launches, so not counted."""
    graph, _ = engines
    layers = graph.cfg.num_layers
    want = {
        "embedding": 1,
        "rms_norm_bf16": 1,
        "paged_decode_tc_rope": layers,
        "add_rms_norm_bf16": 2 * layers,
        "silu_mul_bf16": layers,
        "decode_step_end": 1,
    }
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=5)
    for params, key in ((greedy, (True, False)), (sampled, (False, False))):
        graph.generate(PROMPT, params)
        got = graph._decoders[0].captured_kernels[key]
        assert got == want, f"{key}: {got}"


def test_capture_survives_the_collection_of_an_unreachable_old_graph(engines, monkeypatch) -> None:
    """A cyclic garbage collection inside a capture can destroy an old graph that only a
    reference cycle held, which the capture forbids (it would be invalidated); the
    decoders pause the collector while they capture. Inside each capture this drops an
    old graph into a fresh reference cycle and allocates with the collector's threshold
    at 1, so a running collector would free it there; the captures must stand and
    decode as the engine that captured in peace does."""
    import gc

    from edge.runtime.graph import SlotDecoder

    graph, _ = engines
    olds = []
    for _ in range(4):
        g = torch.cuda.CUDAGraph()
        x = torch.zeros(4, device="cuda")
        with torch.cuda.graph(g):
            x.add_(1)
        olds.append((g, x))
    dropped = []
    body = SlotDecoder._body

    def body_dropping_an_old_graph(self, greedy):
        if torch.cuda.is_current_stream_capturing() and olds:
            thresholds = gc.get_threshold()
            cycle: list = [olds.pop()]
            cycle.append(cycle)
            del cycle
            gc.set_threshold(1)
            try:
                junk = [[i] for i in range(2000)]  # allocations: a collection each, if collecting
                del junk
            finally:
                gc.set_threshold(*thresholds)
            dropped.append(greedy)
        return body(self, greedy)

    monkeypatch.setattr(SlotDecoder, "_body", body_dropping_an_old_graph)
    engine = Engine(graph.model, graph.tokenizer, graph.model_dir, page_size=16, cuda_graph=True, kernels="cuda",
                    num_blocks=64)
    assert engine.capture_graphs(slots=(0,)) == 4 and len(dropped) == 4
    gc.collect()  # the old graphs go now, outside any capture
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert engine.generate(PROMPT, params).token_ids == graph.generate(PROMPT, params).token_ids
