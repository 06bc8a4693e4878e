"""Qwen3-VL and Qwen2.5-VL against transformers on random small models (float32, CPU):
the image processor's pixels, the vision tower's features, and greedy generation with the
Hugging Face processor preparing the same conversation."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from PIL import Image

from edge.runtime.engine import Engine
from edge.sampling import SamplingParams
from edge.model.vision.preprocess import (
    ImageError,
    ImageLimits,
    ProcessorConfig,
    decode_image,
    preprocess,
)
from edge.model.vision.random_model import make_vl_model

PRESETS = ["qwen3-vl-tiny", "qwen2.5-vl-tiny"]
# (width, height): upscaled to min_pixels, landscape, tall and narrow, downscaled to max_pixels.
SIZES = [(20, 30), (120, 90), (300, 170), (64, 400), (1000, 700)]
NEW_TOKENS = 32


def random_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def image_only_processor(model_dir: Path, preset: str):
    """The model's HF processor without its video processor (which needs torchvision)."""
    base = transformers.Qwen3VLProcessor if preset.startswith("qwen3") else transformers.Qwen2_5_VLProcessor

    class ImageOnly(base):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    images = transformers.AutoImageProcessor.from_pretrained(model_dir)
    assert images.backend == "pil", "the oracle is the PIL/numpy image processor"
    return ImageOnly(images, tokenizer, chat_template=tokenizer.chat_template)


@pytest.fixture(scope="module", params=PRESETS)
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(preset, model dir, transformers model, HF processor, edge engine)."""
    preset = request.param
    path = make_vl_model(tmp_path_factory.mktemp(preset), preset, std=0.1)
    hf, info = transformers.AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), f"transformers did not load the checkpoint cleanly: {info}"
    processor = image_only_processor(path, preset)
    # Small chunks and pages: images straddle chunk and page boundaries.
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", page_size=8, prefill_chunk=24)
    return preset, path, hf.eval(), processor, engine


def hf_generate(vl, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) from transformers, the processor applying the template."""
    _, _, hf, processor, _ = vl
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


def edge_generate(vl, messages: list[dict]) -> tuple[list[int], list[int]]:
    engine = vl[4]
    prompt = engine.chat_prompt(messages)
    ids = prompt if isinstance(prompt, list) else prompt.ids
    out = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)).token_ids
    return ids, out


def assert_same_generation(vl, messages: list[dict]) -> list[int]:
    ref_ids, ref = hf_generate(vl, messages)
    ids, ours = edge_generate(vl, messages)
    assert ids == ref_ids, "prompt ids differ from the HF processor's"
    mismatch = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    assert ours == ref, f"{vl[0]}: first mismatch at token {mismatch}"
    return ours


def user(*parts: object) -> dict:
    content = [{"type": "image", "image": p} if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in parts]
    return {"role": "user", "content": content}


# -- preprocessing and the tower -------------------------------------------------------


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_preprocessing_matches_hf_processor(vl, mode: str) -> None:
    _, path, _, processor, _ = vl
    cfg = ProcessorConfig.from_pretrained(path)
    for i, (w, h) in enumerate(SIZES):
        image = random_image(w, h, seed=i, mode=mode)
        ref = processor.image_processor(images=[image], return_tensors="pt")
        ours = preprocess(image, cfg)
        assert ours.grid == tuple(ref["image_grid_thw"][0].tolist()), (w, h)
        assert torch.equal(ours.pixels, ref["pixel_values"]), f"pixels differ for {w}x{h} {mode}"


def test_vision_tower_matches_hf(vl) -> None:
    preset, path, hf, _, engine = vl
    cfg = ProcessorConfig.from_pretrained(path)
    for i, (w, h) in enumerate(SIZES):
        image = preprocess(random_image(w, h, seed=10 + i), cfg)
        with torch.no_grad():
            ref = hf.model.get_image_features(image.pixels, torch.tensor([image.grid]))
        ours = engine.vision.tower(image.pixels, [image.grid])[0]
        expected = ref.pooler_output[0]
        assert ours.embeds.shape == expected.shape
        assert ((ours.embeds - expected).norm() / expected.norm()).item() < 1e-5, (preset, w, h)
        if preset.startswith("qwen3"):
            assert len(ours.deepstack) == len(ref.deepstack_features) == 2
            for mine, theirs in zip(ours.deepstack, ref.deepstack_features):
                assert ((mine - theirs[0]).norm() / theirs[0].norm()).item() < 1e-5


# -- generation ------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES[1:4])
def test_greedy_matches_hf_one_image(vl, size: tuple[int, int]) -> None:
    image = random_image(*size, seed=size[0])
    tokens = assert_same_generation(vl, [user(image, "What is in this picture?")])
    # The answer depends on the picture: a test that could not see it would pass anyway.
    other = edge_generate(vl, [user(random_image(*size, seed=size[0] + 1), "What is in this picture?")])[1]
    assert other != tokens


def test_greedy_matches_hf_two_images(vl) -> None:
    a, b = random_image(96, 128, seed=1), random_image(200, 100, seed=2)
    assert_same_generation(vl, [user(a, "Compare this", b, "with that.")])


