"""``edge serve``: the service (edge/serving/service.py) behind the OpenAI API (edge/serving/),
run by uvicorn over loopback TCP or a Unix socket.

    edge serve --model DIR [--host 127.0.0.1] [--port 8000] [--uds PATH] ...

* ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` or not; SSE
  ``data: {chunk}`` events ending with ``data: [DONE]``), ``GET /v1/models``,
  ``POST /v1/cancel/{id}`` (barge-in while the stream stays open; closing the stream
  cancels too), ``GET /health`` (503 until loaded and warmed), ``GET /metrics``.
* SIGTERM/SIGINT: the service refuses new work, uvicorn drains the connections, the
  service cancels what is left and stops; exit code 0.

Settings are in :mod:`edge.settings`. torch is imported by the loading thread, not here.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import uvicorn

from edge.serving.app import create_app
from edge.serving.connections import Config, ConnectionLimits, connection_cap
from edge.serving.log_limits import limit_repeats
from edge.serving.service import Service
from edge.settings import Settings
from edge.serving.uds import UnixListener

log = logging.getLogger("edge.serving.server")


class _Server(uvicorn.Server):
    """uvicorn, telling the service about SIGTERM/SIGINT before it drains connections."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.service.begin_shutdown()
        super().handle_exit(sig, frame)


def build_server(settings: Settings, *, environ: dict[str, str] | None = None) -> tuple[_Server, Service,
                                                                                            UnixListener | None]:
    """The server, its service and, with ``settings.uds``, the bound Unix socket (raises
    SocketUnavailable when another server owns the path)."""
    listener = UnixListener.bind(settings.uds, settings.uds_mode, settings.uds_group) if settings.uds else None
    service = Service(settings, environ)
    app = create_app(service)
    level = settings.log_level.lower()
    limits = ConnectionLimits(settings.header_timeout_s, settings.body_timeout_s, settings.keep_alive_s,
                              connection_cap(settings.max_connections))
    config = Config(
        app,
        limits,
        host=settings.host,
        port=settings.port,
        log_level=level,
        log_config=None,  # our logging setup (journald gets one format)
        access_log=level == "debug",
        timeout_graceful_shutdown=settings.shutdown_grace_s + 3.0,
        lifespan="on",
        server_header=False,
    )
    server = _Server(config, service)

    def request_exit(code: int) -> None:
        service.exit_code = code
        server.should_exit = True

    service.request_exit = request_exit
    return server, service, listener


def serve(settings: Settings) -> int:
    """Run the service until SIGTERM/SIGINT; the exit code (0 on a clean shutdown)."""
    limit_repeats()  # an attack repeats one message thousands of times a second
    server, service, listener = build_server(settings)
    where = f"unix:{settings.uds}" if settings.uds else f"http://{settings.host}:{settings.port}"
    log.info("edge serve: listening on %s, model %s", where, settings.model or "(embedded default)")
    # uvicorn re-raises the signal it caught after shutting down; with these no-op
    # handlers in place that ends in a normal return and exit code 0.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[listener.sock] if listener else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if listener is not None:
            listener.close()
    if not server.started and service.exit_code == 0:
        return 1  # could not bind
    return service.exit_code
