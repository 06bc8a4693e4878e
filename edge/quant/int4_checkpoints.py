"""Int4 checkpoints as published -> :class:`edge.quant.int4.Int4Weight` (repacked once at load).

The format comes from ``config.json``'s ``quantization_config.quant_method`` (or the
legacy ``quant_config.json`` of AutoAWQ / ``quantize_config.json`` of AutoGPTQ), never
from the directory name:

* ``awq`` (AutoAWQ GEMM): ``qweight`` int32 ``[in, out/8]``, nibble i of a word holds
  output column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``qzeros`` int32 ``[in/G, out/8]``
  packed the same way; ``scales`` ``[in/G, out]``; ``W = (q - z) s``.
* ``gptq``: ``qweight`` int32 ``[in/8, out]``, nibble k = input row ``8r + k``; ``qzeros``
  ``[in/G, out/8]`` in plain nibble order, holding ``z - 1`` (``checkpoint_format``
  ``gptq``, v1) or ``z`` (``gptq_v2``); ``scales`` ``[in/G, out]``; ``g_idx`` ``[in]``,
  non-monotonic with ``desc_act``.
* ``compressed-tensors`` ``pack-quantized``: ``weight_packed`` int32 ``[out, in/8]``
  (value i at bits 4i, stored as q + 8), ``weight_scale`` ``[out, in/G]``, optional
  ``weight_zero_point`` (packed int32 ``[out/8, in/G]`` along the rows, or int8
  ``[out, in/G]`` from older writers), optional ``weight_g_idx``.

A linear is quantized when its packed tensor is in the checkpoint; the others (an
``ignore``d lm_head, say) are float. Each fused destination (q/k/v, gate/up) is read part
by part into uint8 codes on the target device and packed once, so the loader holds at
most one destination's codes beside the final weights.

The lm_head and the embedding table count in the memory budget: by default an int4
model keeps them as int8 groups (q8_0, :class:`edge.quant.q8_0.Int8Weight` /
:class:`edge.quant.embedding.Int8Embedding`), quantized at load from the float tensors;
``lm_head`` / ``embedding`` = ``"float"`` keeps them as they are, ``lm_head="int4"``
packs the lm_head as int4 too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from edge.model.config import ModelConfig
from edge.model.files import read_json_object
from edge.quant.int4 import DEFAULT_GROUP_SIZE, SYMMETRIC_ZERO, Int4Codes, Int4Weight, pack_weight, quantize_rtn
from edge.model.loader import (
    CheckpointError,
    checkpoint_files,
    expected_shapes,
    fused_layout,
    iter_tensor_rows,
    tensor_shape,
)
from edge.quant.formats import (  # noqa: F401 - the int4 formats' names, re-exported
    EMBED,
    EMBED_CHOICES,
    FORMATS,
    HEAD_CHOICES,
    INT4_ALIASES,
    INT8_GROUP_SIZE,
    LEGACY_AWQ_FILE,
    LEGACY_GPTQ_FILE,
    Int4Format,
    detect_format,
    parse_int4,
)
from edge.quant.q8_0 import LM_HEAD, Int8Weight, QuantError, is_linear_weight, quantize_into, quantize_tensor
from edge.quant.embedding import Int8Embedding

log = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
# Float tensors quantized while loading are read and quantized this many bytes of rows at a
# time: neither a whole host copy nor whole-tensor float32 temporaries on the device.
STREAM_CHUNK_BYTES = 16 << 20
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


# -- reading tensors -----------------------------------------------------------------


class TensorReader:
    """Tensors of a checkpoint by name, each read in row chunks through short-lived file
    mappings (:func:`edge.model.loader.iter_tensor_rows`): no shard stays mapped."""

    def __init__(self, model_dir: str | Path, checkpoint_name: Callable[[str], str] | None = None) -> None:
        self.model_dir = model_dir
        self.files = checkpoint_files(model_dir)
        self.checkpoint_name = checkpoint_name or (lambda name: name)

    def __contains__(self, name: str) -> bool:
        return self.checkpoint_name(name) in self.files

    def _stored(self, name: str) -> str:
        """The checkpoint's name of tensor ``name``; CheckpointError when it lacks it."""
        name = self.checkpoint_name(name)
        if name not in self.files:
            raise CheckpointError(f"checkpoint lacks tensor {name}")
        return name

    def rows(self, name: str, chunk_bytes: int = STREAM_CHUNK_BYTES) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, host rows) chunks of ``name``, each at most ``chunk_bytes``."""
        for chunk in iter_tensor_rows(self.model_dir, [self._stored(name)], chunk_bytes):
            yield chunk.row, chunk.data

    def shape(self, name: str) -> tuple[int, ...]:
        name = self._stored(name)
        return tensor_shape(self.files[name], name)

    def get(self, name: str) -> torch.Tensor:
        name = self._stored(name)
        out: torch.Tensor | None = None
        for chunk in iter_tensor_rows(self.model_dir, [name]):
            if out is None:
                if chunk.data.shape == chunk.shape:
                    return chunk.data
                out = torch.empty(chunk.shape, dtype=chunk.data.dtype)
            out[chunk.row : chunk.row + chunk.data.shape[0]].copy_(chunk.data)
        assert out is not None
        return out


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """The 8 nibbles of int32 ``words`` (bits 4i = nibble i) as a new axis after ``dim``
    merged into it: ``[.., n, ..] -> [.., 8 n, ..]`` (int32, 0..15)."""
    w = words.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * w.dim()
    shape[dim + 1] = 8
    nib = (w >> _SHIFTS.to(w.device).view(shape)) & 15
    out_shape = list(words.shape)
    out_shape[dim] *= 8
    return nib.reshape(out_shape)


def _need(t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], name: str) -> torch.Tensor:
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise CheckpointError(f"tensor {name} is {t.dtype} {tuple(t.shape)}, expected {want} {shape}")
    return t


def _groups(fmt: Int4Format, in_features: int, name: str) -> int:
    g = in_features if fmt.group_size < 0 else fmt.group_size
    if g < 1 or in_features % g:
        raise CheckpointError(f"{name}: in_features {in_features} is not a multiple of group_size {g}")
    return g


_INT = (torch.int32,)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def read_awq(r: TensorReader, base: str, shape: tuple[int, int], fmt: Int4Format, device: torch.device) -> Int4Codes:
    out, inp = shape
    g = _groups(fmt, inp, base)
    qw = _need(r.get(base + ".qweight"), (inp, out // 8), _INT, base + ".qweight").to(device)
    order = torch.tensor(AWQ_ORDER).argsort().to(device)  # column m sits in nibble order^-1[m]

    def unpack(words: torch.Tensor) -> torch.Tensor:
        n = _nibbles(words, 1).view(words.shape[0], -1, 8)
        return n[..., order].reshape(words.shape[0], -1)

    q = unpack(qw).t().to(torch.uint8).contiguous()
    del qw
    scales = _need(r.get(base + ".scales"), (inp // g, out), _FLOAT, base + ".scales").to(device).t()
    zero = None
    if fmt.zero_point:
        qz = _need(r.get(base + ".qzeros"), (inp // g, out // 8), _INT, base + ".qzeros").to(device)
        zero = unpack(qz).t().to(torch.uint8).contiguous()
    return Int4Codes(q, scales.contiguous(), zero, g)


def read_gptq(r: TensorReader, base: str, shape: tuple[int, int], fmt: Int4Format, device: torch.device) -> Int4Codes:
    out, inp = shape
    g = _groups(fmt, inp, base)
    qw = _need(r.get(base + ".qweight"), (inp // 8, out), _INT, base + ".qweight").to(device)
    q = _nibbles(qw, 0).t().to(torch.uint8).contiguous()
    del qw
    scales = _need(r.get(base + ".scales"), (inp // g, out), _FLOAT, base + ".scales").to(device).t().contiguous()
    qz = _need(r.get(base + ".qzeros"), (inp // g, -(-out // 8)), _INT, base + ".qzeros").to(device)
    z = _nibbles(qz, 1)[:, :out] + (0 if fmt.gptq_v2 else 1)  # v1 stores z - 1
    zero = z.t().to(torch.uint8).contiguous()
    if not fmt.zero_point and bool((zero == SYMMETRIC_ZERO).all()):
        zero = None
    g_idx = None
    if base + ".g_idx" in r:
        g_idx = _need(r.get(base + ".g_idx"), (inp,), (torch.int32, torch.int64), base + ".g_idx")
    return Int4Codes(q, scales, zero, g, g_idx)


def read_compressed(
    r: TensorReader, base: str, shape: tuple[int, int], fmt: Int4Format, device: torch.device
) -> Int4Codes:
    out, inp = shape
    g = _groups(fmt, inp, base)
    if base + ".weight_shape" in r:
        ws = tuple(int(v) for v in r.get(base + ".weight_shape").flatten().tolist())
        if ws != (out, inp):
            raise CheckpointError(f"{base}.weight_shape is {ws}, config.json implies {(out, inp)}")
    wp = _need(r.get(base + ".weight_packed"), (out, inp // 8), _INT, base + ".weight_packed").to(device)
    q = _nibbles(wp, 1).to(torch.uint8)
    del wp
    scales = _need(r.get(base + ".weight_scale"), (out, inp // g), _FLOAT, base + ".weight_scale").to(device)
    zero = None
    if base + ".weight_zero_point" in r:
        zp = r.get(base + ".weight_zero_point").to(device)
        if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-out // 8), inp // g):
            zero = _nibbles(zp, 0)[:out].to(torch.uint8)  # packed along the rows, stored as z + 8
        elif zp.dtype == torch.int8 and tuple(zp.shape) == (out, inp // g):
            zero = (zp.to(torch.int32) + SYMMETRIC_ZERO).to(torch.uint8)
        else:
            raise CheckpointError(
                f"tensor {base}.weight_zero_point is {zp.dtype} {tuple(zp.shape)}, expected int32 "
                f"{(-(-out // 8), inp // g)} (packed) or int8 {(out, inp // g)}"
            )
        if fmt.zero_point is False and bool((zero == SYMMETRIC_ZERO).all()):
            zero = None
    g_idx = None
    if base + ".weight_g_idx" in r:
        g_idx = _need(r.get(base + ".weight_g_idx"), (inp,), (torch.int32, torch.int64), base + ".weight_g_idx")
    return Int4Codes(q.contiguous(), scales.contiguous(), zero, g, g_idx)


# Per format: (reader, the tensor whose presence marks a linear as quantized).
READERS: dict[str, tuple[Callable[..., Int4Codes], str]] = {
    "awq": (read_awq, ".qweight"),
    "gptq": (read_gptq, ".qweight"),
    "compressed-tensors": (read_compressed, ".weight_packed"),
}


# -- loading -------------------------------------------------------------------------


def parse_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    v = str(value).lower()
    if v not in choices:
        raise QuantError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    return v


def load_int4_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    fmt: Int4Format,
    lm_head: str = "int8",
    embedding: str = "int8",
    checkpoint_name: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """Fused device weights of an int4 checkpoint (``fmt`` from :func:`detect_format`),
    or of a float checkpoint quantized while loading (``fmt.method == "rtn"``: RTN
    int4 codes computed on ``device``, scales float16). Float tensors are cast to
    ``dtype``; ``lm_head`` / ``embedding`` as described in the module docstring.
    ``checkpoint_name``: edge's tensor name -> the checkpoint's (a vision-language
    model's decoder)."""
    lm_head = parse_choice(lm_head, HEAD_CHOICES, "lm_head")
    embedding = parse_choice(embedding, EMBED_CHOICES, "embedding")
    reader = TensorReader(model_dir, checkpoint_name)
    shapes = expected_shapes(cfg)
    layout = fused_layout(shapes)
    parts: dict[str, list[str]] = {}
    for name, (dest, row) in layout.items():
        parts.setdefault(dest, []).append(name)
    for names in parts.values():
        names.sort(key=lambda n: layout[n][1])

    rtn = fmt.method == "rtn"
    read, marker = (None, "") if rtn else READERS[fmt.method]

    def quantized(name: str) -> bool:
        if not is_linear_weight(name) or name == LM_HEAD:
            return False
        if rtn:
            return True
        return name.removesuffix(".weight") + marker in reader

    def codes(name: str) -> Int4Codes:
        base = name.removesuffix(".weight")
        if rtn:
            g = shapes[name][1] if fmt.group_size < 0 else fmt.group_size
            return _rtn_streamed(reader, name, shapes[name], device, g)
        return read(reader, base, shapes[name], fmt, device)

    weights: dict[str, Any] = {}
    for dest, names in parts.items():
        kinds = {quantized(n) for n in names}
        if len(kinds) != 1:
            raise CheckpointError(f"{model_dir}: {dest} mixes int4 and float parts")
        if kinds.pop():
            try:
                weights[dest] = pack_weight([codes(n) for n in names], device, dest)
            except QuantError as exc:
                raise CheckpointError(f"{model_dir}: {exc}") from exc
        elif dest == LM_HEAD and lm_head != "float":
            weights[dest] = _quantized_head(reader, shapes[dest], device, lm_head)
        elif dest == EMBED and embedding == "int8":
            weights[dest] = Int8Embedding(_int8_streamed(reader, dest, shapes[dest], device), dtype)
        else:
            out = torch.empty(sum(shapes[n][0] for n in names), *shapes[names[0]][1:], device=device, dtype=dtype)
            for n in names:
                row = layout[n][1]
                for r0, rows in _float_rows(reader, n, shapes[n]):
                    out[row + r0 : row + r0 + rows.shape[0]].copy_(rows)
            weights[dest] = out
    return weights


def quantize_fused_weights(
    weights: dict[str, Any],
    cfg: ModelConfig,
    dtype: torch.dtype,
    group_size: int = DEFAULT_GROUP_SIZE,
    lm_head: str = "int8",
    embedding: str = "int8",
) -> None:
    """Quantize fused float device weights in place, one tensor at a time, as loading a
    float checkpoint with ``quantize="int4"`` does (RTN is row by row, so fused or
    part by part gives the same codes): every projection int4, the lm_head and the
    embedding as ``lm_head`` / ``embedding`` say."""
    lm_head = parse_choice(lm_head, HEAD_CHOICES, "lm_head")
    embedding = parse_choice(embedding, EMBED_CHOICES, "embedding")
    for name in list(weights):
        w = weights[name]
        if name.endswith("_proj.weight"):
            weights[name] = pack_weight([quantize_rtn(w, group_size, torch.float16, name)], w.device, name)
        elif name == LM_HEAD and lm_head == "int8":
            weights[name] = _int8(w, name)
        elif name == LM_HEAD and lm_head == "int4":
            weights[name] = pack_weight([quantize_rtn(w, DEFAULT_GROUP_SIZE, torch.float16, name)], w.device, name)
        elif name == EMBED and embedding == "int8":
            weights[name] = Int8Embedding(_int8(w, name), dtype)
        del w


def _float_rows(reader: TensorReader, name: str, shape: tuple[int, ...]) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, host rows) of a float tensor, chunk by chunk: the whole tensor is never
    on the host; each chunk goes straight to where the caller puts it."""
    if name.removesuffix(".weight") + ".qweight" in reader or name + "_packed" in reader:
        raise CheckpointError(f"tensor {name} is quantized in this checkpoint; expected it float")
    got = reader.shape(name)
    if tuple(got) != shape:
        raise CheckpointError(f"tensor {name} has shape {tuple(got)}, config.json implies {shape}")
    for r0, t in reader.rows(name):
        if not t.is_floating_point():
            raise CheckpointError(f"tensor {name} is {t.dtype}; expected a float tensor")
        yield r0, t


def _rtn_streamed(
    reader: TensorReader, name: str, shape: tuple[int, ...], device: torch.device, group_size: int
) -> Int4Codes:
    """RTN int4 codes of a float tensor quantized chunk by chunk (RTN is row-wise)."""
    rows, cols = shape
    if group_size < 1 or cols % group_size:
        raise QuantError(f"{name}: in_features {cols} is not a multiple of group_size {group_size}")
    q = torch.empty(rows, cols, dtype=torch.uint8, device=device)
    scale = torch.empty(rows, cols // group_size, dtype=torch.float16, device=device)
    zero = torch.empty(rows, cols // group_size, dtype=torch.uint8, device=device)
    for r0, w in _float_rows(reader, name, shape):
        c = quantize_rtn(w.to(device), group_size, torch.float16, name)
        r1 = r0 + w.shape[0]
        q[r0:r1], scale[r0:r1], zero[r0:r1] = c.q, c.scale, c.zero
    return Int4Codes(q, scale, zero, group_size)


def _int8_streamed(reader: TensorReader, name: str, shape: tuple[int, ...], device: torch.device) -> Int8Weight:
    """q8_0 groups of a float tensor quantized chunk by chunk (quantize_into moves each
    chunk to the device)."""
    rows, cols = shape
    g = _int8_group(cols)
    q = torch.empty(rows, cols, dtype=torch.int8, device=device)
    s = torch.empty(rows, cols // g, dtype=torch.float32, device=device)
    for r0, w in _float_rows(reader, name, shape):
        quantize_into(w, q[r0 : r0 + w.shape[0]], s[r0 : r0 + w.shape[0]], g, name)
    return Int8Weight(q, s, g)


def _int8_group(cols: int) -> int:
    """q8_0 groups of 128 columns, or one group a row where 128 does not divide it."""
    return INT8_GROUP_SIZE if cols % INT8_GROUP_SIZE == 0 else cols


def _int8(w: torch.Tensor, name: str) -> Int8Weight:
    g = _int8_group(w.shape[1])
    q, s = quantize_tensor(w, g, torch.float32, device=w.device, name=name)
    return Int8Weight(q, s, g)


def _quantized_head(reader: TensorReader, shape: tuple[int, ...], device: torch.device, kind: str) -> Any:
    if kind == "int8":
        return _int8_streamed(reader, LM_HEAD, shape, device)
    return pack_weight([_rtn_streamed(reader, LM_HEAD, shape, device, DEFAULT_GROUP_SIZE)], device, LM_HEAD)


def describe_weights(weights: dict[str, Any], fmt: Int4Format) -> dict[str, str]:
    """What ``engine.info()`` reports: the projections' format and how the lm_head and
    the embedding are held."""

    def kind(w: Any) -> str:
        if isinstance(w, Int4Weight):
            return f"int4 g{w.group_size}"
        if isinstance(w, Int8Weight):
            return f"int8 g{w.group_size}"
        if isinstance(w, Int8Embedding):
            return f"int8 rows g{w.table.group_size}"
        return str(w.dtype).removeprefix("torch.")

    head = weights.get(LM_HEAD)
    return {
        "projections": fmt.describe(),
        "lm_head": kind(head) if head is not None else "tied to the embedding",
        "embedding": kind(weights[EMBED]),
    }
