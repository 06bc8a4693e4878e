"""The error of a structured request the server cannot enforce (HTTP 400)."""

from __future__ import annotations


class GrammarError(ValueError):
    """A response format, tool or tool choice that cannot be turned into a grammar: an
    invalid or unsupported JSON Schema, a tool without a name, a ``tool_choice`` naming an
    unknown tool, a grammar that compiles too slowly. ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
