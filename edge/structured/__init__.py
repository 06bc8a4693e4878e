"""Structured output and tool calls: OpenAI ``response_format`` / ``tools`` compiled into
a grammar (llguidance), a per-request matcher that gives the allowed-token bitmask of each
step, and the parsers that turn the constrained text back into ``reasoning_content``,
``content`` and ``tool_calls``.

Host side only: masks are numpy int32 words (bit ``i`` of word ``i // 32`` = token ``i``
allowed); the engine applies them on the device."""
