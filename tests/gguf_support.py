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

import torch

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
