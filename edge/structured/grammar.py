"""A :class:`StructuredRequest` as an llguidance grammar (Lark syntax with ``%json``
JSON Schema rules; https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md).

The shapes, for the Hermes / Qwen tool format (edge/structured/formats.py)::

    start: think? body
    body (schema only)        : JSON of the schema
    body (tools, auto)        : free text without a call | text, then calls
                                (the answer's schema instead of the free text when given)
    body (tools, required)    : calls
    body (tools, function)    : exactly one call of that function
    call: "<tool_call>" "\\n" {"name": <const>, "arguments": <parameters>} "\\n" "</tool_call>"

JSON is written compactly: at most one space between its tokens (``JSON_WHITESPACE``), the
form models write inline and OpenAI's structured outputs return. Free whitespace lets a
model pad an answer with newlines until it runs out of tokens."""

from __future__ import annotations

import json
from typing import Any

from edge.structured.formats import ToolFormat
from edge.structured.request import StructuredRequest, Tool

JSON_WHITESPACE = r"[\x20]{0,1}"
# Between tool calls, and after the last: a line break or two.
CALL_SEPARATOR = r"/[\x20\x0A]{0,3}/"


def _lit(text: str) -> str:
    return json.dumps(text)


def json_rule(schema: dict[str, Any]) -> str:
    """``%json`` of ``schema`` with the server's whitespace rule (a schema's own
    ``x-guidance`` options win)."""
    options = {"whitespace_pattern": JSON_WHITESPACE}
    own = schema.get("x-guidance")
    if isinstance(own, dict):
        options |= own
    return "%json " + json.dumps({**schema, "x-guidance": options}, separators=(",", ":"))


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON a call of ``tool`` is: its name, then arguments following its parameters."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _not_containing(text: str) -> str:
    """A lexeme of any text that does not contain ``text``."""
    special = set(r".^$*+?()[]{}|\-/")
    escaped = "".join("\\" + c if c in special else c for c in text)
    return rf"/(.|\n)*/ & ~/(.|\n)*{escaped}(.|\n)*/"


def build_grammar(req: StructuredRequest, fmt: ToolFormat) -> str | None:
    """The grammar's Lark text, or None when ``req`` constrains nothing."""
    if not req.constrained:
        return None
    rules: list[str] = ["%llguidance {}"]
    if req.thinking == "on":
        rules.append("start: think? body")
        rules.append(f"think[lazy]: {_lit(fmt.think_open)} /(.|\\n)*/ {_lit(fmt.think_close)}")
    elif req.thinking == "open":
        rules.append("start: think body")
        rules.append(f"think[lazy]: /(.|\\n)*/ {_lit(fmt.think_close)}")
    else:
        rules.append("start: body")
    # After a think block, the blank line the model writes before its answer.
    lead = r"/[\x20\x0A]{0,2}/" if req.thinking != "off" else ""
    if not req.calls_tools:
        rules.append(f"body: {lead} answer")
        rules.append(f"answer: {json_rule(req.schema or {})}")
        return "\n".join(rules) + "\n"
    tools = req.callable_tools
    rules.append("call_json: " + " | ".join(f"tool_{i}" for i in range(len(tools))))
    rules += [f"tool_{i}: {json_rule(call_schema(t))}" for i, t in enumerate(tools)]
    rules.append(f"call_body: \"\\n\" call_json \"\\n\" {_lit(fmt.call_close)}")
    rules.append(f"call_tag: {_lit(fmt.call_open)}")
    more = f" ({CALL_SEPARATOR} call_tag call_body)*" if req.parallel_tool_calls and req.tool_choice != "function" else ""
    calls = f"call_tag call_body{more} {CALL_SEPARATOR}"
    if req.tool_choice in ("required", "function"):
        rules.append(f"body: {lead} {calls}")
    elif req.schema is not None:
        rules.append(f"body: {lead} answer | {lead} {calls}")
        rules.append(f"answer: {json_rule(req.schema)}")
    else:
        # Free text that never starts a call, or text up to the first call and the calls.
        rules.append(f"body: TEXT | head call_body{more} {CALL_SEPARATOR}")
        rules.append(f"head[lazy]: /(.|\\n)*/ {_lit(fmt.call_open)}")
        rules.append(f"TEXT: {_not_containing(fmt.call_open)}")
    return "\n".join(rules) + "\n"
