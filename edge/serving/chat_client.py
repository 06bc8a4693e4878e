"""``edge chat``: an interactive front-end for the service.

Talks to ``edge serve`` over HTTP (``--url``) or a Unix socket (``--uds``) with the
OpenAI chat-completions wire format and SSE streaming, like any other client:

* the whole history is resent each turn, so the server's prefix cache reuses the KV
  of the earlier turns instead of prefilling them again;
* Ctrl-C interrupts the current answer (the stream is closed and the request
  cancelled with ``POST /v1/cancel/{id}``) and returns to the prompt; Ctrl-D quits;
* ``/reset`` clears the history, ``/system TEXT`` sets the system prompt,
  ``/set NAME VALUE`` changes a sampling parameter (``/set max_tokens 64``), ``/help``
  lists the commands; any other ``/word`` is answered here, never sent as a prompt.

``--in-process`` starts the service inside this process (on a private Unix socket)
for a self-contained session.
"""

from __future__ import annotations

import base64
import json
import logging
import mimetypes
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import httpx

log = logging.getLogger(__name__)
# A cancel only ends the request on the service (the audio stopped already): wait for it
# longer than a voice reply would, so a loaded board does not lose it.
CANCEL_TIMEOUT_S = 10.0

DEFAULT_URL = "http://127.0.0.1:8000"
BANNER = "edge chat — /help lists the commands, Ctrl-C stops an answer, Ctrl-D quits"
HELP = """commands (handled here, never sent to the model):
  /help            this list
  /reset           clear the history
  /system TEXT     set the system prompt (and clear the history); /system alone clears it
  /image PATH      attach a picture to your next message (vision-language models)
  /set NAME VALUE  change a sampling parameter: {settable}
  //TEXT           send TEXT starting with one '/' as a message
Ctrl-C stops an answer, Ctrl-D quits."""
SETTABLE = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "ignore_eos")


class ServiceError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class ChatClient:
    def __init__(self, url: str | None = None, uds: str | None = None, api_key: str | None = None) -> None:
        transport = httpx.HTTPTransport(uds=uds) if uds else None
        self.where = f"unix:{uds}" if uds else (url or DEFAULT_URL)
        # bytes: httpx encodes str header values as ASCII, and a key may be any UTF-8
        headers = {"Authorization": f"Bearer {api_key}".encode()} if api_key else {}
        self.http = httpx.Client(
            base_url=url or ("http://edge" if uds else DEFAULT_URL),
            transport=transport,
            headers=headers,
            timeout=httpx.Timeout(10.0, read=600.0),
        )
        self.last_finish: str | None = None
        self.last_tool_calls: list[dict] = []
        self.last_usage: dict | None = None

    def close(self) -> None:
        self.http.close()

    def health(self) -> tuple[int, dict]:
        r = self.http.get("/health")
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {}

    def wait_ready(self, timeout: float, on_wait: Callable[[str], None] | None = None) -> None:
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                code, body = self.health()
                if code == 200:
                    return
                why = f"service {body.get('status', code)}"
                if body.get("status") == "failed":
                    raise ServiceError(code, f"the service failed to load its model: {body.get('error')}")
            except httpx.TransportError as exc:
                why = f"cannot connect ({exc})"
            if time.monotonic() >= deadline:
                raise ServiceError(0, f"the service at {self.where} is not ready: {why}")
            if not told and on_wait is not None:
                on_wait(f"waiting for the service at {self.where} ({why}) ...")
                told = True
            time.sleep(0.2)

    def stream_chat(self, messages: list[dict], params: dict[str, Any], request_id: str) -> Iterator[str]:
        """Text deltas of the answer; ``last_finish``/``last_usage`` (and the tool calls it
        made, ``last_tool_calls``) are set at the end.
        Closing the iterator early closes the stream (the server cancels)."""
        self.last_finish, self.last_usage = None, None
        self.last_tool_calls = []  # the answer's tool calls (OpenAI's shape)
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}, **params}
        with self.http.stream("POST", "/v1/chat/completions", json=body,
                              headers={"X-Request-Id": request_id}) as r:
            if r.status_code != 200:
                r.read()
                raise ServiceError(r.status_code, _error_message(r))
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ServiceError(500, event["error"].get("message", "error"))
                if event.get("usage"):
                    self.last_usage = event["usage"]
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {})
                    text = delta.get("content")
                    if text:
                        yield text
                    for call in delta.get("tool_calls") or []:  # each arrives whole (edge/structured)
                        self.last_tool_calls.append({k: call[k] for k in ("id", "type", "function") if k in call})
                    if choice.get("finish_reason"):
                        self.last_finish = choice["finish_reason"]

    def prefill(self, messages: list[dict]) -> dict:
        """A prefill-only request (``max_tokens: 0``): the server caches the prompt's KV so
        that a later request starting with the same messages skips it. Returns the usage."""
        r = self.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 0})
        if r.status_code != 200:
            raise ServiceError(r.status_code, _error_message(r))
        return r.json().get("usage") or {}

    def cancel(self, request_id: str) -> bool:
        return self.cancel_status(request_id) == 200

    def cancel_status(self, request_id: str) -> int | None:
        """``POST /v1/cancel/{id}``: 200 cancelled, 404 already finished, None unreachable.
        A connection the server dropped is retried once on a fresh one (a cancel is
        idempotent); the timeout allows for a service busy on a slow CPU."""
        for attempt in (1, 2):
            try:
                return self.http.post(f"/v1/cancel/{request_id}", timeout=CANCEL_TIMEOUT_S).status_code
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                log.warning("cancel of %s, attempt %d: %s: %s", request_id, attempt, type(exc).__name__, exc)
            except httpx.HTTPError as exc:
                log.warning("cancel of %s failed: %s: %s", request_id, type(exc).__name__, exc)
                return None
        return None