def test_greedy_matches_hf_multi_turn(vl) -> None:
    image = random_image(160, 120, seed=3)
    first = [user(image, "Describe the picture.")]
    answer = vl[4].tokenizer.decode(edge_generate(vl, first)[1])
    follow_up = [*first, {"role": "assistant", "content": answer}, user("And what colour is it?")]
    assert_same_generation(vl, follow_up)


def test_greedy_matches_hf_text_only(vl) -> None:
    assert_same_generation(vl, [user("Hello! Tell me about the river behind the mill.")])


def test_contiguous_kv_matches_paged(vl) -> None:
    _, path, _, _, paged = vl
    contiguous = Engine.from_pretrained(path, device="cpu", dtype="float32", kv_cache="contiguous", prefill_chunk=1000)
    messages = [user(random_image(150, 220, seed=5), "What is this?")]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = paged.generate(paged.chat_prompt(messages), params).token_ids
    assert contiguous.generate(contiguous.chat_prompt(messages), params).token_ids == expected


# -- bad input -------------------------------------------------------------------------


def test_bad_images_are_refused(vl) -> None:
    engine = vl[4]

    def image_message(data: bytes) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image", "image": data}, {"type": "text", "text": "?"}]}]

    with pytest.raises(ImageError, match="cannot decode"):
        engine.chat_prompt(image_message(b"not an image"))
    png = io.BytesIO()
    random_image(10, 2100, seed=0).save(png, format="PNG")
    with pytest.raises(ImageError, match="aspect ratio"):
        engine.chat_prompt(image_message(png.getvalue()))
    with pytest.raises(ImageError, match="exceeds the limit of 100 pixels"):
        decode_image(png.getvalue(), ImageLimits(max_pixels=100))
    with pytest.raises(ImageError, match="exceeds the limit of 1000 bytes"):
        decode_image(png.getvalue(), ImageLimits(max_bytes=1000))


# -- prefix reuse ----------------------------------------------------------------------


def test_prefix_cache_keys_image_tokens_by_content(vl) -> None:
    """A follow-up about the same image reuses the KV blocks up to the first turn's end
    (the tower does not run again) and decodes what an uncached engine decodes; another
    image of the same size shares nothing from its first token on."""
    from edge.scheduling import Scheduler

    engine = vl[4]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    image = random_image(160, 120, seed=7)
    first = [user(image, "Describe the picture in a few words, please.")]
    sched = Scheduler(engine, prefill_chunk=24)
    sched.start()
    try:
        turn1 = engine.chat_prompt(first)
        answer = sched.submit(turn1, params).result(timeout=60)
        follow = [*first, {"role": "assistant", "content": answer.text}, user("Why?")]
        turn2 = engine.chat_prompt(follow)
        second = sched.submit(turn2, params).result(timeout=60)
        other = engine.chat_prompt([user(random_image(160, 120, seed=8), "Describe the picture in a few words, please.")])
        third = sched.submit(other, params).result(timeout=60)
    finally:
        sched.stop()
    ps = engine.page_size
    image_start, image_end = turn2.spans[0]
    assert second.usage.cached_tokens >= len(turn1.ids) // ps * ps >= image_end
    assert turn2.tower_runs == 0, "the image's tokens were all cached: the tower must not run"
    assert second.token_ids == engine.generate(engine.chat_prompt(follow), params).token_ids
    assert third.usage.cached_tokens <= image_start
    assert other.tower_runs == 1


def test_int8_decoder_follows_float(vl) -> None:
    """``quantize="int8"`` quantizes the decoder's projections while loading (under the
    VL checkpoint's tensor names); the tower stays float. Logits stay close to float's."""
    from edge.quant.q8_0 import Int8Weight

    _, path, _, _, engine = vl
    int8 = Engine.from_pretrained(path, device="cpu", dtype="float32", quantize="int8", quant_group_size=32)
    assert isinstance(int8.model.w["model.layers.0.self_attn.qkv_proj.weight"], Int8Weight)
    outs = []
    for e in (engine, int8):
        prompt = e.chat_prompt([user(random_image(100, 100, seed=9), "What is it?")])
        seq = e.new_sequence()
        try:
            outs.append(e.prefill(seq, prompt.ids, all_logits=True, mm=prompt))
        finally:
            e.end_sequence(seq)
    assert 0 < ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 5e-2


@pytest.mark.parametrize(
    ("name", "row"),
    [("model.language_model.layers.0.mlp.up_proj.weight", 3), ("model.visual.blocks.0.mlp.linear_fc1.weight", 1)],
)
def test_non_finite_weights_are_named_by_checkpoint_tensor(tmp_path: Path, name: str, row: int) -> None:
    from safetensors.torch import load_file, save_file

    from edge.model.validate import CheckpointError

    path = make_vl_model(tmp_path / "vl", "qwen3-vl-tiny")
    tensors = load_file(path / "model.safetensors")
    tensors[name][row, 0] = float("nan")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"weight {name} holds 1 NaN or infinite values \(the first at \[{row}\b"):
        Engine.from_pretrained(path, device="cpu", dtype="float32")
    Engine.from_pretrained(path, device="cpu", dtype="float32", check_weights=False)  # skipped on request
