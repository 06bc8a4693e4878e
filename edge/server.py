"""The HTTP service: OpenAI-compatible API over loopback TCP or a Unix socket.

    edge serve --model DIR [--host 127.0.0.1] [--port 8000] [--uds PATH] ...

* ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` or not; SSE
  ``data: {chunk}`` events ending with ``data: [DONE]``), ``GET /v1/models``,
  ``POST /v1/cancel/{id}`` (barge-in while the stream stays open; closing the stream
  cancels too), ``GET /health`` (503 until loaded and warmed), ``GET /metrics``.
* The socket is listening before the model loads: loading, scheduler start and a
  warm-up generation run on a background thread; then ``READY=1`` goes to systemd.
* ``WATCHDOG=1`` is sent only while the engine loop is alive and beating.
* SIGTERM: stop accepting, let streams finish for ``shutdown_grace_s``, cancel the
  rest, stop the scheduler, exit 0.

Request parsing and the wire format are in :mod:`edge.api_schema`, settings in
:mod:`edge.settings`, the systemd protocol in :mod:`edge.sd_notify`, metrics in
:mod:`edge.server_metrics`. torch is imported by the loading thread, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from edge import api_schema as schema
from edge.api_schema import ApiError, bad_request
from edge.monitor import DeviceTooHot, Monitor, MonitorConfig
from edge.sd_notify import Notifier, Watchdog
from edge.server_metrics import ServiceMetrics
from edge.settings import Settings, read_api_key

if TYPE_CHECKING:
    from edge.engine import Engine
    from edge.generation import Chunk

log = logging.getLogger("edge.server")

MAX_BODY_BYTES = 8 << 20
LOADING_RETRY_AFTER_S = 5
QUEUE_FULL_RETRY_AFTER_S = 1
KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/cancel", "/health", "/metrics")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json_line(obj: Any) -> str:
    """One SSE event. U+0085/U+2028/U+2029 are escaped: they are legal in JSON strings
    but clients that split lines with str.splitlines() (httpx) would cut the event."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in _LINE_BREAKS:
        if ch in text:
            text = text.replace(ch, esc)
    return f"data: {text}\n\n"


