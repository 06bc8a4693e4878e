"""How a model writes tool calls and thoughts in its output.

Qwen2.5 / Qwen3 and the Hermes models write each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` after any text, and
Qwen3 thinks in ``<think>...</think>`` before the answer; their chat templates render
earlier calls and tool results the same way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    think_open: str = "<think>"
    think_close: str = "</think>"

    def thinks(self, chat_template: str | None) -> bool:
        """Whether a chat template is a thinking model's (it writes think blocks)."""
        return bool(chat_template) and self.think_open in chat_template


HERMES = ToolFormat()


def thinking_mode(fmt: ToolFormat, chat_template: str | None, prompt_text: str, enabled: bool | None) -> str:
    """"open" when the rendered prompt ends inside a think block, "on" when the model may
    start its answer with one, "off" otherwise (a template without think blocks, or
    thinking switched off: Qwen3's template then closes an empty block in the prompt)."""
    if prompt_text.rstrip().endswith(fmt.think_open):
        return "open"
    if enabled is False or not fmt.thinks(chat_template):
        return "off"
    return "on"
