"""Request -> prompt token ids, off the event loop and never holding the GIL for long.

The chat template and the tokenizer run in a small thread pool, with a bounded number
of prompts waiting for it (more get 429). The Rust tokenizer runs with the GIL
released, so neither the event loop (streams, /health) nor the engine loop (its
heartbeat) waits for a long prompt. A text longer than the context times the most
characters one token can stand for cannot fit, and is refused before tokenizing.

A chat request with images (a vision-language model) takes the same path: its remote
images are fetched on the event loop (when the policy allows them), then the worker
decodes and preprocesses them and tokenizes the text around their placeholders.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from edge.serving import schema
from edge.serving.errors import BadRequest, PromptsBusy
from edge.errors import PromptTooLong
from edge.model.vision.request import ImagePolicy, count_images, fetch_images, resolve_images

if TYPE_CHECKING:
    from edge.runtime.engine import Engine
    from edge.model.tokenizer import RenderedChat, Tokenizer
    from edge.model.vision.runtime import MultimodalPrompt


class PromptEncoder:
    """Turns parsed requests into prompts that fit the engine's context (token ids, or a
    MultimodalPrompt where a chat request holds images under ``images``), in at most
    ``workers`` threads with at most ``waiting`` more requests queued for them."""

    def __init__(self, workers: int = 2, waiting: int = 8, images: ImagePolicy | None = None) -> None:
        if workers < 1 or waiting < 0:
            raise ValueError(f"need workers >= 1 and waiting >= 0, got {workers} and {waiting}")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edge-prompt")
        self.capacity = workers + waiting
        self.images = images or ImagePolicy()
        self._admitted = 0  # touched on the event loop only

    async def prompt(self, engine: Engine, req: Any, kind: str) -> list[int] | MultimodalPrompt:
        if self._admitted >= self.capacity:
            raise PromptsBusy(f"the server is busy: {self._admitted} prompts are waiting for the tokenizer; "
                              "retry later")
        self._admitted += 1
        try:
            fetched: dict[str, bytes] = {}
            if kind == "chat" and engine.vision is not None:
                fetched = await fetch_images(schema.image_urls(req), self.images)
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, encode_request, engine, req, kind, self.images, fetched
            )
        finally:
            self._admitted -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def encode_request(
    engine: Engine, req: Any, kind: str, images: ImagePolicy | None = None, fetched: dict[str, bytes] | None = None
) -> list[int] | MultimodalPrompt:
    """The prompt of a chat or completion request: token ids, or a MultimodalPrompt for
    chat messages holding images (``fetched``: their remote URLs' bytes); BadRequest
    when it is empty, not encodable or longer than the context, ImageError for an image
    that is unusable or over the ``images`` policy's limits."""
    tok = engine.tokenizer
    ctx = engine.max_seq_len
    if kind == "chat":
        param = "messages"
        # A text model's chat_messages refuses image parts (400 at the part's type).
        messages = schema.chat_messages(req, images=engine.vision is not None)
        if tok is None or not tok.chat_template:
            raise BadRequest("this model has no chat template: use /v1/completions", param=param,
                             code="unsupported_model")
        kwargs = schema.template_kwargs(req)
        if count_images(messages):
            return _image_prompt(engine, tok, messages, images or ImagePolicy(), fetched or {}, kwargs)
        ids = _encode_text(tok, tok.render_chat(messages, **kwargs), ctx, param)
    else:
        param = "prompt"
        prompt = schema.completion_prompt(req)
        if isinstance(prompt, str):
            if tok is None:
                raise BadRequest("this model has no tokenizer: send token ids as the prompt", param=param,
                                 code="unsupported_model")
            ids = _encode_text(tok, prompt, ctx, param)
        else:
            ids = prompt
            _check_fits(engine, ids, param)  # before looking at each of a million ids
            vocab = engine.cfg.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"token id {bad} is out of range [0, {vocab})", param=param, code="invalid_value")
    if not ids:
        raise BadRequest("the prompt is empty", param=param, code="invalid_value")
    _check_fits(engine, ids, param)
    _check_no_placeholders(engine, ids, param)
    return ids


def _image_prompt(
    engine: Engine, tok: Tokenizer, messages: list[dict[str, Any]], images: ImagePolicy, fetched: dict[str, bytes],
    kwargs: dict[str, Any],
) -> MultimodalPrompt:
    from edge.model.vision.runtime import split_images

    vision = engine.vision
    assert vision is not None
    rendered, sources = split_images(resolve_images(messages, images, fetched))
    # The text first: a prompt too long for the context fails before any image is decoded.
    ids = _encode_text(tok, tok.render_chat(rendered, **kwargs), engine.max_seq_len, "messages")
    prompt = vision.build_prompt(ids, [vision.prepare(s, images.limits) for s in sources])
    _check_fits(engine, prompt.ids, "messages")
    return prompt


def _encode_text(tok: Tokenizer, text: str | RenderedChat, ctx: int, param: str) -> list[int]:
    """A raw prompt (special-token strings are tokens) or a rendered chat (only the
    template's are), refused untokenized when too long to fit."""
    n = len(text if isinstance(text, str) else text.text)
    limit = ctx * tok.chars_per_token
    if n > limit:
        raise BadRequest(
            f"this model's maximum context length is {ctx} tokens; the prompt has {n} characters, more "
            f"than {ctx} tokens of at most {tok.chars_per_token} characters each can hold",
            param=param, code="context_length_exceeded",
        )
    return tok.encode_releasing_gil(text) if isinstance(text, str) else tok.encode_rendered(text)


def _check_no_placeholders(engine: Engine, ids: list[int], param: str) -> None:
    """Image and video placeholder tokens come only from real images (a prompt of text or
    token ids holding them would run the model on placeholders without pixels)."""
    vision = engine.vision
    if vision is None:
        return
    pads = {vision.cfg.image_token_id, vision.cfg.video_token_id}
    if not pads.isdisjoint(ids):
        raise BadRequest("the prompt holds image placeholder tokens; images go in image_url content parts of "
                         "a chat request", param=param, code="invalid_value")


def _check_fits(engine: Engine, ids: list[int], param: str) -> None:
    try:
        engine.check_prompt(ids, 1)
    except PromptTooLong as exc:
        raise BadRequest(
            f"this model's maximum context length is {engine.max_seq_len} tokens; the prompt has {len(ids)} "
            f"tokens ({exc})",
            param=param, code="context_length_exceeded",
        ) from None
