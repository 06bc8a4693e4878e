"""Image -> patches, as the checkpoint's Hugging Face image processor (Qwen2-VL's, which
Qwen2.5-VL and Qwen3-VL both use) computes them with its PIL backend:

1. decode, apply the EXIF orientation, convert to RGB;
2. resize (bicubic) to the multiple of patch x merge nearest the image's size, scaled
   into [min_pixels, max_pixels] keeping the aspect ratio (``smart_resize``);
3. rescale to [0, 1] (in float64, then float32) and normalise by the mean and std;
4. cut into patches ordered by merge block (the tower merges 2 x 2 neighbours), each
   ``[channels, temporal, patch, patch]`` flattened, the still image repeated over the
   temporal patch.

Memory stays bounded whatever the picture: the header alone (:func:`inspect_image`) gives
the size, the pixel mode and the EXIF orientation, so an image whose decoding would take
more than the limit (its pixels as stored, an upright copy, the RGB conversion, the resize)
is refused before a byte is decoded, and the caller checks its tokens against the context
first. A :class:`PreparedImage` keeps only the resized uint8 pixels; steps 3 and 4 run when
the tower takes them, through a 256-entry table per channel holding exactly the float64 ->
float32 rescale and the float32 normalisation (no float64 array, no full-size float copy).

The digest names the preprocessed content (the resized pixels and the settings that turn
them into patches): the prefix cache keys image tokens by it.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from edge.errors import ImageError
from edge.model.files import read_json_object
from edge.model.vision.request import ImageLimits

if TYPE_CHECKING:
    import torch

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
    """One image ready for the tower: the resized RGB pixels (``raw``, uint8 ``[H, W, 3]``),
    its patch grid ``(t, h, w)``, the content digest and the processor settings that make
    :attr:`pixels` of them."""

    raw: np.ndarray
    grid: tuple[int, int, int]
    digest: bytes
    merge_size: int
    cfg: ProcessorConfig

    @property
    def pixels(self) -> torch.Tensor:
        """``[patches, patch_dim]`` float32 in merge-block order (what the tower takes),
        made now: only the uint8 pixels are kept between the request and the tower."""
        return patch_values(self.raw, self.cfg)

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


# Bytes PIL keeps a decoded pixel in, per mode (multi-band modes, RGB included, take 4).
_MODE_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}
EXIF_ORIENTATION = 0x0112
_SWAPS_SIDES = (5, 6, 7, 8)  # orientations that turn the picture by 90 degrees


@dataclass(frozen=True)
class ImageHeader:
    """What an encoded image's header says: its upright size, pixel mode and EXIF orientation."""

    width: int
    height: int
    mode: str
    orientation: int = 1
    encoded_bytes: int = 0

    @property
    def pixels(self) -> int:
        return self.width * self.height

    def decode_bytes(self, target: tuple[int, int] | None = None) -> int:
        """Peak bytes of decoding it upright as RGB and resizing it to ``target`` (h, w): the
        encoded bytes beside the largest step, of decoding (the pixels as stored), turning it
        upright (two copies), converting it to RGB (stored + RGB) and resizing (the RGB
        pixels, the horizontal pass's output and the result)."""
        n = self.pixels
        stored = n * _MODE_BYTES.get(self.mode, 4)
        steps = [stored]
        if self.orientation != 1:
            steps.append(2 * stored)
        if self.mode != "RGB":
            steps.append(stored + 4 * n)
        if target is not None:
            th, tw = target
            steps.append(4 * n + 4 * tw * self.height + 4 * tw * th)
        return self.encoded_bytes + max(steps)


def inspect_image(data: bytes, limits: ImageLimits | None = None) -> ImageHeader:
    """The header of encoded image bytes (nothing decoded); ImageError when it is unusable
    or over the byte and pixel limits."""
    limits = limits or ImageLimits()
    if len(data) > limits.max_bytes:
        raise ImageError(f"image of {len(data)} bytes exceeds the limit of {limits.max_bytes} bytes")
    try:
        with Image.open(io.BytesIO(data)) as image:
            w, h = image.size
            if w * h > limits.max_pixels:
                raise ImageError(f"image of {w}x{h} pixels exceeds the limit of {limits.max_pixels} pixels")
            orientation = int(image.getexif().get(EXIF_ORIENTATION, 1) or 1)
            mode = image.mode
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, TypeError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"cannot decode image: {exc}") from exc
    if orientation not in range(1, 9):
        orientation = 1
    if orientation in _SWAPS_SIDES:
        w, h = h, w
    return ImageHeader(w, h, mode, orientation, len(data))


