"""Qwen3-VL / Qwen2.5-VL on the GPU: bf16 against the float32 CPU reference, and the
captured decode graph (RoPE at position + delta after images) against eager decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image

from edge.engine import Engine
from edge.sampling import SamplingParams
from edge.vision.random_model import make_vl_model

pytestmark = pytest.mark.cuda

PRESETS = ["qwen3-vl-tiny", "qwen2.5-vl-tiny"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def messages(image: Image.Image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]


@pytest.fixture(scope="module", params=PRESETS)
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = make_vl_model(tmp_path_factory.mktemp(request.param), request.param, std=0.1)
    cpu = Engine.from_pretrained(path, device="cpu", dtype="float32")
    gpu = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", kv_blocks=256)
    eager = Engine(gpu.model, gpu.tokenizer, path, num_blocks=256, cuda_graph=False, vision=gpu.vision)
    return cpu, gpu, eager


def test_tower_bf16_matches_fp32(engines) -> None:
    cpu, gpu, _ = engines
    for i, (w, h) in enumerate([(448, 448), (1280, 720), (90, 300)]):
        image = cpu.vision.prepare(picture(w, h, seed=i))
        ref = cpu.vision.tower(image.pixels, [image.grid])[0]
        ours = gpu.vision.tower(image.pixels, [image.grid])[0]
        assert ours.embeds.dtype == torch.bfloat16
        assert rel_err(ours.embeds, ref.embeds) < 3e-2, (w, h)
        for a, b in zip(ours.deepstack, ref.deepstack):
            assert rel_err(a, b) < 3e-2


def test_prefill_logits_bf16_match_fp32(engines) -> None:
    cpu, gpu, _ = engines
    outs = []
    for engine in (cpu, gpu):
        prompt = engine.chat_prompt(messages(picture(300, 200, seed=4)))
        seq = engine.new_sequence()
        try:
            outs.append(engine.prefill(seq, prompt.ids, all_logits=True, mm=prompt))
        finally:
            engine.end_sequence(seq)
    assert rel_err(outs[1], outs[0]) < 5e-2


def test_graph_decode_after_image_matches_eager(engines) -> None:
    """The graph reads RoPE from the slot's tables shifted by the request's delta."""
    _, gpu, eager = engines
    assert gpu.cuda_graph and not eager.cuda_graph
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for seed in (5, 6):  # two requests on one slot: the second rebinds another delta
        image = picture(200 + 40 * seed, 150, seed=seed)
        prompt = gpu.chat_prompt(messages(image))
        assert prompt.rope_delta < 0
        expected = eager.generate(eager.chat_prompt(messages(image)), params).token_ids
        assert gpu.generate(prompt, params).token_ids == expected
    text = gpu.chat_prompt([{"role": "user", "content": "No picture this time."}])
    assert gpu.generate(text, params).token_ids == eager.generate(text, params).token_ids
