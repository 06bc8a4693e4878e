"""The structured part of a chat request, validated: ``response_format``, ``tools``,
``tool_choice``, ``parallel_tool_calls`` and whether the model thinks first.

Parsed from the request's JSON values as OpenAI defines them; anything the server
cannot honour is a :class:`GrammarError` naming the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from edge.structured.errors import GrammarError

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
ANY_OBJECT: dict[str, Any] = {"type": "object"}

ToolChoice = Literal["none", "auto", "required", "function"]
Thinking = Literal["off", "on", "open"]


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The tool as chat templates receive it (OpenAI's own shape, as transformers passes it)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class StructuredRequest:
    """``schema``: the JSON Schema the answer must follow (json_object: any object), or
    None for free text. ``tools`` with ``tool_choice``: "none" (never call), "auto"
    (answer or call), "required" (call at least one), "function" (call ``tool_name``
    once). ``thinking``: "on" the answer may start with a think block, "open" the prompt
    opened one (the output starts inside it), "off" no think block."""

    schema: dict[str, Any] | None = None
    schema_name: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "none"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    thinking: Thinking = "off"

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        """Whether the output needs a grammar (else only the output parsers apply)."""
        return self.schema is not None or self.calls_tools

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        if self.tool_choice == "function":
            return tuple(t for t in self.tools if t.name == self.tool_name)
        return self.tools if self.calls_tools else ()

    @cached_property
    def key(self) -> str:
        """Canonical text of what the grammar depends on: the compile cache's key
        (computed once: a schema may be large)."""
        return json.dumps(
            {
                "schema": self.schema,
                "tools": [[t.name, t.parameters] for t in self.callable_tools],
                "choice": self.tool_choice if self.calls_tools else "none",
                "parallel": self.parallel_tool_calls,
                "thinking": self.thinking,
            },
            sort_keys=True,
            separators=(",", ":"),
        )


def parse_response_format(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(schema, name) of a ``response_format``; (None, None) for text or none."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise GrammarError("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind in (None, "text"):
        return None, None
    if kind == "json_object":
        return dict(ANY_OBJECT), None
    if kind != "json_schema":
        raise GrammarError(
            f"response_format type {kind!r} is not supported (text, json_object or json_schema)",
            "response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("response_format json_schema needs a 'json_schema' object", "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        raise GrammarError(
            "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, '_', '-' or '.'",
            "response_format.json_schema.name",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise GrammarError("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    schema = spec.get("schema", ANY_OBJECT)
    if not isinstance(schema, dict):
        raise GrammarError("response_format.json_schema.schema must be a JSON Schema object",
                           "response_format.json_schema.schema")
    return schema, name


def parse_tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise GrammarError("tools must be an array", "tools")
    tools: list[Tool] = []
    seen: set[str] = set()
    for i, entry in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise GrammarError(f"{param} must be an object", param)
        if entry.get("type", "function") != "function":
            raise GrammarError(f"{param}: tool type {entry.get('type')!r} is not supported (only 'function')",
                               f"{param}.type")
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise GrammarError(f"{param} needs a 'function' object", f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"{param}.function has no name", f"{param}.function.name")
        if not TOOL_NAME_RE.match(name):
            raise GrammarError(
                f"{param}.function.name {name!r} must be 1-64 characters of a-z, A-Z, 0-9, '_', '-' or '.'",
                f"{param}.function.name",
            )
        if name in seen:
            raise GrammarError(f"{param}: a second tool named {name!r}", f"{param}.function.name")
        seen.add(name)
        parameters = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise GrammarError(f"{param}.function.parameters must be a JSON Schema object",
                               f"{param}.function.parameters")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise GrammarError(f"{param}.function.description must be a string", f"{param}.function.description")
        tools.append(Tool(name, parameters, description))
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise GrammarError("tool_choice 'required' needs tools", "tool_choice")
        return value, None
    if isinstance(value, dict) and value.get("type", "function") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise GrammarError("tool_choice names no function: expected {'type': 'function', 'function': "
                               "{'name': ...}}", "tool_choice")
        if name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "none"
            raise GrammarError(f"tool_choice names the function {name!r}, which is not among the tools ({known})",
                               "tool_choice")
        return "function", name
    raise GrammarError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {value!r:.80}",
                       "tool_choice")


def parse_structured(
    response_format: Any = None,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    thinking: Thinking = "off",
) -> StructuredRequest:
    schema, name = parse_response_format(response_format)
    parsed_tools = parse_tools(tools)
    choice, tool_name = parse_tool_choice(tool_choice, parsed_tools)
    return StructuredRequest(
        schema=schema,
        schema_name=name,
        tools=parsed_tools,
        tool_choice=choice,
        tool_name=tool_name,
        parallel_tool_calls=True if parallel_tool_calls is None else bool(parallel_tool_calls),
        thinking=thinking,
    )
