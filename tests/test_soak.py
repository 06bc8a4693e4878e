"""A bounded soak of a live ``edge serve``: a few hundred requests of every kind
(plain, streamed, disconnected mid-stream, cancelled, malformed, token ids), then the
server must be back at its idle figures: no KV block held, no file or thread more,
resident memory flat once warmed up."""

from __future__ import annotations

from pathlib import Path

from hostile_support import settle, soak
from test_server_support import ServerProc, server_env

WARM_UP = 150
SOAK = 300
RSS_SLACK_MIB = 4.0
# A pool of one 1024-token context, which the warm-up cycles through whole: a block's
# pages become resident when it is first written, and that is not a leak.
SMALL_POOL = {"EDGE_KV_BLOCKS": "64", "EDGE_MAX_SEQ_LEN": "1024"}


def test_soak_returns_to_idle(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path, env=server_env(**SMALL_POOL))
    try:
        srv.wait_ready()
        soak(srv, WARM_UP)  # allocator pools, histograms and the prefix cache fill up here
        before = settle(srv)
        outcomes = soak(srv, SOAK)
        after = settle(srv, before)
    finally:
        assert srv.stop() == 0, srv.log()
    per_kind = SOAK // 6
    assert outcomes == {"plain 200": per_kind, "stream 200 done": per_kind, "disconnect 200": per_kind,
                        "cancel 200": per_kind, "bad 400": per_kind, "ids 200": per_kind}, outcomes
    assert before["kv_blocks_used"] == 0 and after["kv_blocks_used"] == 0, (before, after)
    assert after["kv_blocks_free"] + after["kv_blocks_evictable"] == after["kv_blocks_total"], after
    # A leak grows these; the baseline may still count a keep-alive connection that closes later.
    assert after["open_files"] <= before["open_files"] and after["threads"] <= before["threads"], (before, after)
    assert after["rss_mib"] - before["rss_mib"] <= RSS_SLACK_MIB, (before, after)
