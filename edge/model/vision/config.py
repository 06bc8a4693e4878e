"""Qwen3-VL / Qwen2.5-VL ``config.json``: the text decoder as an :class:`edge.model.config.ModelConfig`
plus the vision tower's shape, the multimodal RoPE layout and the vision token ids.

Two layouts exist in published checkpoints: the text fields at the top level (Qwen2.5-VL as
first published) or under ``text_config`` (Qwen3-VL, and anything transformers >= 4.52 saved).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.model.config import ConfigError, ModelConfig
from edge.model.files import read_json_object

# The VL architecture -> (tower kind, the text decoder's causal-LM architecture).
VL_ARCHITECTURES = {
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2ForCausalLM"),
}

# transformers' defaults for fields a config.json may leave out.
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_vl": {
        "depth": 27,
        "hidden_size": 1152,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 4304,
        "num_heads": 16,
        "patch_size": 16,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": (8, 16, 24),
        "mrope_section": (24, 20, 20),
    },
    "qwen2_5_vl": {
        "depth": 32,
        "hidden_size": 3584,
        "hidden_act": "silu",
        "intermediate_size": 3420,
        "num_heads": 16,
        "patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": (7, 15, 23, 31),
        "mrope_section": (16, 24, 24),
    },
}


@dataclass(frozen=True)
class VisionConfig:
    kind: str  # "qwen3_vl" | "qwen2_5_vl"
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    rope_theta: float
    # Qwen3-VL: the learned position grid and the blocks whose output feeds DeepStack.
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()
    # Qwen2.5-VL: window attention everywhere except the full-attention blocks.
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


@dataclass(frozen=True)
class VLConfig:
    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int]  # frequencies given to the t, h and w axes
    mrope_interleaved: bool  # Qwen3-VL: t/h/w frequencies interleaved, not in three runs

    @property
    def kind(self) -> str:
        return self.vision.kind

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VLConfig:
        return cls.from_dict(read_json_object(Path(path) / "config.json", ConfigError))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VLConfig:
        arch = vl_architecture(d)
        if arch is None:
            raise ConfigError(f"not a vision-language config: architectures {d.get('architectures')!r}")
        kind, text_arch = VL_ARCHITECTURES[arch]
        defaults = _VISION_DEFAULTS[kind]
        text = dict(d.get("text_config") or d)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or d.get("rope_scaling") or {})
        section = tuple(int(s) for s in rope.get("mrope_section") or defaults["mrope_section"])
        text_dict = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling", "architectures")}
        text_dict["architectures"] = [text_arch]
        text_dict["rope_theta"] = rope.get("rope_theta") or text.get("rope_theta") or d.get("rope_theta") or 10000.0
        # The output head's tie and the special ids live at the top level of the VL config.
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "torch_dtype", "dtype"):
            if key in d and (key == "tie_word_embeddings" or text_dict.get(key) is None):
                text_dict[key] = d[key]
        text_dict.setdefault("tie_word_embeddings", False)
        text_cfg = ModelConfig.from_dict(text_dict)
        if len(section) != 3 or sum(section) != text_cfg.head_dim // 2:
            raise ConfigError(f"mrope_section {list(section)} must be 3 numbers summing to head_dim / 2 = {text_cfg.head_dim // 2}")
        rope_kind = rope.get("rope_type") or rope.get("type") or "default"
        if rope_kind not in ("default", "mrope"):
            raise ConfigError(f"unsupported rope type {rope_kind!r} for {arch}: only the default multimodal RoPE")
        return cls(
            text=text_cfg,
            vision=_vision_config(kind, d.get("vision_config") or {}),
            image_token_id=int(d.get("image_token_id", 151655)),
            video_token_id=int(d.get("video_token_id", 151656)),
            vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
            mrope_section=section,  # type: ignore[arg-type]
            mrope_interleaved=kind == "qwen3_vl",
        )


def vl_architecture(d: dict[str, Any]) -> str | None:
    """The VL architecture a config.json names, or None for a text-only model."""
    archs = d.get("architectures") if isinstance(d, dict) else None
    return next((a for a in archs if a in VL_ARCHITECTURES), None) if isinstance(archs, list) else None


def is_vision_language(path: str | Path) -> bool:
    try:
        return vl_architecture(read_json_object(Path(path) / "config.json", ConfigError)) is not None
    except (OSError, ConfigError):  # the text model's loader names what is wrong
        return False


def _vision_config(kind: str, v: dict[str, Any]) -> VisionConfig:
    defaults = _VISION_DEFAULTS[kind]

    def get(key: str) -> Any:
        return v[key] if v.get(key) is not None else defaults[key]

    rope = v.get("rope_parameters") or {}
    hidden = int(get("hidden_size"))
    heads = int(get("num_heads"))
    if hidden % heads or (hidden // heads) % 4:
        raise ConfigError(f"vision hidden_size {hidden} / num_heads {heads} must give a head_dim divisible by 4")
    cfg = VisionConfig(
        kind=kind,
        depth=int(get("depth")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_heads=heads,
        hidden_act=str(get("hidden_act")),
        in_channels=int(v.get("in_channels") or v.get("in_chans") or 3),
        patch_size=int(get("patch_size")),
        temporal_patch_size=int(v.get("temporal_patch_size") or 2),
        spatial_merge_size=int(v.get("spatial_merge_size") or 2),
        out_hidden_size=int(v.get("out_hidden_size") or 3584),
        rope_theta=float(rope.get("rope_theta") or 10000.0),
        num_position_embeddings=int(get("num_position_embeddings")) if kind == "qwen3_vl" else 0,
        deepstack_visual_indexes=tuple(int(i) for i in get("deepstack_visual_indexes")) if kind == "qwen3_vl" else (),
        window_size=int(get("window_size")) if kind == "qwen2_5_vl" else 0,
        fullatt_block_indexes=tuple(int(i) for i in get("fullatt_block_indexes")) if kind == "qwen2_5_vl" else (),
    )
    if cfg.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"unsupported vision hidden_act {cfg.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
    side = int(cfg.num_position_embeddings**0.5)
    if kind == "qwen3_vl" and side * side != cfg.num_position_embeddings:
        raise ConfigError(f"num_position_embeddings {cfg.num_position_embeddings} is not a square grid")
    return cfg


# Activation names as transformers spells them.
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu")
