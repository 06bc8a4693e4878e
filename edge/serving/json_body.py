"""Request bodies parsed in bounded time, whatever they hold.

Parsing and validating JSON (pydantic, jiter) holds the interpreter for the whole
call: a body of a million tiny values froze every thread for seconds, and one of a
50 MB string for a quarter of a second. So, before any parser runs:

* the body's shape is counted with NumPy (whose comparisons run with the interpreter
  released), 1 MiB at a time: values, arrays and objects, nesting depth, and where
  its strings are. Too many values or containers, or too deep: 400 at once.
* strings of ``BLOB_BYTES`` or more (images as base64, long texts) are cut out and
  decoded in pieces of about ``PIECE_BYTES``; the rest, the skeleton, is small and
  parsed in one call, with placeholders where the long strings were.

Each step holds the interpreter for at most a piece's worth of work, so streams,
``/health`` and the engine loop keep their pace while a hostile body is refused.
"""

from __future__ import annotations

import asyncio
import codecs
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from edge.serving.errors import BadRequest, BodyTooLarge, PromptsBusy
from edge.serving.schema import parse_request, validation_error

SCAN_CHUNK = 1 << 20  # the most the scanner looks at in one step
SCAN_STEP = 64 << 10  # a body arriving is scanned each time this much more of it is in (one step holds the event loop)
BLOB_BYTES = 16 << 10  # strings this long leave the skeleton
PIECE_BYTES = 1 << 20  # a long string is decoded this much at a time
MAX_PIECE_BYTES = 4 << 20  # escape sequences so dense that no cut is found within this: refused
SMALL_BODY = 64 << 10  # parsed directly: bounded by its size
_QUOTE, _BACKSLASH = 0x22, 0x5C
_OPENS, _CLOSES, _COMMA = (0x5B, 0x7B), (0x5D, 0x7D), 0x2C


