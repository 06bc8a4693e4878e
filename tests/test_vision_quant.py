"""Int4 decoders of Qwen3-VL / Qwen2.5-VL against transformers (CPU, float32).

Published int4 VL checkpoints (compressed-tensors under transformers' current names,
AutoAWQ and GPTQ under the first-published ``model.*`` / ``visual.*`` names): the
decoder's linears get int4 codes drawn here, written by the independent packers of
tests/test_int4_checkpoints.py, the tower stays float; transformers holds the
dequantized weights and the HF processor prepares the same image conversation.

``quantize="int4"`` on a float VL checkpoint: transformers holds the round-to-nearest
weights computed here with numpy from the rule edge documents (per group, the range
[min(w, 0), max(w, 0)] over 15 steps, the scale rounded to float16 first).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file

from edge.runtime.engine import Engine
from edge.quant.int4 import Int4Weight
from edge.quant.embedding import Int8Embedding
from edge.sampling import SamplingParams
from edge.model.validate import CheckpointError
from edge.model.vision.random_model import make_vl_model
from tests.test_int4_checkpoints import (
    LINEARS,
    Codes,
    ct_config,
    draw_codes,
    write_awq,
    write_compressed,
    write_gptq,
)
from tests.test_vision import image_only_processor, random_image, user

NEW_TOKENS = 32
GROUP = 32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hf_model(path: Path):
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path)
    return hf.eval()


def layers(hf) -> int:
    return hf.config.text_config.num_hidden_layers


def copy_extras(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)


def write_published(src: Path, dst: Path, fmt: str, legacy_names: bool, seed: int = 0):
    """An int4 copy of the VL checkpoint ``src`` in ``fmt`` ("awq", "gptq" or "ct"); returns the
    transformers model (loaded from ``src``) holding the dequantized weights."""
    hf = hf_model(src)
    rng = np.random.default_rng(seed)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers(hf)):
        for lin in LINEARS:
            base = f"model.language_model.layers.{i}.{lin}"
            out, inp = state.pop(base + ".weight").shape
            c: Codes = draw_codes(rng, out, inp, GROUP, symmetric=False, g_idx=None)
            with torch.no_grad():
                hf.get_submodule(base).weight.copy_(c.dequantize())
            if fmt == "awq":
                tensors |= write_awq(c, base)
            elif fmt == "gptq":
                tensors |= write_gptq(c, base, v2=False)
            else:
                tensors |= write_compressed(c, base, "packed", g_idx=False)
    tensors |= state
    if legacy_names:  # Qwen2.5-VL as first published: model.layers.*, visual.*
        tensors = {
            n.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): t
            for n, t in tensors.items()
        }
    copy_extras(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if fmt == "awq":
        config["quantization_config"] = {
            "quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": ["visual"],
        }
    elif fmt == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                         "sym": False}
    else:
        config["quantization_config"] = {**ct_config(GROUP, symmetric=False, actorder=False),
                                          "ignore": ["lm_head", "re:.*visual.*"]}
    (dst / "config.json").write_text(json.dumps(config))
    return hf


def rtn_dequantized(w: np.ndarray, group: int) -> np.ndarray:
    """Round-to-nearest asymmetric int4 of ``w`` [out, in], dequantized (float32)."""
    rows, cols = w.shape
    g = w.astype(np.float32).reshape(rows, cols // group, group)
    lo = np.minimum(g.min(-1), 0)
    hi = np.maximum(g.max(-1), 0)
    scale = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, 15)
    q = np.clip(np.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return ((q - zero[..., None]) * scale[..., None]).reshape(rows, cols).astype(np.float32)


def q8_dequantized(w: np.ndarray, group: int = 128) -> np.ndarray:
    """Symmetric int8 groups (scale max|w| / 127), dequantized (float32)."""
    rows, cols = w.shape
    g = w.astype(np.float32).reshape(rows, cols // group, group)
    scale = np.abs(g).max(-1) / np.float32(127)
    q = np.clip(np.round(g / np.where(scale > 0, scale, 1)[..., None]), -127, 127)
    return (q * scale[..., None]).reshape(rows, cols).astype(np.float32)


def hf_greedy(hf, processor, messages: list[dict]) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt ids, greedy tokens, prompt logits) from transformers."""
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = hf(**inputs).logits[0]
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist(), logits


def edge_greedy(engine: Engine, messages: list[dict]) -> tuple[list[int], list[int], torch.Tensor]:
    prompt = engine.chat_prompt(messages)
    seq = engine.new_sequence()
    try:
        logits = engine.prefill(seq, prompt.ids, all_logits=True, mm=prompt)
    finally:
        engine.end_sequence(seq)
    tokens = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)).token_ids
    return prompt.ids, tokens, logits


