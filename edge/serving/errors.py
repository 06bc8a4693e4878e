"""Every error a client can get, as one table: exception class -> HTTP status, OpenAI
error ``type`` and ``code``, default ``param`` and ``Retry-After``.

The API layer raises the :class:`ApiError` subclasses below; the engine, scheduler,
sampler and thermal governor raise their own typed errors (edge/errors.py,
``DeviceTooHot``). A handler looks the class up here (nearest base class first) and
answers ``{"error": {"message", "type", "param", "code"}}``. Nothing matches on
message text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from edge.errors import (
    ChatTemplateError,
    DuplicateRequestId,
    ImageError,
    InvalidPrompt,
    PromptTooLong,
    QueueFull,
    SamplingError,
    SchedulerStopped,
)
from edge.monitor import DeviceTooHot
from edge.structured.errors import GrammarError

log = logging.getLogger(__name__)

INVALID = "invalid_request_error"
SERVER = "server_error"


class ApiError(Exception):
    """An error raised by the API layer itself; its class selects the row in ``ERRORS``.
    ``param``, ``code`` and ``retry_after_s`` override the row's defaults; ``headers``
    are added to the answer."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers = headers or {}


class BadRequest(ApiError):
    """The request is malformed or asks for something this server does not do."""


class Unauthorized(ApiError):
    """Missing or wrong bearer key."""


class HostNotAllowed(ApiError):
    """The Host header names a host this server does not answer for (DNS rebinding)."""


class NotFound(ApiError):
    """No such endpoint, model or in-flight request."""


class MethodNotAllowed(ApiError):
    """The endpoint exists but not with this method."""


class BodyTooLarge(ApiError):
    """The request body exceeds the configured limit."""


class UnsupportedMediaType(ApiError):
    """A POST body that is not ``application/json`` (blocks cross-site form posts)."""


class PromptsBusy(ApiError):
    """Too many prompts are waiting for the tokenizer workers."""


class Unavailable(ApiError):
    """The service cannot take work now: loading, failed, unhealthy or stopping."""


class GenerationFailed(ApiError):
    """The engine ended the request with an error."""


@dataclass(frozen=True)
class ErrorSpec:
    status: int
    type: str = INVALID
    code: str | None = None
    param: str | None = None
    retry_after_s: float | None = None
    prefix: str = ""  # put before the exception's own message
    headers: tuple[tuple[str, str], ...] = ()


LOADING_RETRY_AFTER_S = 5
QUEUE_FULL_RETRY_AFTER_S = 1

ERRORS: dict[type[BaseException], ErrorSpec] = {
    BadRequest: ErrorSpec(400),
    PromptTooLong: ErrorSpec(400, code="context_length_exceeded", param="prompt"),
    InvalidPrompt: ErrorSpec(400, code="invalid_value", param="prompt"),
    SamplingError: ErrorSpec(400, code="invalid_value"),
    GrammarError: ErrorSpec(400, code="invalid_value"),
    ChatTemplateError: ErrorSpec(400, code="invalid_value", param="messages"),
    ImageError: ErrorSpec(400, code="invalid_image", param="messages"),
    Unauthorized: ErrorSpec(401, code="invalid_api_key", headers=(("WWW-Authenticate", "Bearer"),)),
    HostNotAllowed: ErrorSpec(403, code="host_not_allowed"),
    NotFound: ErrorSpec(404, code="not_found"),
    MethodNotAllowed: ErrorSpec(405, code="method_not_allowed"),
    DuplicateRequestId: ErrorSpec(409, code="duplicate_request_id", param="X-Request-Id"),
    BodyTooLarge: ErrorSpec(413, code="request_too_large"),
    UnsupportedMediaType: ErrorSpec(415, code="unsupported_media_type"),
    QueueFull: ErrorSpec(429, "rate_limit_error", "queue_full", retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
                         prefix="the server is busy: "),
    PromptsBusy: ErrorSpec(429, "rate_limit_error", "queue_full", retry_after_s=QUEUE_FULL_RETRY_AFTER_S),
    GenerationFailed: ErrorSpec(500, SERVER, "engine_error"),
    Unavailable: ErrorSpec(503, SERVER, retry_after_s=LOADING_RETRY_AFTER_S),
    SchedulerStopped: ErrorSpec(503, SERVER, "shutting_down", retry_after_s=LOADING_RETRY_AFTER_S,
                                prefix="the server is shutting down: "),
    DeviceTooHot: ErrorSpec(503, SERVER, "device_too_hot", retry_after_s=LOADING_RETRY_AFTER_S),
}
INTERNAL = ErrorSpec(500, SERVER, "internal_error")


def spec_for(exc: BaseException) -> ErrorSpec | None:
    """The row for ``exc``'s class or its nearest listed base class; None if unlisted."""
    for cls in type(exc).__mro__:
        spec = ERRORS.get(cls)
        if spec is not None:
            return spec
    return None


def describe(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error body, headers) for any exception; an unlisted one is a 500
    that names only its class (details go to the log, not to the client)."""
    spec = spec_for(exc)
    if spec is None:
        spec, message = INTERNAL, f"internal error: {type(exc).__name__}"
    else:
        message = spec.prefix + (getattr(exc, "message", None) or str(exc))
    param = getattr(exc, "param", None) or spec.param
    code = getattr(exc, "code", None) or spec.code
    headers = dict(spec.headers) | (getattr(exc, "headers", None) if isinstance(exc, ApiError) else {})
    retry = getattr(exc, "retry_after_s", None) or spec.retry_after_s
    if retry is not None:
        headers["Retry-After"] = str(max(1, round(retry)))
    body = {"error": {"message": message, "type": spec.type, "param": param, "code": code}}
    return spec.status, body, headers


def error_body(exc: BaseException) -> dict[str, Any]:
    return describe(exc)[1]


def error_response(exc: BaseException, extra_headers: dict[str, str] | None = None) -> JSONResponse:
    status, body, headers = describe(exc)
    return JSONResponse(body, status_code=status, headers=headers | (extra_headers or {}))
