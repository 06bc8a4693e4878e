"""``/v1/chat/completions`` and ``/v1/completions``: parse -> prompt -> submit -> stream.

Every failure is raised as a typed exception (edge/serving/errors.py maps it); the
response is SSE (``data: {chunk}`` ... ``data: [DONE]``) or one JSON body. A client
that goes away, or a stream closed early, cancels its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from edge.serving import schema
from edge.serving.errors import (
    BadRequest,
    BodyTooLarge,
    GenerationFailed,
    Unauthorized,
    Unavailable,
    error_body,
)
from edge.errors import DuplicateRequestId
from edge.serving.json_body import SCAN_STEP, BodyParser, ShapeLimits, ShapeScanner
from edge.structured.errors import GrammarError
from edge.structured.formats import ToolFormat, thinking_mode
from edge.structured.output import OutputParser, ParsedOutput, parse_output

if TYPE_CHECKING:
    from edge.structured.matcher import GrammarMatcher
    from edge.structured.request import StructuredRequest
    from edge.serving.prompts import PromptEncoder
    from edge.model.generation import Chunk
    from edge.serving.service import Service

# Default body limit: room for a context of prompt even at a dozen bytes per character
# of JSON-escaped text, and small enough that parsing it never holds the GIL for long.
MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 64
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_LINE_BREAKS = (("\u0085", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def sse_event(obj: Any) -> str:
    """One SSE event. U+0085/U+2028/U+2029 are escaped: they are legal in JSON strings
    but clients that split lines with str.splitlines() (httpx) would cut the event."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in _LINE_BREAKS:
        if ch in text:
            text = text.replace(ch, esc)
    return f"data: {text}\n\n"


def check_auth(service: Service, request: Request) -> None:
    if service.api_key is None:
        return
    # Bytes as sent (Starlette decodes headers as Latin-1): a UTF-8 key matches as UTF-8.
    header = request.headers.get("authorization", "").encode("latin-1")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), service.api_key.encode()):
        raise Unauthorized("missing or incorrect API key: send 'Authorization: Bearer <key>'")


def check_ready(service: Service) -> None:
    if service.stopping:
        raise Unavailable("the server is shutting down", code="shutting_down")
    if service.state == "failed":
        raise Unavailable(f"the model failed to load: {service.error}", code="model_load_failed")
    if service.state != "ready":
        raise Unavailable("the model is still loading; retry shortly", code="model_loading")
    alive, why = service.engine_alive()
    if not alive:
        raise Unavailable(f"the engine is not healthy: {why}", code="engine_unhealthy")


async def read_body(request: Request, limit: int, scanner: ShapeScanner | None = None) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes. With a
    ``scanner``, its shape is scanned as it arrives and a hostile one refused (400)
    before the rest is read. A refusal closes the connection: the client's remaining
    bytes are not read. The parts are joined once, at the end: ``bytes.join`` copies a
    large body with the GIL released, where growing a buffer part by part holds it for
    each reallocation's copy."""
    close = {"Connection": "close"}
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise BodyTooLarge(f"request body exceeds {limit} bytes", headers=close)
    parts: list[bytes] = []
    unscanned: list[bytes] = []
    total = unscanned_bytes = 0
    try:
        async for part in request.stream():
            total += len(part)
            if total > limit:
                raise BodyTooLarge(f"request body exceeds {limit} bytes", headers=close)
            parts.append(part)
            if scanner is not None:
                unscanned.append(part)
                unscanned_bytes += len(part)
                if unscanned_bytes >= SCAN_STEP:
                    scanner.feed(b"".join(unscanned))
                    unscanned, unscanned_bytes = [], 0
        if scanner is not None and unscanned:
            scanner.feed(b"".join(unscanned))
    except (BadRequest, BodyTooLarge) as exc:
        exc.headers |= close
        raise
    return b"".join(parts)


def body_limit(max_body: int | None, max_seq_len: int, image_bytes: int = 0) -> int:
    """``max_body``, or by default room for a context of text plus ``image_bytes`` (the
    base64 images a vision-language model's request may hold)."""
    if max_body is not None:
        return max_body
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_seq_len) + image_bytes


def request_id(service: Service, request: Request, prefix: str) -> str:
    rid = request.headers.get("x-request-id")
    if rid is None or rid == "":
        return f"{prefix}-{uuid.uuid4().hex}"
    if not schema.REQUEST_ID_RE.match(rid):
        raise BadRequest("X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]", param="X-Request-Id",
                         code="invalid_value")
    if rid in service.active:
        raise DuplicateRequestId(f"request id {rid!r} is already in flight")
    return rid


