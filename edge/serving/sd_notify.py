"""systemd notification protocol (``sd_notify(3)``) from the standard library.

A datagram of ``KEY=VALUE`` lines to the ``AF_UNIX``/``SOCK_DGRAM`` socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` names the abstract namespace). Outside systemd
(no ``$NOTIFY_SOCKET``) every call is a cheap no-op.

The service sends ``STATUS=`` lines while loading, ``READY=1`` after warm-up,
``WATCHDOG=1`` every ``$WATCHDOG_USEC / 2`` from :class:`Watchdog` -- only while a
health check (the engine loop is alive and its heartbeat recent) passes, so a hung
engine stops the pings and systemd restarts the service -- and ``STOPPING=1`` on
shutdown.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def _address(path: str) -> str | bytes:
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path


class Notifier:
    """Sends notifications to ``$NOTIFY_SOCKET``; ``enabled`` is False outside systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.socket_path = env.get("NOTIFY_SOCKET") or None
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()  # sends may come from a signal handler
        self._warned = False
        self.watchdog_usec = self._watchdog_usec(env)

    @staticmethod
    def _watchdog_usec(env: Mapping[str, str]) -> int | None:
        raw = env.get("WATCHDOG_USEC")
        if not raw:
            return None
        pid = env.get("WATCHDOG_PID")
        if pid and pid.strip() != str(os.getpid()):
            return None  # the watchdog is meant for another process
        try:
            usec = int(raw)
        except ValueError:
            log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
            return None
        return usec if usec > 0 else None

    @property
    def enabled(self) -> bool:
        return self.socket_path is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half the watchdog timeout, as sd_watchdog_enabled(3) advises."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 2e6

    def send(self, *lines: str) -> bool:
        """Send one datagram; False (never an exception) when it cannot be sent."""
        if self.socket_path is None or not lines:
            return False
        data = "\n".join(lines).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(data, _address(self.socket_path))
                return True
            except OSError as exc:
                if not self._warned:
                    log.warning("sd_notify to %s failed: %s", self.socket_path, exc)
                    self._warned = True
                return False

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class Watchdog:
    """A daemon thread: every ``interval_s`` sends ``WATCHDOG=1`` if ``healthy()``
    is true, and the ``status()`` line whenever it changes (checked every
    ``status_period_s``). With no watchdog configured it only keeps STATUS current."""

    def __init__(
        self,
        notifier: Notifier,
        healthy: Callable[[], bool],
        status: Callable[[], str | None] | None = None,
        interval_s: float | None = None,
        status_period_s: float = 1.0,
    ) -> None:
        self.notifier = notifier
        self.healthy = healthy
        self.status_fn = status
        self.interval_s = interval_s if interval_s is not None else notifier.watchdog_interval_s
        self.status_period_s = status_period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_status: str | None = None
        self.pings = 0
        self.missed = 0

    def start(self) -> Watchdog:
        if not self.notifier.enabled or self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="edge-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _tick_status(self) -> None:
        if self.status_fn is None:
            return
        try:
            text = self.status_fn()
        except Exception:  # a status line must never kill the watchdog
            log.exception("status callback failed")
            return
        if text and text != self._last_status:
            self._last_status = text
            self.notifier.status(text)

    def _tick_watchdog(self) -> None:
        try:
            ok = bool(self.healthy())
        except Exception:
            log.exception("health check failed")
            ok = False
        if ok:
            self.notifier.watchdog()
            self.pings += 1
            if self.missed:
                log.warning("engine healthy again; watchdog pings resumed")
            self.missed = 0
        else:
            self.missed += 1
            if self.missed == 1:
                log.error("engine loop not alive or not beating: withholding WATCHDOG=1 (systemd will restart us)")

    def _run(self) -> None:
        import time

        period = self.status_period_s
        if self.interval_s is not None:
            period = min(period, self.interval_s)
        next_ping = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if self.interval_s is not None and now >= next_ping:
                self._tick_watchdog()
                next_ping = now + self.interval_s
            self._tick_status()
            self._stop.wait(max(0.01, min(period, (next_ping - time.monotonic()) if self.interval_s else period)))
