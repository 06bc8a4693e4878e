"""The HTTP service, run as the real ``edge serve`` process (embedded model, CPU)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server_support import (
    CHAT,
    HELLO,
    ServerProc,
    parse_stream,
    server_env,
    slots_idle,
    sse_events,
)

LONG = 3000  # tokens: a stream still running when the test acts on it


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProc(tmp_path_factory.mktemp("srv"))
    try:
        yield srv.wait_ready(probe_while_loading=True)
    finally:
        code = srv.stop()
        assert code == 0, srv.log()


@pytest.fixture(scope="module")
def uds_server(tmp_path_factory: pytest.TempPathFactory):
    # The KV pool size from the command line, the reserve from the environment (parsed; CPU: unused).
    srv = ServerProc(tmp_path_factory.mktemp("uds"), "--kv-memory", "48MiB", uds=True, api_key="s3cret-key",
                     env=server_env(EDGE_MEMORY_RESERVE="1GiB"))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def chat_body(**kw) -> dict:
    return {"messages": HELLO, "max_tokens": 8, **kw}


# -- lifecycle -------------------------------------------------------------------------------


def test_health_503_while_loading_then_200(server: ServerProc) -> None:
    assert server.health_seen[0] == 503 and server.health_seen[-1] == 200, server.health_seen
    probe = server.loading_probe
    assert probe is not None and probe.status_code == 503
    assert probe.json()["error"]["code"] == "model_loading"
    assert int(probe.headers["retry-after"]) > 0
    with server.client() as c:
        body = c.get("/health").json()
    assert body["status"] == "ok"
    assert body["engine"]["max_seq_len"] == 4096
    assert body["scheduler"]["alive"] is True and len(body["scheduler"]["slots"]) == 2
    assert body["monitor"]["source"] == "none"


def test_metrics_parse_and_cover_the_service(server: ServerProc) -> None:
    with server.client() as c:  # ignore_eos: all 8 tokens are generated, whatever is sampled
        assert c.post(CHAT, json=chat_body(ignore_eos=True)).status_code == 200
    m = server.metrics()  # parsed by prometheus_client.parser
    for name in (
        'edge_requests_total{endpoint="/v1/chat/completions",status="200"}',
        "edge_generated_tokens_total", "edge_prompt_tokens_total", "edge_cached_prompt_tokens_total",
        "edge_time_to_first_token_seconds_count", "edge_time_per_output_token_seconds_count",
        "edge_queue_depth", 'edge_kv_blocks{state="free"}', 'edge_kv_blocks{state="used"}',
        'edge_kv_blocks{state="cached"}', 'edge_slots{state="idle"}', 'edge_slots{state="decoding"}',
        "edge_model_ready", "edge_scheduler_alive",
        'edge_thermal_state{state="normal"}', "edge_monitor_samples_total",  # the monitor's, same registry
    ):
        assert name in m, name
    assert m["edge_model_ready"] == 1 and m["edge_generated_tokens_total"] >= 8


def test_models(server: ServerProc) -> None:
    with server.client() as c:
        body = c.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == "edge-default"
    assert body["data"][0]["max_model_len"] == 4096


# -- generation -------------------------------------------------------------------------------


def test_chat_non_streaming(server: ServerProc) -> None:
    with server.client() as c:
        r = c.post(CHAT, json=chat_body(max_tokens=6, ignore_eos=True, temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert r.headers["x-request-id"] == body["id"]
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 6 and u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + 6
    assert "cached_tokens" in u["prompt_tokens_details"]


def test_chat_streaming_sse_framing_and_usage(server: ServerProc) -> None:
    body = chat_body(max_tokens=5, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    with server.client() as c:
        r = c.post(CHAT, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks, _ = parse_stream(r.text)
    ids = {ch["id"] for ch in chunks}
    assert ids == {r.headers["x-request-id"]}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    final = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]  # the usage chunk comes last, with no choices
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert "cached_tokens" in usage["usage"]["prompt_tokens_details"]
    # without include_usage: no usage chunk
    with server.client() as c:
        chunks2, _ = parse_stream(c.post(CHAT, json=chat_body(max_tokens=3, stream=True)).text)
    assert all(ch["choices"] for ch in chunks2) and not any(ch.get("usage") for ch in chunks2)


def test_completions_streaming_and_not(server: ServerProc) -> None:
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True,
                                            "stream": True, "stream_options": {"include_usage": True}})
    chunks, _ = parse_stream(r.text)
    assert chunks[-1]["usage"]["prompt_tokens"] == 4 and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_multi_turn_history_reuses_the_prefix(server: ServerProc) -> None:
    history = [{"role": "system", "content": "You are a kiosk robot. " * 12},
               {"role": "user", "content": "Tell me how the paged cache works, in detail please."}]
    with server.client() as c:
        first = c.post(CHAT, json={"messages": history, "max_tokens": 4}).json()
        history += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        second = c.post(CHAT, json={"messages": history, "max_tokens": 4}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, second["usage"]


def test_client_request_id_is_used(server: ServerProc) -> None:
    with server.client() as c:
        r = c.post(CHAT, json=chat_body(), headers={"X-Request-Id": "voice-turn-42"})
        assert r.status_code == 200 and r.json()["id"] == "voice-turn-42"
        assert r.headers["x-request-id"] == "voice-turn-42"
        bad = c.post(CHAT, json=chat_body(), headers={"X-Request-Id": "no spaces please"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


# -- cancel ----------------------------------------------------------------------------------


def _read_some(lines, n: int) -> list[str]:
    got = []
    for line in lines:
        if line.startswith("data: "):
            got.append(line)
            if len(got) >= n:
                break
    return got


def test_closing_the_stream_cancels_the_request(server: ServerProc) -> None:
    before = server.metrics()
    key = 'edge_requests_finished_total{endpoint="/v1/chat/completions",reason="cancelled"}'
    sched_key = 'edge_scheduler_requests_finished_total{reason="cancelled"}'
    with server.client() as c:
        with c.stream("POST", CHAT, json=chat_body(max_tokens=LONG, ignore_eos=True, stream=True)) as r:
            assert r.status_code == 200
            assert len(_read_some(r.iter_lines(), 5)) == 5
        # leaving the block closed the connection mid-stream
    m = server.wait_for(lambda m: m.get(key, 0) > before.get(key, 0) and m.get(sched_key, 0) > before.get(sched_key, 0)
                        and slots_idle(m), what="cancel by disconnect")
    assert m["edge_generated_tokens_total"] - before["edge_generated_tokens_total"] < LONG


def test_non_streaming_client_that_gives_up_cancels(server: ServerProc) -> None:
    before = server.metrics()
    key = 'edge_requests_finished_total{endpoint="/v1/chat/completions",reason="cancelled"}'
    with server.client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post(CHAT, json=chat_body(max_tokens=LONG, ignore_eos=True))
    m = server.wait_for(lambda m: m.get(key, 0) > before.get(key, 0) and slots_idle(m),
                        what="cancel of a non-streaming request by disconnect")
    assert m["edge_generated_tokens_total"] - before["edge_generated_tokens_total"] < LONG


def test_cancel_endpoint_ends_the_open_stream(server: ServerProc) -> None:
    rid = "barge-in-1"
    with server.client() as c, c.stream("POST", CHAT, headers={"X-Request-Id": rid},
                                        json=chat_body(max_tokens=LONG, ignore_eos=True, stream=True,
                                                       stream_options={"include_usage": True})) as r:
        lines = r.iter_lines()
        head = _read_some(lines, 3)
        cancel = c.post(f"/v1/cancel/{rid}")
        assert cancel.status_code == 200 and cancel.json()["cancelled"] is True
        rest = "".join(line + "\n\n" for line in head) + "".join(line + "\n\n" for line in lines if line)
    chunks, _ = parse_stream(rest)
    finals = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert finals == ["cancelled"]
    assert chunks[-1]["usage"]["completion_tokens"] < LONG
    with server.client() as c:
        again = c.post(f"/v1/cancel/{rid}")
    assert again.status_code == 404 and again.json()["error"]["code"] == "request_not_found"
    server.wait_for(slots_idle, what="slots idle after cancel")


# -- bad input ---------------------------------------------------------------------------------

M = HELLO
BAD_CASES = [
    # (name, path, body (dict or raw bytes), expected param or None, expected code or None)
    ("malformed json", CHAT, b'{"messages": [', None, "invalid_json"),
    ("not an object", CHAT, b"[1, 2]", None, "invalid_json"),
    ("empty body", CHAT, b"", None, "invalid_json"),
    ("messages not a list", CHAT, {"messages": "hi"}, "messages", "invalid_type"),
    ("max_tokens string", CHAT, {"messages": M, "max_tokens": "5"}, "max_tokens", "invalid_type"),
    ("temperature string", CHAT, {"messages": M, "temperature": "hot"}, "temperature", "invalid_type"),
    ("content number", CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ("missing messages", CHAT, {"model": "x"}, "messages", "missing_required_parameter"),
    ("empty messages", CHAT, {"messages": []}, "messages", "empty_array"),
    ("empty role", CHAT, {"messages": [{"role": "", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ("missing role", CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    ("prompt too long", CHAT, {"messages": [{"role": "user", "content": "lorem ipsum dolor " * 3000}]},
     "messages", "context_length_exceeded"),
    ("negative max_tokens", CHAT, {"messages": M, "max_tokens": -1}, "max_tokens", "invalid_value"),
    ("absurd max_tokens", CHAT, {"messages": M, "max_tokens": 10**9}, "max_tokens", "invalid_value"),
    ("max_completion_tokens > context", CHAT, {"messages": M, "max_completion_tokens": 5000},
     "max_completion_tokens", "invalid_value"),
    ("n > 1", CHAT, {"messages": M, "n": 2}, "n", "unsupported_parameter"),
    ("logprobs", CHAT, {"messages": M, "logprobs": True}, "logprobs", "unsupported_parameter"),
    ("tool without a name", CHAT, {"messages": M, "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name", "invalid_value"),
    ("functions", CHAT, {"messages": M, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ("json_schema without a name", CHAT, {"messages": M, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.name", "invalid_value"),
    ("unknown schema type", CHAT, {"messages": M, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "color"}}}}, "response_format.json_schema.schema", "invalid_value"),
    ("frequency_penalty", CHAT, {"messages": M, "frequency_penalty": 0.5}, "frequency_penalty",
     "unsupported_parameter"),
    ("temperature out of range", CHAT, {"messages": M, "temperature": 3.5}, "temperature", "invalid_value"),
    ("top_p out of range", CHAT, {"messages": M, "top_p": 1.5}, "top_p", "invalid_value"),
    ("top_k past an int64", CHAT, {"messages": M, "top_k": 2**63}, "top_k", "invalid_value"),
    ("300 000 bad token ids", "/v1/completions", {"prompt": [None] + [0] * 300_000}, None, "request_too_complex"),
    ("empty stop", CHAT, {"messages": M, "stop": [""]}, "stop", "invalid_value"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "unsupported_parameter"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt", "invalid_value"),
    ("batched prompts", "/v1/completions", {"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "prompt", "invalid_value"),
    ("echo", "/v1/completions", {"prompt": "a", "echo": True}, "echo", "unsupported_parameter"),
]


def test_bad_input_gets_400_and_leaves_a_concurrent_stream_alone(server: ServerProc) -> None:
    n_tokens = 400
    result: dict = {}

    def good_stream() -> None:
        with server.client() as c:
            r = c.post(CHAT, json=chat_body(max_tokens=n_tokens, ignore_eos=True, stream=True,
                                            stream_options={"include_usage": True}, seed=7, temperature=0.7,
                                            unknown_field={"tolerated": True}))
            result["status"] = r.status_code
            result["text"] = r.text

    t = threading.Thread(target=good_stream)
    t.start()
    failures = []
    with server.client() as c:
        for name, path, body, param, code in BAD_CASES:
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = c.post(path, json=body)
            try:
                err = r.json()["error"]
                ok = (r.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
                      and set(err) == {"message", "type", "param", "code"}
                      and (param is None or err["param"] == param) and (code is None or err["code"] == code))
            except (ValueError, KeyError):
                ok, err = False, r.text
            if not ok:
                failures.append((name, r.status_code, err))
    t.join(120)
    assert not failures, failures
    assert result["status"] == 200
    chunks, _ = parse_stream(result["text"])
    assert chunks[-1]["usage"]["completion_tokens"] == n_tokens
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_unknown_fields_and_extensions_are_accepted(server: ServerProc) -> None:
    body = chat_body(max_tokens=3, user="u1", parallel_tool_calls=False, metadata={"a": 1}, top_k=5,
                     repetition_penalty=1.1, stop="\n\n\n\n\n\n\n\n", seed=3, temperature=0.5,
                     presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"},
                     stream_options=None, model="anything")
    with server.client() as c:
        r = c.post(CHAT, json=body)
    assert r.status_code == 200, r.text


def test_chat_template_kwargs_cannot_stand_in_for_the_templates_functions(server: ServerProc) -> None:
    with server.client() as c:
        r = c.post(CHAT, json=chat_body(max_tokens=1, chat_template_kwargs={"raise_exception": "x"}))
    assert r.status_code == 400 and "'raise_exception'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"


# -- load ---------------------------------------------------------------------------------------


def test_16_concurrent_clients_all_answered(server: ServerProc) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str, dict]:
        body = chat_body(max_tokens=24, ignore_eos=True, stream=i % 2 == 0,
                         messages=[{"role": "user", "content": f"Question number {i}?"}])
        r = await client.post(CHAT, json=body)
        return r.status_code, r.text, dict(r.headers)

    async def main() -> list[tuple[int, str, dict]]:
        async with server.async_client(timeout=90.0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())  # each request within the client's 90 s timeout
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 8, statuses  # at least the queue of 8 (+ up to two slots)
    for status, text, headers in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert json.loads(text)["error"]["code"] == "queue_full"
        elif text.startswith("data: "):
            parse_stream(text)
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == 24
    server.wait_for(slots_idle, what="idle after the burst")


# -- Unix socket and API key ---------------------------------------------------------------------


def test_unix_socket_with_api_key(uds_server: ServerProc) -> None:
    with uds_server.client(auth=False) as c:
        health = c.get("/health")
        assert health.status_code == 200  # probes stay open
        budget = health.json()["engine"]["kv_budget"]
        assert budget["source"] == "kv_memory=48.0 MiB" and budget["num_blocks"] == (48 << 20) // budget["block_bytes"]
        for method, path, body in (("POST", CHAT, chat_body()), ("GET", "/v1/models", None),
                                   ("POST", "/v1/cancel/x", None)):
            r = c.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        r = c.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    with uds_server.client() as c:
        r = c.post(CHAT, json=chat_body(max_tokens=4, stream=True))
        assert r.status_code == 200
        parse_stream(r.text)
    sock = Path(uds_server.uds)
    assert sock.is_socket() and (sock.stat().st_mode & 0o777) == 0o660


# -- thermal admission ----------------------------------------------------------------------------


def test_device_too_hot_is_503_with_retry_after(tmp_path: Path) -> None:
    from edge.monitor import write_fake_sysfs

    root = write_fake_sysfs(tmp_path / "sys", zones_mc={"tj-thermal": 99000})
    env = server_env(EDGE_MONITOR_SOURCE="sysfs", EDGE_SYSFS_ROOT=str(root), EDGE_MONITOR_PERIOD_S="0.1")
    srv = ServerProc(tmp_path / "hot", env=env)
    try:
        srv.wait_ready()
        with srv.client() as c:
            r = c.post(CHAT, json=chat_body())
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "device_too_hot" and int(r.headers["retry-after"]) >= 1
            assert c.get("/health").json()["monitor"]["governor"]["state"] == "hard"
        (Path(root) / "class/thermal/thermal_zone0/temp").write_text("50000\n")
        deadline = time.monotonic() + 10
        with srv.client() as c:
            while (r := c.post(CHAT, json=chat_body(max_tokens=2))).status_code == 503:
                assert time.monotonic() < deadline, r.text
                time.sleep(0.1)
        assert r.status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()


# -- shutdown ---------------------------------------------------------------------------------------


def test_sigterm_during_streaming_exits_cleanly(tmp_path: Path) -> None:
    grace = 1.0
    srv = ServerProc(tmp_path, env=server_env(EDGE_SHUTDOWN_GRACE_S=str(grace)))
    srv.wait_ready()
    with srv.client() as c, c.stream("POST", CHAT, json=chat_body(max_tokens=4000, ignore_eos=True,
                                                                   stream=True)) as r:
        it = r.iter_lines()
        head = _read_some(it, 3)
        t0 = time.monotonic()
        srv.signal()
        lines = head + [line for line in it if line]
    code = srv.proc.wait(timeout=grace + 15)
    elapsed = time.monotonic() - t0
    srv.stop()
    assert code == 0, srv.log()
    assert elapsed < grace + 8, elapsed
    # the stream was ended properly: a final chunk (cancelled after the grace) and [DONE]
    events = sse_events("".join(line + "\n\n" for line in lines))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "cancelled"
    assert "shutting down" in srv.log()


def test_sse_event_survives_unicode_line_separators() -> None:
    from edge.serving.completions import sse_event

    event = sse_event({"text": "a\u2028b\u2029c\x85d\né"})
    assert event.splitlines() == [event.rstrip("\n"), ""]  # one line + the blank, however split
    assert json.loads(event[len("data: "):])["text"] == "a\u2028b\u2029c\x85d\né"
