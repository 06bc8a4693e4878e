"""Shared fixtures: random Hugging Face checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    """``EDGE_TEST_SMS=16``: run the GPU tests confined to 16 SMs (an AGX Orin's count).
    ``EDGE_TEST_GPU_FRACTION=0.3``: this process may take that share of GPU memory (engines
    size their KV pools to it), so several suites can share one GPU."""
    fraction = os.environ.get("EDGE_TEST_GPU_FRACTION")
    if fraction and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(fraction))
    sms = os.environ.get("EDGE_TEST_SMS")
    if sms and torch.cuda.is_available():
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
        from orin_shape import restrict_sms

        config._edge_green_context = restrict_sms(int(sms))  # kept alive for the session


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _edge_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the embedded default model and kernel cache out of the user's home,
    unless the caller chose a cache directory."""
    if "EDGE_CACHE_DIR" not in os.environ:
        os.environ["EDGE_CACHE_DIR"] = str(tmp_path_factory.mktemp("edge-cache"))


# Small shapes that still exercise GQA, multi-layer residuals and RoPE. A larger
# initializer range than HF's default spreads the logits so greedy decoding has no
# near-ties that float rounding could flip.
HF_VARIANTS = {
    "llama3-scaled": dict(
        arch="LlamaForCausalLM",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
    "qwen2-bias-tied": dict(arch="Qwen2ForCausalLM", tie_word_embeddings=True),
    "qwen3-untied": dict(arch="Qwen3ForCausalLM", tie_word_embeddings=False),
}


def build_hf_model(arch: str, out_dir: Path, seed: int = 0, **overrides):
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[arch]
    model_cls = getattr(transformers, arch)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


@pytest.fixture(scope="session", params=sorted(HF_VARIANTS))
def hf_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(variant name, transformers model, saved directory) for each architecture."""
    spec = dict(HF_VARIANTS[request.param])
    arch = spec.pop("arch")
    out = tmp_path_factory.mktemp(request.param)
    model = build_hf_model(arch, out, **spec)
    return request.param, model, out


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory: pytest.TempPathFactory):
    """GGUF files made by llama.cpp's converter and llama-quantize (tests/gguf_support.py)."""
    from gguf_support import GGUFFiles

    return GGUFFiles(tmp_path_factory.mktemp("gguf"))
