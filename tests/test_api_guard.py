"""Cross-site protection: which Host headers and POST content types get through."""

from __future__ import annotations

import pytest

from edge.serving.errors import HostNotAllowed, UnsupportedMediaType
from edge.serving.guard import HostPolicy, check_request, host_of


def scope(method: str = "GET", **headers: str) -> dict:
    return {"type": "http", "method": method,
            "headers": [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]}


@pytest.mark.parametrize(("header", "host"), [
    ("localhost:8000", "localhost"), ("LOCALHOST.", "localhost"), ("[::1]:8000", "::1"), ("::1", "::1"),
    ("127.0.0.1", "127.0.0.1"), ("attacker.example:80", "attacker.example"),
])
def test_host_header_parsing(header: str, host: str) -> None:
    assert host_of(header) == host


def test_loopback_allowed_by_default_and_rebinding_names_refused() -> None:
    p = HostPolicy("127.0.0.1")
    for ok in ("localhost", "127.0.0.1", "127.8.9.10", "::1", "app.localhost"):
        assert p.allows(ok), ok
    for bad in ("attacker.example", "localhost.attacker.example", "10.0.0.5", "0.0.0.0"):
        assert not p.allows(bad), bad
    with pytest.raises(HostNotAllowed):
        check_request(scope(host="attacker.example:8000"), p)
    check_request(scope(host="127.0.0.1:8000"), p)


def test_bind_address_and_configured_names() -> None:
    assert HostPolicy("192.168.1.5").allows("192.168.1.5")
    assert not HostPolicy("0.0.0.0").allows("192.168.1.5")
    p = HostPolicy("0.0.0.0", ["robot.lan", "*.fleet.example"])
    assert p.allows("robot.lan") and p.allows("a.fleet.example") and not p.allows("fleet.example.evil")
    assert HostPolicy("127.0.0.1", ["*"]).allows("anything.example")


def test_unix_socket_servers_skip_the_host_check() -> None:
    check_request(scope(host="edge"), None)


@pytest.mark.parametrize(("headers", "refused"), [
    ({"content_type": "application/json", "content_length": "12"}, False),
    ({"content_type": "Application/JSON; charset=utf-8", "content_length": "12"}, False),
    ({"content_type": "text/plain", "content_length": "12"}, True),  # a page's "simple" request
    ({"content_type": "application/x-www-form-urlencoded", "content_length": "12"}, True),
    ({"content_length": "12"}, True),  # a body must say what it is
    ({"transfer_encoding": "chunked"}, True),
    ({}, False),  # no body: POST /v1/cancel/{id}
    ({"content_length": "0"}, False),
    ({"content_type": "text/plain", "content_length": "0"}, True),
])
def test_post_needs_json(headers: dict, refused: bool) -> None:
    s = scope("POST", host="localhost", **headers)
    if refused:
        with pytest.raises(UnsupportedMediaType):
            check_request(s, HostPolicy("127.0.0.1"))
    else:
        check_request(s, HostPolicy("127.0.0.1"))
