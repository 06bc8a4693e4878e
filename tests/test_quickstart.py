"""The README's quick-start commands run on the base install: no extra is needed.

Each command runs in a fresh interpreter in which the packages that only the extras
install ([test], [cuda], [nvrtc], [jetson]) cannot be imported, as after
``pip install -c constraints.txt -e .``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from test_server_support import ROOT, free_port, server_env

# Top-level modules installed only by the extras of pyproject.toml.
EXTRAS_ONLY = ("transformers", "hypothesis", "pexpect", "pytest", "cuda", "nvidia", "pynvml", "jtop")

BLOCKER = f"""
import importlib.abc, runpy, sys
class _ExtrasOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {EXTRAS_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (installed only by an extra)", name=name)
        return None
sys.meta_path.insert(0, _ExtrasOnly())
target, sys.argv = sys.argv[1], sys.argv[1:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def base_install(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER, *args], cwd=ROOT, env=server_env(), input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_base_dependencies_hold_the_http_stack() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert block is not None
    names = {re.split(r"[<>=!~ \[]", d.strip().strip('",'))[0].lower() for d in block.group(1).splitlines()
             if d.strip().startswith('"')}
    assert {"fastapi", "uvicorn", "httpx", "prometheus-client", "pydantic"} <= names, names


def test_generate_commands() -> None:
    r = base_install("edge.cli", "generate", "--max-tokens", "4")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = base_install("edge.cli", "generate", "--prompt", "Hello", "--max-tokens", "32", "--json")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)) >= {"token_ids", "text", "finish_reason", "ttft_ms", "decode_tok_s"}
    r = base_install("edge.cli", "generate", "--kv", "contiguous", "--prompt-ids", "5,6,7", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr


def test_make_model_preset_then_generate_prints_text(tmp_path: Path) -> None:
    out = tmp_path / "qwen3-0.6b"  # the README's command; one layer keeps it quick, the vocabulary is real
    r = base_install("tools/make_model.py", str(out), "--preset", "qwen3-0.6b", "--dtype", "bfloat16",
                     "--num-layers", "1")
    assert r.returncode == 0, r.stderr
    r = base_install("edge.cli", "generate", "--model", str(out), "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert len(result["token_ids"]) == 8 and result["text"].strip(), result


def test_info_has_no_import_error() -> None:
    r = base_install("edge.cli", "info")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert "error" not in info["monitor"], info["monitor"]
    assert "ModuleNotFoundError" not in r.stdout


def test_chat_in_process() -> None:
    r = base_install("edge.cli", "chat", "--in-process", "--max-tokens", "4", stdin="Hello\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "edge chat" in r.stdout


def test_monitor() -> None:
    r = base_install("edge.cli", "monitor", "--count", "1", "--source", "none", "--json")
    assert r.returncode == 0, r.stderr


def test_serve_answers(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", BLOCKER, "edge.cli", "serve", "--port", str(port)], cwd=ROOT,
                            env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()
        log.close()
