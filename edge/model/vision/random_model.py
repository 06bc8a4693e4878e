"""Random-weight Qwen3-VL / Qwen2.5-VL models in Hugging Face format (see edge/model/random_model.py).

The directory holds what a published checkpoint holds: config.json (transformers' layout,
``text_config`` + ``vision_config``), safetensors under the published tensor names,
tokenizer.json with the vision special tokens, tokenizer_config.json with a Qwen-VL chat
template, generation_config.json and preprocessor_config.json. transformers loads it as
it loads the real model, which is what the oracle tests rely on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from edge.model.random_model import (
    INIT_STD,
    PRESETS,
    cached_model,
    config_tensor,
    covering_tokenizer_json,
    parse_dtype,
    random_tensor,
    special_token_ids,
    state_dict_shapes,
    tokenizer_config,
    tokenizer_vocab_size,
    write_weights,
)
from edge.model.vision.config import VLConfig
from edge.model.vision.tower import vision_shapes

VL_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen3-VL's chat template without its tool-calling branch.
QWEN3_VL_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {%- for content in messages[0].content %}
            {%- if 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen2.5-VL's chat template (a default system message when there is none).
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_QWEN3_VL = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "mean": [0.5, 0.5, 0.5],
    "std": [0.5, 0.5, 0.5],
    "template": QWEN3_VL_CHAT_TEMPLATE,
}
_QWEN2_5_VL = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "mean": [0.48145466, 0.4578275, 0.40821073],
    "std": [0.26862954, 0.26130258, 0.27577711],
    "template": QWEN2_5_VL_CHAT_TEMPLATE,
}

_TINY_TEXT = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "vocab_size": None,  # the local tokenizer's
}

# The tower of Qwen3-VL-8B-Instruct.
_QWEN3_VL_8B_TOWER = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
    "hidden_act": "gelu_pytorch_tanh",
}

# text: the decoder; vision: the tower; pixels: the image processor's (min, max) area;
# init_profile (optional): the decoder's random_model profile.
VL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-vl-tiny": {
        **_QWEN3_VL,
        # head_dim 64: a size the CUDA attention takes, so GPU tests run graphs.
        "text": {**_TINY_TEXT, "head_dim": 64, "mrope_section": [12, 10, 10]},
        "vision": {
            "depth": 3,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "patch_size": 16,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
            "hidden_act": "gelu_pytorch_tanh",
        },
        "pixels": (32 * 32, 320 * 320),
        "tie_word_embeddings": False,
    },
    "qwen2.5-vl-tiny": {
        **_QWEN2_5_VL,
        "text": {**_TINY_TEXT, "num_attention_heads": 2, "num_key_value_heads": 1, "mrope_section": [8, 12, 12]},
        "vision": {
            "depth": 4,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [1, 3],
            "hidden_act": "silu",
        },
        "pixels": (28 * 28, 280 * 280),
        "tie_word_embeddings": True,
    },
    # The shapes of Qwen3-VL-8B-Instruct (for benchmarks).
    "qwen3-vl-8b": {
        **_QWEN3_VL,
        "text": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_theta": 5_000_000.0,
            "mrope_section": [24, 20, 20],
            "max_position_embeddings": 262144,
            "vocab_size": 151936,
        },
        "vision": _QWEN3_VL_8B_TOWER,
        "pixels": (65536, 16777216),
        "tie_word_embeddings": False,
    },
    # The verification model for bfloat16 on a GPU (tools/verify_paged.py): qwen3-peaked's
    # decoder (peaked logits, so bf16 greedy runs compare hundreds of tokens) behind
    # Qwen3-VL-8B's tower.
    "qwen3-vl-peaked": {
        **_QWEN3_VL,
        "text": {
            **{k: PRESETS["qwen3-peaked"][k] for k in (
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rope_theta", "vocab_size")},
            "mrope_section": [24, 20, 20],
            "max_position_embeddings": 40960,
        },
        "vision": _QWEN3_VL_8B_TOWER,
        "pixels": (65536, 16777216),
        "tie_word_embeddings": False,
        "init_profile": "peaked",
    },
}


def vl_model_config(preset: str, **text_overrides: Any) -> dict[str, Any]:
    """A Hugging Face config.json dict for a VL preset (``text_overrides`` replace text fields)."""
    if preset not in VL_PRESETS:
        raise ValueError(f"unknown vision-language preset {preset!r}; choose from {sorted(VL_PRESETS)}")
    p = VL_PRESETS[preset]
    ids = special_token_ids(VL_SPECIAL_TOKENS)
    text = {k: v for k, v in p["text"].items() if k != "mrope_section"}
    text["vocab_size"] = text["vocab_size"] or tokenizer_vocab_size(VL_SPECIAL_TOKENS)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"), "mrope_section": p["text"]["mrope_section"]}
    if p["model_type"] == "qwen3_vl":
        rope["mrope_interleaved"] = True
    text |= {
        "model_type": p["model_type"] + "_text",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "rope_parameters": rope,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        **text_overrides,
    }
    if p["model_type"] == "qwen3_vl":
        text["attention_bias"] = False
    vision = {
        **p["vision"],
        "model_type": p["model_type"] + "_vision",
        "in_channels": 3,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": text["hidden_size"],
        "initializer_range": INIT_STD,
    }
    return {
        "architectures": p["architectures"],
        "model_type": p["model_type"],
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": p["tie_word_embeddings"],
        "dtype": "float32",
    }


def vl_state_dict_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names (transformers' current layout) and shapes of a VL config."""
    text = dict(config["text_config"])
    text["model_type"] = "qwen3" if config["model_type"] == "qwen3_vl" else "qwen2"
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", False)
    shapes = {}
    for name, shape in state_dict_shapes(text).items():
        shapes[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = shape
    vision = VLConfig.from_dict(config).vision
    shapes |= {"model.visual." + name: shape for name, shape in vision_shapes(vision).items()}
    return shapes


def preprocessor_config(preset: str) -> dict[str, Any]:
    p = VL_PRESETS[preset]
    min_pixels, max_pixels = p["pixels"]
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor" if p["model_type"] == "qwen3_vl" else "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "image_mean": p["mean"],
        "image_std": p["std"],
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": p["vision"]["patch_size"],
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def make_vl_model(
    out_dir: str | os.PathLike[str],
    preset: str = "qwen3-vl-tiny",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    std: float = INIT_STD,
    progress: bool = False,
    **text_overrides: Any,
) -> Path:
    """Write a random-weight VL model directory and return its path. ``std``: the weights'
    standard deviation (tests use a larger one than the default, so that greedy decoding
    has no near-ties and images visibly change the answer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = parse_dtype(dtype)
    config = vl_model_config(preset, **text_overrides)
    config["dtype"] = str(torch_dtype).removeprefix("torch.")
    ids = special_token_ids(VL_SPECIAL_TOKENS)

    def write(name: str, data: Any) -> None:
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    write("config.json", config)
    vocab = config["text_config"]["vocab_size"]
    (out / "tokenizer.json").write_text(covering_tokenizer_json(vocab, VL_SPECIAL_TOKENS), encoding="utf-8")
    max_len = config["text_config"]["max_position_embeddings"]
    write("tokenizer_config.json", tokenizer_config(max_len, VL_PRESETS[preset]["template"], VL_SPECIAL_TOKENS))
    write(
        "generation_config.json",
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]},
    )
    write("preprocessor_config.json", preprocessor_config(preset))
    shapes = vl_state_dict_shapes(config)
    profile = VL_PRESETS[preset].get("init_profile")

    def tensor(name: str, shape: tuple[int, ...]) -> Any:
        if profile is None or name.startswith("model.visual."):
            return random_tensor(name, shape, seed, torch_dtype, std=std)
        # The decoder's tensors under their text-model names, so the profile finds them.
        text_name = name.replace("model.language_model.", "model.", 1)
        return config_tensor({"init_profile": profile}, text_name, shape, seed, torch_dtype)

    write_weights(out, shapes, tensor, torch_dtype, max_shard_bytes, progress)
    return out


def vl_preset_model_path(preset: str, dtype: str = "bfloat16") -> Path:
    """A random-weight VL ``preset`` model in the cache (seed 0), created once and reused."""
    return cached_model(f"{preset}-{dtype}-v2", build=make_vl_model, preset=preset, seed=0, dtype=dtype)
