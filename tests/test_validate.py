"""Broken model directories are refused at load with one line naming what is wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

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


# -- hostile model directories: refused fast, in one line -------------------------------------


def _edit_json(d: Path, file: str, **changes: object) -> None:
    raw = json.loads((d / file).read_text())
    raw.update(changes)
    (d / file).write_text(json.dumps(raw))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


HOSTILE_DIRS = [
    ("config is a list", lambda d: (d / "config.json").write_text("[1, 2]"),
     "must hold a JSON object, not a JSON array"),
    ("a million layers", lambda d: _edit_json(d, "config.json", num_hidden_layers=1_000_000), "beyond any model"),
    ("three layers of two", lambda d: _edit_json(d, "config.json", num_hidden_layers=3), "holds 2 layers"),
    ("vocab of another model", lambda d: _edit_json(d, "config.json", vocab_size=1000), "has "),
    ("config is a FIFO", lambda d: _fifo(d / "config.json"), "is a FIFO, not a regular file"),
    ("config is /dev/zero", lambda d: _link(d / "config.json", "/dev/zero"), "is a character device"),
    ("tokenizer_config is a FIFO", lambda d: _fifo(d / "tokenizer_config.json"), "is a FIFO"),
    ("weights are a FIFO", lambda d: _fifo(d / "model.safetensors"), "is a FIFO"),
    ("template does not compile",
     lambda d: _edit_json(d, "tokenizer_config.json", chat_template="{% for m in messages %}{{ m.content }"),
     "does not compile"),
    ("template is a number", lambda d: _edit_json(d, "tokenizer_config.json", chat_template=5), "chat_template"),
]


@pytest.mark.parametrize(("name", "break_it", "match"), HOSTILE_DIRS, ids=[c[0] for c in HOSTILE_DIRS])
def test_hostile_model_directories_fail_fast(model_dir: Path, tmp_path: Path, name: str, break_it, match: str) -> None:
    d = shutil.copytree(model_dir, tmp_path / "m")
    break_it(d)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            Engine.from_pretrained(d, device="cpu", kv_cache="paged", kv_blocks=8)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(30)
    assert outcome, f"{name}: still loading after 30 s"
    exc = outcome[0]
    assert isinstance(exc, (ValueError, RuntimeError)) and match in str(exc), repr(exc)
    assert "\n" not in str(exc)


def test_broken_template_and_wordlevel_tokenizer_in_generate_and_serve(model_dir: Path, tmp_path: Path) -> None:
    """One line in `edge generate` and `edge serve` alike; a tokenizer that cannot encode a
    word refuses that text (400), not the model."""
    from test_server_support import ServerProc

    bad_template = shutil.copytree(model_dir, tmp_path / "template")
    _edit_json(bad_template, "tokenizer_config.json", chat_template="{% if %}")
    line = one_line_error(edge_cli("generate", "--model", str(bad_template), "--max-tokens", "2"))
    assert "chat template" in line and "does not compile" in line
    srv = ServerProc(tmp_path / "srv1", "--model", str(bad_template))
    code = srv.proc.wait(60)
    log = srv.log()
    srv.stop()
    assert code == 1 and "Traceback" not in log and "does not compile" in log, log

    wordlevel = shutil.copytree(model_dir, tmp_path / "wordlevel")
    vocab = {"<|im_start|>": 0, "<|im_end|>": 1, "user": 2, "assistant": 3, "hi": 4, "\n": 5}
    (wordlevel / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        "pre_tokenizer": {"type": "Whitespace"}}))
    line = one_line_error(edge_cli("generate", "--model", str(wordlevel), "--prompt", "hello", "--max-tokens", "2"))
    assert "cannot encode this text" in line and "Missing [UNK]" in line
    r, log = _one_chat(wordlevel, tmp_path / "srv2", "hello there")
    assert r.status_code == 400 and "cannot encode" in r.json()["error"]["message"], r.text
    assert "Traceback" not in log, log


def _one_chat(model: Path, tmp: Path, content: str) -> tuple[Any, str]:
    """One chat request to ``edge serve --model model``: its answer and the server's log."""
    from test_server_support import CHAT, ServerProc

    srv = ServerProc(tmp, "--model", str(model)).wait_ready()
    try:
        with srv.client() as c:
            r = c.post(CHAT, json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    finally:
        srv.stop()
    return r, srv.log()


def test_a_template_failing_when_rendered_serves_and_answers_400(model_dir: Path, tmp_path: Path) -> None:
    """A template that compiles but fails on every conversation: the server starts (its
    warm-up uses token ids, with one warning line) and each chat gets a one-line 400."""
    d = shutil.copytree(model_dir, tmp_path / "adds")
    _edit_json(d, "tokenizer_config.json", chat_template="{{ messages[0].content + 1 }}")
    r, log = _one_chat(d, tmp_path / "srv", "hi")
    assert r.status_code == 400 and "chat template failed: TypeError" in r.json()["error"]["message"], r.text
    assert "Traceback" not in log and "warming up with token ids" in log, log


def test_an_empty_model_path_is_named_as_such() -> None:
    """``--model "$(edge pull NAME)"`` after a failed download passes an empty string."""
    line = one_line_error(edge_cli("generate", "--model", "", "--max-tokens", "1"))
    assert "empty string" in line and "edge pull" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU answers")
@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_a_gpu_device_without_a_gpu_is_one_line(kernels: str) -> None:
    line = one_line_error(edge_cli("generate", "--device", "cuda", "--kernels", kernels, "--max-tokens", "1"))
    assert "sees no CUDA GPU" in line and "--device cpu" in line
