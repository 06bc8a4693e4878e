"""Service settings: precedence CLI > environment > config file > defaults; the file format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_server_support import ROOT

from edge.settings import (
    Settings,
    export_file_vars,
    parse_env_file,
    read_api_key,
    resolve,
)


def test_defaults_bind_loopback() -> None:
    s, file_vars = resolve({}, {})
    assert s == Settings()
    assert s.host == "127.0.0.1" and s.port == 8000 and s.uds is None and file_vars == {}


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    cfg = tmp_path / "edge.env"
    cfg.write_text("EDGE_PORT=9001\nEDGE_QUEUE_SIZE=3\nEDGE_HOST=0.0.0.0\nEDGE_MODEL=/from/file\n")
    env = {"EDGE_PORT": "9002", "EDGE_QUEUE_SIZE": "4"}
    s, _ = resolve({"port": 9003, "model": None}, env, cfg)
    assert s.port == 9003  # CLI
    assert s.queue_size == 4  # environment over file
    assert s.host == "0.0.0.0" and s.model == "/from/file"  # file over defaults
    assert s.page_size == 16  # default
    # the file can also come from $EDGE_CONFIG or the CLI's config
    assert resolve({}, {"EDGE_CONFIG": str(cfg)})[0].port == 9001
    assert resolve({"config": str(cfg)}, {})[0].config == str(cfg)


def test_env_file_syntax() -> None:
    text = """
# comment
; also a comment
EDGE_MODEL="/opt/models/with space"
EDGE_MODEL_NAME='single quoted'
export EDGE_HOST=127.0.0.1
EDGE_LOG_LEVEL = debug
EDGE_THERMAL_ZONES=cpu-thermal,\\
gpu-thermal
ESCAPED="a\\"b"
EMPTY=
"""
    v = parse_env_file(text)
    assert v == {
        "EDGE_MODEL": "/opt/models/with space",
        "EDGE_MODEL_NAME": "single quoted",
        "EDGE_HOST": "127.0.0.1",
        "EDGE_LOG_LEVEL": "debug",
        "EDGE_THERMAL_ZONES": "cpu-thermal,gpu-thermal",
        "ESCAPED": 'a"b',
        "EMPTY": "",
    }
    with pytest.raises(ValueError, match=":2: expected KEY=VALUE"):
        parse_env_file("A=1\nthis is not an assignment\n", "f")


@pytest.mark.parametrize("var,value", [("EDGE_PORT", "eighty"), ("EDGE_PORT", "70000"), ("EDGE_QUEUE_SIZE", "0"),
                                       ("EDGE_PREFIX_CACHE", "maybe"), ("EDGE_SHUTDOWN_GRACE_S", "-1"),
                                       ("EDGE_KV_MEMORY", "2 gigs"), ("EDGE_KV_MEMORY", "0"),
                                       ("EDGE_MEMORY_RESERVE", "-1GiB"), ("EDGE_PREFILL_BUDGET_MS", "0"),
                                       ("EDGE_PREFILL_BUDGET_MS", "fast")])
def test_bad_values_name_the_variable(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=var):
        resolve({}, {var: value})


def test_memory_settings() -> None:
    s, _ = resolve({}, {"EDGE_KV_MEMORY": "2GiB", "EDGE_MEMORY_RESERVE": "0"})
    assert (s.kv_memory, s.memory_reserve) == (2 << 30, 0)
    s, _ = resolve({"memory_reserve": 3 << 29}, {"EDGE_MEMORY_RESERVE": "4GiB"})
    assert s.memory_reserve == 3 << 29 and s.kv_memory is None


def test_prefill_budget_from_env_and_command_line() -> None:
    assert resolve({}, {})[0].prefill_budget_ms is None
    assert resolve({}, {"EDGE_PREFILL_BUDGET_MS": "12.5"})[0].prefill_budget_ms == 12.5
    assert resolve({"prefill_budget_ms": "30"}, {"EDGE_PREFILL_BUDGET_MS": "12.5"})[0].prefill_budget_ms == 30.0


def test_booleans_and_empty_values() -> None:
    s, _ = resolve({}, {"EDGE_PREFIX_CACHE": "off", "EDGE_CUDA_GRAPH": "auto", "EDGE_MODEL": ""})
    assert s.prefix_cache is False and s.cuda_graph is None and s.model is None
    assert resolve({}, {"EDGE_CUDA_GRAPH": "no"})[0].cuda_graph is False


def test_file_variables_reach_the_monitor_without_overriding_env(tmp_path: Path) -> None:
    cfg = tmp_path / "edge.env"
    cfg.write_text("EDGE_THERMAL_HARD_C=80\nEDGE_THERMAL_SOFT_C=70\nEDGE_CACHE_DIR=/from/file\n")
    _, file_vars = resolve({}, {}, cfg)
    env = {"EDGE_CACHE_DIR": "/from/env"}
    export_file_vars(file_vars, env)
    from edge.monitor import MonitorConfig

    mc = MonitorConfig.from_env(env)
    assert mc.hard_c == 80 and mc.soft_c == 70
    assert env["EDGE_CACHE_DIR"] == "/from/env"


def test_api_key_file(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("\n  sk-local-123  \nignored\n")
    assert read_api_key(f) == "sk-local-123"
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(f)


def test_api_key_file_is_checked_and_non_ascii_keys_match(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from starlette.requests import Request

    from edge.serving.completions import check_auth
    from edge.serving.errors import Unauthorized

    with pytest.raises(ValueError, match="is a directory") as exc:
        read_api_key(tmp_path)
    assert "\n" not in str(exc.value)
    key_file = tmp_path / "key"
    key_file.write_text("ключ-π-🔑\n", encoding="utf-8")
    key_file.chmod(0o644)
    with caplog.at_level("WARNING"):
        key = read_api_key(key_file)
    assert key == "ключ-π-🔑" and "readable by every user" in caplog.text
    key_file.chmod(0o600)
    caplog.clear()
    read_api_key(key_file)
    assert "readable" not in caplog.text

    def request(value: bytes) -> Request:
        return Request({"type": "http", "method": "GET", "path": "/", "headers": [(b"authorization", value)]})

    service = SimpleNamespace(api_key=key)
    check_auth(service, request(b"Bearer " + key.encode()))  # the UTF-8 bytes a client sends
    for wrong in (b"Bearer " + key.encode("utf-16"), b"Bearer " + key.encode()[:-1], b"Basic " + key.encode(),
                  "Bearer ключ-π-".encode() + b"\xff"):
        with pytest.raises(Unauthorized):
            check_auth(service, request(wrong))


def test_serve_reports_bad_config_clearly(tmp_path: Path) -> None:
    cfg = tmp_path / "edge.env"
    cfg.write_text("EDGE_PORT=not-a-port\n")
    r = subprocess.run([sys.executable, "-m", "edge.cli", "serve", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "EDGE_PORT" in r.stderr and str(cfg) in r.stderr
    r = subprocess.run([sys.executable, "-m", "edge.cli", "serve", "--config", str(tmp_path / "missing.env")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "does not exist" in r.stderr
