"""Weight formats as a checkpoint directory declares them, without torch.

What a checkpoint holds (float, edge's q8_0, an int4 AWQ / GPTQ / compressed-tensors
layout) and which tensors the quantizers touch are read from ``config.json``, the legacy
quantization files and the safetensors headers alone: the fit check
(edge/runtime/memory_plan.py) needs them before torch is imported, and the loaders
(edge/quant/q8_0.py, edge/quant/int4_checkpoints.py) take them from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.model.validate import CheckpointError

# -- q8_0 (edge's int8) ------------------------------------------------------------------

QUANT_METHOD = "q8_0"
QUANTIZE_ALIASES = {"int8": QUANT_METHOD, "q8_0": QUANT_METHOD, "w8a16": QUANT_METHOD}
INT4_ALIASES = ("int4", "w4a16")
DEFAULT_GROUP_SIZE = 128
SCALE_SUFFIX = "_scale"  # X.weight -> X.weight_scale
# Elements the reference linears expand at once: q8_0 (128 MiB in bf16: prefill GEMMs stay
# efficient, one per ~64M weights, and Orin keeps its memory) and int4.
INT8_DEQUANT_CHUNK_ELEMENTS = 1 << 26
INT4_DEQUANT_CHUNK_ELEMENTS = 1 << 24
INT4_BLOCK_ROWS = 16  # int4 rows are padded to whole row blocks (edge/quant/int4.py)

LINEAR_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


class QuantError(ValueError):
    """A tensor or option that cannot be quantized; the message names it."""


def is_linear_weight(name: str) -> bool:
    """A projection weight that int8 quantization applies to (lm_head included)."""
    if name == LM_HEAD:
        return True
    return name.startswith("model.layers.") and name.endswith(LINEAR_SUFFIXES)


def quantized_names(names: Any, tie_word_embeddings: bool, keep_lm_head_float: bool = False) -> list[str]:
    """The names among ``names`` that both routes quantize: every layer projection, and
    ``lm_head.weight`` unless it is tied to the embedding or kept float."""
    out = []
    for n in names:
        if not is_linear_weight(n):
            continue
        if n == LM_HEAD and (tie_word_embeddings or keep_lm_head_float):
            continue
        out.append(n)
    return out


def parse_quantize(value: str | None) -> str | None:
    """``"int8"`` / ``"q8_0"`` / ``"w8a16"`` -> ``"q8_0"``; None / ``"none"`` -> None."""
    if value is None or str(value).lower() in ("", "none", "no", "false"):
        return None
    try:
        return QUANTIZE_ALIASES[str(value).lower()]
    except KeyError:
        raise QuantError(f"unsupported quantization {value!r}; supported: int8 (q8_0 group-wise W8A16), int4 (W4A16)") from None


def parse_int4(value: str | None) -> bool:
    """Whether a ``--quantize`` value asks for int4 (RTN while loading)."""
    return value is not None and str(value).lower() in INT4_ALIASES


def q8_0_from_metadata(meta: dict[str, str], where: str) -> tuple[str, int] | None:
    """(method, group_size) from a checkpoint's safetensors ``__metadata__``, None for a float one."""
    method = meta.get("quantization")
    if method is None:
        return None
    if method != QUANT_METHOD:
        raise CheckpointError(f"{where}: unsupported quantization {method!r} in __metadata__ (supported: q8_0)")
    try:
        group_size = int(meta["group_size"])
    except (KeyError, ValueError):
        raise CheckpointError(
            f"{where}: __metadata__ quantization q8_0 needs an integer group_size, got {meta.get('group_size')!r}"
        ) from None
    if group_size < 1:
        raise CheckpointError(f"{where}: group_size {group_size} in __metadata__ must be positive")
    return method, group_size


# -- int4 checkpoints ----------------------------------------------------------------------

FORMATS = ("awq", "gptq", "compressed-tensors")
LEGACY_AWQ_FILE = "quant_config.json"
LEGACY_GPTQ_FILE = "quantize_config.json"
# How an int4 model may hold its lm_head and embedding ("auto": as published, int8 where
# only that fits: edge/runtime/memory_plan.py decides).
HEAD_CHOICES = ("int8", "int4", "float")
EMBED_CHOICES = ("int8", "float")
INT8_GROUP_SIZE = 128


