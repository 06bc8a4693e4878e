"""Images in OpenAI chat messages: ``{"type": "image_url", "image_url": {"url": ...}}``
content parts -> image bytes, under the service's limits.

``data:`` URLs are decoded here; ``http(s)`` URLs are fetched only when the operator
allows it (a model server that fetches whatever URL a client names is a request-forgery
hole on a robot's network). Fetching is async (:func:`fetch_images`, on the event loop);
decoding is not (:func:`resolve_images`, in the prompt workers). Every failure is an
:class:`~edge.errors.ImageError` with a one-line message, which the API answers with
400. Torch-free: the HTTP layer imports it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edge.errors import ImageError

REMOTE_SCHEMES = ("http://", "https://")


@dataclass(frozen=True)
class ImageLimits:
    """What a request may send: encoded bytes and decoded pixels per image, and the memory
    decoding one may take (its pixels as stored, the upright copy an EXIF orientation
    asks for, the RGB conversion): larger images are refused from their header."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000
    max_memory: int = 192 * 2**20


@dataclass(frozen=True)
class ImagePolicy:
    limits: ImageLimits = field(default_factory=ImageLimits)
    max_images: int = 4  # per request
    allow_remote: bool = False
    fetch_timeout_s: float = 10.0

    @property
    def body_bytes(self) -> int:
        """The most a request's images add to its body, as base64 data URLs."""
        return self.max_images * (self.limits.max_bytes * 4 // 3 + 4)


def count_images(messages: Iterable[Mapping[str, Any]]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image_url"
    )


async def fetch_images(urls: list[str], policy: ImagePolicy) -> dict[str, bytes]:
    """The bytes of each remote URL among a request's image ``urls``, fetched when the
    policy allows it (data URLs are left to :func:`resolve_images`); ImageError for
    too many images or a refused or failed fetch."""
    if len(urls) > policy.max_images:
        raise ImageError(f"{len(urls)} images in one request; the limit is {policy.max_images}")
    remote = list(dict.fromkeys(u for u in urls if u.startswith(REMOTE_SCHEMES)))
    if remote and not policy.allow_remote:
        raise ImageError(
            "remote image URLs are disabled on this server (send the image as a data: URL, "
            "or set EDGE_ALLOW_REMOTE_IMAGES=true)"
        )
    return {url: await _fetch(url, policy) for url in remote}


def resolve_images(
    messages: list[dict[str, Any]], policy: ImagePolicy, fetched: Mapping[str, bytes],
    b64decode: Callable[[str], bytes] | None = None,
) -> list[dict[str, Any]]:
    """The messages with each ``image_url`` part replaced by ``{"type": "image", "image":
    bytes}`` (what ``VisionLanguage.prompt_from_messages`` takes); remote URLs come from
    ``fetched`` (:func:`fetch_images`), data URLs are decoded by ``b64decode`` (the image
    decoding process's, in the server) or here a step at a time."""
    n = count_images(messages)
    if n > policy.max_images:
        raise ImageError(f"{n} images in one request; the limit is {policy.max_images}")
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            if part.get("type") == "image_url":
                url = part["image_url"]["url"]
                parts.append({"type": "image", "image": image_bytes(url, policy, fetched, b64decode)})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out


def image_bytes(url: str, policy: ImagePolicy, fetched: Mapping[str, bytes],
                b64decode: Callable[[str], bytes] | None = None) -> bytes:
    if url.startswith("data:"):
        return data_url_bytes(url, policy.limits.max_bytes, b64decode)
    if url.startswith(REMOTE_SCHEMES):
        if url not in fetched:
            raise ImageError("remote image URLs are disabled on this server (send the image as a data: URL)")
        return fetched[url]
    raise ImageError(f"unsupported image URL {url[:40]!r}: expected a data: URL")


def data_url_bytes(url: str, max_bytes: int, b64decode: Callable[[str], bytes] | None = None) -> bytes:
    """The bytes of a ``data:[<mime>][;base64],<data>`` URL holding an image (base64 of
    more than a step decoded by ``b64decode``, which raises ImageError, else here)."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise ImageError("malformed data URL: expected data:image/...;base64,...")
    mime = header[5:].split(";")[0]
    if mime and not mime.startswith("image/") and mime != "application/octet-stream":
        raise ImageError(f"data URL of type {mime!r} is not an image")
    if not header.endswith(";base64"):
        raise ImageError("data URL must be base64-encoded (data:image/...;base64,...)")
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise ImageError(f"image of about {len(payload) * 3 // 4} bytes exceeds the limit of {max_bytes} bytes")
    if b64decode is not None and len(payload) > B64_STEP:
        return b64decode(payload)
    try:
        return b64decode_in_steps(payload)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"data URL is not valid base64: {exc}") from None


# Characters decoded at a time (a multiple of 4): one call holds the GIL, so a large image
# decoded in one go would stall every other thread (docs/reliability.md, Images).
B64_STEP = 1 << 18


def b64decode_in_steps(text: str) -> bytes:
    """``base64.b64decode(text, validate=True)``, a step at a time: the same bytes, and the
    same refusals (padding only at the very end)."""
    if len(text) <= B64_STEP:
        return base64.b64decode(text, validate=True)
    parts = []
    for start in range(0, len(text), B64_STEP):
        piece = text[start : start + B64_STEP]
        if start + B64_STEP < len(text) and "=" in piece:
            raise binascii.Error("Excess data after padding")  # as decoding the whole would say
        parts.append(base64.b64decode(piece, validate=True))
    return b"".join(parts)


async def _fetch(url: str, policy: ImagePolicy) -> bytes:
    import httpx

    limit = policy.limits.max_bytes
    try:
        async with (
            httpx.AsyncClient(timeout=policy.fetch_timeout_s, follow_redirects=True) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise ImageError(f"fetching the image failed: HTTP {response.status_code}")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    raise ImageError(f"remote image exceeds the limit of {limit} bytes")
            return bytes(data)
    except httpx.HTTPError as exc:
        raise ImageError(f"fetching the image failed: {exc}") from None