def check_decode_memory(header: ImageHeader, cfg: ProcessorConfig | None, limits: ImageLimits) -> None:
    """ImageError when decoding ``header``'s image (and resizing it as ``cfg`` would) takes
    more than ``limits.max_memory``."""
    target = None
    if cfg is not None and cfg.do_resize:
        target = smart_resize(header.height, header.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    need = header.decode_bytes(target)
    if need > limits.max_memory:
        turned = ", turned upright by its EXIF orientation" if header.orientation != 1 else ""
        raise ImageError(
            f"image of {header.width}x{header.height} pixels ({header.mode}{turned}) needs about {need / 2**20:.1f} MiB "
            f"to decode, more than the limit of {limits.max_memory / 2**20:.1f} MiB per image (EDGE_IMAGE_MAX_MEMORY): "
            "send a smaller image"
        )


def decode_image(data: bytes, limits: ImageLimits | None = None, cfg: ProcessorConfig | None = None) -> Image.Image:
    """Encoded bytes -> upright RGB image; ImageError for anything unusable, or larger than
    the limits allow (checked from the header, before decoding: see :func:`check_decode_memory`)."""
    limits = limits or ImageLimits()
    check_decode_memory(inspect_image(data, limits), cfg, limits)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        if int(image.getexif().get(EXIF_ORIENTATION, 1) or 1) != 1:
            image = ImageOps.exif_transpose(image)
        # As transformers' load_image: a plain conversion (an RGB image is used as it is).
        return image if image.mode == "RGB" else image.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, TypeError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"cannot decode image: {exc}") from exc


def read_image_file(path: str | Path, limits: ImageLimits | None = None) -> bytes:
    limits = limits or ImageLimits()
    try:
        if Path(path).stat().st_size > limits.max_bytes:
            raise ImageError(f"image {path} exceeds the limit of {limits.max_bytes} bytes")
        return Path(path).read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read image {path}: {exc.strerror or exc}") from exc


def load_image(path: str | Path, limits: ImageLimits | None = None, cfg: ProcessorConfig | None = None) -> Image.Image:
    return decode_image(read_image_file(path, limits), limits, cfg)


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
    p = cfg.patch_size
    return PreparedImage(raw, (1, height // p, width // p), digest.digest(), cfg.merge_size, cfg)


def value_table(cfg: ProcessorConfig, channels: int = 3) -> np.ndarray:
    """``[channels, 256]`` float32: what each uint8 value becomes, computed exactly as the
    processor computes it pixel by pixel (rescale in float64, then float32; normalise in
    float32)."""
    x = np.arange(256, dtype=np.float64)
    x = (x * cfg.rescale_factor if cfg.do_rescale else x).astype(np.float32)
    x = np.broadcast_to(x, (channels, 256))
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
        x = (x - mean) / std
    return np.ascontiguousarray(x, dtype=np.float32)


# Patches looked up at once: each step holds the GIL for a few milliseconds at most.
PATCH_STEP = 4096


def patch_values(raw: np.ndarray, cfg: ProcessorConfig) -> torch.Tensor:
    """uint8 ``[H, W, C]`` -> the tower's float32 ``[patches, C x temporal x patch x patch]``
    in merge-block order (raster blocks, raster patches inside a block, each patch
    channel-major, the still image repeated over the temporal patch)."""
    import torch  # here: the image decoding process imports this module without torch

    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width, c = raw.shape
    gh, gw = height // p, width // p
    # [H, W, C] -> [gh/m, gw/m, m, m, C, p, p] in uint8 (a copy of the small resized image).
    codes = np.ascontiguousarray(raw.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5))
    codes = codes.reshape(gh * gw, c, p * p)
    table = value_table(cfg, c)
    out = np.empty((gh * gw, c, tp, p * p), dtype=np.float32)
    for start in range(0, gh * gw, PATCH_STEP):
        rows = slice(start, start + PATCH_STEP)
        for ch in range(c):
            out[rows, ch] = table[ch][codes[rows, ch]][:, None, :]
    return torch.from_numpy(out.reshape(gh * gw, c * tp * p * p))
