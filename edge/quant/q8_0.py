"""Int8 weight-only group quantization (W8A16, "q8_0").

Format. A linear projection ``X.weight`` ``[out, in]`` is stored as

* ``X.weight``       int8 ``[out, in]``, values in [-127, 127];
* ``X.weight_scale`` float32 (or float16) ``[out, in // group_size]``, one scale per
  group of ``group_size`` consecutive input columns of a row;

with the safetensors ``__metadata__`` ``{"quantization": "q8_0", "group_size": "128"}``.
Quantization is symmetric per group: ``scale = max|w| / 127`` over the group and
``q = round(w / scale)`` clamped to [-127, 127], so ``|w - q * scale| <= scale / 2``.
Embeddings, norms and biases stay float; ``lm_head`` is quantized unless it is tied
to the embedding (or kept float on request).

Two routes produce the same bits:

* route A, offline: ``tools/quantize.py SRC DST`` writes a quantized checkpoint that
  ``edge`` detects by its metadata;
* route B, at load time: ``Engine.from_pretrained(path, quantize="int8")`` quantizes
  a float checkpoint tensor by tensor (row chunk by row chunk) straight into the
  fused device buffers, never holding the float model.

Both use ``quantize_into`` with the scale computed in float32, so route A and route B
weights are bit-identical when route A keeps float32 scales (its default).

Group size: ``in_features`` must be a multiple of ``group_size``. There is no silent
fallback to a smaller group (one checkpoint has one ``group_size`` in its metadata);
the error names the tensor and the largest power-of-two group that would work.

Runtime. The engine's backend (:mod:`edge.runtime.backend`) picks one linear per weight
format (:mod:`edge.quant.linear`): on the CPU the torch reference ``int8_linear_reference``
(dequantize group-wise in float32, rounded once to the activation dtype, ``F.linear``),
on a GPU the int8 GEMV of :mod:`edge.kernels.int8_cuda`. The reference has no host
synchronisation and no data-dependent shapes, so it can be captured in a CUDA graph.
Weights larger than ``DEQUANT_CHUNK_ELEMENTS`` are dequantized and multiplied in row
chunks so the float temporary stays bounded.

Fusions. Decode at batch 1 is launch-bound once the GEMV is at bandwidth, so a linear
also takes the steps around a projection that the int8 decode GEMV folds into its own
launch: an RMSNorm of its input (``norm``), SwiGLU of a ``[gate; up]`` output
(``swiglu``) and an in-place residual add (``residual``). Their meaning is
``fused_linear_reference`` (the unfused ops, bit for bit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from edge.model.config import ModelConfig
from edge.kernels import reference
from edge.model.loader import (
    READ_CHUNK_BYTES,
    CheckpointError,
    checkpoint_files,
    expected_shapes,
    file_metadata,
    fused_layout,
    iter_tensor_rows,
)

from edge.quant.formats import (  # noqa: F401 - the format's names, re-exported
    DEFAULT_GROUP_SIZE,
    INT8_DEQUANT_CHUNK_ELEMENTS,
    LINEAR_SUFFIXES,
    LM_HEAD,
    QUANT_METHOD,
    QUANTIZE_ALIASES,
    SCALE_SUFFIX,
    QuantError,
    is_linear_weight,
    parse_quantize,
    q8_0_from_metadata,
    quantized_names,
)

log = logging.getLogger(__name__)

QMAX = 127
# Elements quantized at once (bounds the float32 temporary of route A and B).
QUANTIZE_CHUNK_ELEMENTS = 1 << 24
# Elements dequantized at once by the reference linear.
DEQUANT_CHUNK_ELEMENTS = INT8_DEQUANT_CHUNK_ELEMENTS


# -- quantization -------------------------------------------------------------------


def check_group_size(in_features: int, group_size: int, name: str = "tensor") -> None:
    if group_size < 1:
        raise QuantError(f"group_size must be positive, got {group_size}")
    if in_features % group_size:
        hint = in_features & -in_features  # largest power of two dividing in_features
        raise QuantError(
            f"{name}: in_features {in_features} is not a multiple of group_size {group_size}; "
            f"choose a group size that divides it (e.g. --group-size {min(hint, group_size)})"
        )


def quantize_into(
    w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, group_size: int, name: str = "tensor"
) -> None:
    """Quantize ``w`` ``[out, in]`` (any float dtype, any device) into ``q_out`` (int8
    ``[out, in]``) and ``scale_out`` (``[out, in // group_size]``, float32 or float16),
    row chunk by row chunk on ``q_out``'s device.

    The scale is ``max|w| / 127`` computed in float32 and rounded to ``scale_out``'s
    dtype; ``q`` is computed against that rounded scale so the error bound
    ``|w - q * scale| <= scale / 2`` holds for the stored scale.
    """
    if w.dim() != 2:
        raise QuantError(f"{name}: only 2-D weights are quantized, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    check_group_size(cols, group_size, name)
    groups = cols // group_size
    if tuple(q_out.shape) != (rows, cols) or q_out.dtype != torch.int8:
        raise QuantError(f"{name}: int8 destination {tuple(q_out.shape)} {q_out.dtype} does not match {(rows, cols)}")
    if tuple(scale_out.shape) != (rows, groups):
        raise QuantError(f"{name}: scale destination {tuple(scale_out.shape)} does not match {(rows, groups)}")
    device = q_out.device
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        wf = w[r0:r1].to(device=device, dtype=torch.float32).view(r1 - r0, groups, group_size)
        amax = wf.abs().amax(dim=-1)
        if not bool(torch.isfinite(amax).all()):
            raise QuantError(f"{name}: rows {r0}..{r1} hold NaN or infinite values")
        # A device tensor divisor: CUDA turns division by a Python scalar into a multiply
        # by its reciprocal, which rounds differently from the CPU (route A vs B bits).
        scale = (amax / torch.full_like(amax, QMAX)).to(scale_out.dtype)
        s = scale.float()
        s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero group: q = 0, scale 0
        q = torch.round(wf / s.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
        q_out[r0:r1].copy_(q.view(r1 - r0, cols))
        scale_out[r0:r1].copy_(scale)
        del wf, amax, scale, s, q


def quantize_tensor(
    w: torch.Tensor,
    group_size: int = DEFAULT_GROUP_SIZE,
    scale_dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    name: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[out, in]``, scale ``[out, in // group_size]``) of a float weight."""
    if w.dim() != 2:
        raise QuantError(f"{name}: only 2-D weights are quantized, got shape {tuple(w.shape)}")
    check_group_size(w.shape[1], group_size, name)
    dev = torch.device(device) if device is not None else w.device
    q = torch.empty(w.shape, dtype=torch.int8, device=dev)
    s = torch.empty(w.shape[0], w.shape[1] // group_size, dtype=scale_dtype, device=dev)
    quantize_into(w, q, s, group_size, name)
    return q, s


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` group-wise, computed in float32, returned as ``dtype``."""
    rows, cols = q.shape
    groups = scale.shape[-1]
    w = q.float().view(rows, groups, cols // groups) * scale.float().unsqueeze(-1)
    return w.view(rows, cols).to(dtype)


# -- the weight container and the linear -------------------------------------------


Norm = tuple[torch.Tensor, float]
"""An RMSNorm for a linear to apply to its input first: (weight ``[in]``, eps)."""


class Int8Weight:
    """A quantized linear weight: ``weight`` int8 ``[out, in]``, ``scale`` float32
    ``[out, in // group_size]``, ``group_size``. ``w(x)`` / ``w.linear(x, bias)``
    computes ``x @ dequant(w).T + bias`` in ``x``'s dtype through the backend's
    linear for the q8_0 format."""

    FORMAT = QUANT_METHOD

    __slots__ = ("weight", "scale", "group_size")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise QuantError(f"Int8Weight needs a 2-D int8 weight, got {weight.dtype} {tuple(weight.shape)}")
        check_group_size(weight.shape[1], group_size, "Int8Weight")
        want = (weight.shape[0], weight.shape[1] // group_size)
        if tuple(scale.shape) != want or not scale.is_floating_point():
            raise QuantError(f"Int8Weight scale must be float {want}, got {scale.dtype} {tuple(scale.shape)}")
        if scale.device != weight.device:
            raise QuantError(f"Int8Weight weight on {weight.device} but scale on {scale.device}")
        self.weight = weight
        self.scale = scale
        self.group_size = group_size

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight, self.scale

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.scale, dtype)

    def to(self, device: torch.device | str) -> "Int8Weight":
        return Int8Weight(self.weight.to(device), self.scale.to(device), self.group_size)

    def __repr__(self) -> str:
        return (
            f"Int8Weight(shape={tuple(self.weight.shape)}, group_size={self.group_size}, "
            f"scale_dtype={self.scale.dtype}, device={self.device})"
        )


Weight = torch.Tensor | Int8Weight

def int8_linear_reference(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference W8A16 linear (CPU path, prefill path, and kernel oracle).

    Dequantizes in float32, casts to ``x.dtype``, multiplies in ``x.dtype``. No host
    sync, shapes depend only on the weight: safe to capture in a CUDA graph.
    """
    rows, cols = w.weight.shape
    groups = w.scale.shape[1]
    scale = w.scale.float().unsqueeze(-1)
    step = min(rows, max(1, DEQUANT_CHUNK_ELEMENTS // cols))
    # One pass per chunk: int8 x float32 scale computed in float32 and rounded once
    # into x's dtype on store (3 bytes of traffic per weight instead of ~19 for a
    # float() / mul / to() chain) - the same values, bit for bit.
    deq = torch.empty(step, cols, dtype=x.dtype, device=x.device)
    outs = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        chunk = deq[: r1 - r0]
        torch.mul(w.weight[r0:r1].view(r1 - r0, groups, cols // groups), scale[r0:r1], out=chunk.view(r1 - r0, groups, -1))
        outs.append(F.linear(x, chunk, None if bias is None else bias[r0:r1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def fused_linear_reference(
    x: torch.Tensor,
    w: Weight,
    bias: torch.Tensor | None = None,
    *,
    norm: Norm | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    ops: Any = reference,
    matmul: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """What a linear with ``norm`` / ``residual`` / ``swiglu`` means, as the
    unfused sequence of ``ops`` calls and a plain linear (the kernel oracle, and the
    path of every call a fusing kernel does not take, such as prefill chunks).
    ``ops`` has ``rms_norm`` and ``silu_mul`` (the reference module or a backend's
    layer ops); ``matmul(h, w, bias)`` is the plain linear of a quantized weight
    (default: the int8 torch reference)."""
    h = x if norm is None else ops.rms_norm(x, norm[0], norm[1])
    if isinstance(w, torch.Tensor):
        y = F.linear(h, w, bias)
    else:
        y = (matmul or int8_linear_reference)(h, w, bias)
    if swiglu:
        y = ops.silu_mul(y)
    if residual is None:
        return y
    if residual.shape != y.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match the output {tuple(y.shape)}")
    return residual.add_(y)


def weight_tensors(w: Weight) -> tuple[torch.Tensor, ...]:
    """The tensors that hold ``w`` (for byte counts)."""
    return (w,) if isinstance(w, torch.Tensor) else w.tensors()


# -- which tensors, and checkpoint metadata ----------------------------------------


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def file_metadata_for(method: str, group_size: int) -> dict[str, str]:
    return {"quantization": method, "group_size": str(group_size)}


def checkpoint_quantization(model_dir: str | Path) -> tuple[str, int] | None:
    """(method, group_size) from a checkpoint's ``__metadata__``, None for a float one."""
    return q8_0_from_metadata(file_metadata(model_dir), str(model_dir))


# -- loading (route A: pre-quantized checkpoint; route B: quantize while loading) ---


def load_quantized_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    quantize: str | None = None,
    group_size: int | None = None,
    keep_lm_head_float: bool = False,
    chunk_bytes: int = READ_CHUNK_BYTES,
    tensor_names: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor | Int8Weight]:
    """Load a checkpoint into fused device weights with int8 projections.
    ``tensor_names`` maps edge's tensor names to the checkpoint's where they differ (a
    vision-language model's decoder, edge/model/vision/loader.py).

    A checkpoint whose metadata says q8_0 is loaded as it is (route A; ``quantize`` and
    ``group_size`` must agree with it or be None). A float checkpoint is quantized while
    loading when ``quantize`` is "int8" (route B): each source tensor is copied to the
    device in row chunks, quantized there and written into its rows of the fused
    destination (q/k/v and gate/up scales stack like their rows, groups being along
    the input dimension). Float tensors are cast to ``dtype``; scales are kept float32.
    Tensors are read in row chunks of at most ``chunk_bytes`` (edge/model/loader.py).
    """
    method = parse_quantize(quantize)
    stored = checkpoint_quantization(model_dir)
    shapes = expected_shapes(cfg)
    layout = fused_layout(shapes)
    if stored is not None:
        g = stored[1]
        if group_size is not None and group_size != g:
            raise QuantError(f"{model_dir} is already quantized with group_size {g}, not {group_size}")
        files = checkpoint_files(model_dir)
        qnames = {n for n in shapes if scale_name(n) in files}
        stray = sorted(n for n in qnames if not is_linear_weight(n))
        if stray:
            raise CheckpointError(f"{model_dir}: {stray[0]} has a scale but is not a linear projection")
    elif method is not None:
        g = group_size or DEFAULT_GROUP_SIZE
        qnames = set(quantized_names(shapes, cfg.tie_word_embeddings, keep_lm_head_float))
    else:
        raise QuantError(f"{model_dir} is a float checkpoint and no quantization was asked for")
    for n in sorted(qnames):
        check_group_size(shapes[n][1], g, n)

    # Fused destinations: all parts quantized or none.
    dest_shapes: dict[str, list[int]] = {}
    dest_quant: dict[str, bool] = {}
    for name, (dest, row) in layout.items():
        shape = shapes[name]
        current = dest_shapes.setdefault(dest, [0, *shape[1:]])
        current[0] = max(current[0], row + shape[0])
        q = name in qnames
        if dest_quant.setdefault(dest, q) != q:
            raise CheckpointError(f"{model_dir}: {dest} mixes int8 and float parts ({name} is {'int8' if q else 'float'})")
    out: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for d, s in dest_shapes.items():
        if dest_quant[d]:
            out[d] = torch.empty(s, device=device, dtype=torch.int8)
            scales[d] = torch.empty(s[0], s[1] // g, device=device, dtype=torch.float32)
        else:
            out[d] = torch.empty(s, device=device, dtype=dtype)

    names = list(shapes)
    if stored is not None:
        names += [scale_name(n) for n in sorted(qnames)]
    rename = dict(tensor_names or {})
    back = {c: n for n, c in rename.items()}
    for piece in iter_tensor_rows(model_dir, [rename.get(n, n) for n in names], chunk_bytes):
        name, shape, r0, host = back.get(piece.name, piece.name), piece.shape, piece.row, piece.data
        del piece  # the chunk goes with ``host``, before the next one is read
        if name.endswith(SCALE_SUFFIX) and name not in shapes:
            base = name[: -len(SCALE_SUFFIX)]
            rows, cols = shapes[base]
            want = (rows, cols // g)
            flat = shape == (rows * cols // g,)  # some writers store scales flat
            if not (flat or shape == want) or not host.is_floating_point():
                raise CheckpointError(
                    f"scale {name} is {host.dtype} {shape}, expected float {want} (group_size {g})"
                )
            dest, row = layout[base]
            target = scales[dest][row : row + rows]
            (target.view(-1) if flat else target)[r0 : r0 + host.shape[0]].copy_(host)
            del host
            continue
        if shape != shapes[name]:
            raise CheckpointError(f"tensor {name} has shape {shape}, config.json implies {shapes[name]}")
        dest, row = layout[name]
        rows = host.shape[0]
        at = slice(row + r0, row + r0 + rows)
        if name in qnames and stored is not None:
            if host.dtype != torch.int8:
                raise CheckpointError(f"tensor {name} has a scale but dtype {host.dtype}, expected int8")
            out[dest][at].copy_(host)
        elif name in qnames:
            if not host.is_floating_point():
                raise CheckpointError(f"tensor {name} is {host.dtype}; route B quantizes float checkpoints only")
            quantize_into(host, out[dest][at], scales[dest][at], g, name)
        else:
            if not host.is_floating_point():
                raise CheckpointError(f"tensor {name} is {host.dtype} without a {SCALE_SUFFIX} tensor; expected float")
            out[dest][at].copy_(host)
        del host
    weights: dict[str, torch.Tensor | Int8Weight] = {}
    for d, t in out.items():
        weights[d] = Int8Weight(t, scales[d], g) if dest_quant[d] else t
    return weights


# -- route A: quantize a checkpoint directory offline -------------------------------


def copy_checkpoint_extras(src: Path, dst: Path) -> None:
    """Every file of ``src`` but config.json, the index and the weights (tokenizer,
    generation config, ...) into ``dst``: what a quantized copy keeps as it is."""
    import shutil

    from edge.model.loader import INDEX_FILE

    for p in sorted(src.iterdir()):
        if p.is_file() and p.name not in ("config.json", INDEX_FILE) and p.suffix != ".safetensors":
            shutil.copy2(p, dst / p.name)


SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    group_size: int = DEFAULT_GROUP_SIZE,
    keep_lm_head_float: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> dict:
    """Write a q8_0 copy of the float checkpoint ``src`` into ``dst`` (route A).

    Every layer projection (and an untied ``lm_head`` unless ``keep_lm_head_float``)
    becomes ``X.weight`` int8 + ``X.weight_scale``; everything else is copied as is.
    Shards keep their source file names (one shard in memory at a time) and each
    carries the ``__metadata__`` ``{"quantization": "q8_0", "group_size": ...}``.
    config.json gains a ``quantization_config`` entry; every other file (tokenizer,
    generation config, ...) is copied. Returns a summary (tensors, bytes in and out).
    ``progress``: a bar on stderr counting the bytes read.
    """
    import json

    from safetensors import safe_open

    from edge.model.loader import INDEX_FILE
    from edge.model.writing import progress_bar, save_safetensors, tensor_data_bytes

    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"model directory {src} does not exist")
    if dst.resolve() == src.resolve():
        raise QuantError("the destination must differ from the source directory")
    if scale_dtype not in SCALE_DTYPES.values():
        raise QuantError(f"scale dtype must be float32 or float16, got {scale_dtype}")
    cfg = ModelConfig.from_pretrained(src)
    if checkpoint_quantization(src) is not None:
        raise QuantError(f"{src} is already quantized (its __metadata__ says q8_0)")
    files = checkpoint_files(src)
    qset = set(quantized_names(files, cfg.tie_word_embeddings, keep_lm_head_float))
    if not qset:
        raise QuantError(f"{src} holds no linear projection weights to quantize")
    shard_names: dict[Path, list[str]] = {}
    for name, path in files.items():
        shard_names.setdefault(path, []).append(name)
    # Fail before writing anything: every quantized tensor must be 2-D float with
    # in_features a multiple of group_size.
    for path, names in sorted(shard_names.items()):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                if name in qset:
                    shape = f.get_slice(name).get_shape()
                    if len(shape) != 2:
                        raise QuantError(f"{name}: expected a 2-D weight, got shape {tuple(shape)}")
                    check_group_size(shape[1], group_size, name)

    dst.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **file_metadata_for(QUANT_METHOD, group_size)}
    weight_map: dict[str, str] = {}
    bytes_in = bytes_out = 0
    total = sum(tensor_data_bytes(path) for path in shard_names)
    with progress_bar(total, f"q8_0: quantizing {src.name}", progress) as bar:
        for path, names in sorted(shard_names.items()):
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in sorted(names):
                    t = f.get_tensor(name)
                    bytes_in += t.numel() * t.element_size()
                    bar.update(t.numel() * t.element_size())
                    if name in qset:
                        if not t.is_floating_point():
                            raise QuantError(f"{name} is {t.dtype}; only float weights are quantized")
                        q, s = quantize_tensor(t, group_size, scale_dtype, device="cpu", name=name)
                        tensors[name], tensors[scale_name(name)] = q, s
                        del t
                    else:
                        tensors[name] = t.contiguous()
            for name, t in tensors.items():
                bytes_out += t.numel() * t.element_size()
                weight_map[name] = path.name
            save_safetensors(tensors, dst / path.name, metadata)
            del tensors
    if (src / INDEX_FILE).is_file():
        index = {
            "metadata": {"total_size": bytes_out, **file_metadata_for(QUANT_METHOD, group_size)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "bits": 8,
        "group_size": group_size,
        "symmetric": True,
        "scale_dtype": str(scale_dtype).removeprefix("torch."),
        "lm_head": LM_HEAD in qset,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_checkpoint_extras(src, dst)
    summary = {
        "src": str(src),
        "dst": str(dst),
        "group_size": group_size,
        "quantized_tensors": len(qset),
        "shards": len(shard_names),
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
    }
    log.info("quantized %d tensors of %s: %d -> %d bytes", len(qset), src, bytes_in, bytes_out)
    return summary