@dataclass(frozen=True)
class ShapeLimits:
    """What one request body may hold. ``max_values`` bounds values and keys together
    (a token-id prompt is one value per token), ``max_containers`` arrays and objects
    (the costly values to build), ``max_depth`` their nesting, ``max_skeleton`` the
    bytes outside long strings."""

    max_values: int = 1 << 16
    max_containers: int = 1 << 12
    max_depth: int = 64
    max_skeleton: int = 1 << 20
    max_string: int = 1 << 20  # bytes of one string as sent: the text limit, or one image

    @classmethod
    def for_context(cls, max_seq_len: int, max_text_bytes: int, max_image_bytes: int = 0) -> ShapeLimits:
        """Room for a context of token ids beside an ordinary request, a message, content
        part or tool per two tokens of context, and strings of the text limit or of one
        base64 image (``max_image_bytes``, on a vision-language model)."""
        return cls(max_values=2 * max_seq_len + (1 << 14), max_containers=max(1 << 12, max_seq_len // 2),
                   max_skeleton=max_text_bytes, max_string=max(max_text_bytes, max_image_bytes))


@dataclass
class Shape:
    """What :func:`scan` found: separators (commas and opening brackets outside
    strings: at least half the values and keys), containers, the deepest nesting, and
    the spans (start, end: inside the quotes) of strings of ``blob_bytes`` or more."""

    separators: int = 0
    containers: int = 0
    depth: int = 0
    blobs: list[tuple[int, int]] = field(default_factory=list)


def _too_big(what: str, limit: int) -> BadRequest:
    return BadRequest(f"the request body holds more than {limit} {what}; this server takes at most that many",
                      code="request_too_complex")


def _invalid_json(why: str) -> BadRequest:
    return BadRequest(f"could not parse the JSON body of the request: {why}", code="invalid_json")


class ShapeScanner:
    """:class:`Shape` of a body fed in pieces as it arrives (BadRequest as soon as a
    limit is passed: a hostile body is refused before the rest of it is read).

    A quote preceded by an odd run of backslashes is escaped. Backslashes outside
    strings make the JSON invalid; the skeleton keeps them, so its parser says so."""

    def __init__(self, limits: ShapeLimits, blob_bytes: int = BLOB_BYTES) -> None:
        self.limits, self.blob_bytes = limits, blob_bytes
        self.shape = Shape()
        self.size = 0  # bytes fed so far
        self._in_string = False
        self._open_at = -1  # where the current string's content starts
        self._depth = 0
        self._bs_carry = 0  # backslashes ending the previous piece
        self._quotes = 0

    def feed(self, data: bytes) -> None:
        buf = np.frombuffer(data, dtype=np.uint8)
        for i in range(0, buf.size, SCAN_CHUNK):
            self._chunk(buf[i:i + SCAN_CHUNK])

    def finish(self) -> Shape:
        if self._in_string:
            raise _invalid_json("a string is not terminated")
        return self.shape

    def _chunk(self, c: np.ndarray) -> None:
        shape, limits, start = self.shape, self.limits, self.size
        quotes = np.flatnonzero(c == _QUOTE)
        is_bs = c == _BACKSLASH
        if quotes.size and (self._bs_carry or is_bs.any()):
            quotes = quotes[_unescaped(is_bs, quotes, self._bs_carry)]
        self._bs_carry = _trailing_run(is_bs, self._bs_carry)
        # Structural characters and whether each lies outside strings: the quotes before
        # it, plus the piece's starting state, are even.
        marks = (c == _COMMA) | (c == _OPENS[0]) | (c == _OPENS[1]) | (c == _CLOSES[0]) | (c == _CLOSES[1])
        pos = np.flatnonzero(marks)
        if pos.size:
            before = np.searchsorted(quotes, pos)
            kinds = c[pos[(before + self._in_string) % 2 == 0]]
            opens = (kinds == _OPENS[0]) | (kinds == _OPENS[1])
            closes = (kinds == _CLOSES[0]) | (kinds == _CLOSES[1])
            n_opens = int(np.count_nonzero(opens))
            shape.containers += n_opens
            shape.separators += n_opens + int(np.count_nonzero(kinds == _COMMA))
            if kinds.size:
                levels = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32)) + self._depth
                shape.depth = max(shape.depth, int(levels.max()))
                self._depth = int(levels[-1])
        self._quotes += quotes.size
        if self._quotes > 4 * shape.separators + 2:  # more strings than values and keys
            raise _invalid_json("strings without separators between them")
        # Quotes alternate opening and closing: pair them up, noting the long strings.
        seq = quotes + start
        if self._in_string:
            seq = np.concatenate(([self._open_at - 1], seq))
        n_pairs = seq.size // 2
        first, last = seq[0:2 * n_pairs:2] + 1, seq[1:2 * n_pairs:2]
        lengths = last - first
        long = lengths >= self.blob_bytes
        shape.blobs += zip(first[long].tolist(), last[long].tolist())
        self._in_string = bool(seq.size % 2)
        if self._in_string:
            self._open_at = int(seq[-1]) + 1
        self.size += c.size
        longest = max(int(lengths.max()) if lengths.size else 0, self.size - self._open_at if self._in_string else 0)
        if longest > limits.max_string:  # refused before it is decoded, or even read to its end
            raise BodyTooLarge(f"a string in the request body exceeds {limits.max_string} bytes")
        if shape.containers > limits.max_containers:
            raise _too_big("arrays and objects", limits.max_containers)
        if shape.separators > limits.max_values:
            raise _too_big("values", limits.max_values)
        if shape.depth > limits.max_depth:
            raise BadRequest(f"the request body nests arrays and objects more than {limits.max_depth} deep",
                             code="request_too_complex")


def scan(body: bytes | bytearray, limits: ShapeLimits, blob_bytes: int = BLOB_BYTES) -> Shape:
    """The body's shape (:class:`ShapeScanner` over all of it)."""
    scanner = ShapeScanner(limits, blob_bytes)
    scanner.feed(body)
    return scanner.finish()


def _unescaped(is_bs: np.ndarray, quotes: np.ndarray, carry: int) -> np.ndarray:
    """For each quote position, True unless an odd run of backslashes precedes it."""
    idx = np.arange(is_bs.size, dtype=np.int64)
    last_other = np.maximum.accumulate(np.where(is_bs, -1, idx))  # the last non-backslash at or before i
    prev = quotes - 1
    run = np.where(prev >= 0, prev - last_other[np.maximum(prev, 0)], 0)
    run = np.where((prev >= 0) & (last_other[np.maximum(prev, 0)] == -1) | (prev < 0), run + carry, run)
    return run % 2 == 0


def _trailing_run(is_bs: np.ndarray, carry: int) -> int:
    if not is_bs.size or not is_bs[-1]:
        return 0
    others = np.flatnonzero(~is_bs)
    return int(is_bs.size - 1 - others[-1]) if others.size else carry + int(is_bs.size)


# -- long strings ----------------------------------------------------------------------------


