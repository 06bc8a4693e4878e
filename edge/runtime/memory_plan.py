"""The memory plan: what a model will hold once loaded, and whether it fits, before anything loads.

From ``config.json``, the quantization config and the safetensors headers alone (no torch,
no weights read: it answers in well under a second), the plan adds up

* the weights by part (embedding, attention, MLP, norms, lm_head, vision tower) in the
  form the engine will hold them: float, q8_0 int8, int4 as published or quantized while
  loading, and the lm_head / embedding as chosen;
* the KV bytes per token for each KV dtype the engine has, and one full context of them;
* the activations: the decoder's worst step (edge/runtime/budget.py's shape estimates) and,
  for a vision-language model, the vision tower's peak on the largest image the context
  can hold (:func:`tower_activation_bytes`, which the engine's budget counts too);
* the runtime (torch, and on a GPU its CUDA context) and the reserve an integrated GPU
  keeps for the OS and the voice front-end;

and compares them with what this process may use (MemAvailable, or its cgroup's headroom
if lower; on a Jetson that is the GPU's memory too) through the engine's own budget
arithmetic (``default_budget``): a plan that fits is one the engine can size a KV pool
for. One that does not is refused in one line naming what would fit
(:class:`DoesNotFit`); ``edge serve`` then exits with :data:`EXIT_DOES_NOT_FIT`, which the
unit's ``RestartPreventExitStatus=`` keeps systemd from retrying.

Faithful by default: an int4 model's lm_head and embedding are held as published
(``"auto"``), and as int8 rows only when only that fits (:func:`resolve`, logged, and
reported by ``edge info``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edge.model.config import ModelConfig, dtype_name
from edge.model.shapes import expected_shapes, fused_layout
from edge.model.validate import CheckpointError
from edge.quant.formats import (
    DEFAULT_GROUP_SIZE,
    EMBED,
    INT4_BLOCK_ROWS,
    INT4_DEQUANT_CHUNK_ELEMENTS,
    INT8_DEQUANT_CHUNK_ELEMENTS,
    INT8_GROUP_SIZE,
    LM_HEAD,
    SCALE_SUFFIX,
    QuantError,
    detect_format,
    is_linear_weight,
    parse_int4,
    parse_quantize,
    q8_0_from_metadata,
)
from edge.runtime.boards import Board
from edge.runtime.budget import (
    ACTIVATION_FLOOR,
    ACTIVATION_MARGIN,
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_RESERVE,
    DEFAULT_UTILIZATION,
    GRAPH_OVERHEAD,
    GRAPH_SLOTS,
    KV_ELEMENT_BYTES,
    SHARED_MEMORY_SEQUENCES,
    BudgetError,
    MemoryBudget,
    MemoryInfo,
    blocks_per_sequence,
    chunk_activation_bytes,
    default_budget,
    default_prefill_chunk,
    dtype_bytes,
    estimate_activation_bytes,
    fmt_bytes,
    host_memory,
    kv_block_bytes,
)

log = logging.getLogger(__name__)

# sysexits.h EX_CONFIG: the configuration cannot work; the unit's RestartPreventExitStatus=.
EXIT_DOES_NOT_FIT = 78
# What the process holds besides weights, KV and activations (assumptions until measured on
# a board): torch's CPU runtime; on an integrated GPU torch with its CUDA context and libraries;
# on a discrete GPU the context's share of the device memory.
RUNTIME_BYTES = {"cpu": 256 << 20, "integrated": int(0.8 * (1 << 30)), "discrete": 512 << 20}
HOLD_CHOICES = ("auto", "float", "int8", "int4")
TEGRA_RELEASE = "/etc/nv_tegra_release"
DEVICE_TREE_COMPATIBLE = "/proc/device-tree/compatible"
NVIDIA_DRIVER = "/proc/driver/nvidia/version"


class DoesNotFit(BudgetError):
    """The model cannot fit the memory this process may use; the message is one line that
    names the figures and what would fit."""


# -- what a checkpoint holds ------------------------------------------------------------


@dataclass(frozen=True)
class Int4Layout:
    """What the engine's int4 layout keeps per weight (edge/quant/int4.py)."""

    group_size: int  # -1: one group per row
    scale_dtype: str  # float16 | bfloat16 | float32
    zero_point: bool
    act_order: bool
    method: str = "rtn"

    @property
    def scale_bytes(self) -> int:
        return dtype_bytes(self.scale_dtype)


