"""Model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.model.files import read_json_object
from edge.model.validate import ConfigError, check_config_fields

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

if TYPE_CHECKING:  # torch is imported where tensors are made: reading a config (the fit check) needs none
    import torch

# Dtype names a user may give -> torch's name.
DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def dtype_name(value: "str | torch.dtype") -> str:
    """torch's name (float32, bfloat16, float16) of a dtype or of a name a user may give."""
    if not isinstance(value, str):
        name = str(value).removeprefix("torch.")
        if name not in DTYPE_NAMES.values():
            raise ConfigError(f"unsupported dtype {value}; use float32, bfloat16 or float16")
        return name
    try:
        return DTYPE_NAMES[value.lower()]
    except KeyError:
        raise ConfigError(f"unsupported dtype {value!r}; use float32, bfloat16 or float16") from None


def parse_dtype(value: "str | torch.dtype") -> "torch.dtype":
    import torch

    return getattr(torch, dtype_name(value))


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors of the inverse frequencies (a GGUF file's rope_freqs tensor,
    # llama.cpp's form of Llama 3 scaling); None: none.
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no config.json at {file}")
        return cls.from_dict(read_json_object(file, ConfigError))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        check_config_fields(d)
        archs = d.get("architectures") or []
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ConfigError(
                f"unsupported architecture {archs or d.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = SUPPORTED_ARCHITECTURES[known[0]]

        def need(key: str) -> Any:
            if key not in d or d[key] is None:
                raise ConfigError(f"config.json lacks required field {key!r} for {known[0]}")
            return d[key]

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")
        if d.get("use_sliding_window"):
            raise ConfigError("unsupported field use_sliding_window=true: sliding-window attention is not implemented")
        if arch == "llama" and d.get("mlp_bias"):
            raise ConfigError("unsupported field mlp_bias=true")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")

        # transformers >= 5 writes rope_parameters (theta inside); older files rope_scaling.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if arch == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=arch == "qwen3",
            rope_scaling=_rope_scaling(rope),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            raw=d,
        )


def _rope_scaling(rs: dict[str, Any]) -> RopeScaling | None:
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(f"unsupported rope_scaling type {kind!r}: only 'llama3' is implemented")
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ConfigError(f"rope_scaling of type llama3 lacks field {exc.args[0]!r}") from None


def rope_cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE rows ``[..., D]`` of ``angles [..., D / 2]``: cos, and sin with rotate_half's
    sign folded in (``cat(-sin[:D/2], sin[D/2:])``), in the angles' dtype."""
    import torch

    emb = torch.cat((angles, angles), dim=-1)
    half = angles.shape[-1]
    sin = emb.sin()
    return emb.cos(), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_tables(inv_freq: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 RoPE tables ``[max_pos, 2 * len(inv_freq)]`` (:func:`rope_cos_sin`), row p
    for position p."""
    import torch

    return rope_cos_sin(torch.outer(torch.arange(max_pos, dtype=torch.float64, device=inv_freq.device),
                                    inv_freq.double()))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (float64 for exactness), Llama 3 scaling applied if configured."""
    import torch

    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if cfg.rope_freq_factors is not None:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