def assert_matches(engine: Engine, hf, processor, messages: list[dict], tol: float = 1e-4) -> None:
    ref_ids, ref_tokens, ref_logits = hf_greedy(hf, processor, messages)
    ids, tokens, logits = edge_greedy(engine, messages)
    assert ids == ref_ids
    assert rel_err(logits, ref_logits) < tol
    assert tokens == ref_tokens


def assert_int4_decoder(engine: Engine) -> None:
    layer = engine.model.layers[0]
    assert all(isinstance(layer[k], Int4Weight) for k in ("qkv", "o", "gate_up", "down"))
    assert all(t.is_floating_point() for t in engine.vision.tower.w.values())


PUBLISHED = [("qwen3-vl-tiny", "ct", False), ("qwen2.5-vl-tiny", "awq", True), ("qwen3-vl-tiny", "gptq", True)]


@pytest.mark.parametrize(("preset", "fmt", "legacy"), PUBLISHED, ids=[f"{p}-{f}" for p, f, _ in PUBLISHED])
def test_published_int4_vl_checkpoint_matches_transformers(tmp_path: Path, preset: str, fmt: str, legacy: bool) -> None:
    src = make_vl_model(tmp_path / "float", preset, std=0.1)
    dst = tmp_path / "int4"
    hf = write_published(src, dst, fmt, legacy)
    processor = image_only_processor(src, preset)
    messages = [user(random_image(150, 110, seed=1), "What is in this picture?")]
    exact = Engine.from_pretrained(dst, device="cpu", dtype="float32", quant_lm_head="float", quant_embedding="float",
                                   page_size=8, prefill_chunk=24)
    assert_int4_decoder(exact)
    assert_matches(exact, hf, processor, messages)
    # By default the lm_head and the embedding stay as published; as int8 groups when
    # chosen (image features replace the embedding's rows at image tokens; the tower
    # still runs in float).
    published = Engine.from_pretrained(dst, device="cpu", dtype="float32", page_size=8, prefill_chunk=24)
    assert published.info()["weights"]["embedding"] == "float32"
    default = Engine.from_pretrained(dst, device="cpu", dtype="float32", page_size=8, prefill_chunk=24,
                                     quant_lm_head="int8", quant_embedding="int8")
    assert isinstance(default.model.w["model.embed_tokens.weight"], Int8Embedding)
    with torch.no_grad():
        for m in {id(m): m for m in (hf.get_input_embeddings(), hf.lm_head)}.values():
            m.weight.copy_(torch.from_numpy(q8_dequantized(m.weight.numpy())))
    assert_matches(default, hf, processor, messages)


def test_quantize_int4_while_loading_is_rtn_of_the_decoder(tmp_path: Path) -> None:
    preset = "qwen3-vl-tiny"
    src = make_vl_model(tmp_path / "float", preset, std=0.1)
    hf = hf_model(src)
    with torch.no_grad():
        for i in range(layers(hf)):
            for lin in LINEARS:
                m = hf.get_submodule(f"model.language_model.layers.{i}.{lin}")
                m.weight.copy_(torch.from_numpy(rtn_dequantized(m.weight.numpy(), GROUP)))
    engine = Engine.from_pretrained(src, device="cpu", dtype="float32", quantize="int4", quant_group_size=GROUP,
                                    quant_lm_head="float", quant_embedding="float", page_size=8, prefill_chunk=24)
    assert_int4_decoder(engine)
    processor = image_only_processor(src, preset)
    assert_matches(engine, hf, processor, [user(random_image(96, 128, seed=2), "Compare this", random_image(200, 100, seed=3), "with that.")])
    assert_matches(engine, hf, processor, [user("No picture: tell me about the river.")])


def test_quantized_tower_is_refused(tmp_path: Path) -> None:
    """Only the decoder's linears may be int4: a checkpoint that quantized the tower too
    is a clear error naming the tower."""
    src = make_vl_model(tmp_path / "float", "qwen3-vl-tiny")
    dst = tmp_path / "int4"
    write_published(src, dst, "ct", legacy_names=False)
    from safetensors.torch import load_file

    tensors = load_file(dst / "model.safetensors")
    name = "model.visual.blocks.0.mlp.linear_fc1"
    w = tensors.pop(name + ".weight")
    c = draw_codes(np.random.default_rng(0), w.shape[0], w.shape[1], GROUP, symmetric=False, g_idx=None)
    tensors |= write_compressed(c, name, "packed", g_idx=False)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"vision tower .*model\.visual\.blocks\.0\.mlp\.linear_fc1 is quantized"):
        Engine.from_pretrained(dst, device="cpu", dtype="float32")


def test_q8_0_vl_checkpoint_is_refused(tmp_path: Path) -> None:
    src = make_vl_model(tmp_path / "float", "qwen3-vl-tiny")
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt", "quantization": "q8_0", "group_size": "32"})
    with pytest.raises(CheckpointError, match="q8_0 vision-language checkpoints are not supported"):
        Engine.from_pretrained(src, device="cpu", dtype="float32")
