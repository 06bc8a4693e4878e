"""Images within bounds: what a picture may cost is read from its header and refused
before any pixel is decoded (the context, the memory one decode may take); requests with
images run in their own worker, so text requests are not delayed by them; the engine
loop's heartbeat stays fresh through a long vision-tower pass."""

from __future__ import annotations

import asyncio
import io
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from edge.model.vision.preprocess import ImageError, ImageLimits, decode_image, inspect_image
from edge.model.vision.random_model import make_vl_model
from edge.runtime.engine import Engine
from edge.sampling import SamplingParams
from edge.scheduling import Scheduler
from edge.serving import prompts as prompts_module
from edge.serving.errors import BadRequest
from edge.serving.prompts import PromptEncoder, encode_request
from edge.model.vision.request import ImagePolicy


def jpeg(width: int, height: int, orientation: int = 1, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(width * height)
    data = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(data).convert(mode)
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(buf, format="JPEG" if mode != "RGBA" else "PNG", exif=exif.tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = make_vl_model(tmp_path_factory.mktemp("vl"), "qwen3-vl-tiny", std=0.1)
    return Engine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=256, page_size=8)


def chat(*images: bytes) -> SimpleNamespace:
    """A parsed chat request as the API hands it to the prompt workers."""
    from edge.serving import schema

    content = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + __import__("base64")
                                                   .b64encode(i).decode()}} for i in images]
    body = {"model": "m", "messages": [{"role": "user", "content": [*content, {"type": "text", "text": "hi"}]}]}
    return schema.parse_request(__import__("json").dumps(body).encode(), schema.ChatCompletionRequest)


