"""A Qwen3-VL / Qwen2.5-VL checkpoint -> the text decoder's weights (under edge's names)
and the vision tower.

Checkpoints name the decoder ``model.language_model.*`` (transformers >= 4.52, Qwen3-VL)
or ``model.*`` (Qwen2.5-VL as first published), and the tower ``model.visual.*`` or
``visual.*``; both layouts load.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edge.config import ModelConfig
from edge.loader import (
    TensorRows,
    checkpoint_files,
    expected_shapes,
    iter_tensor_rows,
    place_rows,
)
from edge.validate import CheckpointError, check_tensor
from edge.vision.config import VisionConfig
from edge.vision.tower import VisionTower, vision_shapes

if TYPE_CHECKING:
    from edge.model import Model
    from edge.vision.runtime import VisionLanguage


def _prefix(names: dict[str, Path], *candidates: str) -> str:
    return next((c for c in candidates if any(n.startswith(c) for n in names)), candidates[-1])


def text_tensor_names(model_dir: str | Path, cfg: ModelConfig) -> dict[str, str]:
    """The checkpoint's name of every decoder tensor -> edge's (text-model) name."""
    files = checkpoint_files(model_dir)
    prefix = _prefix(files, "model.language_model.", "model.")
    names = {}
    for name in expected_shapes(cfg):
        names[prefix + name.removeprefix("model.") if name.startswith("model.") else name] = name
    return names


def load_text_weights(
    model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The decoder's fused device tensors, as :func:`edge.loader.load_weights` makes them
    (read in row chunks, renamed on the way)."""
    names = text_tensor_names(model_dir, cfg)
    pieces = (TensorRows(names[p.name], p.shape, p.row, p.data) for p in iter_tensor_rows(model_dir, list(names)))
    return place_rows(pieces, cfg, device, dtype)


def tower_prefix(model_dir: str | Path) -> str:
    """The checkpoint's name prefix of the vision tower's tensors."""
    return _prefix(checkpoint_files(model_dir), "model.visual.", "visual.")


def load_tower(model_dir: str | Path, cfg: VisionConfig, device: torch.device, dtype: torch.dtype) -> VisionTower:
    """The vision tower on ``device`` in ``dtype``, every tensor shape-checked, read in
    row chunks copied into place."""
    prefix = tower_prefix(model_dir)
    shapes = vision_shapes(cfg)
    weights = {local: torch.empty(shape, device=device, dtype=dtype) for local, shape in shapes.items()}
    for piece in iter_tensor_rows(model_dir, [prefix + n for n in shapes]):
        local = piece.name.removeprefix(prefix)
        check_tensor(piece.name, piece.shape, piece.data.dtype, shapes[local])
        weights[local][piece.row : piece.row + piece.data.shape[0]].copy_(piece.data)
        del piece  # before the next chunk is read
    return VisionTower(cfg, weights)


def checked_tensors(
    model_dir: str | Path, model: Model, vision: VisionLanguage
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, tuple[str, int]]]:
    """What :func:`edge.validate.check_finite_weights` takes for a loaded VL model: the
    decoder's and the tower's tensors, and a layout naming their checkpoint tensors."""
    from edge.loader import fused_layout
    from edge.quant import weight_tensors

    fused = fused_layout(expected_shapes(model.cfg))
    layout = {stored: fused[name] for stored, name in text_tensor_names(model_dir, model.cfg).items()}
    tensors = [(name, t) for name, w in model.w.items() for t in weight_tensors(w)]
    prefix = tower_prefix(model_dir)
    tensors += [(prefix + local, t) for local, t in vision.tower.w.items()]
    return tensors, layout


def load_vision_language(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    quantize: str | None = None,
    quant_group_size: int | None = None,
) -> tuple[Model, VisionLanguage]:
    """The text decoder and its :class:`VisionLanguage` (tower, processor, RoPE layout).
    ``quantize="int8"``: the decoder's projections quantized while loading (the tower
    stays in ``dtype``)."""
    from edge.model import Model
    from edge.quant import (
        checkpoint_quantization,
        load_quantized_weights,
        parse_quantize,
    )
    from edge.vision.config import VLConfig
    from edge.vision.preprocess import ProcessorConfig
    from edge.vision.runtime import VisionLanguage

    cfg = VLConfig.from_pretrained(model_dir)
    processor = ProcessorConfig.from_pretrained(model_dir)
    if checkpoint_quantization(model_dir) is not None:
        raise CheckpointError(f"{model_dir}: pre-quantized vision-language checkpoints are not supported; "
                              "load the float checkpoint with quantize='int8'")
    if parse_quantize(quantize) is not None:
        names = {edge: stored for stored, edge in text_tensor_names(model_dir, cfg.text).items()}
        weights = load_quantized_weights(
            model_dir, cfg.text, device, dtype, quantize, quant_group_size, tensor_names=names
        )
    else:
        weights = load_text_weights(model_dir, cfg.text, device, dtype)
    model = Model(cfg.text, weights, max_seq_len)
    tower = load_tower(model_dir, cfg.vision, device, dtype)
    return model, VisionLanguage(cfg, tower, processor, model.w["model.embed_tokens.weight"], max_seq_len)
