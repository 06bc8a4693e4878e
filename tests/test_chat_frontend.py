"""``edge chat`` in a terminal (pexpect) against a running service on a Unix socket."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_server_support import ROOT, ServerProc, server_env, slots_idle

pexpect = pytest.importorskip("pexpect")

CANCELLED = 'edge_requests_finished_total{endpoint="/v1/chat/completions",reason="cancelled"}'
LENGTH = 'edge_requests_finished_total{endpoint="/v1/chat/completions",reason="length"}'


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProc(tmp_path_factory.mktemp("chat"), uds=True, api_key="chat-key")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _spawn(service: ServerProc, *args: str) -> pexpect.spawn:
    env = server_env()
    return pexpect.spawn(
        sys.executable,
        ["-m", "edge.cli", "chat", "--uds", service.uds, "--api-key-file", str(service.tmp / "api.key"), *args],
        cwd=str(ROOT), env=env, encoding="utf-8", timeout=60, dimensions=(40, 200),
    )


def test_chat_streams_and_ctrl_c_interrupts_only_the_answer(service: ServerProc) -> None:
    child = _spawn(service, "--max-tokens", "4000", "--ignore-eos", "--temperature", "0")
    try:
        child.expect_exact("edge chat")
        child.expect_exact("> ")
        before = service.metrics()
        child.sendline("Tell me a very long story")
        # The answer is streaming: tokens are being generated for it.
        service.wait_for(lambda m: m["edge_generated_tokens_total"] >= before["edge_generated_tokens_total"] + 20
                         and m["edge_requests_in_flight"] == 1, what="a streaming answer")
        child.sendintr()  # Ctrl-C mid-answer
        child.expect_exact("[interrupted]")
        child.expect_exact("> ")  # still running, ready for the next question
        m = service.wait_for(lambda m: m.get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1 and slots_idle(m),
                             what="the interrupted answer cancelled on the server")
        assert m["edge_generated_tokens_total"] - before["edge_generated_tokens_total"] < 4000
        child.sendline("/set max_tokens 12")
        child.expect_exact("[max_tokens = 12]")
        child.expect_exact("> ")
        child.sendline("And a short one?")
        child.expect_exact("> ", timeout=60)  # answered in full, then the prompt again
        m = service.wait_for(lambda m: m.get(LENGTH, 0) == before.get(LENGTH, 0) + 1, what="the second answer")
        assert m.get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1
        child.sendline("/reset")
        child.expect_exact("[history cleared]")
        child.sendeof()  # Ctrl-D quits
        child.expect(pexpect.EOF, timeout=20)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_chat_streams_a_reply_and_resends_history(service: ServerProc) -> None:
    child = _spawn(service, "--max-tokens", "6", "--ignore-eos")
    try:
        child.expect_exact("> ")
        child.sendline("/system You are a kiosk robot that explains the paged cache in great detail.")
        child.expect_exact("[system prompt set]")
        child.expect_exact("> ")
        before = service.metrics()
        for question in ("Hello robot, how does the paged cache work?", "Go on please"):
            child.sendline(question)
            child.expect_exact("> ")
        m = service.wait_for(lambda m: m.get(LENGTH, 0) == before.get(LENGTH, 0) + 2, what="two answers")
        # the second turn resent the first whole: its prefix came from the cache
        assert m["edge_cached_prompt_tokens_total"] > before["edge_cached_prompt_tokens_total"]
        child.sendeof()
        child.expect(pexpect.EOF, timeout=20)
    finally:
        child.close(force=True)


def chat_requests(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith('edge_requests_total{endpoint="/v1/chat/completions"'))


def test_chat_commands_stay_local_and_no_http_log_lines(service: ServerProc) -> None:
    """/help and a mistyped /command are answered by edge chat, not sent as prompts, and
    the conversation holds no httpx INFO lines ("HTTP Request: POST ...")."""
    child = _spawn(service, "--max-tokens", "3", "--ignore-eos")
    try:
        child.expect_exact("> ")
        before = service.metrics()
        child.sendline("/help")
        child.expect_exact("/set NAME VALUE")
        child.expect_exact("> ")
        child.sendline("/frobnicate now")
        child.expect_exact("[unknown command /frobnicate")
        child.expect_exact("> ")
        assert chat_requests(service.metrics()) == chat_requests(before)
        child.sendline("Hello")
        child.expect_exact("> ")
        service.wait_for(lambda m: m.get(LENGTH, 0) == before.get(LENGTH, 0) + 1, what="the answer")
        child.sendeof()
        child.expect(pexpect.EOF, timeout=20)
        transcript = child.before or ""
    finally:
        child.close(force=True)
    assert "HTTP Request" not in transcript and " INFO " not in transcript, transcript


def test_chat_commands_in_process() -> None:
    import io

    from edge.serving.chat_client import run_chat

    sent: list[list[dict]] = []

    class Client:
        def stream_chat(self, messages, params, rid):
            sent.append(messages)
            yield "ok"

    lines = iter(["/help", "/nope", "/set temperature 0.5", "//etc/hosts is a file", "/systemic"])

    def read_line(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    params: dict = {}
    assert run_chat(Client(), params, out=out, read_line=read_line) == 0
    text = out.getvalue()
    assert "/image PATH" in text and "[unknown command /nope" in text and "[unknown command /systemic" in text
    assert params == {"temperature": 0.5}
    assert sent == [[{"role": "user", "content": "/etc/hosts is a file"}]]


def test_chat_reports_an_unreachable_service(tmp_path: Path) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "edge.cli", "chat", "--uds", str(tmp_path / "none.sock"),
                                           "--wait", "0.5"], cwd=str(ROOT), env=server_env(), encoding="utf-8",
                          timeout=30)
    child.expect("not ready")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1


def test_chat_in_process(tmp_path: Path) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "edge.cli", "chat", "--in-process", "--max-tokens", "5",
                                           "--ignore-eos"], cwd=str(ROOT), env=server_env(), encoding="utf-8",
                          timeout=90)
    try:
        child.expect_exact("> ")
        child.sendline("Hello")
        child.expect_exact("> ")
        child.sendeof()
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_two_quick_ctrl_c_stop_the_answer_but_not_the_chat(service: ServerProc) -> None:
    child = _spawn(service, "--max-tokens", "4000", "--ignore-eos", "--temperature", "0")
    try:
        child.expect_exact("> ")
        for _ in range(3):
            before = service.metrics()
            child.sendline("Tell me a very long story")
            service.wait_for(lambda m, b=before: m["edge_generated_tokens_total"] >= b["edge_generated_tokens_total"]
                             + 20 and m["edge_requests_in_flight"] == 1, what="a streaming answer")
            child.sendintr()
            child.sendintr()  # a second Ctrl-C while the first is still being handled
            child.expect_exact("[interrupted]")
            child.expect_exact("> ")
            service.wait_for(slots_idle, what="the answer cancelled")
        assert child.isalive()
        child.sendeof()
        child.expect(pexpect.EOF, timeout=20)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_cancel_retries_a_dropped_connection_once_and_reports_timeouts() -> None:
    """A barge-in cancel whose keep-alive connection the server dropped is sent again; a
    timeout or a second drop reports None (unreachable), never a false 200."""
    import httpx

    from edge.serving.chat_client import ChatClient

    def client(*responses):
        calls = []

        def handle(request: httpx.Request) -> httpx.Response:
            calls.append(request.url.path)
            r = responses[len(calls) - 1]
            if isinstance(r, Exception):
                raise r
            return httpx.Response(r, json={})

        c = ChatClient("http://edge.test")
        c.http = httpx.Client(base_url="http://edge.test", transport=httpx.MockTransport(handle))
        return c, calls

    drop = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    c, calls = client(drop, 200)
    assert c.cancel_status("req-1") == 200 and calls == ["/v1/cancel/req-1"] * 2
    c, calls = client(drop, drop)
    assert c.cancel_status("req-1") is None and len(calls) == 2
    c, calls = client(httpx.ReadTimeout("slow"), 200)
    assert c.cancel_status("req-1") is None and len(calls) == 1
    c, calls = client(404, 404)
    assert c.cancel_status("req-1") == 404 and c.cancel("req-1") is False and len(calls) == 2


def test_a_late_second_ctrl_c_is_dropped_until_the_prompt() -> None:
    """In process, deterministic: the first Ctrl-C stops the answer; a second one that
    lands while " [interrupted]" is printed (after the cancel, the window that once
    quit the chat) is dropped, the chat goes on to its prompt, and Ctrl-C behaves
    normally again there."""
    import io
    import os
    import signal

    from edge.serving.chat_client import run_chat

    class Client:
        cancelled: list[str] = []

        def stream_chat(self, messages, params, rid):
            def gen():
                yield "Once"
                raise KeyboardInterrupt  # the first Ctrl-C, mid-answer
            return gen()

        def cancel(self, rid):
            self.cancelled.append(rid)
            return True

    class Out(io.StringIO):
        def write(self, s):
            if "[interrupted]" in s:
                os.kill(os.getpid(), signal.SIGINT)  # the second press, late
            return super().write(s)

    prompts: list[str] = []

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        if len(prompts) == 1:
            return "Tell me a story"
        # Back at the prompt: Ctrl-C is live again (it raises here, not in the answer).
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        raise EOFError

    out = Out()
    try:
        assert run_chat(Client(), {}, out=out, read_line=read_line) == 0
    except KeyboardInterrupt:
        pytest.fail("a late second Ctrl-C quit the chat")
    assert "Once [interrupted]" in out.getvalue() and len(Client.cancelled) == 1 and len(prompts) == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
