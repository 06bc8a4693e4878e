"""Structured requests made in this process (``edge generate --json-schema / --tools``):
files read into a :class:`StructuredRequest`, the prompt rendered with the tools, the
grammar compiled for the engine's tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.structured.compiler import GrammarCompiler
from edge.structured.errors import GrammarError
from edge.structured.formats import HERMES, thinking_mode
from edge.structured.matcher import GrammarMatcher
from edge.structured.output import ParsedOutput, parse_output
from edge.structured.request import StructuredRequest, parse_structured

if TYPE_CHECKING:
    from edge.runtime.engine import Engine


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise GrammarError(f"{what} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise GrammarError(f"{what} {path} is not JSON: {exc}") from None


def read_structured(json_schema: str | None, tools: str | None, tool_choice: str | None = None) -> StructuredRequest | None:
    """``json_schema``: a JSON Schema file; ``tools``: a file of OpenAI tools (a list, or
    ``{"tools": [...]}``); ``tool_choice``: auto, required, none or a tool's name."""
    if json_schema is None and tools is None:
        return None
    fmt = None
    if json_schema is not None:
        fmt = {"type": "json_schema", "json_schema": {"name": "schema", "schema": _read_json(json_schema, "--json-schema")}}
    tool_list = None
    if tools is not None:
        data = _read_json(tools, "--tools")
        tool_list = data.get("tools") if isinstance(data, dict) else data
    choice: Any = tool_choice
    if tool_choice not in (None, "auto", "required", "none"):
        choice = {"type": "function", "function": {"name": tool_choice}}
    return parse_structured(fmt, tool_list, choice)


@dataclass
class LocalStructured:
    """A structured request ready to submit: its prompt, matcher and output shape."""

    prompt_ids: list[int]
    grammar: GrammarMatcher | None
    request: StructuredRequest

    def parse(self, text: str) -> ParsedOutput:
        return parse_output(text, HERMES, self.request.thinking, self.request.calls_tools)


def prepare(engine: Engine, req: StructuredRequest, prompt: str, chat: bool, **template: Any) -> LocalStructured:
    """``prompt`` as one user message through the chat template with the tools (``chat``),
    or as plain text; ``template``: chat template keyword arguments."""
    tok = engine.tokenizer
    if tok is None:
        raise GrammarError(f"{engine.model_dir} has no tokenizer.json: structured output needs one")
    if chat:
        tools = [t.as_template_dict() for t in req.tools]
        ids = tok.encode_chat([{"role": "user", "content": prompt}], **({"tools": tools} if tools else {}), **template)
    else:
        ids = tok.encode(prompt)
    enabled = template.get("enable_thinking")
    thinking = thinking_mode(HERMES, tok.chat_template if chat else None, tok.decode(ids[-8:], False),
                             enabled if isinstance(enabled, bool) else None) if chat else "off"
    req = replace(req, thinking=thinking)
    compiler = GrammarCompiler(tok.to_json(), engine.cfg.vocab_size, tok.eos_token_ids)
    try:
        grammar = compiler.compile(req)
    except GrammarError as exc:  # name the file's flag, not the API field
        raise GrammarError(exc.message.replace("response_format.json_schema.schema", "--json-schema")
                           .replace("tools[", "--tools: tools["), exc.param, exc.code) from None
    finally:
        compiler.close()
    return LocalStructured(ids, grammar.matcher() if grammar is not None else None, req)
