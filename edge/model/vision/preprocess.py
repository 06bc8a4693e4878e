"""Image -> patches, as the checkpoint's Hugging Face image processor (Qwen2-VL's, which
Qwen2.5-VL and Qwen3-VL both use) computes them with its PIL backend:

1. decode, apply the EXIF orientation, convert to RGB;
2. resize (bicubic) to the multiple of patch x merge nearest the image's size, scaled
   into [min_pixels, max_pixels] keeping the aspect ratio (``smart_resize``);
3. rescale to [0, 1] (in float64, then float32) and normalise by the mean and std;
4. cut into patches ordered by merge block (the tower merges 2 x 2 neighbours), each
   ``[channels, temporal, patch, patch]`` flattened, the still image repeated over the
   temporal patch.

The digest names the preprocessed content (the resized pixels and the settings that turn
them into patches): the prefix cache keys image tokens by it.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from edge.errors import ImageError
from edge.model.files import read_json_object
from edge.model.vision.request import ImageLimits

PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class ProcessorConfig:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = Image.Resampling.BICUBIC

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ProcessorConfig:
        file = Path(path) / PREPROCESSOR_FILE
        try:
            data = read_json_object(file, ImageError)
        except FileNotFoundError:
            raise ImageError(f"{file} is missing: a vision-language model needs its image processor settings") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProcessorConfig:
        # As Qwen2VLImageProcessor: min_pixels / max_pixels override size's edges.
        size = d.get("size") or {}
        min_pixels = d.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
        max_pixels = d.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
        clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
        return cls(
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            merge_size=int(d.get("merge_size", 2)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(float(x) for x in d.get("image_mean", clip_mean)),
            image_std=tuple(float(x) for x in d.get("image_std", clip_std)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_resize=bool(d.get("do_resize", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            do_normalize=bool(d.get("do_normalize", True)),
            resample=int(d.get("resample", Image.Resampling.BICUBIC)),
        )


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: ``pixels [patches, patch_dim]`` float32 in merge-block
    order, its patch grid ``(t, h, w)`` and the content digest."""

    pixels: torch.Tensor
    grid: tuple[int, int, int]
    digest: bytes
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens in the prompt: one per merged block of patches."""
        t, h, w = self.grid
        return t * h * w // self.merge_size**2

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        """The grid of merged tokens ``(t, h, w)`` (what multimodal RoPE positions)."""
        t, h, w = self.grid
        return t, h // self.merge_size, w // self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size transformers resizes to: multiples of ``factor``, area within
    [min_pixels, max_pixels], aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, limits: ImageLimits | None = None) -> Image.Image:
    """Encoded bytes -> upright RGB image; ImageError for anything unusable."""
    limits = limits or ImageLimits()
    if len(data) > limits.max_bytes:
        raise ImageError(f"image of {len(data)} bytes exceeds the limit of {limits.max_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        # The header gives the size: refuse before decoding the pixels.
        w, h = image.size
        if w * h > limits.max_pixels:
            raise ImageError(f"image of {w}x{h} pixels exceeds the limit of {limits.max_pixels} pixels")
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"cannot decode image: {exc}") from exc


def load_image(path: str | Path, limits: ImageLimits | None = None) -> Image.Image:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read image {path}: {exc.strerror or exc}") from exc
    return decode_image(data, limits)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the processor makes it: transparency composited onto white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, cfg: ProcessorConfig) -> PreparedImage:
    """An RGB image -> :class:`PreparedImage` (see the module docstring)."""
    image = to_rgb(image)
    width, height = image.size
    if cfg.do_resize:
        height, width = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        image = image.resize((width, height), resample=cfg.resample)
    elif height % cfg.factor or width % cfg.factor:
        raise ImageError(f"image of {width}x{height} is not a multiple of {cfg.factor} and do_resize is off")
    raw = np.asarray(image, dtype=np.uint8)  # [H, W, C]
    digest = hashlib.blake2b(raw.tobytes(), digest_size=32)
    digest.update(repr((raw.shape, cfg)).encode())
    x = raw.astype(np.float64) * cfg.rescale_factor if cfg.do_rescale else raw.astype(np.float64)
    x = x.astype(np.float32)
    if cfg.do_normalize:
        x = (x - np.asarray(cfg.image_mean, dtype=np.float32)) / np.asarray(cfg.image_std, dtype=np.float32)
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    c = x.shape[2]
    # [H, W, C] -> [gh/m, gw/m, m, m, C, p, p]: merge blocks in raster order, patches
    # in raster order inside a block, each patch channel-major.
    blocks = x.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)
    patches = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
    pixels = torch.from_numpy(np.ascontiguousarray(patches).reshape(gh * gw, c * tp * p * p))
    return PreparedImage(pixels, (1, gh, gw), digest.digest(), m)
