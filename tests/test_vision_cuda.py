"""Qwen3-VL / Qwen2.5-VL on the GPU: bf16 against the float32 CPU reference (the tower,
prompts with images of several sizes, two images, a multi-turn chat and text only, and
decode after images fed the reference's tokens), the captured decode graph (RoPE at
position + delta after images) against eager decode, and int8 / int4 decoders against
the same quantization on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image

from edge.runtime.engine import Engine
from edge.sampling import SamplingParams
from edge.model.vision.random_model import make_vl_model

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


def conversations() -> dict[str, list[dict]]:
    """Image sizes and aspect ratios (upscaled, landscape, tall, downscaled), two images,
    a multi-turn chat about one image, text only."""
    out = {f"{w}x{h}": messages(picture(w, h, seed=w + h)) for w, h in [(40, 30), (300, 200), (64, 400), (1280, 720)]}
    a, b = picture(96, 128, seed=1), picture(200, 100, seed=2)
    out["two-images"] = [{"role": "user", "content": [
        {"type": "image", "image": a}, {"type": "text", "text": "Compare this"},
        {"type": "image", "image": b}, {"type": "text", "text": "with that."}]}]
    out["multi-turn"] = [*messages(picture(160, 120, seed=3)), {"role": "assistant", "content": "A field of noise."},
                         {"role": "user", "content": "And what colour is it?"}]
    out["text-only"] = [{"role": "user", "content": "No picture this time: tell me about the river."}]
    return out


def teacher_forced(engine: Engine, conversation: list[dict], tokens: list[int] | None, n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (or ``tokens``, fed in turn) after the conversation's prompt, and the
    float32 logits of the prompt's last position and of every decode step."""
    prompt = engine.chat_prompt(conversation)
    mm = None if isinstance(prompt, list) else prompt
    ids = prompt if mm is None else mm.ids
    delta = 0 if mm is None else mm.rope_delta
    seq = engine.new_sequence()
    out: list[int] = []
    rows = []
    try:
        logits = engine.prefill(seq, ids, mm=mm)
        for i in range(n):
            rows.append(logits.float().cpu())
            out.append(int(torch.argmax(logits)) if tokens is None else tokens[i])
            logits = engine.forward(seq, [out[-1]], rope_delta=delta)
    finally:
        engine.end_sequence(seq)
    return out, torch.stack(rows)


def test_prompts_and_decode_bf16_match_fp32(engines) -> None:
    """bf16 logits of the prompt and of 24 decode steps fed the fp32 reference's greedy
    tokens stay within tolerance; where the reference's top-2 gap is clear, bf16 picks
    the same token."""
    cpu, _, eager = engines
    compared = 0
    for name, conversation in conversations().items():
        tokens, ref = teacher_forced(cpu, conversation, None, 24)
        _, ours = teacher_forced(eager, conversation, tokens, 24)
        assert rel_err(ours, ref) < 5e-2, name
        top2 = torch.topk(ref, 2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.25
        assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear]), name
        compared += int(clear.sum())
    assert compared >= 50, "the reference's logits are too flat to compare tokens"


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
    two = conversations()["two-images"]
    assert gpu.generate(gpu.chat_prompt(two), params).token_ids == eager.generate(eager.chat_prompt(two), params).token_ids


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_decoder_matches_cpu_and_graph(tmp_path_factory: pytest.TempPathFactory, quantize: str) -> None:
    """The int8 / int4 GEMV plan with images: bf16 logits against the same quantization
    on the CPU in float32, and graph decode against eager decode."""
    path = make_vl_model(tmp_path_factory.mktemp(f"vl-{quantize}"), "qwen3-vl-tiny", std=0.1)
    kw = {"quantize": quantize, "quant_group_size": 64}
    cpu = Engine.from_pretrained(path, device="cpu", dtype="float32", **kw)
    gpu = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", kv_blocks=256, **kw)
    eager = Engine(gpu.model, gpu.tokenizer, path, num_blocks=256, cuda_graph=False, vision=gpu.vision)
    assert gpu.cuda_graph and gpu.model.int8_projections
    conversation = conversations()["300x200"]
    tokens, ref = teacher_forced(cpu, conversation, None, 16)
    assert rel_err(teacher_forced(eager, conversation, tokens, 16)[1], ref) < 5e-2
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = eager.generate(eager.chat_prompt(conversation), params).token_ids
    assert gpu.generate(gpu.chat_prompt(conversation), params).token_ids == expected
