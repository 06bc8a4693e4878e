"""A GGUF model file (llama.cpp, Ollama) opened for loading: its metadata and tensor
table, parsed by the ``gguf`` package that llama.cpp maintains, and checked.

Split files (``NAME-00001-of-00003.gguf``, written by ``gguf-split`` and the converter's
``--split-max-*``) are one model: the metadata comes from the first, the tensors from
all. The parser maps a file only while reading its header; tensor data is then read
row chunk by row chunk with plain reads (:func:`read_rows`), so no file stays mapped
while the weights are copied to their device (on Orin a mapping and the device copy
would be the same DRAM twice).

Every problem with a file is a :class:`GGUFError` with a one-line message naming the
file: not GGUF, truncated, a tensor type edge does not read, a tensor whose type and
shape need more bytes than the file gives it, missing metadata.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.model.validate import CheckpointError

GGUF_MAGIC = b"GGUF"
SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(CheckpointError):
    """A GGUF file edge cannot load; the message names the file (one line)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` in PyTorch order (``[out, in]``, the reverse of
    ggml's ``ne``), ``nbytes`` at ``offset`` in ``path``."""

    name: str
    qtype: int
    type_name: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if len(self.shape) > 1 else 1
        return self.nbytes // rows


@dataclass(frozen=True)
class GGUFFile:
    """The metadata (key -> Python value) and tensors (name -> :class:`TensorInfo`) of a
    GGUF model, over its split files ``paths``."""

    paths: tuple[Path, ...]
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def path(self) -> Path:
        return self.paths[0]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name}: metadata {key!r} is missing")
        return self.metadata[key]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def is_gguf_path(spec: str | Path) -> bool:
    """Whether ``--model`` names a GGUF file (by its suffix or its magic)."""
    p = Path(spec)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    try:
        with p.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def split_files(path: Path) -> tuple[Path, ...]:
    """All files of the model ``path`` belongs to, in order (just ``path`` when it is
    not one of a split)."""
    m = SPLIT_RE.match(path.name)
    if m is None:
        return (path,)
    count = int(m["count"])
    files = tuple(path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise GGUFError(f"{path.name} is part {int(m['no'])} of {count} split files, but {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}")
    return files


def _reader(path: Path):  # noqa: ANN202 - a gguf.GGUFReader
    """gguf-py's reader, its slices taken from a plain ndarray view of its memory map: a
    vocabulary of 150k tokens is parsed element by element, and numpy's memmap subclass
    costs three quarters of that time (its result is the same)."""
    import numpy as np
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None or plain.base is not self.data:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            dt = np.dtype(dtype)
            arr = plain[offset : offset + dt.itemsize * int(count)].view(dtype=dt)[: int(count)]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader(path)


def _read_one(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path.name} is not a GGUF file (its first bytes are {magic!r}, not {GGUF_MAGIC!r})")
    try:
        reader = _reader(path)
    except Exception as exc:  # gguf raises ValueError, IndexError, KeyError, numpy errors
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if "not a valid GGMLQuantizationType" in reason:
            raise GGUFError(f"{path.name}: a tensor has an unknown ggml type ({reason})") from None
        raise GGUFError(f"{path.name} is truncated or corrupt: cannot parse its header ({reason})") from None
    try:
        metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
        infos = [
            TensorInfo(
                t.name, int(t.tensor_type), t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                path, int(t.data_offset), int(t.n_bytes),
            )
            for t in reader.tensors
        ]
    except Exception as exc:
        raise GGUFError(f"{path.name}: unreadable metadata ({' '.join(str(exc).split())})") from None
    finally:
        del reader  # unmaps the file
    _check_extents(path, size, infos)
    return metadata, infos


def _check_extents(path: Path, size: int, infos: list[TensorInfo]) -> None:
    """Every tensor's bytes (its type and shape's worth) lie inside the file and before
    the next tensor's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    ordered = sorted(infos, key=lambda t: t.offset)
    for i, t in enumerate(ordered):
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)]
        if not t.shape or t.shape[-1] % block:
            raise GGUFError(f"{path.name}: tensor {t.name} of type {t.type_name} has shape {list(t.shape)}, "
                            f"whose rows are not whole blocks of {block} values")
        need = math.prod(t.shape) // block * type_size
        end = t.offset + need
        if end > size:
            raise GGUFError(f"{path.name} is truncated: tensor {t.name} ({t.type_name} {list(t.shape)}, {need} bytes "
                            f"at offset {t.offset}) ends at byte {end}, past the end of the file ({size} bytes)")
        if i + 1 < len(ordered) and end > ordered[i + 1].offset:
            nxt = ordered[i + 1]
            raise GGUFError(f"{path.name}: tensor {t.name} ({t.type_name} {list(t.shape)}) needs {need} bytes, but "
                            f"tensor {nxt.name} starts {nxt.offset - t.offset} bytes after it: size and type/shape "
                            "disagree")


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse and check the GGUF model at ``path`` (any of its split files)."""
    p = Path(path)
    if not p.is_file():
        if p.exists():
            raise GGUFError(f"{p} is not a file")
        raise FileNotFoundError(f"GGUF file {p} does not exist")
    paths = split_files(p)
    metadata: dict[str, Any] = {}
    tensors: dict[str, TensorInfo] = {}
    for i, f in enumerate(paths):
        meta, infos = _read_one(f)
        if i == 0:
            metadata = meta
        for t in infos:
            if t.name in tensors:
                raise GGUFError(f"{f.name}: tensor {t.name} is also in {tensors[t.name].path.name}")
            tensors[t.name] = t
    if len(paths) > 1:
        count = metadata.get("split.count")
        if count is not None and int(count) != len(paths):
            raise GGUFError(f"{paths[0].name} says the model is {count} files, its name says {len(paths)}")
    return GGUFFile(paths, metadata, tensors)


def read_rows(info: TensorInfo, r0: int, r1: int) -> bytearray:
    """Bytes of rows ``[r0, r1)`` of ``info`` (a plain read: nothing stays mapped)."""
    rb = info.row_bytes
    buf = bytearray((r1 - r0) * rb)
    try:
        with info.path.open("rb", buffering=0) as f:
            f.seek(info.offset + r0 * rb)
            got = f.readinto(buf)
    except OSError as exc:
        raise GGUFError(f"cannot read tensor {info.name} from {info.path.name}: {exc.strerror or exc}") from None
    if got != len(buf):
        raise GGUFError(f"{info.path.name} is truncated: tensor {info.name} ends past the end of the file")
    return buf
