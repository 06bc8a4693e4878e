"""Slow and excess connections against a live ``edge serve`` (edge/serving/connections.py):
request heads and bodies that never complete are closed, connections past the cap
(below the file-descriptor limit) get 503, the log stays short, and SIGTERM with
stalled bodies exits cleanly without tracebacks."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from hostile_support import SlowClients
from test_server_support import CHAT, HELLO, ServerProc, server_env

from edge.serving.connections import BACKLOG, FD_RESERVE, connection_cap
from edge.serving.log_limits import RepeatLimiter

NOFILE = 256  # the server's descriptor limit: the cap must stay below it


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    env = server_env(EDGE_HEADER_TIMEOUT_S="1", EDGE_BODY_TIMEOUT_S="2", EDGE_MAX_CONNECTIONS="40")
    srv = ServerProc(tmp_path_factory.mktemp("connections"), env=env, nofile=NOFILE)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_the_cap_fits_the_descriptor_limit() -> None:
    assert connection_cap(256, limit=1024, in_use=20) == 256
    assert connection_cap(256, limit=300, in_use=20) == 300 - 20 - FD_RESERVE - 2 * BACKLOG
    with pytest.raises(ValueError, match="file descriptor limit"):
        connection_cap(256, limit=64, in_use=10)


def test_repeats_are_summarized() -> None:
    limiter = RepeatLimiter(window_s=0.2)
    rec = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                             None, None) for _ in range(4)]
    assert [limiter.filter(r) for r in rec[:3]] == [True, False, False]
    time.sleep(0.25)
    assert limiter.filter(rec[3]) and "(and 2 more like it" in rec[3].getMessage()


def _post_until_served(c, body: dict, within_s: float) -> httpx.Response:
    """POST as a well-behaved client does: on 503 wait the Retry-After and try again."""
    deadline = time.monotonic() + within_s
    while True:
        r = c.post(CHAT, json=body)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        time.sleep(float(r.headers.get("retry-after", "1")))


def test_slow_and_excess_connections(server: ServerProc) -> None:
    with server.client() as c, server.client() as streaming:
        assert c.get("/health").status_code == 200
        # a request in flight before the attack keeps its connection and ends whole
        body = {"messages": HELLO, "max_tokens": 48, "ignore_eos": True, "stream": True}
        with streaming.stream("POST", CHAT, json=body) as stream:
            assert stream.status_code == 200
            slow = SlowClients(server, 150)  # silent, half a head, a stalled body, in turn: past the cap of 40
            try:
                assert slow.failed == 0  # none hangs: the excess are answered and closed
                text = "".join(stream.iter_text())
                assert text.endswith("data: [DONE]\n\n"), text[-300:]
                # a new client meets 503 + Retry-After while the cap is full, then is served once the
                # head (1 s) and body (2 s) deadlines have shed the slow connections
                r = _post_until_served(c, {"messages": HELLO, "max_tokens": 2}, within_s=30.0)
                assert r.status_code == 200, r.text
                fig = slow.outcome(wait_s=30.0)
            finally:
                slow.close()
        assert fig["answered_503"] > 0 and fig["still_open"] == 0, (fig, server.log()[-3000:])
        assert c.get("/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log and "out of system resource" not in log, log[-3000:]
    assert log.count("refused a connection") <= 2, log[-3000:]  # one line per 10 s, with a count


def _post_raw(server: ServerProc, path: str, body: bytes) -> tuple[bytes, list[str]]:
    """``body`` sent whole from one thread while another reads the answer to its end: what
    came back, and the sender's errors (a client that sends and reads at once)."""
    import socket
    import threading

    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(30)
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              f"content-length: {len(body)}\r\n\r\n".encode())
    errors: list[str] = []

    def send() -> None:
        try:
            for i in range(0, len(body), 1 << 16):
                s.sendall(body[i:i + (1 << 16)])
        except OSError as exc:
            errors.append(repr(exc))

    sender = threading.Thread(target=send)
    sender.start()
    answer = b""
    try:
        while chunk := s.recv(1 << 16):
            answer += chunk
    except OSError as exc:
        errors.append(repr(exc))
    sender.join(30)
    s.close()
    return answer, errors


def test_a_client_still_sending_gets_the_early_answer(server: ServerProc) -> None:
    """A body refused before it is all in (413 from its Content-Length, 400 from its shape):
    the answer reaches a client still sending, which meets no connection reset."""
    too_large = b'{"messages": [{"role": "user", "content": "' + b"x" * (8 << 20) + b'"}]}'
    too_many = b'{"prompt": [null' + b",0" * ((1 << 20) // 2 - 16) + b"]}"
    for path, body, status in ((CHAT, too_large, b" 413 "), ("/v1/completions", too_many, b" 400 ")):
        answer, errors = _post_raw(server, path, body)
        assert status in answer.split(b"\r\n", 1)[0] and b'"error"' in answer and not errors, (answer[:200], errors)
    with server.client() as c:  # and the server goes on
        assert c.post(CHAT, json={"messages": HELLO, "max_tokens": 1}).status_code == 200


def test_sigterm_with_stalled_bodies_exits_quietly(server: ServerProc) -> None:
    slow = SlowClients(server, 20, "body")
    try:
        t0 = time.monotonic()
        assert server.stop() == 0
        took = time.monotonic() - t0
    finally:
        slow.close()
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert "timeout graceful shutdown exceeded" not in log, took