@dataclass(frozen=True)
class Checkpoint:
    """A model as its directory (or a preset's config) declares it."""

    name: str
    cfg: ModelConfig
    stored: str = "float"  # "float" | "q8_0" | "int4"
    stored_dtype: str | None = None  # the float tensors' dtype as stored
    int8_group: int = DEFAULT_GROUP_SIZE  # q8_0 checkpoints
    int8_lm_head: bool = False  # a q8_0 checkpoint whose lm_head is int8
    int4: Int4Layout | None = None
    vision: Any = None  # edge.model.vision.config.VisionConfig of a vision-language model
    tower_elements: int = 0  # the vision tower's tensors' elements
    max_image_pixels: int | None = None  # the image processor's max_pixels
    file_bytes: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str) -> Checkpoint:
        """A float model of this ``config.json`` dict (a preset: no files)."""
        return cls(name, ModelConfig.from_dict(config), stored_dtype=config.get("torch_dtype"))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Read ``config.json``, the quantization config and the safetensors headers."""
        root = Path(path)
        from edge.model.vision.config import VLConfig, is_vision_language

        vision = None
        max_pixels = None
        if is_vision_language(root):
            vl = VLConfig.from_pretrained(root)
            cfg, vision = vl.text, vl.vision
            max_pixels = _processor_max_pixels(root)
        else:
            cfg = ModelConfig.from_pretrained(root)
        headers = _headers(root)
        fmt = detect_format(root)
        stored, int4 = "float", None
        int8_group, int8_head = DEFAULT_GROUP_SIZE, False
        q8 = next((m for m in (q8_0_from_metadata(meta, str(root)) for meta, _ in headers.values()) if m), None)
        tensors = {name: info for _, infos in headers.values() for name, info in infos.items()}
        if fmt is not None:
            stored = "int4"
            scale = next((dt for n, (dt, _) in tensors.items()
                          if n.endswith((".scales", ".weight_scale")) and ".layers." in n), "F16")
            int4 = Int4Layout(fmt.group_size, _SAFETENSORS_NAMES.get(scale, "float32"), fmt.zero_point, fmt.desc_act,
                              fmt.method)
        elif q8 is not None:
            stored, int8_group = "q8_0", q8[1]
            int8_head = any(n.endswith(LM_HEAD + SCALE_SUFFIX) for n in tensors)
        floats = [dt for n, (dt, _) in tensors.items() if dt in ("BF16", "F16", "F32") and "norm" not in n]
        stored_dtype = _SAFETENSORS_NAMES.get(max(set(floats), key=floats.count)) if floats else None
        tower = sum(math.prod(shape) for n, (_, shape) in tensors.items() if n.startswith(("model.visual.", "visual.")))
        return cls(
            root.name, cfg, stored, stored_dtype, int8_group, int8_head, int4, vision, tower, max_pixels,
            sum(size for _, size in _file_sizes(root)),
        )


_SAFETENSORS_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _file_sizes(root: Path) -> list[tuple[str, int]]:
    return [(p.name, p.stat().st_size) for p in sorted(root.glob("*.safetensors"))]


def _headers(root: Path) -> dict[str, tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]]]]:
    """file -> (its __metadata__, {tensor: (safetensors dtype, shape)}) from the headers only."""
    from safetensors import safe_open

    out = {}
    for name, _ in _file_sizes(root):
        try:
            with safe_open(str(root / name), framework="numpy") as f:
                infos = {}
                for key in f.keys():
                    s = f.get_slice(key)
                    infos[key] = (s.get_dtype(), tuple(s.get_shape()))
                out[name] = (f.metadata() or {}, infos)
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read safetensors file {root / name}: {exc}") from None
    return out


def _processor_max_pixels(root: Path) -> int | None:
    try:
        d = json.loads((root / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return None
    size = d.get("size") or {}
    value = d.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
    return int(value)


# -- how the engine will hold it --------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """The weights' form once loaded."""

    projections: str  # "float" | "int8" | "int4"
    dtype: str  # float tensors (and activations)
    lm_head: str = "float"  # "float" | "int8" | "int4" | "tied"
    embedding: str = "float"  # "float" | "int8"
    int8_group: int = DEFAULT_GROUP_SIZE
    int4: Int4Layout | None = None
    quantized_here: bool = False  # quantized while loading (lossy by the user's choice)

    def label(self) -> str:
        if self.projections == "float":
            return self.dtype
        if self.projections == "int8":
            return f"int8 (q8_0 g{self.int8_group}{', quantized while loading' if self.quantized_here else ''})"
        assert self.int4 is not None
        g = "channel" if self.int4.group_size < 0 else f"g{self.int4.group_size}"
        if self.quantized_here:
            return f"int4 (RTN {g}, quantized while loading)"
        return f"int4 ({self.int4.method} {g})"

    def int4_scale_dtypes(self) -> tuple[str, ...]:
        """The scale dtypes of the int4 weights held (each has its own int4 kernels)."""
        out = set()
        if self.projections == "int4" and self.int4 is not None:
            out.add(self.int4.scale_dtype)
        if self.lm_head == "int4":
            out.add("float16")
        return tuple(sorted(out))

    def parts_label(self) -> str:
        head = "tied to the embedding" if self.lm_head == "tied" else _hold_label(self.lm_head, self.dtype)
        return f"lm_head {head}, embedding {_hold_label(self.embedding, self.dtype)}"


def _hold_label(kind: str, dtype: str) -> str:
    return dtype if kind == "float" else f"{kind} rows" if kind == "int8" else kind


