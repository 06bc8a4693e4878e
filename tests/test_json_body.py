"""Bounded JSON bodies (edge/serving/json_body.py): the shape scan refuses hostile
bodies before any parser runs, and the long-string path decodes exactly what one
parser call over the whole body decodes (pydantic_core's jiter is the oracle)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import RootModel
from pydantic_core import from_json

from edge.serving import schema
from edge.serving.errors import BadRequest, BodyTooLarge
from edge.serving.json_body import ShapeLimits, decode_string, parse_body, scan

LIMITS = ShapeLimits(max_values=1 << 16, max_containers=1 << 12, max_depth=64, max_skeleton=1 << 20,
                     max_string=1 << 20)


class Anything(RootModel[Any]):
    pass


def parse_small_pieces(body: bytes) -> Any:
    """Every path of parse_body on a small body: scanned, strings of 8+ bytes cut out
    and decoded 16 bytes at a time."""
    return parse_body(body, Anything, LIMITS, small_body=0, blob_bytes=8, piece=16).root


text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(value=json_values, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_long_strings_decode_as_one_parse_does(value: Any, ascii_only: bool, indent: int | None) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert parse_small_pieces(body) == from_json(body)


@settings(max_examples=100, deadline=None)
@given(value=json_values, cut=st.integers(0, 10_000), junk=st.sampled_from(
    [b"", b'"', b"\\", b"\x01", b"\xff", b"[", b"}", b",", b"\\u12", b"\\ud800", b"\\x"]))
def test_broken_bodies_fail_as_one_parse_does(value: Any, cut: int, junk: bytes) -> None:
    body = json.dumps(value, ensure_ascii=False).encode()
    cut %= len(body) + 1
    body = body[:cut] + junk + body[cut:]
    try:
        want = from_json(body)
    except ValueError:
        with pytest.raises(BadRequest) as exc:
            parse_small_pieces(body)
        assert exc.value.code in ("invalid_json", "request_too_complex")
    else:
        assert parse_small_pieces(body) == want


def test_shape_limits_refuse_before_parsing() -> None:
    limits = ShapeLimits(max_values=1000, max_containers=100, max_depth=8, max_skeleton=1 << 20)
    with pytest.raises(BadRequest, match="more than 1000 values"):
        scan(b'{"prompt":[null' + b",0" * 2000 + b"]}", limits)
    with pytest.raises(BadRequest, match="more than 100 arrays and objects"):
        scan(b'{"prompt":[' + b",".join([b"[1]"] * 200) + b"]}", limits)
    with pytest.raises(BadRequest, match="more than 8 deep"):
        scan(b"[" * 9 + b"]" * 9, limits)
    # brackets, commas and quotes inside strings are text
    shape = scan(json.dumps({"messages": [{"content": '[{,"\\' * 5000}]}).encode(), limits, blob_bytes=1000)
    assert shape.containers == 3 and shape.separators == 3 and len(shape.blobs) == 1
    with pytest.raises(BadRequest, match="not terminated"):
        scan(b'{"a": "b', limits)
    with pytest.raises(BadRequest, match="without separators"):
        scan(b'""' * 100, limits)


def test_a_huge_malformed_prompt_is_one_error() -> None:
    """The audit's body: a million invalid token ids made a million error dicts."""
    body = b'{"prompt":[null' + b",0" * 600_000 + b'],"max_tokens":1}'
    limits = ShapeLimits.for_context(4096, 1 << 20)
    with pytest.raises(BadRequest) as exc:
        parse_body(body, schema.CompletionRequest, limits)
    assert exc.value.code == "request_too_complex"
    # under the limits, pydantic stops at the first bad item of each member of the union
    body = b'{"prompt":[null' + b",0" * 20_000 + b'],"max_tokens":1}'
    with pytest.raises(BadRequest) as exc:
        parse_body(body, schema.CompletionRequest, limits)
    assert exc.value.param == "prompt" and len(exc.value.message) < 200


def test_long_strings_reach_the_model_and_text_is_bounded() -> None:
    image = "data:image/png;base64," + "QUJD" * 300_000
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this? \u00e9\u4f60"}, {"type": "image_url", "image_url": {"url": image}}]}]})
    req = parse_body(body.encode(), schema.ChatCompletionRequest, ShapeLimits(max_skeleton=1 << 16,
                                                                              max_string=2 << 20))
    assert req.messages[0].content[1].image_url.url == image
    assert req.messages[0].content[0].text == "what is this? \u00e9\u4f60"
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 10_000}] * 20}).encode()
    with pytest.raises(BodyTooLarge, match="text exceeds"):
        parse_body(body, schema.ChatCompletionRequest, ShapeLimits(max_skeleton=100_000))
    # one string longer than the text limit (or one image) is refused before it is decoded
    with pytest.raises(BodyTooLarge, match="a string in the request body exceeds 1000000 bytes"):
        scan(json.dumps({"messages": [{"role": "user", "content": "x" * 1_000_001}]}).encode(),
             ShapeLimits(max_string=1_000_000))


def test_dense_escapes_decode_in_pieces() -> None:
    text = "\u4f60\u597d" * 200_000 + "\U0001f600" * 1000  # ensure_ascii: \uXXXX, surrogate pairs
    body = json.dumps(text).encode()
    assert decode_string(body, 1, len(body) - 1, piece=1 << 12) == text
    raw = json.dumps("\\" * 100_000).encode()  # escaped backslashes only
    assert decode_string(raw, 1, len(raw) - 1, piece=1 << 10) == "\\" * 100_000


@settings(max_examples=100, deadline=None)
@given(value=json_values, cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_scanning_in_pieces_equals_one_scan(value: Any, cuts: list[int]) -> None:
    from edge.serving.json_body import ShapeScanner

    body = json.dumps({"v": value, "s": "x" * 40}).encode()
    whole = scan(body, LIMITS, blob_bytes=8)
    scanner = ShapeScanner(LIMITS, blob_bytes=8)
    at = 0
    for cut in sorted(c % (len(body) + 1) for c in cuts) + [len(body)]:
        scanner.feed(body[at:cut])
        at = cut
    assert scanner.finish() == whole
