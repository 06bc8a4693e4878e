"""The multimodal half of an engine: prompts with images in, the decoder's inputs out.

A :class:`MultimodalPrompt` is one request's prompt: its token ids (each image's
placeholder expanded to one token per merged patch block), its images, their 3-axis
RoPE positions and the rope delta of what follows, and the ids the prefix cache keys it
by (each image's tokens replaced by its content digest, so the same image asked about
again hits the cache and a different one of the same size does not).

``VisionLanguage.chunk_inputs`` gives the decoder what a prefill chunk needs: input
embeddings with the image features scattered in, the chunk's rows of the multimodal
RoPE tables and the DeepStack features to add after the first layers. The tower runs
only for images a chunk actually covers, once per prompt: a prompt whose images all lie
in a cached prefix never runs it.
"""

from __future__ import annotations

import time

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edge.model.config import rope_inv_freq
from edge.kernels.reference import embedding
from edge.quant.embedding import Int8Embedding
from edge.model.vision.config import VLConfig
from edge.model.vision.mrope import frequency_axes, mrope_tables, rope_positions
from edge.model.vision.preprocess import (
    ImageError,
    ImageHeader,
    ImageLimits,
    PreparedImage,
    ProcessorConfig,
    check_decode_memory,
    decode_image,
    inspect_image,
    preprocess,
    read_image_file,
    smart_resize,
)
from edge.model.vision.tower import ImageFeatures, TowerPass, VisionTower


@dataclass
class Deepstack:
    """Features added to the residual stream after decoder layer ``i`` (for ``i <
    len(features)``) at the chunk's rows ``rows``."""

    rows: torch.Tensor
    features: tuple[torch.Tensor, ...]


@dataclass
class MultimodalPrompt:
    ids: list[int]
    images: list[PreparedImage]
    spans: list[tuple[int, int]]  # each image's token range in ``ids``
    positions: torch.Tensor  # [3, len(ids)] int64 on the host
    rope_delta: int
    key_ids: list[int]  # ``ids`` with image tokens replaced by their image's digest
    _features: dict[int, ImageFeatures] = field(default_factory=dict, repr=False)
    _passes: dict[int, TowerPass] = field(default_factory=dict, repr=False)  # tower passes run in slices
    _tables: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    tower_runs: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    def towers_due(self, start: int, end: int) -> list[int]:
        """The images in tokens [start, end) whose tower features are not ready yet."""
        return [i for i, (s, e) in enumerate(self.spans) if s < end and e > start and i not in self._features]


