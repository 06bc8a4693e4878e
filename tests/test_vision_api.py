"""Images through the OpenAI API (``image_url`` content parts) and the CLI, on a random
Qwen3-VL served by the real ``edge serve`` process (CPU)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image
from test_server_support import CHAT, ROOT, ServerProc, server_env

from edge.runtime.engine import Engine
from edge.sampling import SamplingParams
from edge.model.vision.random_model import make_vl_model


def png_bytes(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, text: str = "What is in the picture?") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vl_model(tmp_path_factory.mktemp("qwen3-vl"), "qwen3-vl-tiny", std=0.1)


@pytest.fixture(scope="module")
def vl_server(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProc(tmp_path_factory.mktemp("srv"), "--model", str(vl_dir), "--page-size", "8",
                     env=server_env(EDGE_MAX_IMAGES="2"))
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.log()


def test_chat_with_image_matches_the_engine_and_reuses_the_prefix(vl_server: ServerProc, vl_dir: Path) -> None:
    image = png_bytes(150, 100, seed=1)
    messages = [image_message(data_url(image))]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with vl_server.client() as c:
        r = c.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        follow = [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "Tell me more."}]
        r2 = c.post(CHAT, json={**body, "messages": follow})
        assert r2.status_code == 200, r2.text
    engine = Engine.from_pretrained(vl_dir, device="cpu", dtype="float32")
    local = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is in the picture?"}]}]
    prompt = engine.chat_prompt(local)
    expected = engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert answer["choices"][0]["message"]["content"] == expected.text
    assert answer["usage"]["prompt_tokens"] == len(prompt.ids)
    # The follow-up's cached prefix covers the first turn, image included.
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(prompt.ids) // 8 * 8 >= prompt.spans[0][1]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ([{"type": "image_url", "image_url": {"url": data_url(b"garbage")}}], "cannot decode image"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "remote image URLs are disabled"),
        ([{"type": "image_url", "image_url": {"url": data_url(b"hello", "text/plain")}}], "not an image"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "not valid base64"),
        ([{"type": "image_url", "image_url": {"url": data_url(png_bytes(8, 8, 0))}}] * 3, "limit is 2"),
        ([{"type": "image_url", "image_url": {"url": data_url(png_bytes(4, 900, 0))}}], "aspect ratio"),
    ],
)
def test_bad_images_get_400(vl_server: ServerProc, content: list, match: str) -> None:
    body = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "?"}]}], "max_tokens": 2}
    with vl_server.client() as c:
        r = c.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["code"] == "invalid_image"


def test_image_in_assistant_message_is_refused(vl_server: ServerProc) -> None:
    url = data_url(png_bytes(32, 32, 0))
    messages = [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]},
                {"role": "user", "content": "?"}]
    with vl_server.client() as c:
        r = c.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].type"


def test_cli_generate_with_image(vl_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "photo.png"
    path.write_bytes(png_bytes(120, 90, seed=3))
    cmd = [sys.executable, "-m", "edge.cli", "generate", "--model", str(vl_dir), "--image", str(path),
           "--prompt", "What is this?", "--max-tokens", "6", "--ignore-eos", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    engine = Engine.from_pretrained(vl_dir, device="cpu", dtype="float32")
    messages = [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "What is this?"}]}]
    expected = engine.generate(engine.chat_prompt(messages), SamplingParams(max_tokens=6, ignore_eos=True))
    assert result["token_ids"] == expected.token_ids
    bad = subprocess.run([*cmd[:7], str(tmp_path / "missing.png"), *cmd[8:]], cwd=ROOT, env=server_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    # Checked up front, as every CLI flag is, before the model loads.
    assert bad.returncode == 2 and "missing.png: no such file" in bad.stderr


def test_image_part_without_url_is_refused(vl_server: ServerProc) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}, {"type": "text", "text": "?"}]}]
    with vl_server.client() as c:
        r = c.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "missing_required_parameter"


def test_remote_images_are_fetched_only_when_allowed(tmp_path: Path) -> None:
    import asyncio
    import http.server
    import threading
    from functools import partial

    from edge.errors import ImageError
    from edge.model.vision.request import ImageLimits, ImagePolicy, fetch_images, resolve_images

    image = png_bytes(40, 30, seed=5)
    (tmp_path / "cat.png").write_bytes(image)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        url = f"{base}/cat.png"
        allowed = ImagePolicy(allow_remote=True)
        fetched = asyncio.run(fetch_images([url], allowed))
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        assert resolve_images(messages, allowed, fetched)[0]["content"][0] == {"type": "image", "image": image}
        with pytest.raises(ImageError, match="remote image URLs are disabled"):
            asyncio.run(fetch_images([url], ImagePolicy()))
        with pytest.raises(ImageError, match="HTTP 404"):
            asyncio.run(fetch_images([f"{base}/missing.png"], allowed))
        with pytest.raises(ImageError, match=f"exceeds the limit of {len(image) - 1} bytes"):
            asyncio.run(fetch_images([url], ImagePolicy(ImageLimits(max_bytes=len(image) - 1), allow_remote=True)))
        httpd.shutdown()


def test_image_placeholders_come_only_from_images(vl_server: ServerProc, vl_dir: Path) -> None:
    """``<|image_pad|>`` typed by a user is text; placeholder ids in a raw prompt are refused."""
    pad = json.loads((vl_dir / "config.json").read_text())["image_token_id"]
    typed = "<|vision_start|><|image_pad|><|vision_end|> what is this?"
    with vl_server.client() as c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": typed}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 20  # the placeholders spelled out as text
        r = c.post(CHAT, json={"messages": [image_message(data_url(png_bytes(32, 32, 0)), typed)], "max_tokens": 1})
        assert r.status_code == 200, r.text  # one real image beside typed placeholders
        for prompt in ("look: <|image_pad|>", [1, 2, pad, 3]):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"], r.text
