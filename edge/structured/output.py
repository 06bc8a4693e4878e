"""The model's text back into OpenAI's message fields: a think block into
``reasoning_content``, tool-call blocks into ``tool_calls``, the rest into ``content``.

One incremental parser serves both shapes of response: streamed, it turns text deltas
into ``delta.reasoning_content`` / ``delta.content`` / ``delta.tool_calls`` fragments
(each call complete, with its ``index``, as the openai SDK reassembles them); whole, the
same parser runs over the full text, so both always agree. Text that might still become
a marker (``<think>``, ``</think>``, ``<tool_call>``) is held back until it is known."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from edge.structured.formats import ToolFormat


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class ParsedOutput:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parse_call(body: str) -> ToolCall | None:
    """A call block's JSON (``{"name": ..., "arguments": {...}}``), or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class OutputParser:
    """Incremental: :meth:`feed` text deltas, then :meth:`finish`; each returns OpenAI
    delta dicts. ``thinking``: "open" (the output starts inside a think block), "on" (it
    may start with one), "off". ``tools``: parse tool-call blocks."""

    def __init__(self, fmt: ToolFormat, thinking: str = "off", tools: bool = False) -> None:
        self.fmt = fmt
        self.tools = tools
        self.state = {"open": "think", "on": "maybe_think"}.get(thinking, "content")
        self.buf = ""
        self.calls: list[ToolCall] = []
        self._started: set[str] = set()  # keys whose text has begun (leading whitespace dropped)

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self._step(out):
            pass
        rest, self.buf = self.buf, ""
        if self.state == "think":
            self._text("reasoning_content", rest, out, final=True)
        elif self.state == "call":
            call = parse_call(rest.strip())
            if call is not None:
                self._add_call(call, out)
            else:
                self._content(self.fmt.call_open + rest, out, final=True)
        elif self.state in ("content", "maybe_think", "between"):
            self._content(rest, out, final=True)
        return out

    def _step(self, out: list[dict[str, Any]]) -> bool:
        """Consume what can be decided now; True if the state moved on."""
        f = self.fmt
        if self.state == "maybe_think":
            s = self.buf.lstrip()
            if not s or (len(s) < len(f.think_open) and f.think_open.startswith(s)):
                return False
            if s.startswith(f.think_open):
                self.buf = s[len(f.think_open):]
                self.state = "think"
            else:
                self.state = "content"
            return True
        if self.state == "think":
            at = self.buf.find(f.think_close)
            if at >= 0:
                self._text("reasoning_content", self.buf[:at], out, final=True)
                self.buf = self.buf[at + len(f.think_close):]
                self.state = "content"
                return True
            self._hold("reasoning_content", _held(self.buf, f.think_close), out)
            return False
        if self.state == "content":
            at = self.buf.find(f.call_open) if self.tools else -1
            if at >= 0:
                self._content(self.buf[:at], out, final=True)
                self.buf = self.buf[at + len(f.call_open):]
                self.state = "call"
                return True
            self._hold("content", _held(self.buf, f.call_open) if self.tools else 0, out)
            return False
        if self.state == "call":
            at = self.buf.find(f.call_close)
            if at < 0:
                return False
            body, self.buf = self.buf[:at], self.buf[at + len(f.call_close):]
            call = parse_call(body.strip())
            if call is None:
                self._content(f.call_open + body + f.call_close, out)
            else:
                self._add_call(call, out)
            self.state = "between"
            return True
        if self.state == "between":
            s = self.buf.lstrip()
            if not s or (len(s) < len(f.call_open) and f.call_open.startswith(s)):
                return False
            if s.startswith(f.call_open):
                self.buf = s[len(f.call_open):]
                self.state = "call"
            else:
                self.state = "content"
            return True
        return False

    def _content(self, text: str, out: list[dict[str, Any]], final: bool = False) -> None:
        self._text("content", text, out, final)

    def _hold(self, key: str, keep: int, out: list[dict[str, Any]]) -> None:
        """Emit the buffer but its last ``keep`` characters (a marker's possible start)
        and its trailing whitespace, which waits for more text: it is dropped at the end
        of the part."""
        body = self.buf[: len(self.buf) - keep]
        shown = body.rstrip()
        self._text(key, shown, out)
        self.buf = body[len(shown):] + self.buf[len(self.buf) - keep:]

    def _text(self, key: str, text: str, out: list[dict[str, Any]], final: bool = False) -> None:
        if key not in self._started:
            text = text.lstrip()
        if final:
            text = text.rstrip()
        if text:
            self._started.add(key)
            out.append({key: text})

    def _add_call(self, call: ToolCall, out: list[dict[str, Any]]) -> None:
        out.append({"tool_calls": [call.as_dict(len(self.calls))]})
        self.calls.append(call)


def parse_output(text: str, fmt: ToolFormat, thinking: str = "off", tools: bool = False) -> ParsedOutput:
    """The whole text at once (the same parser as a stream)."""
    parser = OutputParser(fmt, thinking, tools)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    return ParsedOutput(content or None, reasoning or None, parser.calls)
