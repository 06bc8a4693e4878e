"""Broken model directories are refused at load with one line naming what is wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edge.model.config import ConfigError, ModelConfig
from edge.runtime.engine import Engine
from edge.model.loader import CheckpointError
from edge.model.random_model import make_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("v") / "m", preset="tiny", num_hidden_layers=2)


def edited(src: Path, dst: Path, **tensors: torch.Tensor) -> Path:
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights.update({k.replace("__", "."): v for k, v in tensors.items()})
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def edge_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    lines = [line for line in r.stderr.splitlines() if "edge: error:" in line or "Traceback" in line]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize(("field", "value"), [
    ("hidden_size", "256"), ("num_hidden_layers", 2.0), ("vocab_size", True), ("num_attention_heads", 0),
    ("rms_norm_eps", "1e-6"), ("rope_theta", float("nan")), ("tie_word_embeddings", "false"),
    ("eos_token_id", "2"), ("architectures", "Qwen3ForCausalLM"),
])
def test_config_field_types(model_dir: Path, field: str, value: object) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    raw[field] = value
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(raw)


def test_integer_weights_are_named(model_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    shape = load_file(model_dir / "model.safetensors")[name].shape
    d = edited(model_dir, tmp_path / "int", **{name.replace(".", "__"): torch.zeros(shape, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=rf"{name} is torch.int32, expected a float dtype"):
        Engine.from_pretrained(d)


@pytest.mark.parametrize(("name", "row"), [
    ("model.layers.1.self_attn.k_proj.weight", 5),  # fused into qkv_proj: the name is mapped back
    ("model.layers.0.mlp.up_proj.weight", 300),  # fused into gate_up_proj
    ("model.norm.weight", 17),
    ("model.embed_tokens.weight", 9),
])
def test_non_finite_weights_are_found_and_named(model_dir: Path, tmp_path: Path, name: str, row: int) -> None:
    w = load_file(model_dir / "model.safetensors")[name].clone()
    w.view(w.shape[0], -1)[row, 0] = float("nan")
    w.view(w.shape[0], -1)[row + 1, 0] = float("inf")
    d = edited(model_dir, tmp_path / "nan", **{name.replace(".", "__"): w})
    with pytest.raises(CheckpointError, match=rf"weight {name} holds 2 NaN or infinite values \(the first at "
                                              rf"\[{row}\b"):
        Engine.from_pretrained(d)
    Engine.from_pretrained(d, check_weights=False)  # skipped on request


def test_cli_refuses_nan_weights_in_one_line_and_can_skip(model_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    w = load_file(model_dir / "model.safetensors")[name].clone()
    w[3, 3] = float("nan")
    d = edited(model_dir, tmp_path / "nan", **{name.replace(".", "__"): w})
    assert name in one_line_error(edge_cli("generate", "--model", str(d), "--max-tokens", "2"))
    assert edge_cli("generate", "--model", str(d), "--max-tokens", "2", "--skip-weight-check").returncode == 0


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_tokenizer_files_give_one_line(model_dir: Path, tmp_path: Path, file: str) -> None:
    d = shutil.copytree(model_dir, tmp_path / "tok")
    (d / file).write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": ')
    line = one_line_error(edge_cli("generate", "--model", str(d), "--max-tokens", "2"))
    assert f"cannot parse {d / file}" in line


def test_model_pointing_at_a_file_asks_for_the_directory(model_dir: Path) -> None:
    line = one_line_error(edge_cli("generate", "--model", str(model_dir / "config.json")))
    assert "expects a model directory" in line and f"did you mean its directory {model_dir}" in line


def test_serve_reports_a_broken_model_in_one_line(model_dir: Path, tmp_path: Path) -> None:
    from test_server_support import ServerProc

    d = shutil.copytree(model_dir, tmp_path / "cfg")
    raw = json.loads((d / "config.json").read_text())
    raw["hidden_size"] = "256"
    (d / "config.json").write_text(json.dumps(raw))
    srv = ServerProc(tmp_path / "srv", "--model", str(d))
    code = srv.proc.wait(60)
    log = srv.log()
    srv.stop()
    assert code == 1 and "Traceback" not in log, log
    assert "model load failed: config.json field 'hidden_size' must be a positive integer, got '256' (str)" in log
