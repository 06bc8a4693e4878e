"""Connections that cannot pile up: header and body deadlines, and a cap below the
file-descriptor limit.

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but waits
forever for a request head that never completes or a body that stalls, and accepts
until ``accept()`` fails for want of file descriptors (then asyncio logs that failure
on every retry). Its HTTP/1.1 protocol is extended here:

* a request head must arrive within ``header_timeout_s`` of the connection opening
  or of the previous response ending, and its body within ``body_timeout_s`` of the
  head; otherwise the connection is closed (the handler waiting for the body sees the
  client gone and ends without a traceback);
* past ``max_connections`` open connections a new one is answered 503 and closed at
  once, so the process never runs out of descriptors;
* on shutdown, connections still sending a body are closed rather than waited for;
* an answer sent before the request's body is in (a 413 for a body too large, a 400 for
  one refused by its shape) is followed by a lingering close: the write side is shut,
  so the answer and then the end reach the client, and what it still sends is read
  and dropped for at most ``LINGER_S``. Closing with unread bytes would send a reset,
  and a client still sending loses the answer to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import resource
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("edge.connections")

FD_RESERVE = 64  # descriptors kept for the process itself: model files, sockets to systemd, logs
# asyncio accepts up to the listen backlog of connections in one go, before any of them
# reaches the protocol (and its cap): that many, twice (accepted, and refused but not
# yet closed), must fit beside the cap.
BACKLOG = 32
LINGER_S = 2.0  # how long a client still sending after its answer is read from before the close


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 256


def fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return 32


def connection_cap(wanted: int, limit: int | None = None, in_use: int | None = None) -> int:
    """``wanted`` connections, or fewer where the descriptor limit (``ulimit -n``,
    systemd's ``LimitNOFILE=``) leaves less room beside what the process holds;
    ValueError when it leaves almost none."""
    limit = fd_limit() if limit is None else limit
    in_use = open_fds() if in_use is None else in_use
    room = limit - in_use - FD_RESERVE - 2 * BACKLOG
    if room < 4:
        raise ValueError(f"the file descriptor limit ({limit}) leaves no room for connections beside the "
                         f"{in_use} descriptors in use; raise it (ulimit -n, LimitNOFILE=)")
    if room < wanted:
        log.warning("serving at most %d connections (EDGE_MAX_CONNECTIONS is %d, but the file descriptor "
                    "limit is %d with %d in use); raise the limit (ulimit -n, LimitNOFILE=)",
                    room, wanted, limit, in_use)
    return min(wanted, room)


class Config(uvicorn.Config):
    """uvicorn's settings plus ours, for :class:`GuardedH11Protocol`."""

    def __init__(self, app: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedH11Protocol, timeout_keep_alive=max(1, round(limits.keep_alive_s)),
                         backlog=BACKLOG, **kwargs)
        self.connection_limits = limits


def _busy_response() -> bytes:
    body = json.dumps({"error": {"message": "the server has too many open connections; retry later",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


BUSY_RESPONSE = _busy_response()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and the cap of the module docstring."""

    def __init__(self, config: Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.limits: ConnectionLimits = config.connection_limits
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._raw: asyncio.Transport | None = None
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refused = True
            log.warning("refused a connection: %d are open, the limit (EDGE_MAX_CONNECTIONS)",
                        len(self.connections))
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        self._raw = transport
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._expect_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._refused and not self._lingering:  # lingering: the answer is out, the rest is dropped
            super().data_received(data)

    def eof_received(self) -> bool | None:
        if self._lingering:
            self._close_now()
            return False
        return super().eof_received()

    @property
    def lingering(self) -> bool:
        """The answer is out and the write side shut; what arrives is dropped."""
        return self._lingering

    def linger(self) -> bool:
        """Called for a close while the request body is still arriving: shut the write
        side after the answer and drop what still comes, until the client ends or
        ``LINGER_S`` passes. False when a plain close is what is wanted."""
        raw = self._raw
        if (self._lingering or raw is None or raw.is_closing() or self.conn.their_state is not h11.SEND_BODY
                or not raw.can_write_eof()):
            return False
        self._lingering = True
        self._cancel_deadline()
        raw.write_eof()
        raw.resume_reading()  # flow control may have paused it: read, so as to drop
        self._deadline = self.loop.call_later(LINGER_S, self._close_now)
        return True

    def _close_now(self) -> None:
        self._cancel_deadline()
        if self._raw is not None and not self._raw.is_closing():
            self._raw.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None and not self.transport.is_closing():
            self._arm(self.limits.body_timeout_s, self._body_late, self.cycle)  # a new request's head is in

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():  # (a pipelined request has its own)
            self._expect_head()

    def shutdown(self) -> None:
        if self._lingering or self._receiving_body():  # nobody waits for a body that may never come
            self._close_now()
            return
        super().shutdown()

    # -- deadlines ----------------------------------------------------------------------------

    def _expect_head(self) -> None:
        self._arm(self.limits.header_timeout_s, self._head_late, self.cycle)

    def _arm(self, delay: float, callback: Any, cycle: Any) -> None:
        self._cancel_deadline()
        # Spread over a tenth of the delay: a thousand connections opened together must
        # not all be closed in one turn of the event loop, which would delay the streams.
        self._deadline = self.loop.call_later(delay * (1.0 + 0.1 * random.random()), callback, cycle)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _receiving_body(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete and self.conn.their_state is h11.SEND_BODY

    def _head_late(self, cycle: Any) -> None:
        # No new request since the deadline was set: nothing, or half a head, arrived.
        if self.cycle is cycle and not self.transport.is_closing():
            log.info("closed a connection that sent no complete request head in %.0f s",
                     self.limits.header_timeout_s)
            self.transport.close()

    def _body_late(self, cycle: Any) -> None:
        if self.cycle is cycle and self._receiving_body() and not self.transport.is_closing():
            log.info("closed a connection whose request body did not arrive in %.0f s", self.limits.body_timeout_s)
            self.transport.close()


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: a close while the request body is
    still arriving lingers (:meth:`GuardedH11Protocol.linger`), and the connection then
    counts as closing."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport, self._protocol = transport, protocol
        self.write = transport.write  # the per-event calls, bound once
        self.get_extra_info = transport.get_extra_info

    def close(self) -> None:
        if not self._protocol.linger():
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
