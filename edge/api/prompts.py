"""Request -> prompt token ids: chat template, tokenizer, context check."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edge import api_schema as schema
from edge.api.errors import BadRequest
from edge.errors import PromptTooLong

if TYPE_CHECKING:
    from edge.engine import Engine


class PromptEncoder:
    """Turns a parsed request into prompt ids that fit the engine's context."""

    async def prompt_ids(self, engine: Engine, req: Any, kind: str) -> list[int]:
        return encode_request(engine, req, kind)

    def close(self) -> None:
        pass


def encode_request(engine: Engine, req: Any, kind: str) -> list[int]:
    tok = engine.tokenizer
    if kind == "chat":
        messages = schema.chat_messages(req)
        if tok is None or not tok.chat_template:
            raise BadRequest("this model has no chat template: use /v1/completions", param="messages",
                             code="unsupported_model")
        ids = tok.encode_chat(messages)
        param = "messages"
    else:
        prompt = schema.completion_prompt(req)
        if isinstance(prompt, str):
            if tok is None:
                raise BadRequest("this model has no tokenizer: send token ids as the prompt", param="prompt",
                                 code="unsupported_model")
            ids = tok.encode(prompt)
        else:
            vocab = engine.cfg.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"token id {bad} is out of range [0, {vocab})", param="prompt",
                                 code="invalid_value")
            ids = prompt
        param = "prompt"
    if not ids:
        raise BadRequest("the prompt is empty", param=param, code="invalid_value")
    try:
        engine.check_prompt(ids, 1)
    except PromptTooLong as exc:
        raise BadRequest(
            f"this model's maximum context length is {engine.max_seq_len} tokens; the prompt has "
            f"{len(ids)} tokens ({exc})",
            param=param,
            code="context_length_exceeded",
        ) from None
    return ids
