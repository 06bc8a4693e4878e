"""Attacks on a live ``edge serve`` and the figures they produce (used by test_hostile.py).

Run directly to print the figures docs/reliability.md quotes, as JSON:

    EDGE_CACHE_DIR=/tmp/edge-cache python tests/hostile_support.py [--senders 2] [--mb 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402
from test_server_support import CHAT, HELLO, ServerProc, server_env, slots_idle  # noqa: E402


def _event_text(data: str) -> str:
    """What an SSE event says, less its request id and time."""
    try:
        choice = json.loads(data)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return data
    return json.dumps([choice.get("delta"), choice.get("text"), choice.get("finish_reason")])


@dataclass
class StreamProbe:
    """A long streaming request in a thread, recording when each event arrives. With
    ``repeat``, the same request again each time it ends (a GPU finishes 3000 tokens in
    seconds), until stopped; ``pos`` is each event's place in its own stream."""

    server: ServerProc
    max_tokens: int | None = 3000
    repeat: bool = False
    times: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    status: int | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, warm_events: int = 8, timeout: float = 60.0) -> StreamProbe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while len(self.times) < warm_events:
            if time.monotonic() > deadline or (self.status not in (None, 200)):
                raise RuntimeError(f"stream did not start: status {self.status}, {len(self.times)} events")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        body: dict = {"messages": HELLO, "ignore_eos": True, "stream": True, "temperature": 0}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        with self.server.client(timeout=120.0) as c:
            while True:
                with c.stream("POST", CHAT, json=body) as r:
                    self.status = r.status_code
                    n = 0
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.times.append(time.monotonic())
                            self.texts.append(_event_text(line[6:]))
                            self.pos.append(n)
                            n += 1
                        if self._stop.is_set():
                            return
                if not self.repeat or self.status != 200 or self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def gaps_ms(self, t0: float, t1: float) -> list[float]:
        """Gaps between consecutive events of one stream, for gaps ending in [t0, t1]."""
        ts, pos = list(self.times), list(self.pos)
        return [(ts[i] - ts[i - 1]) * 1e3 for i in range(1, min(len(ts), len(pos))) if pos[i] and t0 <= ts[i] <= t1]

    def run(self, timeout: float = 120.0) -> StreamProbe:
        """The whole stream, to its end."""
        self.start()
        if self._thread is not None:
            self._thread.join(timeout)
        return self

    def delays_ms(self, reference: StreamProbe, t0: float, t1: float) -> list[float] | None:
        """For gaps ending in [t0, t1], each gap less the gap between the same two events of
        ``reference``, the same greedy request streamed on a quiet server: the delay the
        server added, apart from what the text holds (tokens that end inside a character
        are sent with the next, so even a quiet stream has gaps of several tokens). None
        when the two streams' events differ."""
        ts, texts, pos, rs = list(self.times), list(self.texts), list(self.pos), reference.times
        out = []
        for i in range(1, min(len(ts), len(texts), len(pos))):
            p = pos[i]
            if not p or not t0 <= ts[i] <= t1 or p >= len(rs):
                continue
            if texts[i] != reference.texts[p]:
                return None
            out.append(((ts[i] - ts[i - 1]) - (rs[p] - rs[p - 1])) * 1e3)
        return out


@dataclass
class HealthProbe:
    """GET /health every ``period_s``, recording latency and status."""

    server: ServerProc
    period_s: float = 0.02
    latencies_ms: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, warm: int = 3, timeout: float = 60.0) -> HealthProbe:
        """Start polling; return once ``warm`` answers came (a busy machine is slow to begin)."""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while len(self.latencies_ms) < warm and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        with self.server.client(timeout=60.0) as c:
            while not self._stop.is_set():
                t = time.monotonic()
                r = c.get("/health")
                self.latencies_ms.append((time.monotonic() - t) * 1e3)
                self.statuses.append(r.status_code)
                self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)


