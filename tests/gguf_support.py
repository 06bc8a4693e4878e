"""GGUF test files made by llama.cpp's own tools (tools/gguf_files.py): random llama /
qwen2 / qwen3 models from edge's make_model, converted by convert_hf_to_gguf.py and
quantized by llama-quantize, both from the llama-cpp-python source package.

The source package and the built llama-quantize are kept in ``$EDGE_TEST_TOOLS_CACHE``
(default ``~/.cache/edge-tools``) across sessions; the model files are made once per
session. The oracle is transformers: it reads the same GGUF file itself
(``gguf_file=``, dequantized by gguf-py to float32) into a model built from the original
config.json.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import gguf_files  # noqa: E402

from edge.model.random_model import LLAMA3_ROPE_SCALING, make_model  # noqa: E402

# Random models small enough for the CPU, shaped so that every K-quant applies (rows of
# 256 and 512 values): llama with Llama 3 RoPE scaling (rope_freqs) and its own lm_head,
# qwen2 with q/k/v biases and a tied lm_head, qwen3 with q/k norms and its own lm_head.
ARCH_VARIANTS: dict[str, dict] = {
    "llama": dict(arch="llama", tie_word_embeddings=False,
                  rope_scaling={**LLAMA3_ROPE_SCALING, "original_max_position_embeddings": 64}),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", tie_word_embeddings=False),
}
# Every type edge reads, as llama.cpp users have them: whole-file types of llama-quantize
# (Q4_K_M and Q5_K_M mix Q4_K / Q5_K with Q6_K), and the converter's float files.
FILE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")


def tools_cache() -> Path:
    return Path(os.environ.get("EDGE_TEST_TOOLS_CACHE") or Path.home() / ".cache" / "edge-tools")


@dataclass
class GGUFFiles:
    """HF directories and GGUF files made on first use, under ``root``."""

    root: Path
    cache: Path = field(default_factory=tools_cache)
    _made: dict[tuple[str, str], Path] = field(default_factory=dict)

    def source(self) -> Path:
        return gguf_files.llama_cpp_source(self.cache)

    def hf_dir(self, variant: str) -> Path:
        out = self.root / f"hf-{variant}"
        if not (out / "config.json").is_file():
            spec = dict(ARCH_VARIANTS[variant])
            make_model(out, arch=spec.pop("arch"), preset="tiny", seed=7, num_hidden_layers=2, **spec)
        return out

    def file(self, variant: str, qtype: str) -> Path:
        """``variant`` converted to F32 by the converter, then to ``qtype`` by llama-quantize
        (F32 itself: the converter's file)."""
        key = (variant, qtype)
        if key in self._made:
            return self._made[key]
        src = self.source()
        f32 = self.root / f"{variant}-F32.gguf"
        if not f32.is_file():
            gguf_files.convert(src, self.hf_dir(variant), f32, "f32", pre="gpt-2")
        out = f32
        if qtype != "F32":
            out = self.root / f"{variant}-{qtype}.gguf"
            gguf_files.quantize(gguf_files.quantize_binary(self.cache, src), f32, out, qtype)
        self._made[key] = out
        return out

    def vocab_only(self, hf_dir: Path, pre: str) -> Path:
        """The converter's vocabulary-only file of ``hf_dir`` (metadata, no tensors)."""
        out = hf_dir / "vocab.gguf"
        gguf_files.convert(self.source(), hf_dir, out, "f32", pre=pre, vocab_only=True)
        return out

    def split(self, variant: str, max_tensors: int) -> list[Path]:
        out = self.root / f"split-{variant}" / f"{variant}.gguf"
        if not out.parent.is_dir():
            out.parent.mkdir(parents=True)
            gguf_files.convert(self.source(), self.hf_dir(variant), out, "f32", pre="gpt-2",
                               split_max_tensors=max_tensors)
        return sorted(out.parent.glob("*.gguf"))


def transformers_oracle(hf_dir: Path, gguf_path: Path):  # noqa: ANN201 - a transformers model
    """A transformers model of ``hf_dir``'s config.json holding the weights transformers
    reads from ``gguf_path`` (its own GGUF loader: names, q/k order, gguf-py's
    dequantization to float32)."""
    import transformers

    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = from_gguf.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def greedy_reference(model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:  # noqa: ANN001
    """transformers' greedy continuation of ``ids`` and its logits at every step."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [lg[0].float() for lg in out.logits]


# Two logits closer than this (relative to the logits' spread) are a tie that float
# rounding may break either way: edge and transformers add in different orders.
NEAR_TIE = 1e-5


def assert_same_greedy(ours: list[int], ref: list[int], logits: list[torch.Tensor], what: str) -> None:
    """Equal token ids; a divergence is accepted only where transformers' own logits of
    the two tokens are a measured near-tie (the rest then follows another path)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        lg = logits[i]
        gap = float(lg[b] - lg[a]) / float(lg.max() - lg.min())
        assert gap < NEAR_TIE, f"{what}: token {i} is {a}, transformers {b} (relative logit gap {gap:.2e})"
        return
    assert len(ours) == len(ref), what


# Where each type keeps its float16 scales (byte offsets in a block): filled with finite
# random halves, so the comparison has no NaN payloads to disagree on.
HALF_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_rows(name: str, rows: int, in_features: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """uint8 ``[rows, row_bytes]`` of random blocks of type ``name`` (scales ~ ``scale``)."""
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if block == 1:
        dt = {"F32": np.float32, "F16": np.float16, "BF16": np.float32}[name]
        vals = (rng.standard_normal((rows, in_features)) * scale).astype(dt)
        if name == "BF16":
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return vals.view(np.uint8).reshape(rows, -1)
    data = rng.integers(0, 256, size=(rows, in_features // block, size), dtype=np.uint8)
    for off in HALF_OFFSETS[name]:
        halves = (rng.standard_normal((rows, in_features // block)) * scale).astype(np.float16)
        data[:, :, off : off + 2] = halves.view(np.uint8).reshape(rows, -1, 2)
    return data.reshape(rows, -1)


# Scales of random blocks that give weights of about 0.02 (a 6-bit sub-scale times a code
# is up to ~2000 for Q6_K, ~1000 for Q5_K).
WEIGHT_SCALES = {"Q4_0": 4e-3, "Q8_0": 3e-4, "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 2e-5}


def random_gguf_model(root: Path, device: torch.device, dtype: torch.dtype):  # noqa: ANN201 - a Model
    """A 2-layer qwen3 model (make_model's tiny shape, tied lm_head) on random GGUF blocks
    mixed as in a Q4_K_M file: q/k Q4_K with v Q6_K, o Q4_K, gate/up Q5_K, down Q6_K, the
    embedding (and so the lm_head) Q6_K."""
    from edge.model.config import ModelConfig
    from edge.model.decoder import Model
    from edge.quant.gguf import GGUFEmbedding, GGUFPart, GGUFWeight

    hf = root / "cfg"
    make_model(hf, arch="qwen3", preset="tiny", num_hidden_layers=2)
    cfg = ModelConfig.from_pretrained(hf)
    seed = [0]

    def blocks(parts: list[tuple[str, int]], cols: int) -> GGUFWeight:
        out = []
        for name, rows in parts:
            seed[0] += 1
            data = random_rows(name, rows, cols, seed=seed[0], scale=WEIGHT_SCALES[name])
            out.append(GGUFPart(int(GGMLQuantizationType[name]), torch.from_numpy(data).to(device)))
        return GGUFWeight(out, cols)

    def norm(n: int) -> torch.Tensor:
        seed[0] += 1
        g = torch.Generator().manual_seed(seed[0])
        return (1 + 0.05 * torch.randn(n, generator=g)).to(device=device, dtype=dtype)

    h, inter = cfg.hidden_size, cfg.intermediate_size
    w: dict = {
        "model.embed_tokens.weight": GGUFEmbedding(blocks([("Q6_K", cfg.vocab_size)], h), dtype),
        "model.norm.weight": norm(h),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.qkv_proj.weight": blocks([("Q4_K", cfg.q_size + cfg.kv_size), ("Q6_K", cfg.kv_size)], h),
            p + "self_attn.o_proj.weight": blocks([("Q4_K", h)], cfg.q_size),
            p + "mlp.gate_up_proj.weight": blocks([("Q5_K", 2 * inter)], h),
            p + "mlp.down_proj.weight": blocks([("Q6_K", h)], inter),
            p + "self_attn.q_norm.weight": norm(cfg.head_dim),
            p + "self_attn.k_norm.weight": norm(cfg.head_dim),
        }
    return Model(cfg, w, 256)
