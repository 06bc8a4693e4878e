"""Tools the voice assistant runs: ``edge voice --tools FILE --tool-handler MODULE:FUNCTION``.

The model's calls (edge/structured) go to ``FUNCTION(name, arguments)``, a Python
function the user names; what it returns goes back to the model as the tool's result
(text as is, anything else as JSON), and the model's answer after the results is spoken."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ToolHandler = Callable[[str, dict], Any]

# Model -> tools -> model rounds in one turn, so a model that keeps calling still answers.
MAX_TOOL_ROUNDS = 4


def load_handler(spec: str) -> ToolHandler:
    """``MODULE:FUNCTION`` (the module importable from the current directory or the path)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--tool-handler {spec!r}: expected MODULE:FUNCTION")
    if os.getcwd() not in sys.path:  # the `edge` script, unlike `python -m`, does not add it
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--tool-handler {spec!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"--tool-handler {spec!r} is not callable")
    return fn


def run_calls(handler: ToolHandler, text: str, calls: list[dict]) -> list[dict]:
    """The messages that continue the conversation after ``calls``: the assistant's
    message with them, then one ``tool`` message per call with the handler's result (an
    error as ``{"error": ...}``, so the model can say so)."""
    out: list[dict] = [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    for call in calls:
        fn = call.get("function", {})
        name = fn.get("name", "")
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
            result = handler(name, arguments)
        except Exception as exc:  # a broken tool is the model's to explain, not a crash
            log.warning("tool %s failed: %s", name, exc)
            result = {"error": f"{type(exc).__name__}: {exc}"}
        content = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
        out.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": content})
    return out