def big_chat_body(n_bytes: int) -> bytes:
    """A chat request whose one message is ``n_bytes`` of ordinary text, JSON-encoded once."""
    words = "the quick brown fox jumps over the lazy dog "
    text = (words * (n_bytes // len(words) + 1))[:n_bytes]
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()


ATTACKER = """
import sys, httpx
url, uds, path, n, body_file = sys.argv[1], sys.argv[2] or None, sys.argv[3], int(sys.argv[4]), sys.argv[5]
body = open(body_file, "rb").read()
transport = httpx.HTTPTransport(uds=uds) if uds else None
with httpx.Client(base_url=url, transport=transport, timeout=120.0) as c:
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(n):
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        print(r.status_code, flush=True)
"""


class Attackers:
    """``senders`` processes, each posting one body ``rounds`` times once told to go.
    Separate processes, started and warmed up beforehand, so that neither their start
    nor their sending competes with the measuring threads of this process."""

    def __init__(self, server: ServerProc, body: bytes, senders: int, rounds: int, path: str = CHAT) -> None:
        self.body_file = server.tmp / f"attack-{len(body)}.json"
        self.body_file.write_bytes(body)
        self.procs = [subprocess.Popen([sys.executable, "-c", ATTACKER, server.base_url, server.uds or "", path,
                                        str(rounds), str(self.body_file)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(senders)]
        for proc in self.procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    def run(self) -> list[int]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        statuses: list[int] = []
        for proc in self.procs:
            out, _ = proc.communicate(timeout=300)
            statuses += [int(line) for line in out.split()]
        return statuses


def large_prompt_attack(server: ServerProc, n_bytes: int = 5 << 20, senders: int = 1, rounds: int = 1,
                        path: str = CHAT, body: bytes | None = None) -> dict:
    """A stream and /health probes running while ``senders`` clients each post
    ``rounds`` prompts of ``n_bytes``: the stream's largest gap, /health latency, 503s;
    the same figures for a quiet window of the same length before the attack."""
    body = big_chat_body(n_bytes) if body is None else body
    attackers = Attackers(server, body, senders, rounds, path)
    stream = StreamProbe(server).start()
    health = HealthProbe(server).start()
    n_warm = len(health.latencies_ms)
    time.sleep(1.0)  # the quiet window
    t0 = time.monotonic()
    n_quiet = len(health.latencies_ms)
    statuses = attackers.run()
    t1 = time.monotonic() + 0.3  # gaps that end just after the last answer count too
    time.sleep(0.3)
    health.stop()
    stream.stop()
    gaps = stream.gaps_ms(t0, t1)
    quiet = stream.gaps_ms(t0 - 1.0, t0)
    return {
        "body_bytes": len(body),
        "senders": senders,
        "rounds": rounds,
        "attack_s": round(t1 - 0.3 - t0, 3),
        "attack_statuses": sorted(statuses),
        "stream_status": stream.status,
        "stream_max_gap_ms": round(max(gaps), 1) if gaps else None,
        "stream_events_during_attack": len(gaps),
        "quiet_stream_max_gap_ms": round(max(quiet), 1) if quiet else None,
        "quiet_stream_median_gap_ms": round(statistics.median(quiet), 1) if quiet else None,
        "health_max_ms": round(max(health.latencies_ms[n_quiet:]), 1),
        "quiet_health_max_ms": round(max(health.latencies_ms[n_warm:n_quiet] or health.latencies_ms[:n_quiet]), 1),
        "health_polls": len(health.statuses),
        "count_503": health.statuses.count(503) + statuses.count(503),
    }


SLOW_CLIENT = """
import resource, socket, sys, time
host, port, n, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 64)), hard))
starts = {
    "silent": b"",
    "head": b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: localhost\\r\\n",
    "body": b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: localhost\\r\\nContent-Type: application/json\\r\\n"
            b"Content-Length: 1000\\r\\n\\r\\n{\\"messages\\": [",
}
socks, failed = [], 0
for i in range(n):
    k = kind if kind != "mix" else ("silent", "head", "body")[i % 3]
    try:
        s = socket.create_connection((host, port), timeout=10)
        if starts[k]:
            s.sendall(starts[k])
        socks.append(s)
    except OSError:
        failed += 1
print(len(socks), failed, flush=True)
wait_s = float(sys.stdin.readline())  # then: what becomes of each connection within wait_s
busy = closed = 0
deadline = time.monotonic() + wait_s
for s in socks:
    s.setblocking(False)
while socks and time.monotonic() < deadline:
    left = []
    for s in socks:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            left.append(s)
            continue
        except OSError:
            data = b""
        if data.startswith(b"HTTP/1.1 503"):
            busy += 1
        else:
            closed += 1
    socks = left
    time.sleep(0.1)
still = len(socks)
print(busy, closed, still, flush=True)
"""


class SlowClients:
    """``n`` connections from another process (its own descriptors) that send nothing,
    half a request head, or a head and a stalled body (``kind``: silent, head, body,
    mix); ``outcome()`` says how many were answered 503, closed, or are still open."""

    def __init__(self, server: ServerProc, n: int, kind: str = "mix") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SLOW_CLIENT, "127.0.0.1", str(server.port), str(n), kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        opened, failed = self.proc.stdout.readline().split()
        self.opened, self.failed = int(opened), int(failed)

    def outcome(self, wait_s: float = 0.0) -> dict[str, int]:
        """How the connections ended up, waiting up to ``wait_s`` for them all to end."""
        out, _ = self.proc.communicate(f"{wait_s}\n", timeout=wait_s + 60)
        busy, closed, still = (int(x) for x in out.split())
        return {"opened": self.opened, "connect_failed": self.failed, "answered_503": busy, "closed": closed,
                "still_open": still}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def rss_mib(pid: int) -> float:
    """A process's resident memory (VmRSS), MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def process_figures(server: ServerProc) -> dict:
    """The server's resident memory, open files and threads, and its KV blocks in use."""
    pid = server.proc.pid
    m = server.metrics()
    return {
        "rss_mib": round(rss_mib(pid), 1),
        "open_files": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "kv_blocks_used": m['edge_kv_blocks{state="used"}'],
        "kv_blocks_free": m['edge_kv_blocks{state="free"}'],
        "kv_blocks_evictable": m['edge_kv_blocks{state="evictable"}'],
        "kv_blocks_total": m["edge_kv_blocks_total"],
    }


async def _one_soak_request(client: httpx.AsyncClient, i: int) -> str:
    """Request ``i`` of the soak mix; returns its outcome."""
    messages = [{"role": "user", "content": f"Question {i}: how does the paged cache work?"}]
    kind = i % 6
    if kind == 0:
        r = await client.post(CHAT, json={"messages": messages, "max_tokens": 8, "ignore_eos": True})
        return f"plain {r.status_code}"
    if kind == 1:
        r = await client.post(CHAT, json={"messages": messages, "max_tokens": 8, "stream": True,
                                          "stream_options": {"include_usage": True}})
        done = r.text.endswith("data: [DONE]\n\n")
        return f"stream {r.status_code} {'done' if done else 'cut'}"
    if kind in (2, 3):  # leave mid-stream: by disconnecting, or by cancelling first
        rid = f"soak-{i}"
        body = {"messages": messages, "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", CHAT, json=body, headers={"X-Request-Id": rid}) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    if kind == 3:
                        c = await client.post(f"/v1/cancel/{rid}")
                        return f"cancel {c.status_code}"
                    return f"disconnect {r.status_code}"
        return f"ended {r.status_code}"
    if kind == 4:
        r = await client.post(CHAT, content=b'{"messages": [', headers={"Content-Type": "application/json"})
        return f"bad {r.status_code}"
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7, i % 500], "max_tokens": 4})
    return f"ids {r.status_code}"


def soak(server: ServerProc, n: int, concurrency: int = 8) -> dict[str, int]:
    """``n`` requests of the mix above, ``concurrency`` at a time; outcome counts."""

    async def run() -> list[str]:
        sem = asyncio.Semaphore(concurrency)
        async with server.async_client(timeout=120.0) as client:
            async def guarded(i: int) -> str:
                async with sem:
                    return await _one_soak_request(client, i)

            return await asyncio.gather(*(guarded(i) for i in range(n)))

    outcomes: dict[str, int] = {}
    for o in asyncio.run(run()):
        outcomes[o] = outcomes.get(o, 0) + 1
    return outcomes


def settle(server: ServerProc, idle: dict | None = None, timeout: float = 30.0) -> dict:
    """Wait until no request runs and the connections are closed (down to ``idle``'s
    open files when given, else steady for a second); then the figures."""
    server.wait_for(slots_idle, timeout=timeout, what="idle slots")
    deadline = time.monotonic() + timeout
    figures = process_figures(server)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        again = process_figures(server)
        done = again["open_files"] <= idle["open_files"] if idle else again["open_files"] == figures["open_files"]
        if done and again["kv_blocks_used"] == 0:
            return again
        figures = again
    return figures


def short_behind_long(server: ServerProc, long_tokens: int | None = 3000) -> dict:
    """Latency of a 5-token request sent while a ``long_tokens`` stream decodes
    (None: the long request omits max_tokens, i.e. the rest of the context)."""
    stream = StreamProbe(server, max_tokens=long_tokens).start()
    t0 = time.monotonic()
    with server.client(timeout=300.0) as c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "ignore_eos": True})
    waited = time.monotonic() - t0
    stream.stop()
    n = len(stream.times)
    return {"long_max_tokens": long_tokens, "short_status": r.status_code, "short_latency_s": round(waited, 2),
            "long_events_seen": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="measure a live edge serve under a large-prompt attack")
    p.add_argument("--mb", type=float, default=5.0, help="prompt size in MiB")
    p.add_argument("--senders", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--short-behind-long", action="store_true", help="measure item 9 instead")
    p.add_argument("--soak", type=int, default=0, help="run N soak requests instead (after 150 warm-up ones)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (repeatable)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProc(Path(tmp), env=server_env(**dict(kv.split("=", 1) for kv in args.env)))
        try:
            srv.wait_ready()
            if args.soak:
                soak(srv, 150)
                idle = settle(srv)
                t0 = time.monotonic()
                outcomes = soak(srv, args.soak)
                out = {"soak_s": round(time.monotonic() - t0, 1), "outcomes": outcomes, "idle_before": idle,
                       "idle_after": settle(srv, idle)}
            elif args.short_behind_long:
                out = {"runs": [short_behind_long(srv, 3000), short_behind_long(srv, None)]}
            else:
                out = large_prompt_attack(srv, int(args.mb * (1 << 20)), args.senders, args.rounds)
        finally:
            out_code = srv.stop()
        out["server_exit"] = out_code
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
