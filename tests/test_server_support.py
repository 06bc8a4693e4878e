"""Helpers for the service tests: run the real ``edge serve`` process and talk to it.

(No tests here; imported by test_server*.py, test_sd_notify.py, test_chat_frontend.py.)
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there"}]


def ensure_default_model() -> Path:
    """Build the embedded model once per session (in $EDGE_CACHE_DIR, set by conftest)
    so servers started concurrently do not each build it."""
    from edge.model.random_model import default_model_path

    return default_model_path()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "EDGE_"))}
    env["EDGE_CACHE_DIR"] = os.environ["EDGE_CACHE_DIR"]
    env.update(
        OMP_NUM_THREADS="1",  # a tiny model on a shared 2-core box: threads only contend
        TOKENIZERS_PARALLELISM="false",
        EDGE_MONITOR_SOURCE="none",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class ServerProc:
    """``python -m edge.cli serve ...`` on a loopback port or a Unix socket."""

    def __init__(self, tmp: Path, *args: str, uds: bool = False, env: dict[str, str] | None = None,
                 api_key: str | None = None, nofile: int | None = None) -> None:
        ensure_default_model()
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.api_key = api_key
        cmd = [sys.executable, "-m", "edge.cli", "serve", *args]
        if uds:
            self.uds: str | None = str(self.tmp / "edge.sock")
            cmd += ["--uds", self.uds]
            self.base_url = "http://edge"
        else:
            self.uds = None
            self.port = free_port()
            cmd += ["--port", str(self.port)]
            self.base_url = f"http://127.0.0.1:{self.port}"
        if api_key is not None:
            key_file = self.tmp / "api.key"
            key_file.write_text(api_key + "\n")
            cmd += ["--api-key-file", str(key_file)]
        self.log_path = self.tmp / "server.log"
        self._log = open(self.log_path, "wb")
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env or server_env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, preexec_fn=None if nofile is None else
                                     lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
        self.health_seen: list[int] = []
        self.loading_probe: httpx.Response | None = None

    # -- clients ---------------------------------------------------------------------------

    def client(self, timeout: float = 60.0, auth: bool = True) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if (auth and self.api_key) else {}
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        return httpx.Client(base_url=self.base_url, transport=transport, timeout=timeout, headers=headers)

    def async_client(self, timeout: float = 60.0) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        transport = httpx.AsyncHTTPTransport(uds=self.uds) if self.uds else None
        return httpx.AsyncClient(base_url=self.base_url, transport=transport, timeout=timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=64))

    # -- lifecycle -------------------------------------------------------------------------

    def wait_ready(self, timeout: float = 120.0, probe_while_loading: bool = False) -> ServerProc:
        """Poll /health until 200, recording every status seen; optionally send one chat
        request while the model is still loading (kept in ``loading_probe``)."""
        deadline = time.monotonic() + timeout
        with self.client(timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    r = c.get("/health")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                if not self.health_seen or self.health_seen[-1] != r.status_code:
                    self.health_seen.append(r.status_code)
                if r.status_code == 200:
                    return self
                if probe_while_loading and self.loading_probe is None:
                    self.loading_probe = c.post(CHAT, json={"messages": HELLO, "max_tokens": 2})
                time.sleep(0.02)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    # -- observations ------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{label="v",...}': value} (parsed by prometheus_client)."""
        from prometheus_client.parser import text_string_to_metric_families

        with self.client(timeout=10.0) as c:
            text = c.get("/metrics").text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "condition") -> dict[str, float]:
        deadline = time.monotonic() + timeout
        m: dict[str, float] = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if predicate(m):
                return m
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; metrics: "
                             f"{ {k: v for k, v in m.items() if not k.startswith(('edge_time', 'edge_request_duration', 'python', 'process'))} }")


def slots_idle(m: dict[str, float]) -> bool:
    busy = sum(m.get(f'edge_slots{{state="{s}"}}', 0.0) for s in ("prefilling", "ready", "decoding"))
    return busy == 0 and m.get('edge_slots{state="idle"}', 0.0) == 2 and m.get("edge_requests_in_flight", 1) == 0


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    assert text.endswith("\n\n"), repr(text[-50:])
    events = []
    for block in text.split("\n\n")[:-1]:
        lines = block.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), repr(block)
        events.append(lines[0][len("data: "):])
    return events


def parse_stream(text: str) -> tuple[list[dict], str]:
    events = sse_events(text)
    assert events[-1] == "[DONE]", events[-3:]
    assert "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    return chunks, "".join(
        c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or ""
        for c in chunks if c["choices"]
    )
