"""The FastAPI application: routes, request counting, and one error handler per kind
of exception, each answering through the table in edge/serving/errors.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from edge.serving import schema
from edge.serving.completions import Completions, check_auth
from edge.serving.errors import (
    ERRORS,
    LOADING_RETRY_AFTER_S,
    BadRequest,
    MethodNotAllowed,
    NotFound,
    describe,
    error_response,
)
from edge.serving.guard import HostPolicy, RequestGuard
from edge.serving.json_body import BodyParser
from edge.serving.prompts import PromptEncoder
from edge.serving.service import Service
from edge.model.vision.request import ImageLimits, ImagePolicy

log = logging.getLogger("edge.serving")

CLIENT_GONE = 499  # nginx's status for "client closed request", in the request counts
KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/cancel", "/health", "/metrics")


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


def create_app(service: Service) -> FastAPI:
    s = service.settings
    images = ImagePolicy(ImageLimits(s.image_max_bytes, s.image_max_pixels, s.image_max_memory), s.max_images, s.allow_remote_images)
    prompts = PromptEncoder(waiting=s.queue_size, images=images)
    parser = BodyParser(waiting=s.queue_size)
    completions = Completions(service, prompts, parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.shutdown)
            prompts.close()
            parser.close()

    app = FastAPI(title="edge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    if s.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(s.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(RequestGuard, hosts=None if s.uds else HostPolicy(s.host, s.allowed_hosts))
    app.add_middleware(_MetricsMiddleware, service=service)  # the outermost: counts the guard's refusals too

    async def _known_error(request: Request, exc: Exception) -> JSONResponse:
        status = describe(exc)[0]
        if status >= 500:
            log.warning("%s %s -> %d %s", request.method, request.url.path, status, exc)
        return error_response(exc)

    for cls in ERRORS:  # the classes of the table; anything else is a bug (below)
        app.add_exception_handler(cls, _known_error)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(exc)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client left (or its connection was closed for a stalled body) before its
        # request was read: nobody to answer, nothing to report.
        log.debug("%s %s: the client went away before its request was read", request.method, request.url.path)
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: NotFound, 405: MethodNotAllowed}
        err = kinds.get(exc.status_code, BadRequest)(str(exc.detail))
        return error_response(err, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(BadRequest(str(exc)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completions.handle(request, "chat")

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Response:
        return await completions.handle(request, "completion")

    @app.post("/v1/cancel/{request_id}")
    async def cancel(request_id: str, request: Request) -> JSONResponse:
        check_auth(service, request)
        if not service.cancel(request_id):
            raise NotFound(f"no request {request_id!r} in flight", param="request_id", code="request_not_found")
        return JSONResponse({"id": request_id, "object": "cancellation", "cancelled": True})

    def _model_card() -> dict[str, Any]:
        card: dict[str, Any] = {"id": service.model_id, "object": "model", "created": int(time.time()),
                                "owned_by": "edge"}
        if service.engine is not None:
            card["max_model_len"] = service.engine.max_seq_len
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(service, request)
        return JSONResponse({"object": "list", "data": [_model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        check_auth(service, request)
        if model_id != service.model_id:
            raise NotFound(f"model {model_id!r} not found", param="model", code="model_not_found")
        return JSONResponse(_model_card())

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = service.health()
        headers = None if ok else {"Retry-After": str(LOADING_RETRY_AFTER_S)}
        return JSONResponse(schema.jsonable(body), status_code=200 if ok else 503, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return app