def decode_string(body: bytes | bytearray, start: int, end: int, piece: int = PIECE_BYTES) -> str:
    """The JSON string whose raw content is ``body[start:end]`` (between its quotes),
    decoded about ``piece`` bytes at a time, by the parser that reads the rest of the
    body; BadRequest when it is not valid JSON."""
    raw = memoryview(body)[start:end]
    if np.count_nonzero(np.frombuffer(raw, dtype=np.uint8) < 0x20):
        raise _invalid_json("a control character in a string (escape it)")
    if body.find(b"\\", start, end) < 0:  # no escapes: the bytes are the text
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            parts = [decoder.decode(raw[i:i + piece]) for i in range(0, len(raw), piece)]
            parts.append(decoder.decode(b"", final=True))
        except UnicodeDecodeError as exc:
            raise _invalid_json(f"invalid UTF-8 in a string ({exc.reason})") from None
        return "".join(parts)
    parts = []
    at = start
    while at < end:
        cut = _cut(body, at + piece, end, piece)
        try:
            parts.append(from_json(b'"' + bytes(raw[at - start:cut - start]) + b'"'))
        except ValueError as exc:
            raise _invalid_json(f"a bad string: {exc}") from None
        at = cut
    return "".join(parts)


def _cut(body: bytes | bytearray, target: int, end: int, piece: int) -> int:
    """A position at or after ``target`` where the string splits into two that decode
    separately to the same text: no backslash in the 6 bytes before it, so no escape
    (at most ``\\uXXXX``) and no surrogate pair straddles it, and not inside a UTF-8
    sequence. ``end`` when it is near."""
    if end - target < piece // 4:
        return end
    q, limit = target, min(end, target + MAX_PIECE_BYTES - piece)
    while q < limit:
        k = body.rfind(b"\\", q - 6, q)
        if k >= 0:
            q = k + 7
        elif body[q] & 0xC0 == 0x80:  # inside a UTF-8 sequence
            q += 1
        else:
            return q
    if limit == end:
        return end
    raise BadRequest(f"a string holds more than {MAX_PIECE_BYTES} bytes of dense escape sequences; "
                     "send such text unescaped (UTF-8)", code="request_too_complex")


# -- parsing ----------------------------------------------------------------------------------


def parse_body(body: bytes | bytearray, model: type[BaseModel], limits: ShapeLimits, shape: Shape | None = None, *,
               small_body: int = SMALL_BODY, blob_bytes: int = BLOB_BYTES, piece: int = PIECE_BYTES) -> Any:
    """Validate a JSON body into ``model`` in bounded time: BadRequest (or BodyTooLarge
    for text beyond ``limits.max_skeleton``) naming what is wrong. ``shape``: the body's,
    when it was scanned as it arrived."""
    if len(body) <= small_body:
        return parse_request(bytes(body), model)
    if shape is None:
        shape = scan(body, limits, blob_bytes)
    if not shape.blobs:
        if len(body) > limits.max_skeleton:
            raise BodyTooLarge(f"the request's text exceeds {limits.max_skeleton} bytes")
        return parse_request(bytes(body), model)
    tag = f"edge-blob-{secrets.token_hex(8)}-"  # a placeholder no client sends: NUL, then a random tag
    parts, at = [], 0
    for i, (s, e) in enumerate(shape.blobs):
        parts += [body[at:s], f"\\u0000{tag}{i}".encode()]
        at = e
    parts.append(body[at:])
    skeleton = b"".join(parts)
    if len(skeleton) > limits.max_skeleton:
        raise BodyTooLarge(f"the request's text exceeds {limits.max_skeleton} bytes")
    try:
        tree = from_json(skeleton)
    except ValueError as exc:
        raise _invalid_json(str(exc)) from None
    blobs = {f"\x00{tag}{i}": span for i, span in enumerate(shape.blobs)}
    tree = _restore(tree, blobs, body, piece)
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _restore(node: Any, blobs: dict[str, tuple[int, int]], body: bytes | bytearray, piece: int) -> Any:
    """``node`` with each placeholder string replaced by the long string it stands for."""
    if isinstance(node, str):
        span = blobs.get(node)
        return node if span is None else decode_string(body, *span, piece=piece)
    if isinstance(node, list):
        return [_restore(v, blobs, body, piece) for v in node]
    if isinstance(node, dict):
        return {_restore(k, blobs, body, piece): _restore(v, blobs, body, piece) for k, v in node.items()}
    return node


class BodyParser:
    """:func:`parse_body` in ``workers`` threads (never on the event loop), with at most
    ``waiting`` more bodies queued for them (more get 429)."""

    def __init__(self, workers: int = 1, waiting: int = 8) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edge-parse")
        self.capacity = workers + waiting
        self._admitted = 0  # touched on the event loop only

    async def parse(self, body: bytes | bytearray, model: type[BaseModel], limits: ShapeLimits,
                    shape: Shape | None = None) -> Any:
        if self._admitted >= self.capacity:
            raise PromptsBusy(f"the server is busy: {self._admitted} request bodies are waiting to be parsed; "
                              "retry later")
        self._admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, parse_body, body, model, limits,
                                                                    shape)
        finally:
            self._admitted -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