def _error_message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text


def run_chat(
    client: ChatClient,
    params: dict[str, Any],
    out: TextIO = sys.stdout,
    read_line: Callable[[str], str] = input,
) -> int:
    print(BANNER, file=out, flush=True)
    history: list[dict] = []
    system: str | None = None
    images: list[dict] = []  # image_url parts for the next user message
    held = _InterruptHold()
    while True:
        try:
            held.release()  # inside the try: a Ctrl-C from here on is one at the prompt
            line = read_line("> ").strip()
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, not an exit
            print(file=out)
            continue
        if not line:
            continue
        if line.startswith("//"):
            line = line[1:]  # a message that starts with '/'
        elif line.startswith("/"):
            # Every /word is a command of this front-end: a mistyped one is said so here,
            # never sent to the model as a prompt.
            command, _, arg = line.partition(" ")
            arg = arg.strip()
            if command == "/help":
                print(HELP.format(settable=", ".join(SETTABLE)), file=out, flush=True)
            elif command == "/reset":
                history.clear()
                print("[history cleared]", file=out, flush=True)
            elif command == "/system":
                system = arg or None
                history.clear()
                print("[system prompt set]" if system else "[system prompt cleared]", file=out, flush=True)
            elif command == "/set":
                print(_set_param(params, arg.split()), file=out, flush=True)
            elif command == "/image":
                try:
                    images.append(image_part(arg))
                    print(f"[image attached: {len(images)} for the next message]", file=out, flush=True)
                except (OSError, ValueError) as exc:
                    print(f"[cannot attach image: {exc}]", file=out, flush=True)
            else:
                print(f"[unknown command {command}: /help lists the commands; //TEXT sends a message starting "
                      "with '/']", file=out, flush=True)
            continue
        history.append({"role": "user", "content": [*images, {"type": "text", "text": line}] if images else line})
        images = []
        messages = ([{"role": "system", "content": system}] if system else []) + history
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reply: list[str] = []
        stream = client.stream_chat(messages, params, rid)
        try:
            for text in stream:
                out.write(text)
                out.flush()
                reply.append(text)
            calls = getattr(client, "last_tool_calls", [])  # a client without tools has none
            for call in calls:
                fn = call.get("function", {})
                print(f"\n[tool call] {fn.get('name')}({fn.get('arguments', '')})", end="", file=out)
            print(file=out, flush=True)
        except KeyboardInterrupt:
            held.hold()  # a second Ctrl-C (a double press) is dropped until the next prompt
            stream.close()  # closes the HTTP stream: the server cancels the request
            client.cancel(rid)  # and say so at once (barge-in), whatever the transport
            print(" [interrupted]", file=out, flush=True)
        except (ServiceError, httpx.HTTPError) as exc:
            stream.close()
            print(f"\n[error: {exc}]", file=out, flush=True)
            history.pop()
            continue
        finally:
            stream.close()
        answer: dict[str, Any] = {"role": "assistant", "content": "".join(reply)}
        if getattr(client, "last_tool_calls", None):
            answer["tool_calls"] = client.last_tool_calls
        history.append(answer)


def image_part(path: str) -> dict:
    """An OpenAI ``image_url`` content part holding the file as a data URL."""
    if not path:
        raise ValueError("usage: /image PATH")
    data = Path(path).expanduser().read_bytes()
    mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
    url = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    return {"type": "image_url", "image_url": {"url": url}}


class _InterruptHold:
    """Ctrl-C ignored from an interrupted answer until the next prompt: a second press
    while the answer is being stopped, or just after, must not quit the chat. Only the
    main thread can own signals; elsewhere this does nothing."""

    def __init__(self) -> None:
        self._previous: Any = None

    def hold(self) -> None:
        if self._previous is None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _set_param(params: dict[str, Any], args: list[str]) -> str:
    if len(args) != 2 or args[0] not in SETTABLE:
        return f"[usage: /set NAME VALUE with NAME one of {', '.join(SETTABLE)}]"
    name, raw = args
    try:
        value = json.loads(raw.lower() if raw.lower() in ("true", "false") else raw)
    except ValueError:
        return f"[not a number: {raw!r}]"
    params[name] = value  # the server validates it on the next turn
    return f"[{name} = {value}]"


class InProcessService:
    """The service on a private Unix socket in a background thread."""

    def __init__(self, settings: Any) -> None:
        from edge.serving.server import build_server

        self._dir = tempfile.TemporaryDirectory(prefix="edge-chat-")
        settings.uds = str(Path(self._dir.name) / "edge.sock")
        self.uds = settings.uds
        self.server, self.service, listener = build_server(settings)
        assert listener is not None
        self._listener = listener
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener.sock]},
                                        name="edge-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15.0)
        self._listener.close()
        self._dir.cleanup()
