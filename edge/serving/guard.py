"""Requests a web page could make the browser send (or read) are refused.

* Host: only loopback names and addresses (``localhost``, ``*.localhost``,
  ``127.0.0.0/8``, ``::1``), the address the server is bound to, and what
  ``EDGE_ALLOWED_HOSTS`` adds (``*`` turns the check off). A DNS-rebinding page
  reaches the server under its own host name and is refused. Unix-socket servers
  skip this check: no browser connects to them.
* POST bodies must be ``application/json``: a cross-site form or ``text/plain`` post
  (a "simple" request the browser sends without asking) is refused with 415. A POST
  without a body (``/v1/cancel/{id}``) needs no Content-Type.
* No CORS headers are sent unless ``EDGE_CORS_ORIGINS`` names origins (then
  Starlette's CORSMiddleware answers for exactly those).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from typing import Any

from edge.serving.errors import HostNotAllowed, UnsupportedMediaType, error_response

log = logging.getLogger(__name__)

WILDCARD_BINDS = ("0.0.0.0", "::", "")


def host_of(header: str) -> str:
    """The host part of a Host header, lower case, without port and trailing dot."""
    h = header.strip().lower()
    if h.startswith("["):  # [IPv6]:port
        h = h[1:].partition("]")[0]
    elif h.count(":") == 1:
        h = h.partition(":")[0]
    return h.rstrip(".")


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostPolicy:
    """Which Host headers a TCP server answers: loopback, its bind address, and
    ``extra`` names (``*.example.com`` matches subdomains, ``*`` anything)."""

    def __init__(self, bind_host: str, extra: Iterable[str] = ()) -> None:
        names = {host_of(e) if e.strip() != "*" else "*" for e in extra if e.strip()}
        self.any = "*" in names
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))
        bind = host_of(bind_host)
        self.names = {n for n in names if not n.startswith("*")} | ({bind} if bind not in WILDCARD_BINDS else set())
        if bind in WILDCARD_BINDS and not names:
            log.warning("listening on all interfaces, but only loopback Host names are answered; "
                        "set EDGE_ALLOWED_HOSTS to the names clients use")

    def allows(self, host: str) -> bool:
        return self.any or _is_loopback(host) or host in self.names or host.endswith(self.suffixes)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def check_request(scope: dict, hosts: HostPolicy | None) -> None:
    """Raise HostNotAllowed or UnsupportedMediaType for a request a page could forge."""
    if hosts is not None:
        header = _header(scope, b"host")
        if header is not None and not hosts.allows(host_of(header)):
            raise HostNotAllowed(f"host {host_of(header)!r} is not served here; add it to EDGE_ALLOWED_HOSTS "
                                 "to allow it")
    if scope.get("method") == "POST":
        ctype = _header(scope, b"content-type")
        length = _header(scope, b"content-length")
        has_body = _header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() != "0")
        media = (ctype or "").partition(";")[0].strip().lower()
        if (ctype is not None or has_body) and media != "application/json":
            raise UnsupportedMediaType(f"POST bodies must be 'Content-Type: application/json', got "
                                       f"{ctype or 'none'!r}", param="Content-Type")


class RequestGuard:
    """Pure ASGI middleware applying :func:`check_request` before anything else runs."""

    def __init__(self, app: Any, hosts: HostPolicy | None) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            try:
                check_request(scope, self.hosts)
            except (HostNotAllowed, UnsupportedMediaType) as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