def held_form(
    ckpt: Checkpoint,
    dtype: str,
    quantize: str | None = None,
    lm_head: str = "auto",
    embedding: str = "auto",
    group_size: int | None = None,
) -> Held:
    """How the engine holds ``ckpt`` loaded as ``dtype`` with ``quantize`` (the loader's
    rules, edge/model/decoder.py ``Model.load``); ``"auto"`` lm_head / embedding are taken
    as published (:func:`resolve` turns them to int8 where only that fits)."""
    for what, value, choices in (("lm_head", lm_head, HOLD_CHOICES), ("embedding", embedding, HOLD_CHOICES[:3])):
        if value not in choices:
            raise QuantError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    dtype = dtype_name(dtype)
    tied = ckpt.cfg.tie_word_embeddings
    int4 = parse_int4(quantize)
    int8 = not int4 and parse_quantize(quantize) is not None
    if ckpt.stored == "int4" and quantize is not None and (int4 or int8):
        raise QuantError(f"{ckpt.name} is already an int4 checkpoint; drop --quantize")
    if ckpt.stored == "q8_0" and int4:
        raise QuantError(f"{ckpt.name} is already quantized (q8_0); int4 quantizes float checkpoints")

    def head_and_embedding(default: str) -> tuple[str, str]:
        head = "tied" if tied else (default if lm_head == "auto" else lm_head)
        return head, default if embedding == "auto" else embedding

    if ckpt.stored == "int4" or int4:
        layout = ckpt.int4 if ckpt.stored == "int4" else Int4Layout(group_size or DEFAULT_GROUP_SIZE, "float16", True, False)
        head, emb = head_and_embedding("float")
        return Held("int4", dtype, head, emb, int4=layout, quantized_here=int4)
    if ckpt.stored == "q8_0" or int8:
        head = "tied" if tied else ("int8" if (ckpt.int8_lm_head if ckpt.stored == "q8_0" else True) else "float")
        g = ckpt.int8_group if ckpt.stored == "q8_0" else group_size or DEFAULT_GROUP_SIZE
        return Held("int8", dtype, head, "float", int8_group=g, quantized_here=int8)
    return Held("float", dtype, "tied" if tied else "float", "float")


# -- bytes ----------------------------------------------------------------------------------


