"""The error table: every typed error answers with its status and an OpenAI error body."""

from __future__ import annotations

import pytest

from edge.serving.errors import (
    BadRequest,
    BodyTooLarge,
    HostNotAllowed,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
    describe,
)
from edge.errors import DuplicateRequestId, ImageError, InvalidPrompt, PromptTooLong, QueueFull, SchedulerStopped
from edge.monitor import DeviceTooHot

CASES = [
    (BadRequest("bad", param="top_p", code="invalid_value"), 400, "invalid_request_error", "invalid_value", "top_p"),
    (PromptTooLong("too long"), 400, "invalid_request_error", "context_length_exceeded", "prompt"),
    (InvalidPrompt("token id 9 is outside"), 400, "invalid_request_error", "invalid_value", "prompt"),
    (ImageError("cannot decode image"), 400, "invalid_request_error", "invalid_image", "messages"),
    (Unauthorized("no key"), 401, "invalid_request_error", "invalid_api_key", None),
    (HostNotAllowed("evil.example"), 403, "invalid_request_error", "host_not_allowed", None),
    (DuplicateRequestId("dup"), 409, "invalid_request_error", "duplicate_request_id", "X-Request-Id"),
    (BodyTooLarge("big"), 413, "invalid_request_error", "request_too_large", None),
    (UnsupportedMediaType("text/plain"), 415, "invalid_request_error", "unsupported_media_type", None),
    (QueueFull("request queue is full (8 of 8 waiting)"), 429, "rate_limit_error", "queue_full", None),
    (Unavailable("loading", code="model_loading"), 503, "server_error", "model_loading", None),
    (SchedulerStopped("scheduler is stopped"), 503, "server_error", "shutting_down", None),
    (DeviceTooHot("too hot", retry_after_s=12.4), 503, "server_error", "device_too_hot", None),
]


@pytest.mark.parametrize(("exc", "status", "type_", "code", "param"), CASES, ids=lambda c: type(c).__name__)
def test_each_error_has_its_status_and_openai_body(exc, status, type_, code, param) -> None:
    got_status, body, headers = describe(exc)
    assert got_status == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert (err["type"], err["code"], err["param"]) == (type_, code, param)
    assert str(exc) in err["message"]
    if status in (429, 503):
        assert int(headers["Retry-After"]) >= 1
    if status == 401:
        assert headers["WWW-Authenticate"] == "Bearer"


def test_queue_full_message_says_it_once() -> None:
    msg = describe(QueueFull("request queue is full (8 of 8 waiting behind the two slots); retry later"))[1]
    assert msg["error"]["message"].count("queue is full") == 1


def test_retry_after_comes_from_the_governor() -> None:
    assert describe(DeviceTooHot("hot", retry_after_s=12.4))[2]["Retry-After"] == "12"


def test_unlisted_exception_is_a_500_that_hides_its_message() -> None:
    status, body, _ = describe(KeyError("/secret/path"))
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "secret" not in body["error"]["message"] and "KeyError" in body["error"]["message"]
