"""Safetensors checkpoint directory -> tensors on the target device.

Tensors are read in row chunks of at most ``READ_CHUNK_BYTES``: each chunk is read from a
fresh memory map of its file, which is unmapped before the chunk is copied to its device
and dtype, and the chunk dropped right after. No shard stays mapped, so the process's
resident memory while loading is the weights loaded so far plus about two chunks. On
Orin the mapped pages and the "device" copy live in the same DRAM: keeping a shard mapped
would double the footprint of its weights.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from edge.model.config import ModelConfig
from edge.model.files import check_regular, read_json_object
from edge.model.shapes import FUSED, expected_shapes, fused_layout  # noqa: F401 - re-exported
from edge.model.validate import CheckpointError, check_tensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
READ_CHUNK_BYTES = 64 << 20


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {root} does not exist")
    index = root / INDEX_FILE
    if index.exists():
        weight_map = read_json_object(index, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"unreadable index {index}: no 'weight_map' object")
        files = {name: root / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise CheckpointError(f"shard {shard.name} named in {INDEX_FILE} is missing from {root}")
        return files
    single = root / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(path: Path):  # noqa: ANN202 - safetensors' handle type is private
    check_regular(path, CheckpointError)  # a FIFO would block the open
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises several private error types
        raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from exc


def file_metadata(model_dir: str | Path) -> dict[str, str]:
    """``__metadata__`` of the checkpoint (of its first shard when sharded)."""
    files = checkpoint_files(model_dir)
    with _open(next(iter(sorted(set(files.values()))))) as f:
        return dict(f.metadata() or {})


@dataclass(frozen=True)
class TensorRows:
    """Rows ``[row, row + len(data))`` of the checkpoint tensor ``name`` of ``shape``; ``data``
    is a host tensor that owns its memory (no view of a file mapping)."""

    name: str
    shape: tuple[int, ...]
    row: int
    data: torch.Tensor


def iter_tensor_rows(
    model_dir: str | Path, names: list[str], chunk_bytes: int = READ_CHUNK_BYTES
) -> Iterator[TensorRows]:
    """Yield every tensor of ``names`` as row chunks of at most ``chunk_bytes`` (one row at
    least), file by file, each chunk read through a mapping that is closed before it is
    yielded. The caller copies each chunk to its destination and drops it."""
    files = checkpoint_files(model_dir)
    missing = [n for n in names if n not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint in {model_dir} lacks tensors: {shown}")
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    for path, shard_names in sorted(by_file.items()):
        for n in shard_names:
            try:
                yield from _rows(path, n, chunk_bytes)
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"cannot read tensor {n} from {path.name}: {exc}") from exc


def tensor_shape(path: Path, name: str) -> tuple[int, ...]:
    """The shape of tensor ``name`` in the safetensors file ``path`` (its header only)."""
    try:
        with _open(path) as f:
            return tuple(f.get_slice(name).get_shape())
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor {name} from {path.name}: {exc}") from exc


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_checkpoint_matches_config(model_dir: str | Path, cfg: ModelConfig) -> None:
    """Before anything is allocated, from the checkpoint's headers: it holds the
    decoder layers config.json names, and an embedding of ``vocab_size`` rows. A
    config.json edited to a million layers fails here, not after minutes of allocating."""
    files = checkpoint_files(model_dir)
    layers = {int(m.group(1)) for name in files if (m := _LAYER.search(name))}
    if layers and (len(layers) != cfg.num_layers or max(layers) != cfg.num_layers - 1):
        raise CheckpointError(f"config.json says num_hidden_layers {cfg.num_layers}, but the checkpoint in "
                              f"{model_dir} holds {len(layers)} layers (0..{max(layers)})")
    embedding = next((n for n in files if n.endswith("embed_tokens.weight")), None)
    if embedding is not None:
        rows = tensor_shape(files[embedding], embedding)[0]
        if rows != cfg.vocab_size:
            raise CheckpointError(f"config.json says vocab_size {cfg.vocab_size}, but {embedding} in the checkpoint "
                                  f"has {rows} rows")


def _rows(path: Path, name: str, chunk_bytes: int) -> Iterator[TensorRows]:
    with _open(path) as f:
        shape = tuple(f.get_slice(name).get_shape())
        if len(shape) == 0 or math.prod(shape) == 0:
            yield TensorRows(name, shape, 0, f.get_tensor(name))
            return
        first = f.get_slice(name)[0:1]
    row_bytes = first.element_size() * math.prod(shape[1:])
    step = max(1, chunk_bytes // row_bytes)
    for r0 in range(0, shape[0], step):
        with _open(path) as f:  # a fresh mapping per chunk: its pages leave the process with it
            data = f.get_slice(name)[r0 : r0 + step]
        yield TensorRows(name, shape, r0, data)
        del data


def load_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    chunk_bytes: int = READ_CHUNK_BYTES,
    checkpoint_name: Callable[[str], str] | None = None,
) -> dict[str, torch.Tensor]:
    """Load and shape-check a float checkpoint into fused device tensors of ``dtype``.
    ``checkpoint_name``: edge's tensor name -> the checkpoint's, where they differ (the
    decoder of a vision-language model)."""
    names = list(expected_shapes(cfg))
    if checkpoint_name is None:
        return place_rows(iter_tensor_rows(model_dir, names, chunk_bytes), cfg, device, dtype)
    back = {checkpoint_name(n): n for n in names}
    pieces = (TensorRows(back[p.name], p.shape, p.row, p.data) for p in iter_tensor_rows(model_dir, list(back), chunk_bytes))
    return place_rows(pieces, cfg, device, dtype)


def fuse_weights(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Place whole (name, tensor) pairs into fused device tensors (see :func:`place_rows`)."""
    return place_rows((TensorRows(n, tuple(t.shape), 0, t) for n, t in tensors), cfg, device, dtype)


def place_rows(
    pieces: Iterable[TensorRows], cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Place row chunks into fused destinations allocated once on the device: one copy
    per chunk, no host-side concatenation. Every expected tensor must come whole."""
    shapes = expected_shapes(cfg)
    layout = fused_layout(shapes)
    dest_shapes: dict[str, list[int]] = {}
    for name, (dest, row) in layout.items():
        shape = shapes[name]
        current = dest_shapes.setdefault(dest, [0, *shape[1:]])
        current[0] = max(current[0], row + shape[0])
    out = {d: torch.empty(s, device=device, dtype=dtype) for d, s in dest_shapes.items()}
    rows_seen: dict[str, int] = {}
    for piece in pieces:
        name = piece.name
        if name not in shapes:
            continue
        check_tensor(name, piece.shape, piece.data.dtype, shapes[name])
        dest, row = layout[name]
        n = piece.data.shape[0]
        out[dest][row + piece.row : row + piece.row + n].copy_(piece.data)
        rows_seen[name] = rows_seen.get(name, 0) + n
        del piece  # before the next chunk is read
    missing = sorted(n for n in shapes if rows_seen.get(n, 0) != shapes[n][0])
    if missing:
        raise CheckpointError(f"tensors missing: {', '.join(missing[:5])}")
    return out
