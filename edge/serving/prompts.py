"""Request -> prompt token ids, off the event loop and never holding the GIL for long.

The chat template and the tokenizer run in a small thread pool, with a bounded number
of prompts waiting for it (more get 429). The Rust tokenizer runs with the GIL
released, so neither the event loop (streams, /health) nor the engine loop (its
heartbeat) waits for a long prompt. A text longer than the context times the most
characters one token can stand for cannot fit, and is refused before tokenizing.

A chat request with images (a vision-language model) goes to its own pool, one worker
with a few requests waiting (more get 429): its remote images are fetched on the event
loop (when the policy allows them), then the worker reads every image's header, refuses
what cannot fit (the context, or the memory one decode may take: 400) before decoding
anything, and has the images decoded and resized one at a time in a child process
(``decode_process.py``: Pillow holds the GIL through parts of a decode). So images never
delay a text request's tokenizing, nor hold the interpreter the streams and the engine
loop run in.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from edge.serving import schema
from edge.serving.errors import BadRequest, PromptsBusy
from edge.errors import PromptTooLong
from edge.model.vision.decode_process import DecodeProcess
from edge.model.vision.request import ImagePolicy, count_images, fetch_images, resolve_images

if TYPE_CHECKING:
    from edge.runtime.engine import Engine
    from edge.model.tokenizer import RenderedChat, Tokenizer
    from edge.model.vision.runtime import MultimodalPrompt


class _Pool:
    """A thread pool and how many requests it admits (workers + waiting), counted on the event loop."""

    def __init__(self, workers: int, waiting: int, name: str) -> None:
        if workers < 1 or waiting < 0:
            raise ValueError(f"need workers >= 1 and waiting >= 0, got {workers} and {waiting}")
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.capacity = workers + waiting
        self.admitted = 0


class PromptEncoder:
    """Turns parsed requests into prompts that fit the engine's context (token ids, or a
    MultimodalPrompt where a chat request holds images under ``images``): text in at most
    ``workers`` threads with at most ``waiting`` more requests queued for them, requests
    with images in ``image_workers`` threads of their own with ``image_waiting`` queued."""

    def __init__(
        self, workers: int = 2, waiting: int = 8, images: ImagePolicy | None = None, image_workers: int = 1,
        image_waiting: int = 2,
    ) -> None:
        self._text = _Pool(workers, waiting, "edge-prompt")
        self._images = _Pool(image_workers, image_waiting, "edge-image")
        self.capacity = self._text.capacity
        self.images = images or ImagePolicy()
        self.decoder = DecodeProcess()

    async def prompt(self, engine: Engine, req: Any, kind: str) -> list[int] | MultimodalPrompt:
        urls = schema.image_urls(req) if kind == "chat" and engine.vision is not None else []
        pool = self._images if urls else self._text
        if pool.admitted >= pool.capacity:
            what = "requests with images are waiting for the image worker" if urls else \
                "prompts are waiting for the tokenizer"
            raise PromptsBusy(f"the server is busy: {pool.admitted} {what}; retry later")
        pool.admitted += 1
        try:
            fetched = await fetch_images(urls, self.images) if urls else {}
            return await asyncio.get_running_loop().run_in_executor(
                pool.executor, encode_request, engine, req, kind, self.images, fetched, self.decoder
            )
        finally:
            pool.admitted -= 1

    def close(self) -> None:
        for pool in (self._text, self._images):
            pool.executor.shutdown(wait=False, cancel_futures=True)
        self.decoder.close()


def encode_request(
    engine: Engine, req: Any, kind: str, images: ImagePolicy | None = None, fetched: dict[str, bytes] | None = None,
    decoder: DecodeProcess | None = None,
) -> list[int] | MultimodalPrompt:
    """The prompt of a chat or completion request: token ids, or a MultimodalPrompt for
    chat messages holding images (``fetched``: their remote URLs' bytes; ``decoder``: the
    process that decodes them, else this one); BadRequest
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
            return _image_prompt(engine, tok, messages, images or ImagePolicy(), fetched or {}, kwargs, decoder)
        ids = _encode_text(tok, _render(tok, messages, ctx, param, kwargs), ctx, param)
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
    kwargs: dict[str, Any], decoder: DecodeProcess | None,
) -> MultimodalPrompt:
    from edge.model.vision.runtime import split_images

    vision = engine.vision
    assert vision is not None
    # The server's base64 is decoded in the image decoding process too: one call holds an interpreter.
    b64decode = decoder.b64decode if decoder is not None else None
    rendered, sources = split_images(resolve_images(messages, images, fetched, b64decode))
    # The text, then every image's header: a prompt too long for the context, or an image
    # too large to decode, fails before any image is decoded.
    ids = _encode_text(tok, _render(tok, rendered, engine.max_seq_len, "messages", kwargs), engine.max_seq_len, "messages")
    headers = [vision.inspect(s, images.limits) for s in sources]
    image_tokens = sum(vision.image_tokens(h) for h in headers)
    total = len(ids) - len(sources) + image_tokens
    if total + 1 > engine.max_seq_len:
        raise BadRequest(
            f"this model's maximum context length is {engine.max_seq_len} tokens; the prompt has {total} tokens, "
            f"{image_tokens} of them for its {len(sources)} image(s): send smaller images or fewer",
            param="messages", code="context_length_exceeded",
        )
    for header in headers:
        vision.check_memory(header, images.limits)
    if decoder is not None:
        prepared = [decoder.prepare(s, images.limits, vision.processor) for s in sources]
    else:
        prepared = [vision.prepare(s, images.limits) for s in sources]
    prompt = vision.build_prompt(ids, prepared)
    _check_fits(engine, prompt.ids, "messages")
    return prompt


def _encode_text(tok: Tokenizer, text: str | RenderedChat, ctx: int, param: str) -> list[int]:
    """A raw prompt (special-token strings are tokens) or a rendered chat (only the
    template's are), refused untokenized when too long to fit."""
    _check_chars(tok, len(text if isinstance(text, str) else text.text), ctx, param)
    return tok.encode_releasing_gil(text) if isinstance(text, str) else tok.encode_rendered(text)


def _render(
    tok: Tokenizer, messages: list[dict[str, Any]], ctx: int, param: str, kwargs: dict[str, Any] | None = None
) -> RenderedChat:
    """The chat template over messages (and tools) whose text can fit: a 50 MB message is
    refused before the template copies it and its special tokens are looked for."""
    kwargs = kwargs or {}
    _check_chars(tok, _chars(messages) + _chars(kwargs), ctx, param)
    return tok.render_chat(messages, **kwargs)


def _chars(node: Any) -> int:
    if isinstance(node, str):
        return len(node)
    if isinstance(node, dict):
        return sum(_chars(v) for v in node.values())
    if isinstance(node, list):
        return sum(_chars(v) for v in node)
    return 0


def _check_chars(tok: Tokenizer, n: int, ctx: int, param: str) -> None:
    limit = ctx * tok.chars_per_token
    if n > limit:
        raise BadRequest(
            f"this model's maximum context length is {ctx} tokens; the prompt has {n} characters, more "
            f"than {ctx} tokens of at most {tok.chars_per_token} characters each can hold",
            param=param, code="context_length_exceeded",
        )


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