def _linear_bytes(out: int, cols: int, kind: str, held: Held) -> int:
    """Bytes the engine holds for a ``[out, cols]`` weight in ``kind``."""
    if kind == "float":
        return out * cols * dtype_bytes(held.dtype)
    if kind == "int8":
        g = held.int8_group if cols % held.int8_group == 0 else cols
        return out * cols + out * (cols // g) * 4
    layout = held.int4 if kind == "int4-proj" else Int4Layout(DEFAULT_GROUP_SIZE, "float16", True, False)
    assert layout is not None
    rows = -(-out // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS
    groups = rows * (1 if layout.group_size < 0 else cols // layout.group_size)
    return rows * cols // 2 + groups * (layout.scale_bytes + (1 if layout.zero_point else 0)) + (
        4 * cols if layout.act_order else 0)


def row_table_bytes(rows: int, cols: int, kind: str, held: Held) -> int:
    """An lm_head or embedding table held as ``kind`` (int8: edge's q8_0 rows)."""
    if kind == "int8":
        g = INT8_GROUP_SIZE if cols % INT8_GROUP_SIZE == 0 else cols
        return rows * cols + rows * (cols // g) * 4
    if kind == "int4":
        return _linear_bytes(rows, cols, "int4-head", held)
    return rows * cols * dtype_bytes(held.dtype)


def weight_parts(ckpt: Checkpoint, held: Held) -> dict[str, int]:
    """Bytes by part as the engine holds them (= ``Model.weight_bytes()`` plus the tower)."""
    cfg = ckpt.cfg
    shapes = expected_shapes(cfg)
    fused: dict[str, list[int]] = {}
    for name, (dest, row) in fused_layout(shapes).items():
        shape = shapes[name]
        cur = fused.setdefault(dest, [0, *shape[1:]])
        cur[0] = max(cur[0], row + shape[0])
    parts = {"embedding": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head": 0, "vision tower": 0}
    b = dtype_bytes(held.dtype)
    for dest, shape in fused.items():
        if dest == EMBED:
            parts["embedding"] += row_table_bytes(shape[0], shape[1], held.embedding, held)
        elif dest == LM_HEAD:
            parts["lm_head"] += row_table_bytes(shape[0], shape[1], held.lm_head, held)
        elif is_linear_weight(dest.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")):
            kind = {"float": "float", "int8": "int8", "int4": "int4-proj"}[held.projections]
            parts["mlp" if ".mlp." in dest else "attention"] += _linear_bytes(shape[0], shape[1], kind, held)
        elif dest.endswith(".bias"):
            parts["attention"] += math.prod(shape) * b
        else:
            parts["norms"] += math.prod(shape) * b
    parts["vision tower"] = ckpt.tower_elements * b
    return parts


def _dequant_elements(ckpt: Checkpoint, held: Held) -> int:
    """The largest float temporary (elements) of the torch reference's quantized linears."""
    if held.projections == "float":
        return 0
    shapes = expected_shapes(ckpt.cfg)
    fused: dict[str, list[int]] = {}
    for name, (dest, row) in fused_layout(shapes).items():
        if dest.endswith("_proj.weight"):
            cur = fused.setdefault(dest, [0, shapes[name][1]])
            cur[0] = max(cur[0], row + shapes[name][0])
    worst = 0
    for out, cols in fused.values():
        if held.projections == "int8":
            worst = max(worst, min(out * cols, max(1, INT8_DEQUANT_CHUNK_ELEMENTS // cols) * cols))
        else:
            blocks = -(-out // INT4_BLOCK_ROWS)
            step = max(1, INT4_DEQUANT_CHUNK_ELEMENTS // (INT4_BLOCK_ROWS * cols))
            worst = max(worst, min(blocks, step) * INT4_BLOCK_ROWS * cols)
    if held.lm_head == "int8" and not ckpt.cfg.tie_word_embeddings:
        v, h = ckpt.cfg.vocab_size, ckpt.cfg.hidden_size
        worst = max(worst, min(v * h, max(1, INT8_DEQUANT_CHUNK_ELEMENTS // h) * h))
    return worst


def tower_activation_bytes(vision: Any, patches: int, dtype: str) -> int:
    """Peak bytes of one vision-tower pass over ``patches`` patches (edge/model/vision/tower.py):
    the float32 pixels and their cast, the residual stream, the larger of a block's attention
    (qkv, the float32 RoPE temporaries of q and k, the output and its projection) and its
    MLP, the rotary tables, and the merged features kept for the decoder (DeepStack
    included); times the activation margin."""
    b = dtype_bytes(dtype)
    n, h = patches, vision.hidden_size
    pixels = n * vision.patch_dim * (4 + b)
    residual = 2 * n * h * b
    attention = n * 3 * h * b + 4 * n * h * 4 + 2 * n * h * b
    mlp = (2 if vision.kind == "qwen2_5_vl" else 1) * n * vision.intermediate_size * b * 2 + n * h * b
    rotary = 2 * n * vision.head_dim * 4
    tokens = n // vision.merge_unit
    features = tokens * vision.out_hidden_size * b * (1 + len(vision.deepstack_visual_indexes))
    merge = tokens * vision.merge_unit * h * b * 2
    return int((pixels + residual + max(attention, mlp, merge) + rotary + features) * ACTIVATION_MARGIN)


def tower_patches(vision: Any, max_pixels: int | None, max_seq_len: int) -> int:
    """The most patches one image can bring: the processor's max_pixels, and no more image
    tokens than the context holds."""
    by_pixels = (max_pixels or 28 * 28 * 1280) // (vision.patch_size**2)
    return max(vision.merge_unit, min(by_pixels, (max_seq_len - 1) * vision.merge_unit))


def tower_peak(vision: Any, max_pixels: int | None, max_seq_len: int, dtype: Any) -> int:
    """:func:`tower_activation_bytes` of the largest image a context of ``max_seq_len`` holds."""
    return tower_activation_bytes(vision, tower_patches(vision, max_pixels, max_seq_len), dtype_name(dtype))


# -- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """Everything :func:`plan` adds up (bytes), and what it leads to."""

    name: str
    held: Held
    kind: str  # "cpu" | "integrated" | "discrete": where the weights and KV live
    weights: dict[str, int]
    kv_dtype: str
    kv_per_token: dict[str, int]  # per KV dtype the engine has
    max_seq_len: int
    page_size: int
    prefill_chunk: int
    activations: int  # the decoder's worst step, or the tower's, whichever is larger
    graphs: int
    tower: int  # the vision tower's peak (within ``activations``)
    runtime: int
    reserve: int
    utilization: float = DEFAULT_UTILIZATION
    memory: MemoryInfo | None = None  # what this process may use now (None: not known)
    board: Board | None = None
    kv_blocks: int | None = None  # explicit sizes: the plan checks them, the budget warns
    kv_memory: int | None = None
    file_bytes: int = 0  # the checkpoint's safetensors files on disk (0: a preset)
    notes: tuple[str, ...] = field(default=())

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def block_bytes(self) -> int:
        return self.page_size * self.kv_per_token[self.kv_dtype]

    @property
    def context_bytes(self) -> int:
        """KV of one full context, in whole blocks."""
        return blocks_per_sequence(self.max_seq_len, self.page_size) * self.block_bytes

    @property
    def need(self) -> int:
        """The least memory that holds the weights, the runtime and a KV pool of one full
        context under the engine's budget rule (``min(available x utilization, available
        - reserve) - activations - graphs``)."""
        base = self.weight_bytes + self.runtime
        if self.kv_memory is not None or self.kv_blocks is not None:
            kv = self.kv_memory if self.kv_memory is not None else (self.kv_blocks or 0) * self.block_bytes
            return base + kv + self.activations + self.graphs
        per_run = self.context_bytes + self.activations + self.graphs
        return base + max(math.ceil(per_run / self.utilization), per_run + self.reserve)

    @property
    def fits(self) -> bool | None:
        """None when the memory is not known here (a discrete GPU before torch). With an
        explicit KV size only weights and runtime beyond what is available are refused (the
        engine's budget warns about the rest: the operator may know better than the probe)."""
        if self.memory is None:
            return None
        if self.kv_memory is not None or self.kv_blocks is not None:
            return self.weight_bytes + self.runtime <= self.memory.available
        return self.need <= self.memory.available

    def after_weights(self) -> MemoryInfo | None:
        """What the engine's budget will probe once the weights are loaded."""
        if self.memory is None:
            return None
        left = self.memory.available - self.weight_bytes - self.runtime
        return replace(self.memory, available=max(0, left))

    def budget(self, kv_dtype: str | None = None) -> MemoryBudget | None:
        """The engine's default budget for the pool (``kv_dtype``: another KV dtype); None
        when no full context fits or the memory is not known."""
        memory = self.after_weights()
        if memory is None:
            return None
        block = self.page_size * self.kv_per_token[kv_dtype or self.kv_dtype]
        try:
            return default_budget(
                memory, block_bytes=block, page_size=self.page_size, max_seq_len=self.max_seq_len,
                reserve=self.reserve, weights=self.weight_bytes, activations=self.activations, graphs=self.graphs,
                utilization=self.utilization, kv_blocks=self.kv_blocks, kv_memory=self.kv_memory,
            )
        except BudgetError:
            return None

    def contexts(self, kv_dtype: str | None = None) -> float:
        """Full contexts the memory holds beside everything else (before the pool's cap)."""
        memory = self.after_weights()
        if memory is None:
            return 0.0
        usable = min(int(memory.available * self.utilization), memory.available - self.reserve)
        room = usable - self.activations - self.graphs
        per = blocks_per_sequence(self.max_seq_len, self.page_size) * self.page_size * self.kv_per_token[
            kv_dtype or self.kv_dtype]
        return max(0.0, room / per)

    def left_for_others(self) -> int | None:
        """Memory left beside the service with its default pool: the OS, ASR / TTS models."""
        b = self.budget()
        if self.memory is None or b is None:
            return None
        return self.memory.available - self.weight_bytes - self.runtime - self.activations - self.graphs - b.kv_bytes

    def as_dict(self) -> dict[str, Any]:
        b = self.budget()
        return {
            "model": self.name,
            "format": self.held.label(),
            "lm_head": self.held.lm_head,
            "embedding": self.held.embedding,
            "dtype": self.held.dtype,
            "memory_kind": self.kind,
            "weights": dict(self.weights),
            "weight_bytes": self.weight_bytes,
            "file_bytes": self.file_bytes,
            "runtime": self.runtime,
            "activations": self.activations,
            "vision_tower_activations": self.tower,
            "graphs": self.graphs,
            "prefill_chunk": self.prefill_chunk,
            "reserve": self.reserve,
            "kv_dtype": self.kv_dtype,
            "kv_bytes_per_token": dict(self.kv_per_token),
            "max_seq_len": self.max_seq_len,
            "context_kv_bytes": self.context_bytes,
            "need": self.need,
            "available": None if self.memory is None else self.memory.available,
            "memory_source": None if self.memory is None else self.memory.source,
            "board": None if self.board is None else self.board.key,
            "fits": self.fits,
            "contexts": {d: round(self.contexts(d), 2) for d in self.kv_per_token},
            "default_kv_bytes": None if b is None else b.kv_bytes,
            "default_contexts": None if b is None else round(b.full_sequences, 2),
            "left_for_others": self.left_for_others(),
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        """The plan as ``edge plan`` prints it."""
        g = fmt_bytes
        lines = [f"model      {self.name}: {self.held.label()}, {self.held.parts_label()}"]
        if self.board is not None:
            where = f"{self.board.name}: MemTotal {g(self.board.mem_total)} less {g(self.board.os_used)} for the OS"
        elif self.memory is not None:
            where = f"{self.kind}: {self.memory.source}"
        else:
            where = f"{self.kind}: memory not known here (checked when the engine starts)"
        lines.append(f"memory     {where}")
        disk = f"  ({g(self.file_bytes)} of safetensors on disk)" if self.file_bytes else ""
        lines.append(f"weights    {g(self.weight_bytes):>10}{disk}")
        layers = self.weights
        for part, n in layers.items():
            if n:
                lines.append(f"  {part:<12} {g(n):>10}")
        lines.append(f"runtime    {g(self.runtime):>10}  torch{' and its CUDA context' if self.kind != 'cpu' else ''}")
        tower = f", vision tower {g(self.tower)}" if self.tower else ""
        lines.append(f"activations {g(self.activations + self.graphs):>9}  prefill chunk {self.prefill_chunk} tokens"
                     f"{tower}{', graphs ' + g(self.graphs) if self.graphs else ''}")
        if self.reserve:
            lines.append(f"reserve    {g(self.reserve):>10}  kept free for the OS and the voice front-end")
        per = ", ".join(f"{d} {g(n)}" for d, n in self.kv_per_token.items())
        lines.append(f"KV/token   {per}")
        lines.append(f"context    {self.max_seq_len} tokens: {g(self.context_bytes)} of KV ({self.kv_dtype})")
        if self.memory is None:
            lines.append(f"needs      {g(self.need)} for one full context")
            return "\n".join(lines)
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"needs      {g(self.need)} for one full context; {g(self.memory.available)} available: {verdict}")
        fit = ", ".join(f"{d} {self.contexts(d):.1f}" for d in self.kv_per_token)
        lines.append(f"contexts   of {self.max_seq_len} tokens that fit: {fit}")
        b = self.budget()
        if b is not None:
            cap = f" (capped at {SHARED_MEMORY_SEQUENCES})" if b.capped else ""
            lines.append(f"KV pool    {g(b.kv_bytes)} = {b.full_sequences:.1f} contexts{cap} by default")
            lines.append(f"left       {g(self.left_for_others() or 0)} for the OS, ASR / TTS and other processes")
        for note in self.notes:
            lines.append(f"note       {note}")
        return "\n".join(lines)


def plan(
    ckpt: Checkpoint,
    *,
    kind: str,
    memory: MemoryInfo | None = None,
    dtype: str | None = None,
    quantize: str | None = None,
    lm_head: str = "auto",
    embedding: str = "auto",
    max_seq_len: int | None = None,
    page_size: int = 16,
    kv_dtype: str | None = None,
    kv_dtypes: tuple[str, ...] | None = None,
    reserve: int | None = None,
    utilization: float = DEFAULT_UTILIZATION,
    prefill_chunk: int | None = None,
    cuda_graph: bool | None = None,
    kv_blocks: int | None = None,
    kv_memory: int | None = None,
    board: Board | None = None,
    held: Held | None = None,
    runtime: int | None = None,
) -> MemoryPlan:
    """The plan of ``ckpt`` on memory of ``kind`` ("cpu", "integrated", "discrete") with
    ``memory`` available now (None: unknown), loaded as the engine would be with these
    options (their defaults are the engine's). ``runtime``: what the process will add
    besides weights, KV and activations (default :data:`RUNTIME_BYTES` of the kind: a
    process that has not started torch yet)."""
    cfg = ckpt.cfg
    dtype = dtype_name(dtype or ("float32" if kind == "cpu" else "bfloat16"))
    held = held or held_form(ckpt, dtype, quantize, lm_head, embedding)
    seq = max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    kv_dtype = dtype if kv_dtype in (None, "auto") else kv_dtype  # "auto": the engine's, the model's dtype
    kv_dtypes = kv_dtypes or tuple(dict.fromkeys((kv_dtype, *(d for d in ("bfloat16", "int8") if kind != "cpu"))))
    weights = weight_parts(ckpt, held)
    runtime = RUNTIME_BYTES[kind] if runtime is None else runtime
    total = sum(weights.values())
    after = None if memory is None else replace(memory, available=max(0, memory.available - total - runtime))
    expands = kind != "cpu" and held.projections != "float"
    chunk = prefill_chunk or default_prefill_chunk(cfg, dtype, seq, expands, after)
    graphs = 0
    if kind == "cpu":
        activations = estimate_activation_bytes(cfg, chunk, seq, dtype, _dequant_elements(ckpt, held))
    else:
        activations = gpu_activation_bytes(ckpt, held, chunk)
        if cuda_graph is not False:
            graphs = GRAPH_SLOTS * gpu_activation_bytes(ckpt, held, 1, expand=False) + GRAPH_OVERHEAD
    tower = tower_peak(ckpt.vision, ckpt.max_image_pixels, seq, dtype) if ckpt.vision is not None else 0
    kept = (DEFAULT_RESERVE if reserve is None else reserve) if kind == "integrated" else 0
    return MemoryPlan(
        name=ckpt.name, held=held, kind=kind, weights=weights, kv_dtype=kv_dtype,
        kv_per_token={d: kv_block_bytes(cfg, 1, d) for d in kv_dtypes if d in KV_ELEMENT_BYTES},
        max_seq_len=seq, page_size=page_size, prefill_chunk=chunk, activations=max(activations, tower),
        graphs=graphs, tower=tower, runtime=runtime, reserve=kept, utilization=utilization, memory=memory,
        board=board, kv_blocks=kv_blocks, kv_memory=kv_memory, file_bytes=ckpt.file_bytes,
    )


def gpu_activation_bytes(ckpt: Checkpoint, held: Held, tokens: int, expand: bool = True) -> int:
    """A ``tokens``-token step on the GPU from shapes (the engine measures it there): the
    CUDA attention's chunk (no score matrix), the largest weight expanded to the dtype by a
    quantized prefill, and the logits; times the activation margin."""
    cfg = ckpt.cfg
    b = dtype_bytes(held.dtype)
    step = chunk_activation_bytes(cfg, tokens, held.dtype)
    expansion = 0
    if expand and held.projections != "float":
        expansion = max(2 * cfg.intermediate_size * cfg.hidden_size, (cfg.q_size + 2 * cfg.kv_size) * cfg.hidden_size,
                        cfg.hidden_size * cfg.intermediate_size) * b
    logits = 2 * cfg.vocab_size * 4
    return int((step + expansion + logits) * ACTIVATION_MARGIN) + ACTIVATION_FLOOR


# -- what fits -----------------------------------------------------------------------------


def resolve(p: MemoryPlan, ckpt: Checkpoint, lm_head: str, embedding: str, **options: Any) -> MemoryPlan:
    """``p`` with its ``"auto"`` lm_head / embedding settled: as published when that fits,
    else int8 rows when that fits (said in the plan's notes, which the engine logs)."""
    held = p.held
    wants_auto = held.projections == "int4" and (lm_head == "auto" or embedding == "auto")
    if p.fits is not False or not wants_auto:
        return p
    head = "int8" if lm_head == "auto" and held.lm_head == "float" else held.lm_head
    emb = "int8" if embedding == "auto" else held.embedding
    smaller = plan(ckpt, **options, held=replace(held, lm_head=head, embedding=emb))
    if not smaller.fits:
        return p
    note = (f"lm_head and embedding held as int8 rows: as published ({held.parts_label()}) the model needs "
            f"{fmt_bytes(p.need)} and {fmt_bytes(p.memory.available if p.memory else 0)} is available")
    return replace(smaller, notes=(*smaller.notes, note))


def fit(
    ckpt: Checkpoint, *, quantize: str | None = None, lm_head: str = "auto", embedding: str = "auto", **options: Any
) -> MemoryPlan:
    """:func:`plan`, its ``"auto"`` choices settled (:func:`resolve`), checked
    (:func:`check_fits`): the plan the engine will run, or :class:`DoesNotFit`."""
    p = plan(ckpt, quantize=quantize, lm_head=lm_head, embedding=embedding, **options)
    p = resolve(p, ckpt, lm_head, embedding, quantize=quantize, **options)
    check_fits(p, ckpt, quantize=quantize, lm_head=lm_head, embedding=embedding, **options)
    return p


def check_fits(p: MemoryPlan, ckpt: Checkpoint, **options: Any) -> None:
    """Raise :class:`DoesNotFit` (one line: the figures and what would fit) unless it fits."""
    if p.fits is not False:
        return
    assert p.memory is not None
    avail = p.memory.available
    ideas = alternatives(p, ckpt, **options)
    tail = ("use " + " or ".join(ideas)) if ideas else "no format or context of this model fits here: use a smaller model"
    raise DoesNotFit(
        f"{p.name} {p.held.label()} needs {fmt_bytes(p.need)} for a context of {p.max_seq_len} tokens "
        f"(weights {fmt_bytes(p.weight_bytes)}), {fmt_bytes(avail)} available ({p.memory.source}): {tail}"
    )


def alternatives(p: MemoryPlan, ckpt: Checkpoint, **options: Any) -> list[str]:
    """What would fit instead, cheapest change first: int8 / int4 while loading (a float
    checkpoint), an int4 checkpoint, int8 rows for an int4 model's lm_head and embedding, a
    shorter context."""
    out: list[str] = []
    base = {k: v for k, v in options.items() if k not in ("quantize", "lm_head", "embedding", "held")}
    if ckpt.stored == "float":
        smaller = {"float": ("int8", "int4"), "int8": ("int4",)}.get(p.held.projections, ())
        for q in smaller:
            alt = plan(ckpt, **base, quantize=q)
            alt = resolve(alt, ckpt, "auto", "auto", **base, quantize=q)
            if alt.fits:
                out.append(f"--quantize {q} (needs {fmt_bytes(alt.need)})")
                break
        published = replace(ckpt, stored="int4", int4=Int4Layout(DEFAULT_GROUP_SIZE, "float16", True, False, "awq"))
        alt = plan(published, **base)
        if alt.fits:
            out.append(f"an int4 (AWQ / GPTQ) checkpoint (~{fmt_bytes(alt.weight_bytes)} of weights)")
    if p.held.projections == "int4" and (p.held.lm_head == "float" or p.held.embedding == "float"):
        head = "tied" if p.held.lm_head == "tied" else "int8"
        alt = plan(ckpt, **base, held=replace(p.held, lm_head=head, embedding="int8"))
        if alt.fits:
            out.append(f"--quant-lm-head int8 --quant-embedding int8 (needs {fmt_bytes(alt.need)})")
    shorter = _longest_context(p, ckpt, **options)
    if shorter:
        out.append(f"--max-seq-len {shorter}")
    return out


def _longest_context(p: MemoryPlan, ckpt: Checkpoint, **options: Any) -> int | None:
    """The longest context (a multiple of 256 tokens, at least 256) that fits as planned."""
    opts = {k: v for k, v in options.items() if k != "max_seq_len"}
    opts["held"] = p.held
    lo, hi, best = 1, p.max_seq_len // 256 - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if plan(ckpt, **opts, max_seq_len=mid * 256).fits:
            best, lo = mid * 256, mid + 1
        else:
            hi = mid - 1
    return best


# -- what this process may use ------------------------------------------------------------


def memory_kind(device: str | None, *, tegra_release: str = TEGRA_RELEASE, compatible: str = DEVICE_TREE_COMPATIBLE,
                nvidia_driver: str = NVIDIA_DRIVER) -> str:
    """Where the weights will live, without torch: "cpu" for ``device="cpu"``; on a Jetson
    (L4T) "integrated" (CPU and GPU share the DRAM); elsewhere "discrete" when an NVIDIA
    driver is loaded and the device is not the CPU, else "cpu"."""
    if device is not None and device.split(":")[0] == "cpu":
        return "cpu"
    if os.path.exists(tegra_release) or _is_tegra(compatible):
        return "integrated"
    if device is not None and device.startswith("cuda"):
        return "discrete"
    return "discrete" if os.path.exists(nvidia_driver) else "cpu"


def _is_tegra(compatible: str) -> bool:
    try:
        return b"nvidia,tegra" in Path(compatible).read_bytes()
    except OSError:
        return False


def probe(kind: str) -> MemoryInfo | None:
    """What the process may use now: host memory (MemAvailable or the cgroup's headroom) on
    the CPU and on an integrated GPU; None for a discrete GPU (the engine asks CUDA)."""
    if kind == "discrete":
        return None
    try:
        total, available, source = host_memory()
    except (OSError, BudgetError):
        return None
    return MemoryInfo(kind, total, available, source)


def runtime_to_come(kind: str, statm: str = "/proc/self/statm") -> int:
    """:data:`RUNTIME_BYTES` of ``kind`` less what this process already holds (torch and a
    CUDA context started before the check are already out of MemAvailable)."""
    try:
        resident = int(Path(statm).read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        resident = 0
    return max(0, RUNTIME_BYTES[kind] - resident)


def board_memory(b: Board) -> MemoryInfo:
    return MemoryInfo("integrated", b.mem_total, b.available, f"{b.name}, MemTotal less the OS")


# -- the service's check and the tables of docs/orin.md ------------------------------------


def fit_settings(settings: Any, device_kind: str | None = None) -> MemoryPlan | None:
    """The fit check ``edge serve`` runs before torch is imported (edge.settings.Settings in):
    the plan that will load, or :class:`DoesNotFit`; None for the embedded demo model (a few
    megabytes) and where the memory is not known without CUDA (a discrete GPU: the engine
    checks it when it starts)."""
    if settings.model is None:
        return None
    kind = device_kind or memory_kind(settings.device)
    memory = probe(kind)
    if memory is None:
        return None
    return fit(
        Checkpoint.from_dir(settings.model), quantize=settings.quantize, lm_head=settings.quant_lm_head,
        embedding=settings.quant_embedding, kind=kind, memory=memory, dtype=settings.dtype,
        max_seq_len=settings.max_seq_len, page_size=settings.page_size, kv_blocks=settings.kv_blocks,
        kv_memory=settings.kv_memory, kv_dtype=settings.kv_dtype, reserve=settings.memory_reserve, prefill_chunk=None,
        cuda_graph=settings.cuda_graph, runtime=runtime_to_come(kind),
    )


TABLE_FORMATS = (("bf16", None), ("int8", "int8"), ("int4", "int4"))


def board_table(ckpts: list[Checkpoint], boards: list[Board], max_seq_len: int | None = None,
                page_size: int = 16) -> str:
    """Markdown: each checkpoint in bf16, int8 and int4 on each board (docs/orin.md)."""
    g = fmt_bytes
    rows = [
        "| board | model | format | lm_head / embedding | weights | KV per token bf16 / int8 | needs (one context) "
        "| available | fits | contexts bf16 / int8 | default KV pool | left for OS, ASR / TTS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in boards:
        for ckpt in ckpts:
            for label, quantize in TABLE_FORMATS:
                opts = dict(kind="integrated", memory=board_memory(b), board=b, max_seq_len=max_seq_len,
                            page_size=page_size, kv_dtypes=("bfloat16", "int8"))
                p = plan(ckpt, quantize=quantize, **opts)
                p = resolve(p, ckpt, "auto", "auto", quantize=quantize, **opts)
                kv = " / ".join(g(p.kv_per_token[d]) for d in ("bfloat16", "int8"))
                head = p.held.parts_label().replace("lm_head ", "").replace(", embedding ", " / ")
                budget = p.budget()
                fits = "yes" if p.fits else "**no**"
                ctx = " / ".join(f"{p.contexts(d):.1f}" for d in ("bfloat16", "int8")) if p.fits else "—"
                pool = f"{g(budget.kv_bytes)} ({budget.full_sequences:.1f})" if budget else "—"
                left = g(p.left_for_others() or 0) if budget else "—"
                rows.append(f"| {b.name} | {ckpt.name} | {label} | {head} | {g(p.weight_bytes)} | {kv} | {g(p.need)} "
                            f"| {g(b.available)} | {fits} | {ctx} | {pool} | {left} |")
    return "\n".join(rows)
