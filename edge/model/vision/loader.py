"""A Qwen3-VL / Qwen2.5-VL checkpoint -> the text decoder's weights (under edge's names)
and the vision tower.

Checkpoints name the decoder ``model.language_model.*`` (transformers >= 4.52, Qwen3-VL)
or ``model.*`` (Qwen2.5-VL as first published), and the tower ``model.visual.*`` or
``visual.*``; both layouts load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edge.model.config import ModelConfig
from edge.model.loader import checkpoint_files, expected_shapes, iter_tensor_rows
from edge.model.validate import CheckpointError, check_tensor
from edge.model.vision.config import VisionConfig
from edge.model.vision.tower import VisionTower, vision_shapes

if TYPE_CHECKING:
    from edge.model.decoder import Model
    from edge.model.vision.runtime import VisionLanguage


# The tensors that replace ``.weight`` in int4 checkpoints (AWQ / GPTQ, compressed-tensors).
QUANTIZED_MARKERS = (".qweight", ".weight_packed")


def _prefix(names: dict[str, Path], *candidates: str) -> str:
    return next((c for c in candidates if any(n.startswith(c) for n in names)), candidates[-1])


def text_name_mapper(model_dir: str | Path) -> Callable[[str], str]:
    """edge's (text-model) name of a decoder tensor -> the checkpoint's; also for the
    tensors a quantized checkpoint derives from it (``...q_proj.qweight``)."""
    prefix = _prefix(checkpoint_files(model_dir), "model.language_model.", "model.")
    return lambda name: prefix + name.removeprefix("model.") if name.startswith("model.") else name


def text_tensor_names(model_dir: str | Path, cfg: ModelConfig) -> dict[str, str]:
    """The checkpoint's name of every decoder tensor -> edge's (text-model) name."""
    stored = text_name_mapper(model_dir)
    return {stored(name): name for name in expected_shapes(cfg)}


def tower_prefix(model_dir: str | Path) -> str:
    """The checkpoint's name prefix of the vision tower's tensors."""
    return _prefix(checkpoint_files(model_dir), "model.visual.", "visual.")


def load_tower(model_dir: str | Path, cfg: VisionConfig, device: torch.device, dtype: torch.dtype) -> VisionTower:
    """The vision tower on ``device`` in ``dtype``, every tensor shape-checked, read in
    row chunks copied into place."""
    prefix = tower_prefix(model_dir)
    shapes = vision_shapes(cfg)
    files = checkpoint_files(model_dir)
    for local in shapes:
        base = prefix + local.removesuffix(".weight")
        if any(base + marker in files for marker in QUANTIZED_MARKERS):
            raise CheckpointError(f"{model_dir}: vision tower weights must be float, but {base} is quantized "
                                  "(only the language model's linears may be int4)")
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
    """What :func:`edge.model.validate.check_finite_weights` takes for a loaded VL model: the
    decoder's and the tower's tensors, and a layout naming their checkpoint tensors."""
    from edge.model.loader import fused_layout
    from edge.quant.q8_0 import weight_tensors

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
    lm_head: str = "int8",
    embedding: str = "int8",
) -> tuple[Model, VisionLanguage]:
    """The text decoder and its :class:`VisionLanguage` (tower, processor, RoPE layout).
    The decoder loads as :meth:`Model.load` loads a text model: ``quantize="int8"`` /
    ``"int4"`` quantize its projections while loading, and an int4 checkpoint (AWQ,
    GPTQ, compressed-tensors) loads as published; the tower stays in ``dtype``."""
    from edge.model.decoder import Model
    from edge.quant.q8_0 import checkpoint_quantization
    from edge.model.vision.config import VLConfig
    from edge.model.vision.preprocess import ProcessorConfig
    from edge.model.vision.runtime import VisionLanguage

    cfg = VLConfig.from_pretrained(model_dir)
    processor = ProcessorConfig.from_pretrained(model_dir)
    if checkpoint_quantization(model_dir) is not None:
        raise CheckpointError(f"{model_dir}: q8_0 vision-language checkpoints are not supported; "
                              "load the float checkpoint with quantize='int8'")
    model = Model.load(
        model_dir, cfg.text, device, dtype, max_seq_len, quantize=quantize, quant_group_size=quant_group_size,
        lm_head=lm_head, embedding=embedding, checkpoint_name=text_name_mapper(model_dir),
    )
    tower = load_tower(model_dir, cfg.vision, device, dtype)
    return model, VisionLanguage(cfg, tower, processor, model.w["model.embed_tokens.weight"], max_seq_len)
