"""Images decoded in a child process (edge/model/vision/decode_process.py): the same
prepared pixels as decoding in the server's own process, one-line errors, a crashed
decoder costs one request and is replaced, the child never loads torch, and the
server's prompt workers decode through it."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edge.errors import ImageError
from edge.model.vision.decode_process import DecodeProcess
from edge.model.vision.preprocess import ProcessorConfig, decode_image, preprocess
from edge.model.vision.random_model import make_vl_model
from edge.model.vision.request import B64_STEP, ImageLimits, b64decode_in_steps, data_url_bytes
from edge.runtime.engine import Engine
from edge.serving import schema
from edge.serving.prompts import PromptEncoder

CFG = ProcessorConfig(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=64 * 64, max_pixels=256 * 256,
                      image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def photo(width: int, height: int, fmt: str = "JPEG", orientation: int = 1) -> bytes:
    rng = np.random.default_rng(width + 7 * height)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(buf, format=fmt, exif=exif.tobytes())
    return buf.getvalue()


class _Crash:
    """Unpickled in the child, it ends the child at once (as a codec crash would)."""

    def __reduce__(self):  # noqa: ANN204
        return (os._exit, (3,))


@pytest.fixture
def decoder():
    d = DecodeProcess()
    yield d
    d.close()


@pytest.mark.parametrize("fmt,orientation", [("JPEG", 1), ("PNG", 1), ("JPEG", 6)])
def test_the_child_prepares_what_this_process_does(decoder: DecodeProcess, fmt: str, orientation: int) -> None:
    data = photo(300, 200, fmt, orientation)
    ours = decoder.prepare(data, ImageLimits(), CFG)
    here = preprocess(decode_image(data, ImageLimits(), CFG), CFG)
    assert np.array_equal(ours.raw, here.raw) and ours.grid == here.grid and ours.digest == here.digest
    assert ours.num_tokens == here.num_tokens and ours.cfg == CFG


def test_errors_are_one_line_and_the_child_stays(decoder: DecodeProcess) -> None:
    with pytest.raises(ImageError, match="^cannot decode image: ") as exc:
        decoder.prepare(b"RIFF\x00\x00\x00\x00garbage", ImageLimits(), CFG)
    assert "\n" not in str(exc.value)
    pid = decoder.pid
    with pytest.raises(ImageError, match="exceeds the limit of 1000 pixels"):
        decoder.prepare(photo(64, 64), ImageLimits(max_pixels=1000), CFG)
    assert decoder.pid == pid  # refusals are answers, not crashes
    assert decoder.prepare(photo(64, 64), ImageLimits(), CFG).grid == (1, 4, 4)


def test_a_crashed_decoder_costs_one_request_and_is_replaced(decoder: DecodeProcess) -> None:
    decoder.prepare(photo(64, 64), ImageLimits(), CFG)
    first = decoder.pid
    with pytest.raises(ImageError, match=r"the decoder stopped on it \(exit code 3\)"):
        decoder.prepare(photo(64, 64), ImageLimits(), _Crash())
    assert decoder.prepare(photo(96, 64), ImageLimits(), CFG).grid == (1, 4, 6)
    assert decoder.pid != first


def test_the_child_does_not_load_torch(decoder: DecodeProcess) -> None:
    decoder.prepare(photo(64, 64), ImageLimits(), CFG)
    maps = Path(f"/proc/{decoder.pid}/maps").read_text()
    assert "_imaging" in maps and "libtorch" not in maps  # Pillow's decoder, and no torch
    assert os.getpriority(os.PRIO_PROCESS, decoder.pid) > os.getpriority(os.PRIO_PROCESS, 0)


def test_close_ends_the_child() -> None:
    d = DecodeProcess()
    d.prepare(photo(64, 64), ImageLimits(), CFG)
    pid = d.pid
    assert pid is not None and Path(f"/proc/{pid}").exists()
    d.close()
    assert not Path(f"/proc/{pid}").exists() and d.pid is None  # ended and reaped


@pytest.mark.parametrize("size", [0, 3, B64_STEP - 1, B64_STEP, 3 * B64_STEP + 5])
def test_base64_in_steps_is_base64(size: int) -> None:
    raw = os.urandom(size)
    text = base64.b64encode(raw).decode()
    assert b64decode_in_steps(text) == raw


@pytest.mark.parametrize("bad", ["QQ==" + "QUJD" * (B64_STEP // 4), "QUJD" * (B64_STEP // 4) + "Q!==",
                                 "QUJD" * B64_STEP + "Q"], ids=["early padding", "bad digit", "length"])
def test_base64_in_steps_refuses_what_the_whole_refuses(bad: str) -> None:
    with pytest.raises(binascii.Error):
        base64.b64decode(bad, validate=True)
    with pytest.raises(binascii.Error):
        b64decode_in_steps(bad)


@pytest.mark.parametrize("size", [0, 3, 3 * B64_STEP + 5])
def test_the_child_decodes_base64(decoder: DecodeProcess, size: int) -> None:
    raw = os.urandom(size)
    assert decoder.b64decode(base64.b64encode(raw).decode()) == raw


@pytest.mark.parametrize("bad", ["QQ==" + "QUJD" * (B64_STEP // 4), "QUJD" * (B64_STEP // 4) + "Q!==",
                                 "QUJD" * B64_STEP + "Q"], ids=["early padding", "bad digit", "length"])
def test_the_childs_base64_refusals_are_this_process_s(decoder: DecodeProcess, bad: str) -> None:
    url = "data:image/png;base64," + bad
    with pytest.raises(ImageError) as here:
        data_url_bytes(url, 2**30)
    with pytest.raises(ImageError) as there:
        data_url_bytes(url, 2**30, decoder.b64decode)
    for exc in (here.value, there.value):
        assert str(exc).startswith("data URL is not valid base64: ") and "\n" not in str(exc)
    assert decoder.b64decode(base64.b64encode(b"still up").decode()) == b"still up"


def test_the_prompt_workers_decode_in_the_child(tmp_path: Path) -> None:
    path = make_vl_model(tmp_path / "vl", "qwen3-vl-tiny", std=0.1)
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=256, page_size=8)
    data = photo(320, 320, "PNG")  # noise: a data URL longer than one base64 step
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert len(url) > B64_STEP
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                    {"type": "text", "text": "hi"}]}]}
    import json

    req = schema.parse_request(json.dumps(body).encode(), schema.ChatCompletionRequest)
    encoder = PromptEncoder(workers=1, waiting=0)
    calls: list[str] = []
    b64decode = encoder.decoder.b64decode
    encoder.decoder.b64decode = lambda text: calls.append(text) or b64decode(text)  # type: ignore[method-assign]
    try:
        mm = asyncio.run(encoder.prompt(engine, req, "chat"))
        assert encoder.decoder.pid is not None  # the child decoded it
        assert len(calls) == 1 and len(calls[0]) == len(url) - len("data:image/png;base64,")  # its base64 too
    finally:
        encoder.close()
    here = engine.vision.prepare(data)
    assert np.array_equal(mm.images[0].raw, here.raw) and mm.images[0].digest == here.digest
