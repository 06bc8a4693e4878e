"""Config and checkpoint loading: sharded files and every error path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edge.model.config import ConfigError, ModelConfig
from edge.runtime.engine import Engine
from edge.model.loader import CheckpointError, fuse_weights, iter_tensor_rows, load_weights
from edge.model.random_model import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "qwen3", preset="tiny", num_hidden_layers=2)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_the_same_weights(model_dir: Path, tmp_path: Path) -> None:
    sharded = make_model(tmp_path / "sharded", preset="tiny", num_hidden_layers=2, max_shard_bytes=200_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_pretrained(model_dir)
    a = load_weights(model_dir, cfg, torch.device("cpu"), torch.float32)
    b = load_weights(sharded, cfg, torch.device("cpu"), torch.float32)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_directory() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine.from_pretrained("/no/such/model")


def test_missing_tensor_is_named(model_dir: Path, tmp_path: Path) -> None:
    d = copy(model_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        Engine.from_pretrained(d)


def test_mismatched_shape_names_tensor_and_shapes(model_dir: Path, tmp_path: Path) -> None:
    d = copy(model_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 256)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(7, 256\), config\.json implies \(128, 256\)"):
        Engine.from_pretrained(d)


def test_unreadable_file(model_dir: Path, tmp_path: Path) -> None:
    d = copy(model_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"this is not safetensors")
    with pytest.raises(CheckpointError, match="cannot read safetensors file"):
        Engine.from_pretrained(d)


def test_missing_shard(model_dir: Path, tmp_path: Path) -> None:
    d = make_model(tmp_path / "sharded", preset="tiny", num_hidden_layers=2, max_shard_bytes=200_000)
    shard = sorted(d.glob("model-0000*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name}"):
        Engine.from_pretrained(d)


def test_no_weights_at_all(model_dir: Path, tmp_path: Path) -> None:
    d = copy(model_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Engine.from_pretrained(d)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture.*MistralForCausalLM"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_unsupported_config_fields_are_named(model_dir: Path, change: dict, match: str) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(change)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_missing_required_field(model_dir: Path) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("chunk_bytes", [1, 3000, 70_000])
def test_row_chunks_load_the_same_weights(model_dir: Path, chunk_bytes: int) -> None:
    """Reading in row chunks (one row, a few rows, several tensors' worth) gives what
    safetensors' own whole-file load gives."""
    cfg = ModelConfig.from_pretrained(model_dir)
    whole = fuse_weights(load_file(model_dir / "model.safetensors").items(), cfg, torch.device("cpu"), torch.float32)
    chunked = load_weights(model_dir, cfg, torch.device("cpu"), torch.float32, chunk_bytes=chunk_bytes)
    assert whole.keys() == chunked.keys()
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)
    pieces = list(iter_tensor_rows(model_dir, ["model.embed_tokens.weight"], chunk_bytes))
    vocab, hidden = pieces[0].shape
    per = max(1, chunk_bytes // (hidden * 4))
    assert [p.row for p in pieces] == list(range(0, vocab, per))
    assert all(p.data.shape[0] <= per for p in pieces)