_LINE_BREAKS = (("\u0085", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


class Service:
    """State shared by the endpoints: settings, engine, scheduler, monitor, metrics."""

    def __init__(self, settings: Settings, environ: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.environ = dict(os.environ if environ is None else environ)
        self.api_key = read_api_key(settings.api_key_file) if settings.api_key_file else None
        self.model_id = settings.model_name or (Path(settings.model).name if settings.model else "edge-default")
        self.registry = CollectorRegistry()
        self.metrics = ServiceMetrics(self.registry, self._stats_or_none, lambda: self.state == "ready")
        self.monitor_config = MonitorConfig.from_env(self.environ)
        self.monitor: Monitor | None = None
        self.engine: Engine | None = None
        self.scheduler: Any = None
        self.state = "starting"  # starting, loading, warming, ready, failed, stopping
        self.error: str | None = None
        self.exit_code = 0
        self.started_at = time.monotonic()
        self.active: dict[str, Any] = {}  # request id -> RequestHandle
        self.notifier = Notifier(self.environ)
        interval = self.notifier.watchdog_interval_s
        # A heartbeat older than this means the engine loop is stuck: stop the pings
        # (WatchdogSec=30: stale after 15 s, restarted by systemd within 45 s of the hang).
        self.heartbeat_stale_s = max(5.0, interval) if interval else 5.0
        self.watchdog = Watchdog(self.notifier, self.healthy, self.status_line)
        self._lock = threading.RLock()  # RLock: begin_shutdown may run in a signal handler
        self._loader: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._request_exit = lambda code: None  # set by serve()

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the monitor, the watchdog and the background loader (non-blocking)."""
        try:
            self.monitor = Monitor(self.monitor_config, registry=self.registry).start()
        except Exception as exc:  # monitoring is informative, never fatal
            log.warning("monitor unavailable: %s", exc)
        self.watchdog.start()
        self._loader = threading.Thread(target=self._load, name="edge-loader", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        s = self.settings
        try:
            self._set_state("loading")
            log.info("loading model %s", s.model or "(embedded default)")
            from edge.engine import Engine
            from edge.scheduler import Scheduler

            options: dict[str, Any] = {}
            if s.kv_blocks:
                options["kv_blocks"] = s.kv_blocks
            if s.kv_memory:
                options["kv_memory"] = s.kv_memory
            if s.memory_reserve is not None:
                options["memory_reserve"] = s.memory_reserve
            engine = Engine.from_pretrained(
                s.model,
                device=s.device,
                dtype=s.dtype,
                kv_cache="paged",
                page_size=s.page_size,
                max_seq_len=s.max_seq_len,
                cuda_graph=s.cuda_graph,
                **options,
            )
            self.engine = engine
            self._set_state("warming")
            # Every decode graph both slots can need, before serving: no request pays a capture.
            log.info("captured %d decode graphs", engine.capture_graphs())
            mon = self.monitor
            governor = _WarmupExempt(mon.governor) if mon else None
            sched = Scheduler(
                engine,
                queue_size=s.queue_size,
                prefill_chunk=s.prefill_chunk,
                prefix_cache=s.prefix_cache,
                governor=governor,
                energy=mon.energy if mon else None,
            )
            with self._lock:
                if self._stopping:
                    return
                sched.start()
                self.scheduler = sched
            t = time.perf_counter()
            # A device that boots hot still warms up (four tokens), then refuses work.
            if governor is not None:
                governor.exempt = True
            try:
                self._warm_up(engine, sched)
            finally:
                if governor is not None:
                    governor.exempt = False
            log.info("warm-up generation took %.0f ms", (time.perf_counter() - t) * 1e3)
            with self._lock:
                if self._stopping:
                    return
                self.state = "ready"
            info = engine.info()
            log.info("ready: %s (%s, %s, context %d) in %.1f s", self.model_id, info["device"], info["dtype"],
                     engine.max_seq_len, time.monotonic() - self.started_at)
            self.notifier.ready(f"ready: {self.model_id} on {info['device']}")
        except Exception as exc:
            log.exception("model load failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            self.notifier.status(f"failed: {self.error}"[:200])
            self.exit_code = 1
            self._request_exit(1)

    def _warm_up(self, engine: Engine, sched: Any) -> None:
        """One short generation through the scheduler: compiles kernels, captures CUDA
        graphs and renders the chat template before the first real request."""
        from edge.sampling import SamplingParams

        if engine.tokenizer is not None and engine.tokenizer.chat_template:
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
        else:
            ids = [1, 2, 3, 4]
        handle = sched.submit(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              request_id=f"warmup-{uuid.uuid4().hex[:8]}")
        final = None
        for chunk in handle:
            final = chunk
        if final is None or final.finish_reason not in ("stop", "length"):
            reason = None if final is None else (final.message or final.finish_reason)
            raise RuntimeError(f"warm-up generation failed: {reason}")

    def _set_state(self, state: str) -> None:
        self.state = state
        self.notifier.status(self.status_line() or state)

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new work, tell systemd, cancel what is left after the grace."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        n = len(self.active)
        log.info("shutting down: %d request(s) in flight, %.1f s grace", n, self.settings.shutdown_grace_s)
        self.notifier.stopping(f"stopping: {n} request(s) in flight")
        if n:
            timer = threading.Timer(self.settings.shutdown_grace_s, self.cancel_all, kwargs={"why": "grace expired"})
            timer.daemon = True
            timer.start()

    def cancel_all(self, why: str = "shutdown") -> None:
        handles = list(self.active.values())
        if handles:
            log.info("cancelling %d request(s): %s", len(handles), why)
        for h in handles:
            with contextlib.suppress(Exception):
                h.cancel()

    def shutdown(self) -> None:
        """Lifespan end (connections drained or timed out): stop everything. Blocking."""
        self.begin_shutdown()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.state = "stopping" if self.state != "failed" else self.state
        self.cancel_all()
        if self.scheduler is not None:
            try:
                self.scheduler.stop(timeout=5.0)
            except Exception:
                log.exception("scheduler stop failed")
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                self.monitor.stop()
        self.watchdog.stop()
        self.notifier.close()
        log.info("stopped")

    # -- health -------------------------------------------------------------------------

    def _stats_or_none(self) -> dict[str, Any] | None:
        return self.scheduler.stats() if self.scheduler is not None else None

    def engine_alive(self) -> tuple[bool, str]:
        stats = self._stats_or_none()
        if stats is None:
            return False, "no scheduler"
        if not stats.get("alive"):
            return False, "engine loop is not running"
        hb = stats.get("last_heartbeat")
        if hb is not None and time.monotonic() - float(hb) > self.heartbeat_stale_s:
            return False, f"engine loop heartbeat is {time.monotonic() - float(hb):.1f} s old"
        return True, "ok"

    def healthy(self) -> bool:
        """Watchdog predicate: the loader is making progress, or the engine loop beats."""
        if self.state in ("starting", "loading", "warming"):
            return self._loader is not None and self._loader.is_alive()
        if self.state == "failed":
            return False
        if self.state == "stopping":
            return True
        return self.engine_alive()[0]

    def status_line(self) -> str | None:
        if self.state == "loading":
            return f"loading {self.model_id}"
        if self.state == "warming":
            return "warming up"
        if self.state == "ready":
            stats = self._stats_or_none() or {}
            n = len(self.active)
            return f"ready: serving {n} request{'s' if n != 1 else ''}, queue {stats.get('queue_depth', 0)}"
        if self.state == "failed":
            return f"failed: {self.error}"[:200]
        return self.state

    # -- request handling ---------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_ready(self) -> None:
        if self._stopping:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                           headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        if self.state == "failed":
            raise ApiError(503, f"the model failed to load: {self.error}", type="server_error",
                           code="model_load_failed")
        if self.state != "ready":
            raise ApiError(503, "the model is still loading; retry shortly", type="server_error",
                           code="model_loading", headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        alive, why = self.engine_alive()
        if not alive:
            raise ApiError(503, f"the engine is not healthy: {why}", type="server_error", code="engine_unhealthy")

    @staticmethod
    async def read_body(request: Request) -> bytes:
        size = int(request.headers.get("content-length") or 0)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
        parts, total = [], 0
        async for part in request.stream():
            total += len(part)
            if total > MAX_BODY_BYTES:
                raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
            parts.append(part)
        return b"".join(parts)

    def request_id(self, request: Request, prefix: str) -> str:
        rid = request.headers.get("x-request-id")
        if rid is None or rid == "":
            return f"{prefix}-{uuid.uuid4().hex}"
        if not schema.REQUEST_ID_RE.match(rid):
            raise bad_request("X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]", param="X-Request-Id",
                              code="invalid_value")
        if rid in self.active:
            raise ApiError(409, f"request id {rid!r} is already in flight", param="X-Request-Id",
                           code="duplicate_request_id")
        return rid

    def prompt_ids(self, req: Any, kind: str) -> list[int]:
        engine = self.engine
        assert engine is not None
        tok = engine.tokenizer
        if kind == "chat":
            messages = schema.chat_messages(req)
            if tok is None or not tok.chat_template:
                raise bad_request("this model has no chat template: use /v1/completions", param="messages",
                                  code="unsupported_model")
            from edge.tokenizer import ChatTemplateError

            try:
                ids = tok.encode_chat(messages)
            except ChatTemplateError as exc:
                raise bad_request(str(exc), param="messages", code="invalid_value") from None
            param = "messages"
        else:
            prompt = schema.completion_prompt(req)
            if isinstance(prompt, str):
                if tok is None:
                    raise bad_request("this model has no tokenizer: send token ids as the prompt", param="prompt",
                                      code="unsupported_model")
                ids = tok.encode(prompt)
            else:
                vocab = engine.cfg.vocab_size
                bad = next((t for t in prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise bad_request(f"token id {bad} is out of range [0, {vocab})", param="prompt",
                                      code="invalid_value")
                ids = prompt
            param = "prompt"
        if not ids:
            raise bad_request("the prompt is empty", param=param, code="invalid_value")
        from edge.engine import PromptTooLong

        try:
            engine.check_prompt(ids, 1)
        except PromptTooLong as exc:
            raise bad_request(
                f"this model's maximum context length is {engine.max_seq_len} tokens; the prompt has "
                f"{len(ids)} tokens ({exc})",
                param=param,
                code="context_length_exceeded",
            ) from None
        return ids

    async def generate(self, request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        self.check_auth(request)
        self.check_ready()
        body = await self.read_body(request)
        model = schema.ChatCompletionRequest if kind == "chat" else schema.CompletionRequest
        req = schema.parse_request(body, model)
        schema.check_unsupported(req)
        ids = self.prompt_ids(req, kind)
        engine = self.engine
        assert engine is not None
        params = schema.sampling_params(req, len(ids), engine.max_seq_len, self.settings.default_max_tokens)
        rid = self.request_id(request, "chatcmpl" if kind == "chat" else "cmpl")
        handle = self._submit(ids, params, rid)
        self.active[rid] = handle
        self.metrics.in_flight.inc()
        self.metrics.prompt_tokens.inc(len(ids))
        created = int(time.time())
        headers = {"X-Request-Id": rid}
        tracked = _Tracked(self, handle, rid, endpoint, t0)
        chunks = self._consume(tracked)
        if req.stream:
            events = self._sse(chunks, kind, rid, created, schema.include_usage(req))

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
            return await self._collect(request, chunks, handle, kind, rid, created, headers)
        finally:
            tracked.close(None)

    def _submit(self, ids: list[int], params: Any, rid: str) -> Any:
        from edge.engine import PromptTooLong
        from edge.sampling import SamplingError
        from edge.scheduler import QueueFull

        try:
            params.validate(self.engine.max_seq_len if self.engine else None)
            if self.monitor is not None:
                self.monitor.governor.check_admission()
            return self.scheduler.submit(ids, params, request_id=rid)
        except SamplingError as exc:
            msg = str(exc)
            raise bad_request(msg, param=msg.split(" ", 1)[0], code="invalid_value") from None
        except PromptTooLong as exc:
            raise bad_request(str(exc), code="context_length_exceeded") from None
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: request queue is full ({exc})", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}) from None
        except DeviceTooHot as exc:
            retry = max(1, round(exc.retry_after_s or LOADING_RETRY_AFTER_S))
            raise ApiError(503, exc.message, type="server_error", code="device_too_hot",
                           headers={"Retry-After": str(retry)}) from None
        except ValueError as exc:  # InvalidPrompt (token ids), a duplicate request id
            if "already in flight" in str(exc):
                raise ApiError(409, str(exc), param="X-Request-Id", code="duplicate_request_id") from None
            raise bad_request(str(exc), param="prompt", code="invalid_value") from None
        except RuntimeError as exc:  # the scheduler is stopping
            raise ApiError(503, f"the server is shutting down ({exc})", type="server_error", code="shutting_down",
                           headers={"Retry-After": str(LOADING_RETRY_AFTER_S)}) from None

    async def _consume(self, tracked: _Tracked) -> AsyncIterator[Chunk]:
        """The request's chunks, with metrics; cancels the request if left early
        (client gone, stream closed, server shutting down)."""
        m = self.metrics
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
        self, chunks: AsyncIterator[Chunk], kind: str, rid: str, created: int, with_usage: bool
    ) -> AsyncIterator[str]:
        model = self.model_id
        async with contextlib.aclosing(chunks):
            if kind == "chat":
                yield _json_line(schema.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
            async for chunk in chunks:
                reason = chunk.finish_reason
                if chunk.text:
                    if kind == "chat":
                        yield _json_line(schema.chat_chunk(rid, created, model, {"content": chunk.text}))
                    else:
                        yield _json_line(schema.completion_chunk(rid, created, model, chunk.text))
                if reason is None:
                    continue
                if reason == "error":
                    err = ApiError(500, chunk.message or "generation failed", type="server_error", code="engine_error")
                    yield _json_line(err.body())
                if kind == "chat":
                    yield _json_line(schema.chat_chunk(rid, created, model, {}, reason))
                else:
                    yield _json_line(schema.completion_chunk(rid, created, model, "", reason))
                if with_usage:
                    yield _json_line(schema.usage_chunk(kind, rid, created, model, chunk.usage))
            yield "data: [DONE]\n\n"

    async def _collect(
        self, request: Request, chunks: AsyncIterator[Chunk], handle: Any, kind: str, rid: str, created: int,
        headers: dict[str, str],
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
            raise ApiError(500, msg, type="server_error", code="engine_error", headers=headers)
        build = schema.chat_completion if kind == "chat" else schema.completion
        body = build(rid, created, self.model_id, "".join(parts), final.finish_reason, final.usage)
        return JSONResponse(body, headers=headers)

    def cancel(self, rid: str) -> bool:
        handle = self.active.get(rid)
        done = False
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.cancel()
                done = True
        if self.scheduler is not None:
            with contextlib.suppress(Exception):
                done = bool(self.scheduler.cancel(rid)) or done
        return done

    def health(self) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {
            "status": self.state,
            "model": self.model_id,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }
        code = 503
        if self._stopping:
            body["status"] = "stopping"
        elif self.state == "ready":
            alive, why = self.engine_alive()
            body["status"] = "ok" if alive else "unhealthy"
            if not alive:
                body["error"] = why
            code = 200 if alive else 503
        elif self.state == "failed":
            body["error"] = self.error
        if self.engine is not None:
            body["engine"] = self.engine.info()
        stats = None
        with contextlib.suppress(Exception):
            stats = self._stats_or_none()
        if stats is not None:
            stats = dict(stats)
            hb = stats.pop("last_heartbeat", None)
            if hb is not None:
                stats["heartbeat_age_s"] = round(time.monotonic() - float(hb), 3)
            stats["active_requests"] = len(self.active)
            body["scheduler"] = stats
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                body["monitor"] = self.monitor.describe()
        return code, schema.jsonable(body)


class _WarmupExempt:
    """The thermal governor as the scheduler sees it, with admission waived while
    ``exempt`` (the warm-up request must not fail the start of a hot device)."""

    def __init__(self, governor: Any) -> None:
        self._governor = governor
        self.exempt = False

    def check_admission(self) -> None:
        if not self.exempt:
            self._governor.check_admission()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._governor, name)


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


class _MetricsMiddleware:
    """Counts every HTTP response by endpoint and status (pure ASGI: streams untouched)."""

    def __init__(self, app: Any, service: Service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = next((e for e in KNOWN_ENDPOINTS if path == e or path.startswith(e + "/")), "other")
        counted = False

        async def counting_send(message: dict) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.service.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield
        await asyncio.to_thread(service.shutdown)

    app = FastAPI(title="edge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(_MetricsMiddleware, service=service)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("%s %s -> %d %s", request.method, request.url.path, exc.status, exc.message)
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(ApiError(exc.status_code, str(exc.detail), code=code,
                                        headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(bad_request(str(exc)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.generate(request, "completion")

    @app.post("/v1/cancel/{request_id}")
    async def cancel(request_id: str, request: Request) -> JSONResponse:
        service.check_auth(request)
        if not service.cancel(request_id):
            raise ApiError(404, f"no request {request_id!r} in flight", param="request_id", code="request_not_found")
        return JSONResponse({"id": request_id, "object": "cancellation", "cancelled": True})

    def _model_card() -> dict[str, Any]:
        card: dict[str, Any] = {"id": service.model_id, "object": "model", "created": int(time.time()),
                                "owned_by": "edge"}
        if service.engine is not None:
            card["max_model_len"] = service.engine.max_seq_len
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        service.check_auth(request)
        return JSONResponse({"object": "list", "data": [_model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        service.check_auth(request)
        if model_id != service.model_id:
            raise ApiError(404, f"model {model_id!r} not found", param="model", code="model_not_found")
        return JSONResponse(_model_card())

    @app.get("/health")
    async def health() -> JSONResponse:
        code, body = service.health()
        headers = {"Retry-After": str(LOADING_RETRY_AFTER_S)} if code == 503 else None
        return JSONResponse(body, status_code=code, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _Server(uvicorn.Server):
    """uvicorn, telling the service about SIGTERM/SIGINT before it drains connections."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.service.begin_shutdown()
        super().handle_exit(sig, frame)


def _bind_uds(path: str) -> socket.socket:
    """Bind the Unix socket ourselves: remove a stale one, owner+group access only."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if p.is_socket():
            p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(str(p))
    finally:
        os.umask(old)
    os.chmod(p, 0o660)
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def build_server(settings: Settings, *, environ: dict[str, str] | None = None) -> tuple[_Server, Service,
                                                                                            list[socket.socket]]:
    service = Service(settings, environ)
    app = create_app(service)
    level = settings.log_level.lower()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=level,
        log_config=None,  # our logging setup (journald gets one format)
        access_log=level == "debug",
        timeout_graceful_shutdown=settings.shutdown_grace_s + 3.0,
        lifespan="on",
        server_header=False,
    )
    server = _Server(config, service)

    def request_exit(code: int) -> None:
        service.exit_code = code
        server.should_exit = True

    service._request_exit = request_exit
    sockets = [_bind_uds(settings.uds)] if settings.uds else []
    return server, service, sockets


def serve(settings: Settings) -> int:
    """Run the service until SIGTERM/SIGINT; the exit code (0 on a clean shutdown)."""
    server, service, sockets = build_server(settings)
    where = f"unix:{settings.uds}" if settings.uds else f"http://{settings.host}:{settings.port}"
    log.info("edge serve: listening on %s, model %s", where, settings.model or "(embedded default)")
    # uvicorn re-raises the signal it caught after shutting down; with these no-op
    # handlers in place that ends in a normal return and exit code 0.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=sockets or None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in sockets:
            sock.close()
        if settings.uds:
            with contextlib.suppress(OSError):
                Path(settings.uds).unlink()
    if not server.started and service.exit_code == 0:
        return 1  # could not bind
    return service.exit_code
