from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from edge.model import random_model as rm
from edge.model.random_model import (
    PRESETS,
    default_model_path,
    make_model,
    model_config,
    random_state_dict,
    state_dict_shapes,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
ARCHS = ["llama", "qwen2", "qwen3"]


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def file_digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


# ---------------------------------------------------------------- configs


def test_tiny_preset_defaults() -> None:
    config = model_config()
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["vocab_size"] == rm.tokenizer_vocab_size()
    expected = {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["hidden_act"] == "silu" and config["attention_bias"] is False
    ids = rm.special_token_ids()
    assert config["eos_token_id"] == ids["<|im_end|>"] and config["bos_token_id"] == ids["<|endoftext|>"]


def test_published_presets() -> None:
    llama = model_config(preset="llama-3.2-1b")
    assert llama["architectures"] == ["LlamaForCausalLM"]
    assert llama["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["intermediate_size"]) == (2048, 16, 8192)
    assert (llama["vocab_size"], llama["rope_theta"], llama["rms_norm_eps"]) == (128256, 500000.0, 1e-5)
    assert llama["tie_word_embeddings"] is True and llama["attention_bias"] is False
    q8 = model_config(preset="qwen3-8b")
    assert (q8["hidden_size"], q8["num_hidden_layers"], q8["num_attention_heads"]) == (4096, 36, 32)
    assert q8["tie_word_embeddings"] is False and q8["vocab_size"] == 151936
    assert model_config("qwen2", "qwen3-0.6b")["attention_bias"] is True


def test_overrides_and_errors() -> None:
    config = model_config("llama", "tiny", num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=False)
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 1024
    assert "lm_head.weight" in state_dict_shapes(config)
    with pytest.raises(ValueError, match="preset"):
        model_config(preset="nope")
    with pytest.raises(ValueError, match="architecture"):
        model_config("gpt2")


SHAPE_CASES = [(None, preset, {}) for preset in sorted(PRESETS)] + [
    ("qwen2", "qwen3-0.6b", {}),
    ("qwen3", "tiny", {"attention_bias": True, "tie_word_embeddings": False}),
    ("llama", "tiny", {"attention_bias": True}),
]


@pytest.mark.parametrize(("arch", "preset", "overrides"), SHAPE_CASES)
def test_preset_shapes_match_transformers(transformers, arch: str | None, preset: str, overrides: dict) -> None:
    config = model_config(arch, preset, **overrides)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        expected.pop("lm_head.weight")
    assert state_dict_shapes(config) == expected


# ---------------------------------------------------------------- weights


def test_state_dict_names_per_arch() -> None:
    for arch in ARCHS:
        names = list(random_state_dict(model_config(arch, num_hidden_layers=1)))
        assert any(k.endswith("q_proj.bias") for k in names) == (arch == "qwen2")
        assert any(k.endswith("q_norm.weight") for k in names) == (arch == "qwen3")
        assert "lm_head.weight" not in names  # tiny is tied, like Qwen3-0.6B
    qwen3 = random_state_dict(model_config("qwen3", num_hidden_layers=1))
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].shape == (64,)


def test_init_statistics_and_dtype() -> None:
    sd = random_state_dict(model_config(num_hidden_layers=1), seed=3, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in sd.values())
    emb = sd["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 0.002
    norm = sd["model.norm.weight"].float()
    assert abs(norm.mean().item() - 1.0) < 0.02 and norm.std().item() > 0.01  # not exactly ones
    bias = random_state_dict(model_config("qwen2", num_hidden_layers=1))["model.layers.0.self_attn.q_proj.bias"]
    assert 0.01 < bias.std().item() < 0.03


def test_weights_are_deterministic_and_order_independent() -> None:
    a = random_state_dict(model_config(num_hidden_layers=2), seed=7)
    b = random_state_dict(model_config(num_hidden_layers=1), seed=7)
    c = random_state_dict(model_config(num_hidden_layers=1), seed=8)
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert not any(torch.equal(b[k], c[k]) for k in b)


def test_random_tensor_independent_of_dtype_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rm, "_CHUNK_ELEMENTS", 1000)  # several chunks, one of them partial
    full = rm.random_tensor("w.weight", (37, 101), seed=4)
    assert torch.equal(rm.random_tensor("w.weight", (37, 101), seed=4, dtype=torch.bfloat16), full.bfloat16())
    assert abs(full.std().item() - 0.02) < 0.003
    if torch.cuda.is_available():
        assert torch.equal(rm.random_tensor("w.weight", (37, 101), seed=4, device="cuda").cpu(), full)


@pytest.mark.parametrize("arch", ARCHS)
def test_written_model_loads_in_transformers(transformers, tmp_path: Path, arch: str) -> None:
    overrides = {"tie_word_embeddings": False} if arch == "llama" else {}
    d = make_model(tmp_path / arch, arch=arch, num_hidden_layers=2, **overrides)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
    assert type(model).__name__ == rm.ARCHITECTURES[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = random_state_dict(json.loads((d / "config.json").read_text()))
    theirs = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    if arch == "llama":
        assert not torch.equal(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, ours["model.embed_tokens.weight"].shape[0])
    assert torch.isfinite(logits).all()


def test_llama3_rope_scaling_loads(transformers, tmp_path: Path) -> None:
    d = make_model(
        tmp_path / "m",
        arch="llama",
        num_hidden_layers=1,
        max_position_embeddings=16384,
        rope_scaling=dict(rm.LLAMA3_ROPE_SCALING),
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d))
    rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0


def test_sharded_model(transformers, tmp_path: Path) -> None:
    single = make_model(tmp_path / "single", arch="qwen2", num_hidden_layers=2)
    sharded = make_model(tmp_path / "sharded", arch="qwen2", num_hidden_layers=2, max_shard_bytes=600_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert all(p.name.endswith(f"-of-{len(shards):05d}.safetensors") for p in shards)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    weights = load_weights(sharded)
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    reference = load_weights(single)
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(sharded), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # A limit the model fits under writes one plain file.
    roomy = make_model(tmp_path / "roomy", num_hidden_layers=1, max_shard_bytes=1 << 30)
    assert (roomy / "model.safetensors").exists() and not (roomy / "model.safetensors.index.json").exists()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", num_hidden_layers=1, seed=11, dtype="bfloat16")
    b = make_model(tmp_path / "b", num_hidden_layers=1, seed=11, dtype="bfloat16")
    c = make_model(tmp_path / "c", num_hidden_layers=1, seed=12, dtype="bfloat16")
    assert file_digests(a) == file_digests(b)
    da, dc = file_digests(a), file_digests(c)
    assert da["model.safetensors"] != dc["model.safetensors"]
    assert da["tokenizer.json"] == dc["tokenizer.json"] and da["config.json"] == dc["config.json"]
    assert json.loads((a / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert next(iter(load_weights(a).values())).dtype == torch.bfloat16


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    code = "import hashlib; from edge.model.random_model import tokenizer_json; print(hashlib.sha256(tokenizer_json().encode()).hexdigest())"
    env = {**os.environ, "PYTHONHASHSEED": "123", "RAYON_NUM_THREADS": "3", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hashlib.sha256(rm.tokenizer_json().encode()).hexdigest()


def test_presets_tokenizer_covers_the_model_vocabulary(transformers) -> None:
    from tokenizers import Tokenizer

    from edge.model.tokenizer import Tokenizer as EdgeTokenizer

    vocab = PRESETS["qwen3-0.6b"]["vocab_size"]
    covering = Tokenizer.from_str(rm.covering_tokenizer_json(vocab))
    trained = Tokenizer.from_str(rm.tokenizer_json())
    assert covering.get_vocab_size(with_added_tokens=True) == vocab
    assert all(covering.decode([i], skip_special_tokens=False) for i in range(vocab))  # every id is text
    texts = [rm.CORPUS, "<|im_start|>user\nHi 今天 🎉<|im_end|>\n<|endoftext|>", "  spaces\ttabs\n"]
    for text in texts:  # encoding is the trained tokenizer's, also as transformers reads the file
        assert covering.encode(text).ids == trained.encode(text).ids
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=covering)
    assert hf.encode(texts[1], add_special_tokens=False) == trained.encode(texts[1]).ids
    assert EdgeTokenizer(covering).decode([vocab - 1])


# ---------------------------------------------------------------- default model and CLI


def test_default_model_path_created_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path))
    # Two processes race to create it; both must end up with the same complete model.
    code = "from edge.model.random_model import default_model_path; print(default_model_path())"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [Path(proc.communicate()[0].strip()) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    path = tmp_path / "models" / "default-v1"
    assert results == [path] * 2
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["default-v1"]  # no temp dirs left
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["num_hidden_layers"] == 4
    assert config["torch_dtype"] == "float32"
    before = file_digests(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime and file_digests(path) == before


def test_a_killed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path))
    code = "from edge.model.random_model import default_model_path; default_model_path()"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    models = tmp_path / "models"
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".default-v1-") for p in (models.iterdir() if models.is_dir() else ())):
        assert time.monotonic() < deadline and proc.poll() is None, "the build never started"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # mid-build
    proc.wait()
    leftovers = [p.name for p in models.iterdir()]
    assert leftovers and all(n.startswith(".default-v1-") for n in leftovers), leftovers
    path = default_model_path()
    assert sorted(p.name for p in models.iterdir()) == ["default-v1"]
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 4


def test_cli_from_repo_root(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [
        sys.executable,
        "tools/make_model.py",
        str(out),
        "--arch",
        "llama",
        "--num-layers",
        "1",
        "--vocab-size",
        "1024",
        "--dtype",
        "float16",
        "--max-shard-mb",
        "0.25",
        "--seed",
        "5",
    ]
    subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1 and config["vocab_size"] == 1024
    assert (out / "model.safetensors.index.json").exists()
    weights = load_weights(out)
    assert weights["model.embed_tokens.weight"].dtype == torch.float16
    expected = rm.random_tensor("model.norm.weight", (256,), seed=5, dtype=torch.float16)
    assert torch.equal(weights["model.norm.weight"], expected)