class Completions:
    """The two generation endpoints over one service and one prompt encoder."""

    def __init__(self, service: Service, prompts: PromptEncoder, parser: BodyParser) -> None:
        self.service = service
        self.prompts = prompts
        self.parser = parser

    async def handle(self, request: Request, kind: str) -> Response:
        svc = self.service
        t0 = time.perf_counter()
        check_auth(svc, request)
        check_ready(svc)
        engine = svc.engine
        assert engine is not None
        image_bytes = self.prompts.images.body_bytes if engine.vision is not None else 0
        images = self.prompts.images
        one_image = images.body_bytes // max(1, images.max_images) + 256  # a data: URL, its prefix included
        limits = ShapeLimits.for_context(engine.max_seq_len, body_limit(None, engine.max_seq_len),
                                         one_image if engine.vision is not None else 0)
        scanner = ShapeScanner(limits)
        body = await read_body(request, body_limit(svc.settings.max_body, engine.max_seq_len, image_bytes), scanner)
        model = schema.ChatCompletionRequest if kind == "chat" else schema.CompletionRequest
        req = await self.parser.parse(body, model, limits, scanner.finish())
        del body
        schema.check_unsupported(req)
        structured = schema.structured_request(req) if kind == "chat" else None
        prompt = await self.prompts.prompt(engine, req, kind)
        ids = prompt if isinstance(prompt, list) else prompt.ids
        params = schema.sampling_params(req, len(ids), engine.max_seq_len, svc.settings.default_max_tokens)
        rid = request_id(svc, request, "chatcmpl" if kind == "chat" else "cmpl")
        params.validate(engine.max_seq_len)
        matcher, output = None, None
        if structured is not None:
            matcher, output = await self._structure(structured, ids, req)
        if svc.monitor is not None:
            svc.monitor.governor.check_admission()
        handle = svc.scheduler.submit(prompt, params, request_id=rid, grammar=matcher)
        svc.active[rid] = handle
        svc.metrics.in_flight.inc()
        svc.metrics.prompt_tokens.inc(len(ids))
        created = int(time.time())
        headers = {"X-Request-Id": rid}
        tracked = _Tracked(svc, handle, rid, ENDPOINTS[kind], t0)
        chunks = self._consume(tracked)
        if req.stream:
            events = self._sse(chunks, kind, rid, created, schema.include_usage(req), output)

            async def close_events() -> None:
                # Runs after the response, also when the client went away mid-stream:
                # closing the generator cancels the request if it is still running.
                await events.aclose()
                tracked.close(None)  # the stream never started: still cancel and account

            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers=SSE_HEADERS | headers,
                background=BackgroundTask(close_events),
            )
        try:
            return await self._collect(request, chunks, handle, kind, rid, created, headers, output)
        finally:
            tracked.close(None)

    async def _structure(
        self, structured: StructuredRequest, ids: list[int], req: schema.ChatCompletionRequest
    ) -> tuple[GrammarMatcher | None, OutputShape | None]:
        """The request's grammar matcher (None: unconstrained), compiled off the event loop
        within the compiler's time limit, and how to parse its output (None: plain text)."""
        engine, grammars = self.service.engine, self.service.grammars
        assert engine is not None
        tok = engine.tokenizer
        if tok is None or grammars is None:
            if structured.constrained:
                raise GrammarError("this model has no tokenizer.json: structured output needs one")
            return None, None
        enabled = (req.chat_template_kwargs or {}).get("enable_thinking")
        tail = tok.decode(ids[-8:], skip_special_tokens=False)
        thinking = thinking_mode(grammars.format, tok.chat_template, tail, enabled if isinstance(enabled, bool) else None)
        structured = dataclasses.replace(structured, thinking=thinking)
        grammar = await grammars.compile_async(structured)
        output = OutputShape(grammars.format, thinking, structured.calls_tools)
        return (grammar.matcher() if grammar is not None else None), (output if output.parses else None)

    async def _consume(self, tracked: _Tracked) -> AsyncIterator[Chunk]:
        """The request's chunks, with metrics; cancels the request if left early
        (client gone, stream closed, server shutting down)."""
        m = self.service.metrics
        final: Chunk | None = None
        last_t: float | None = None
        try:
            async for chunk in tracked.handle:
                now = time.perf_counter()
                n = len(chunk.token_ids)
                if n:
                    if last_t is None:
                        m.ttft.observe(now - tracked.t0)
                    else:
                        per = (now - last_t) / n
                        for _ in range(n):
                            m.tpot.observe(per)
                    last_t = now
                    m.generated_tokens.inc(n)
                if chunk.finish_reason is not None:
                    final = chunk
                yield chunk
                if final is not None:
                    return
        finally:
            tracked.close(final)

    async def _sse(
        self, chunks: AsyncIterator[Chunk], kind: str, rid: str, created: int, with_usage: bool,
        output: OutputShape | None = None,
    ) -> AsyncIterator[str]:
        model = self.service.model_id
        parser = output.parser() if output is not None else None
        async with contextlib.aclosing(chunks):
            if kind == "chat":
                yield sse_event(schema.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
            async for chunk in chunks:
                reason = chunk.finish_reason
                if chunk.text:
                    if parser is not None:
                        for delta in parser.feed(chunk.text):
                            yield sse_event(schema.chat_chunk(rid, created, model, delta))
                    elif kind == "chat":
                        yield sse_event(schema.chat_chunk(rid, created, model, {"content": chunk.text}))
                    else:
                        yield sse_event(schema.completion_chunk(rid, created, model, chunk.text))
                if reason is None:
                    continue
                if parser is not None:
                    for delta in parser.finish():
                        yield sse_event(schema.chat_chunk(rid, created, model, delta))
                    if parser.calls and reason == "stop":
                        reason = "tool_calls"
                if reason == "error":
                    yield sse_event(error_body(GenerationFailed(chunk.message or "generation failed")))
                if kind == "chat":
                    yield sse_event(schema.chat_chunk(rid, created, model, {}, reason))
                else:
                    yield sse_event(schema.completion_chunk(rid, created, model, "", reason))
                if with_usage:
                    yield sse_event(schema.usage_chunk(kind, rid, created, model, chunk.usage))
            yield "data: [DONE]\n\n"

    async def _collect(
        self, request: Request, chunks: AsyncIterator[Chunk], handle: Any, kind: str, rid: str, created: int,
        headers: dict[str, str], output: OutputShape | None = None,
    ) -> Response:
        async def watch_disconnect() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    handle.cancel()
                    return

        watcher = asyncio.create_task(watch_disconnect())
        parts: list[str] = []
        final: Chunk | None = None
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    parts.append(chunk.text)
                    if chunk.finish_reason is not None:
                        final = chunk
        finally:
            watcher.cancel()
        if final is None or final.finish_reason == "error":
            msg = (final.message if final is not None else None) or "generation failed"
            raise GenerationFailed(msg, headers=headers)
        text = "".join(parts)
        if kind == "chat":
            parsed = output.parse(text) if output is not None else None
            body = schema.chat_completion(rid, created, self.service.model_id, text, final.finish_reason, final.usage,
                                          parsed)
        else:
            body = schema.completion(rid, created, self.service.model_id, text, final.finish_reason, final.usage)
        return JSONResponse(body, headers=headers)


@dataclasses.dataclass(frozen=True)
class OutputShape:
    """How a chat response's text splits into reasoning, content and tool calls."""

    format: ToolFormat
    thinking: str
    tools: bool

    @property
    def parses(self) -> bool:
        return self.tools or self.thinking != "off"

    def parser(self) -> OutputParser:
        return OutputParser(self.format, self.thinking, self.tools)

    def parse(self, text: str) -> ParsedOutput:
        return parse_output(text, self.format, self.thinking, self.tools)


class _Tracked:
    """One admitted request's bookkeeping, closed exactly once however it ends."""

    def __init__(self, service: Service, handle: Any, rid: str, endpoint: str, t0: float) -> None:
        self.service = service
        self.handle = handle
        self.rid = rid
        self.endpoint = endpoint
        self.t0 = t0
        self.closed = False

    def close(self, final: Chunk | None) -> None:
        if self.closed:
            return
        self.closed = True
        if final is None:
            with contextlib.suppress(Exception):
                self.handle.cancel()
        m = self.service.metrics
        self.service.active.pop(self.rid, None)
        m.in_flight.dec()
        m.finished.labels(self.endpoint, final.finish_reason if final is not None else "cancelled").inc()
        m.duration.observe(time.perf_counter() - self.t0)
        u = final.usage if final is not None else None
        if u is not None:
            m.cached_tokens.inc(u.cached_tokens or 0)