class VisionLanguage:
    """A VL model's tower, image processor settings and RoPE layout, for one engine."""

    def __init__(
        self,
        cfg: VLConfig,
        tower: VisionTower,
        processor: ProcessorConfig,
        embed_tokens: torch.Tensor | Int8Embedding,
        max_seq_len: int,
    ) -> None:
        if cfg.vision.out_hidden_size != cfg.text.hidden_size:
            raise ValueError(
                f"vision out_hidden_size {cfg.vision.out_hidden_size} != text hidden_size {cfg.text.hidden_size}"
            )
        if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != (
            cfg.vision.patch_size,
            cfg.vision.spatial_merge_size,
            cfg.vision.temporal_patch_size,
        ):
            raise ValueError("preprocessor_config.json's patch/merge/temporal sizes disagree with config.json")
        self.cfg = cfg
        self.tower = tower
        self.processor = processor
        self.embed_tokens = embed_tokens
        self.device, self.dtype = embed_tokens.device, embed_tokens.dtype
        self.inv_freq = rope_inv_freq(cfg.text)
        self.axes = frequency_axes(cfg.mrope_section, cfg.mrope_interleaved)
        # Decode after images is plain RoPE at (position + delta), delta <= 0: tables
        # over positions [-max_seq_len, max_seq_len) let a view start at any delta.
        self.max_seq_len = max_seq_len
        ext = torch.arange(-max_seq_len, max_seq_len).expand(3, -1)
        self._ext_cos, self._ext_sin = mrope_tables(ext, self.inv_freq, self.axes, self.device, self.dtype)

    # -- prompts ------------------------------------------------------------------------

    def prepare(self, source: Any, limits: ImageLimits | None = None) -> PreparedImage:
        """Bytes, a path or a PIL image -> a preprocessed image (ImageError if unusable, or
        larger than ``limits`` let it be decoded: checked from its header first)."""
        from PIL import Image

        limits = limits or ImageLimits()
        if isinstance(source, (str, Path)):
            source = read_image_file(source, limits)
        if isinstance(source, (bytes, bytearray)):
            image = decode_image(bytes(source), limits, self.processor)
        elif isinstance(source, Image.Image):
            image = source
        else:
            raise ImageError(f"unsupported image source {type(source).__name__}")
        return preprocess(image, self.processor)

    def inspect(self, source: Any, limits: ImageLimits | None = None) -> ImageHeader:
        """An image's header (nothing decoded), checked against ``limits``' bytes and
        pixels: what :meth:`image_tokens` and :meth:`check_memory` take."""
        from PIL import Image

        limits = limits or ImageLimits()
        if isinstance(source, (str, Path)):
            source = read_image_file(source, limits)
        if isinstance(source, (bytes, bytearray)):
            return inspect_image(bytes(source), limits)
        if isinstance(source, Image.Image):
            return ImageHeader(source.width, source.height, source.mode)
        raise ImageError(f"unsupported image source {type(source).__name__}")

    def check_memory(self, header: ImageHeader, limits: ImageLimits | None = None) -> None:
        """ImageError when decoding and resizing the image would take more than ``limits.max_memory``."""
        if header.encoded_bytes:  # PIL images given as such are decoded already
            check_decode_memory(header, self.processor, limits or ImageLimits())

    def image_tokens(self, header: ImageHeader) -> int:
        """Placeholder tokens the image of ``header`` will take in the prompt."""
        proc = self.processor
        h, w = header.height, header.width
        if proc.do_resize:
            h, w = smart_resize(h, w, proc.factor, proc.min_pixels, proc.max_pixels)
        return (h // proc.patch_size) * (w // proc.patch_size) // proc.merge_size**2

    def build_prompt(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> MultimodalPrompt:
        """A rendered prompt ``ids`` holding one image placeholder token per image (as the
        chat template writes them) -> the expanded :class:`MultimodalPrompt`."""
        pad = self.cfg.image_token_id
        found = sum(1 for t in ids if t == pad)
        if found != len(images):
            raise ImageError(f"the prompt holds {found} image placeholders for {len(images)} images")
        out: list[int] = []
        keys: list[int] = []
        spans: list[tuple[int, int]] = []
        it = iter(images)
        for t in ids:
            if t != pad:
                out.append(t)
                keys.append(t)
                continue
            image = next(it)
            spans.append((len(out), len(out) + image.num_tokens))
            out += [pad] * image.num_tokens
            # A negative int no token id can equal; 256 bits, so a collision is not a risk.
            keys += [-1 - int.from_bytes(image.digest, "big")] * image.num_tokens
        positions, delta = rope_positions(len(out), [(s, e, im.llm_grid) for (s, e), im in zip(spans, images)])
        return MultimodalPrompt(out, list(images), spans, positions, delta, keys)

    def prompt_from_messages(
        self, tokenizer: Any, messages: Sequence[Mapping[str, Any]], limits: ImageLimits | None = None
    ) -> MultimodalPrompt:
        """Chat messages whose content may hold ``{"type": "image", "image": source}``
        parts -> the prompt the model's chat template and image processor make of them."""
        rendered, sources = split_images(messages)
        for source in sources:  # every header before any image is decoded
            self.check_memory(self.inspect(source, limits), limits)
        images = [self.prepare(s, limits) for s in sources]
        return self.build_prompt(tokenizer.encode_chat(rendered), images)

    # -- prefill inputs -----------------------------------------------------------------

    def features(self, prompt: MultimodalPrompt, index: int, progress: Callable[[], None] | None = None) -> ImageFeatures:
        """The tower's features of the prompt's image ``index`` (run once a prompt);
        ``progress`` is called after each tower block (the engine loop's heartbeat)."""
        if index not in prompt._features:
            self._advance(prompt, index, None, time.perf_counter(), progress)
        return prompt._features[index]

    def run_towers(self, prompt: MultimodalPrompt, start: int, end: int, budget_s: float | None,
                   progress: Callable[[], None] | None = None) -> None:
        """A slice of the tower passes of the images in tokens [start, end)
        (:meth:`MultimodalPrompt.towers_due`): blocks until ``budget_s`` is spent (at least
        one; one when None)."""
        t0 = time.perf_counter()
        for index in prompt.towers_due(start, end):
            if not self._advance(prompt, index, budget_s if budget_s is not None else 0.0, t0, progress):
                return

    def _advance(self, prompt: MultimodalPrompt, index: int, budget_s: float | None, t0: float,
                 progress: Callable[[], None] | None) -> bool:
        """Run image ``index``'s pass block by block until it is done (True) or, with a
        budget, until ``budget_s`` since ``t0`` is spent (False: the pass stays for later)."""
        run = self._pass(prompt, index)
        while True:
            done = run.step()
            if budget_s is not None and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # a slice's time is the device's
            if progress is not None:
                progress()
            if done:
                self._finish_pass(prompt, index)
            if budget_s is not None and time.perf_counter() - t0 >= budget_s:
                return False
            if done:
                return True

    def _pass(self, prompt: MultimodalPrompt, index: int) -> TowerPass:
        if index not in prompt._passes:
            image = prompt.images[index]
            prompt._passes[index] = self.tower.start(image.pixels, [image.grid])
        return prompt._passes[index]

    def _finish_pass(self, prompt: MultimodalPrompt, index: int) -> None:
        run = prompt._passes.pop(index)
        assert run.result is not None
        prompt._features[index] = run.result[0]
        prompt.tower_runs += 1

    def chunk_inputs(
        self, prompt: MultimodalPrompt, start: int, end: int, progress: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """``Model.hidden``'s keyword arguments for the prompt tokens [start, end)
        (``progress``: see :meth:`features`)."""
        ids = torch.tensor(prompt.ids[start:end], device=self.device)
        embeds = embedding(ids, self.embed_tokens)  # a table, or int8 rows (int4 models)
        rows: list[torch.Tensor] = []
        deepstack: list[list[torch.Tensor]] = []
        for i, (s, e) in enumerate(prompt.spans):
            lo, hi = max(s, start), min(e, end)
            if lo >= hi:
                continue
            f = self.features(prompt, i, progress)
            embeds[lo - start : hi - start] = f.embeds[lo - s : hi - s].to(embeds.dtype)
            rows.append(torch.arange(lo - start, hi - start, device=self.device))
            deepstack.append([d[lo - s : hi - s] for d in f.deepstack])
        if prompt._tables is None:
            prompt._tables = mrope_tables(prompt.positions, self.inv_freq, self.axes, self.device, self.dtype)
        inputs: dict[str, Any] = {"embeds": embeds, "rope": prompt._tables}
        if rows and deepstack[0]:
            layers = zip(*deepstack)
            inputs["deepstack"] = Deepstack(torch.cat(rows), tuple(torch.cat(layer).to(self.dtype) for layer in layers))
        return inputs

    def decode_rope(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed-sin tables whose row p is RoPE at position p + delta (views)."""
        if not -self.max_seq_len < delta <= 0:
            raise ValueError(f"rope delta {delta} outside (-{self.max_seq_len}, 0]")
        start = self.max_seq_len + delta
        return self._ext_cos[start:], self._ext_sin[start:]


def split_images(messages: Iterable[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages -> (the messages with each image part reduced to ``{"type": "image"}``,
    which the chat template renders as a placeholder, and the images' sources in order)."""
    rendered: list[dict[str, Any]] = []
    sources: list[Any] = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            rendered.append(dict(m))
            continue
        parts = []
        for part in content:
            if part.get("type") == "image":
                sources.append(part.get("image"))
                parts.append({"type": "image"})
            else:
                parts.append(dict(part))
        rendered.append({**m, "content": parts})
    return rendered, sources
