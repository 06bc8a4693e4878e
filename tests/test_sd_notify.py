"""sd_notify from the standard library, the watchdog's health rule, the unit file."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_server_support import ROOT, ServerProc, server_env

from edge.serving.sd_notify import Notifier, Watchdog


class NotifySocket:
    """A SOCK_DGRAM socket standing in for systemd's; collects every datagram."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path if not path.startswith("@") else "\0" + path[1:])
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def lines(self) -> list[str]:
        return [line for m in list(self.messages) for line in m.split("\n")]

    def wait_for(self, line: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.lines():
            assert time.monotonic() < deadline, f"no {line!r} in {self.lines()}"
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def test_notifier_is_a_no_op_outside_systemd() -> None:
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval_s is None
    assert n.ready() is False and n.watchdog() is False


def test_notifier_sends_to_a_path_and_to_the_abstract_namespace(tmp_path: Path) -> None:
    for addr in (str(tmp_path / "notify"), f"@edge-test-{os.getpid()}"):
        sink = NotifySocket(addr)
        try:
            n = Notifier({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "3000000"})
            assert n.watchdog_interval_s == 1.5
            assert n.ready("ready: test")
            assert n.status("serving 1 request") and n.watchdog() and n.stopping()
            deadline = time.monotonic() + 5
            while len(sink.messages) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sink.messages == ["READY=1\nSTATUS=ready: test", "STATUS=serving 1 request", "WATCHDOG=1",
                                     "STOPPING=1"]
            n.close()
        finally:
            sink.close()


def test_watchdog_for_another_pid_is_ignored() -> None:
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_usec is None
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000",
                     "WATCHDOG_PID": str(os.getpid())}).watchdog_usec == 1000


def test_watchdog_pings_only_while_healthy(tmp_path: Path) -> None:
    sink = NotifySocket(str(tmp_path / "notify"))
    healthy = threading.Event()
    healthy.set()
    wd = Watchdog(Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")}), healthy.is_set,
                  status=lambda: "fine" if healthy.is_set() else "sick", interval_s=0.02, status_period_s=0.02)
    wd.start()
    try:
        time.sleep(0.3)
        assert sink.lines().count("WATCHDOG=1") >= 3 and "STATUS=fine" in sink.lines()
        healthy.clear()
        time.sleep(0.1)  # a ping may be in flight
        before = sink.lines().count("WATCHDOG=1")
        time.sleep(0.3)
        assert sink.lines().count("WATCHDOG=1") == before, "pings continued while unhealthy"
        assert "STATUS=sick" in sink.lines()
        healthy.set()
        time.sleep(0.3)
        assert sink.lines().count("WATCHDOG=1") > before
    finally:
        wd.stop()
        sink.close()


class _FakeScheduler:
    def __init__(self) -> None:
        self.alive = True
        self.heartbeat = time.monotonic()

    def stats(self) -> dict:
        return {"alive": self.alive, "last_heartbeat": self.heartbeat, "queue_depth": 0, "slots": []}


def test_service_health_rule_follows_the_engine_loop() -> None:
    from edge.serving.service import Service
    from edge.settings import Settings

    svc = Service(Settings(), environ={"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "200000"})
    assert svc.state == "starting" and svc.healthy()  # before the loader thread even exists
    svc.state = "ready"
    sched = _FakeScheduler()
    svc.scheduler = sched
    assert svc.healthy()
    sched.heartbeat = time.monotonic() - svc.heartbeat_stale_s - 1  # loop stuck
    assert not svc.healthy()
    assert svc.health()[0] is False
    sched.heartbeat = time.monotonic()
    sched.alive = False  # loop thread died
    assert not svc.healthy()
    sched.alive = True
    assert svc.healthy() and svc.health()[0] is True
    svc.state = "failed"
    assert not svc.healthy()


def test_service_under_a_fake_notify_socket(tmp_path: Path) -> None:
    addr = str(tmp_path / "notify.sock")
    sink = NotifySocket(addr)
    srv = ServerProc(tmp_path / "srv", env=server_env(NOTIFY_SOCKET=addr, WATCHDOG_USEC="200000"))
    try:
        sink.wait_for("READY=1")
        srv.wait_ready(timeout=10)  # READY=1 came after warm-up: /health is already 200
        assert srv.health_seen == [200]
        n = sink.lines().count("WATCHDOG=1")
        time.sleep(0.6)
        assert sink.lines().count("WATCHDOG=1") >= n + 3  # every 0.1 s
        statuses = [line for line in sink.lines() if line.startswith("STATUS=")]
        assert any(s.startswith("STATUS=loading") for s in statuses), statuses
        assert any(s.startswith("STATUS=ready") for s in statuses), statuses
        lines = sink.lines()
        assert lines.index("READY=1") > next(i for i, s in enumerate(lines) if s.startswith("STATUS=loading"))
        assert "WATCHDOG=1" in lines[: lines.index("READY=1")]  # pinged while loading
        assert "withholding" not in srv.log() and " ERROR " not in srv.log(), srv.log()
        srv.signal()
        assert srv.proc.wait(15) == 0, srv.log()
        assert "STOPPING=1" in sink.lines()
    finally:
        srv.stop()
        sink.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_file_verifies(tmp_path: Path) -> None:
    unit = (ROOT / "systemd" / "edge.service").read_text()
    for needle in ("Type=notify", "WatchdogSec=30", "Restart=on-failure", "EnvironmentFile=/etc/edge/edge.env",
                   "User=edge", "SupplementaryGroups=video render jtop", "NoNewPrivileges=yes", "ProtectSystem=strict",
                   "StandardOutput=journal"):
        assert needle in unit, needle
    directives = [line.strip() for line in unit.splitlines() if line.strip() and not line.startswith("#")]
    assert "PrivateDevices=yes" not in directives  # would hide /dev/nvhost-*, /dev/nvmap, /dev/nvgpu
    # The installed ExecStart (/opt/edge/venv/bin/edge) does not exist here: point it
    # at this interpreter so verify checks everything else.
    lines = [f"ExecStart={sys.executable} -m edge.cli serve" if line.startswith("ExecStart=") else line
             for line in unit.splitlines()]
    path = tmp_path / "edge.service"
    path.write_text("\n".join(lines) + "\n")
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "edge.service" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_env_example_is_valid_config() -> None:
    from edge.settings import load_env_file, resolve

    path = ROOT / "systemd" / "edge.env.example"
    values = load_env_file(path)
    assert values["EDGE_HOST"] == "127.0.0.1"
    settings, _ = resolve({}, {}, path)
    assert settings.port == 8000 and settings.queue_size == 8


def test_what_loading_made_is_frozen_out_of_garbage_collection() -> None:
    """A full collection over the loaded model holds every thread, the token loop's too:
    the service freezes it once ready, and gives it back to the collector when it stops."""
    import gc

    from edge.serving.service import Service
    from edge.settings import Settings

    gc.unfreeze()
    svc = Service(Settings(), environ={})  # no NOTIFY_SOCKET, no monitor settings
    try:
        svc.start()
        deadline = time.monotonic() + 120
        while svc.state not in ("ready", "failed") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.state == "ready", svc.error
        assert gc.get_freeze_count() > 10_000  # the engine, torch and the libraries
        assert not gc.is_tracked(svc.engine) or svc.engine not in gc.get_objects(generation=2)
    finally:
        svc.shutdown()
    assert gc.get_freeze_count() == 0