def forbid_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Image.Image) -> None:
        raise AssertionError("an image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    monkeypatch.setattr(Image.Image, "load", refuse)


def test_the_header_gives_size_mode_and_orientation() -> None:
    header = inspect_image(jpeg(64, 48, orientation=6))
    assert (header.width, header.height, header.mode, header.orientation) == (48, 64, "RGB", 6)
    upright = decode_image(jpeg(64, 48, orientation=6))
    assert upright.size == (48, 64) and upright.mode == "RGB"


def test_images_too_long_for_the_context_are_refused_before_decoding(engine, monkeypatch) -> None:
    req = chat(jpeg(400, 300), jpeg(300, 400), jpeg(400, 400))
    forbid_decoding(monkeypatch)
    with pytest.raises(BadRequest, match="maximum context length is 256 tokens.*for its 3 image") as exc:
        encode_request(engine, req, "chat", ImagePolicy(), {})
    assert exc.value.code == "context_length_exceeded"


def test_an_image_too_large_to_decode_is_refused_before_decoding(engine, monkeypatch) -> None:
    big, turned = chat(jpeg(600, 400)), chat(jpeg(64, 64, orientation=8))
    forbid_decoding(monkeypatch)
    with pytest.raises(ImageError, match=r"600x400 pixels \(RGB\) needs about .* to decode, more than the limit "
                       r"of 0.9 MiB per image"):
        encode_request(engine, big, "chat", ImagePolicy(ImageLimits(max_memory=600 * 400 * 4)), {})
    upright = ImagePolicy(ImageLimits(max_memory=64 * 64 * 4 * 2))
    with pytest.raises(ImageError, match="turned upright by its EXIF orientation"):
        encode_request(engine, turned, "chat", upright, {})


def test_the_decode_estimate_counts_pils_pixels() -> None:
    header = inspect_image(jpeg(100, 80))
    # PIL holds RGB in four bytes a pixel; no copy for RGB, a resize's two buffers beside it.
    assert header.decode_bytes() == header.encoded_bytes + 100 * 80 * 4
    assert header.decode_bytes((32, 32)) == header.encoded_bytes + 4 * 8000 + 4 * 32 * 80 + 4 * 32 * 32
    gray = inspect_image(jpeg(100, 80, mode="L"))
    assert gray.decode_bytes() == gray.encoded_bytes + 8000 + 4 * 8000  # L, then its RGB conversion


def test_images_use_their_own_worker(engine, monkeypatch) -> None:
    """A request with images that takes its worker for long does not delay a text request."""
    started, release = threading.Event(), threading.Event()
    real = prompts_module.encode_request

    def slow_images(eng, req, kind, images, fetched, decoder):  # noqa: ANN001, ANN202
        if prompts_module.schema.image_urls(req):
            started.set()
            release.wait(10)
        return real(eng, req, kind, images, fetched, decoder)

    monkeypatch.setattr(prompts_module, "encode_request", slow_images)
    encoder = PromptEncoder(workers=1, waiting=0, image_workers=1, image_waiting=0)

    async def scenario() -> tuple[list[int], object]:
        image_task = asyncio.ensure_future(encoder.prompt(engine, chat(jpeg(32, 32)), "chat"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        # The image worker is busy: another request with an image is refused at once...
        with pytest.raises(prompts_module.PromptsBusy, match="image worker"):
            await encoder.prompt(engine, chat(jpeg(32, 32)), "chat")
        # ...and a text request is encoded while the image is still being worked on.
        from edge.serving import schema

        text = schema.parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}',
                                    schema.ChatCompletionRequest)
        ids = await encoder.prompt(engine, text, "chat")
        assert not image_task.done()
        release.set()
        return ids, await image_task

    try:
        ids, mm = asyncio.run(scenario())
    finally:
        release.set()
        encoder.close()
    assert isinstance(ids, list) and ids and len(mm.images) == 1


def test_the_heartbeat_beats_between_tower_blocks(engine, monkeypatch) -> None:
    sched = Scheduler(engine, queue_size=2)
    beats: list[float] = []
    tower = type(engine.vision.tower)
    block = tower._block

    def recording_block(self, *args, **kwargs):  # noqa: ANN001, ANN202
        beats.append(sched.stats()["last_heartbeat"])
        return block(self, *args, **kwargs)

    monkeypatch.setattr(tower, "_block", recording_block)
    prompt = engine.chat_prompt([{"role": "user", "content": [{"type": "image", "image": jpeg(64, 64)},
                                                              {"type": "text", "text": "?"}]}])
    sched.start()
    try:
        result = sched.submit(prompt, SamplingParams(max_tokens=2)).result()
    finally:
        sched.stop()
    assert result.finish_reason in ("stop", "length")
    depth = engine.vision.cfg.vision.depth
    assert len(beats) == depth
    # Each block after the first sees the beat its predecessor left: the loop is alive.
    assert all(later > earlier for earlier, later in zip(beats, beats[1:]))


def test_a_tower_pass_beside_a_stream_runs_in_slices_between_its_decode_steps(engine, monkeypatch) -> None:
    """An image request prefilled beside a decoding conversation runs its tower a slice at a
    time (here a block a slice: a tiny budget), with the other conversation's decode steps in
    between, and its features are those of the whole pass."""
    sched = Scheduler(engine, queue_size=2, prefill_budget_ms=0.001)
    tower = type(engine.vision.tower)
    block = tower._block
    stream_tokens_at_block: list[int] = []
    images = [{"type": "image", "image": jpeg(96, 64)}, {"type": "image", "image": jpeg(64, 96)}]
    messages = [{"role": "user", "content": [*images, {"type": "text", "text": "?"}]}]
    whole = engine.chat_prompt(messages)
    features = [engine.vision.features(whole, i) for i in range(2)]
    prompt = engine.chat_prompt(messages)
    sched.start()
    try:
        stream = sched.submit([1, 2, 3], SamplingParams(max_tokens=3000, ignore_eos=True))
        next(iter(stream))  # decoding

        def recording_block(self, *args, **kwargs):  # noqa: ANN001, ANN202
            stream_tokens_at_block.append(len(stream._chunks))  # on the engine thread: what it pushed
            return block(self, *args, **kwargs)

        monkeypatch.setattr(tower, "_block", recording_block)
        result = sched.submit(prompt, SamplingParams(max_tokens=0)).result()
        assert not stream.finished  # the images were prefilled beside it
        stream.cancel()
    finally:
        sched.stop()
    assert result.finish_reason == "length"
    depth = engine.vision.cfg.vision.depth
    assert len(stream_tokens_at_block) == 2 * depth
    # Every block after the first ran after at least one more token of the stream.
    pairs = zip(stream_tokens_at_block, stream_tokens_at_block[1:])
    assert all(later > earlier for earlier, later in pairs), stream_tokens_at_block
    for i, f in enumerate(features):
        assert torch.equal(prompt._features[i].embeds, f.embeds)
        assert all(torch.equal(a, b) for a, b in zip(prompt._features[i].deepstack, f.deepstack))