@dataclass(frozen=True)
class Int4Format:
    """How a checkpoint stores its int4 linears (or ``rtn``: a float checkpoint that the
    loader quantizes itself)."""

    method: str  # "awq" | "gptq" | "compressed-tensors" | "rtn"
    group_size: int  # -1: one group per row (per-channel)
    zero_point: bool = True
    gptq_v2: bool = False
    desc_act: bool = False

    def describe(self) -> str:
        g = "channel" if self.group_size < 0 else f"g{self.group_size}"
        extra = " desc_act" if self.desc_act else ""
        return f"{self.method} int4 {g}{'' if self.zero_point else ' symmetric'}{extra}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def _bits(cfg: dict[str, Any], key: str, where: str) -> None:
    bits = cfg.get(key, 4)
    if int(bits) != 4:
        raise CheckpointError(f"{where}: {bits}-bit weights are not supported (int4 only)")


def detect_format(model_dir: str | Path) -> Int4Format | None:
    """The checkpoint's int4 format, None for a float (or q8_0) checkpoint; a clear
    CheckpointError for a quantization this engine does not load."""
    root = Path(model_dir)
    config = _read_json(root / "config.json") if (root / "config.json").is_file() else {}
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    where = f"{root / 'config.json'} quantization_config"
    if qc is None:
        if (root / LEGACY_AWQ_FILE).is_file():
            qc, where = {"quant_method": "awq", **_read_json(root / LEGACY_AWQ_FILE)}, str(root / LEGACY_AWQ_FILE)
        elif (root / LEGACY_GPTQ_FILE).is_file():
            qc, where = {"quant_method": "gptq", **_read_json(root / LEGACY_GPTQ_FILE)}, str(root / LEGACY_GPTQ_FILE)
        else:
            return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "q8_0":
        return None  # edge's own int8 format (edge.quant.q8_0)
    if method == "awq":
        _bits(qc, "bits" if "bits" in qc else "w_bit", where)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: AWQ version {version!r} is not supported (GEMM only)")
        g = int(qc.get("group_size", qc.get("q_group_size", DEFAULT_GROUP_SIZE)))
        return Int4Format("awq", g, zero_point=bool(qc.get("zero_point", True)))
    if method == "gptq":
        _bits(qc, "bits", where)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return Int4Format(
            "gptq", int(qc.get("group_size", DEFAULT_GROUP_SIZE)), zero_point=not qc.get("sym", True),
            gptq_v2=fmt == "gptq_v2", desc_act=bool(qc.get("desc_act", False)),
        )
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc, where)
    raise CheckpointError(
        f"{where}: quant_method {method!r} is not supported (int4: {', '.join(FORMATS)}; int8: q8_0)"
    )


def _compressed_tensors_format(qc: dict[str, Any], where: str) -> Int4Format:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError(f"{where}: compressed-tensors without config_groups")
    schemes = []
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise CheckpointError(f"{where}: compressed-tensors format {fmt!r} in {name} is not supported (pack-quantized)")
        w = group.get("weights") or {}
        if group.get("input_activations"):
            raise CheckpointError(f"{where}: {name} quantizes activations; only weight-only (W4A16) is supported")
        if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) != 4:
            raise CheckpointError(f"{where}: {name} has {w.get('num_bits')}-bit {w.get('type')} weights (int4 only)")
        strategy = w.get("strategy", "group")
        if strategy == "group":
            g = int(w["group_size"])
        elif strategy == "channel":
            g = -1
        else:
            raise CheckpointError(f"{where}: {name} strategy {strategy!r} is not supported (group, channel)")
        schemes.append((g, not w.get("symmetric", True), w.get("actorder") not in (None, False, "none")))
    if len(set(schemes)) != 1:
        raise CheckpointError(f"{where}: config_groups with different int4 schemes are not supported")
    g, asym, actorder = schemes[0]
    return Int4Format("compressed-tensors", g, zero_point=asym, desc_act=actorder)
