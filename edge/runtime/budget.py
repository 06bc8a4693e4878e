"""Memory budget: how many KV blocks the engine may allocate.

At start the engine sizes its paged block pool from the memory really available,
after the weights are loaded and the activations of the worst step measured:

    kv_bytes = min(available * utilization, available - reserve) - activations - graph buffers
    blocks   = min(kv_bytes // block_bytes, cap)

* ``available`` is probed after the weights are loaded (so they are already out of it):
  - integrated GPU (Jetson Orin, ``get_device_properties().is_integrated``): CPU and GPU
    share one DRAM, so the figure is what the OS reports available, ``MemAvailable``
    of /proc/meminfo (or the process's cgroup headroom if lower);
  - discrete GPU: the free figure of ``torch.cuda.mem_get_info``;
  - CPU: ``MemAvailable``, or the cgroup headroom if lower.
  The cgroup is the process's own, named in ``/proc/self/cgroup`` (a systemd service's
  ``MemoryMax=``, a container's limit), with its ancestors: v2 ``memory.max`` minus
  ``memory.current``, v1 ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``, less
  the inactive page cache in either.
* ``activations``: on a GPU a warm-up runs one ``prefill_chunk``-token prefill at the
  end of a full context and one decode step against a one-block scratch pool, and
  takes the peak of ``torch.cuda.max_memory_allocated`` above the baseline (the
  caching allocator is emptied before memory is probed, so nothing is counted twice).
  On the CPU it is estimated from shapes (``estimate_activation_bytes``).
  A vision-language model's tower peak on the largest image a context holds
  (edge/runtime/memory_plan.py ``tower_peak``) counts where it is the larger.
* ``graph buffers``: with CUDA graphs, each of the two slots' captured decode step
  keeps its intermediates in the graph pool: reserved as 2 x the measured decode peak
  plus ``GRAPH_OVERHEAD``.
* ``utilization`` (default 0.9) leaves the rest to the OS and other processes.
* ``reserve`` (integrated GPU only; ``--memory-reserve``, default ``DEFAULT_RESERVE``,
  1.5 GiB, sized for an 8 GB board) is kept free besides: on Orin the OS, its page cache
  and the voice front-end (ASR/TTS models) live in the same DRAM as the KV cache.
* ``cap``: where the pool shares memory with everything else (CPU, integrated GPU) it
  holds at most ``SHARED_MEMORY_SEQUENCES`` (4) full-context sequences — the two
  scheduler slots plus as much again for cached prefixes — so a 64 GB AGX Orin does not
  pin 45 GB for a one-conversation service. Discrete GPUs are not capped.

The prefill chunk itself (:func:`default_prefill_chunk`) is 512 tokens, or, where
quantized linears expand every weight once per forward (the CUDA int8 / int4 prefill),
``EXPANDED_PREFILL_CHUNK`` tokens so that a prompt up to that length pays the expansion
once, shortened while its activations exceed ``PREFILL_MEMORY_SHARE`` of the memory
available. The expansion buffer is a temporary of each linear call (bounded per weight,
stream-ordered by torch's caching allocator), so the warm-up measures it with the rest.

Explicit sizes: ``kv_blocks=N`` or ``kv_memory=BYTES`` (``--kv-memory 2GiB``) replace
the computation (a request above what is available is logged as a warning, not
refused: the probes cannot see everything, the operator can). Every budget — computed
or explicit — must hold one full-context sequence (``ceil(max_seq_len / page_size)``
blocks), else ``BudgetError`` names the figures.

The probes are injectable: pass a ``MemoryInfo`` (tests fake integrated and discrete
figures) or point ``probe_memory`` at fake /proc/meminfo, /proc/self/cgroup and cgroup files.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from edge.model.config import ModelConfig
    from edge.model.decoder import Model

log = logging.getLogger(__name__)

DEFAULT_UTILIZATION = 0.9
# The context length when neither the operator nor the model's maximum sets a shorter one.
DEFAULT_MAX_SEQ_LEN = 4096
# Default cap where the pool shares memory with everything else (CPU, integrated GPU): full
# contexts for the two scheduler slots plus as many again for cached prefixes.
SHARED_MEMORY_SEQUENCES = 4
# Kept free on an integrated GPU for the OS's page cache and the processes beside the engine
# (a voice front-end with its ASR/TTS models): sized for an 8 GB board.
DEFAULT_RESERVE = 3 << 29  # 1.5 GiB
GRAPH_SLOTS = 2
GRAPH_OVERHEAD = 16 << 20  # graph objects, static inputs, sampler state per engine
ACTIVATION_MARGIN = 1.25  # on the CPU shape estimate
ACTIVATION_FLOOR = 16 << 20  # allocator slack, small buffers
MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


class BudgetError(ValueError):
    """The memory budget cannot hold what the engine needs; the message names the figures."""


# -- sizes ---------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float, *, allow_zero: bool = False) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5G"`` (SI: 10^9), ``"4096"`` -> bytes.

    Raises BudgetError (a ValueError) for anything else, negative sizes included, and zero
    unless ``allow_zero`` (a reserve may be none at all).
    """
    if isinstance(value, bool):
        raise BudgetError(f"malformed memory size {value!r}")
    if isinstance(value, (int, float)):
        n = value
    else:
        m = _SIZE.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise BudgetError(
                f"malformed memory size {value!r}: use a number with an optional unit, "
                "e.g. 2GiB, 512MiB, 1.5GB, 1048576"
            )
        n = float(m.group(1)) * _UNITS[unit]
    if allow_zero and n == 0:
        return 0
    if not math.isfinite(n) or n < 1:
        raise BudgetError(f"memory size {value!r} must be at least one byte")
    return int(n)


def parse_reserve(value: str | int | float) -> int:
    """A memory reserve: like :func:`parse_bytes`, and ``0`` keeps none."""
    return parse_bytes(value, allow_zero=True)


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# -- probes --------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryInfo:
    """Memory the KV pool would come from, as probed (bytes).

    ``kind``: "integrated" (unified memory, Orin), "discrete" (GPU memory) or "cpu".
    ``available``: free for this engine now, after its weights are loaded.
    """

    kind: str
    total: int
    available: int
    source: str = "given"


def read_meminfo(path: str | os.PathLike[str] = MEMINFO) -> dict[str, int]:
    """``/proc/meminfo`` as {field: bytes}."""
    out: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        try:
            n = int(parts[0])
        except ValueError:
            continue
        out[key.strip()] = n * 1024 if len(parts) > 1 and parts[1].lower() == "kb" else n
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit of this process's cgroup and what is left under it (bytes)."""

    limit: int  # the least limit over the cgroup and its ancestors
    headroom: int  # the least of limit - (usage - inactive file pages) over them
    path: str  # the cgroup, as /proc/self/cgroup names it
    version: int  # 1 or 2


def own_cgroup(proc_cgroup: str | os.PathLike[str] = PROC_SELF_CGROUP) -> tuple[int, str]:
    """(version, path) of this process's memory cgroup from ``/proc/self/cgroup``: the v1
    hierarchy whose controllers include ``memory`` if there is one, else the v2 (``0::``)
    path; (2, "/") when the file cannot be read."""
    try:
        text = Path(proc_cgroup).read_text()
    except OSError:
        return 2, "/"
    v2 = "/"
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return 1, path or "/"
        if hierarchy == "0" and not controllers:
            v2 = path or "/"
    return 2, v2


def _inactive_file(stat: Path, version: int) -> int:
    """Page-cache bytes the kernel reclaims first: not counted as used (as container runtimes do)."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return 0
    fields = dict(line.split(maxsplit=1) for line in lines if " " in line)
    key = "total_inactive_file" if version == 1 and "total_inactive_file" in fields else "inactive_file"
    try:
        return int(fields.get(key, 0))
    except ValueError:
        return 0


def cgroup_headroom(
    root: str | os.PathLike[str] = CGROUP_ROOT, proc_cgroup: str | os.PathLike[str] = PROC_SELF_CGROUP
) -> CgroupMemory | None:
    """Limit and headroom of this process's own memory cgroup (named in ``/proc/self/cgroup``)
    under the cgroup mount ``root``; None when neither it nor an ancestor is limited.

    cgroup v2: ``memory.max`` / ``memory.current`` in ``root/<path>``; v1:
    ``memory.limit_in_bytes`` / ``memory.usage_in_bytes`` in ``root/memory/<path>`` (limits
    near 2^63 mean none). Every ancestor up to ``root`` counts (a slice's ``MemoryMax=``
    binds the services in it); directories absent from this mount (a container that sees
    only its own subtree) are skipped.
    """
    version, path = own_cgroup(proc_cgroup)
    base = Path(root) / "memory" if version == 1 else Path(root)
    limit_name, usage_name = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes") if version == 1 else ("memory.max", "memory.current")
    )
    parts = [p for p in path.split("/") if p]
    limits: list[tuple[int, int]] = []
    for depth in range(len(parts), -1, -1):
        d = base.joinpath(*parts[:depth])
        limit = _read_int(d / limit_name)
        if limit is None or limit >= 1 << 60:
            continue
        usage = max(0, (_read_int(d / usage_name) or 0) - _inactive_file(d / "memory.stat", version))
        limits.append((limit, max(0, limit - usage)))
    if not limits:
        return None
    return CgroupMemory(min(lim for lim, _ in limits), min(h for _, h in limits), path, version)


def host_memory(
    meminfo: str | os.PathLike[str] = MEMINFO,
    cgroup_root: str | os.PathLike[str] | None = CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = PROC_SELF_CGROUP,
) -> tuple[int, int, str]:
    """(total, available, source) of host RAM: MemAvailable, or the own cgroup's headroom if lower."""
    info = read_meminfo(meminfo)
    if "MemAvailable" not in info or "MemTotal" not in info:
        raise BudgetError(f"{meminfo} lacks MemTotal/MemAvailable; pass kv_blocks= or kv_memory=")
    total, avail, source = info["MemTotal"], info["MemAvailable"], f"{meminfo} MemAvailable"
    cg = cgroup_headroom(cgroup_root, proc_cgroup) if cgroup_root is not None else None
    if cg is not None:
        total = min(total, cg.limit)
        if cg.headroom < avail:
            avail, source = cg.headroom, f"cgroup v{cg.version} {cg.path} limit {fmt_bytes(cg.limit)} - usage"
    return total, avail, source


def probe_memory(
    device: "torch.device | str" = "cpu",
    *,
    meminfo: str | os.PathLike[str] = MEMINFO,
    cgroup_root: str | os.PathLike[str] | None = CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = PROC_SELF_CGROUP,
    integrated: bool | None = None,
    mem_get_info: Callable[[], tuple[int, int]] | None = None,
    process_share: tuple[float, int] | None = None,
) -> MemoryInfo:
    """What the KV pool may come from on ``device``. ``integrated``, ``mem_get_info`` and
    ``process_share`` (torch's per-process memory fraction, bytes this process's allocator
    already holds) override the CUDA queries (tests fake both kinds of GPU).

    On a discrete GPU the free memory is capped by ``torch.cuda.set_per_process_memory_fraction``
    when the process set one: the pool must fit the share the allocator will grant."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if integrated is None:
            props = torch.cuda.get_device_properties(dev)
            integrated = bool(getattr(props, "is_integrated", False))
        if integrated:
            total, avail, source = host_memory(meminfo, cgroup_root, proc_cgroup)
            return MemoryInfo("integrated", total, avail, source)
        if mem_get_info is None:
            free, total = torch.cuda.mem_get_info(dev)
        else:
            free, total = mem_get_info()
        if process_share is None and mem_get_info is None:
            index = dev.index if dev.index is not None else torch.cuda.current_device()  # "cuda" has none
            process_share = (torch.cuda.get_per_process_memory_fraction(index), torch.cuda.memory_reserved(index))
        fraction, held = process_share or (1.0, 0)
        if fraction < 1.0:
            share = max(0, int(total * fraction) - held)
            if share < free:
                return MemoryInfo(
                    "discrete", int(total), share, f"torch.cuda per-process memory fraction {fraction:g}"
                )
        return MemoryInfo("discrete", int(total), int(free), "torch.cuda.mem_get_info")
    if dev.type != "cpu":
        raise BudgetError(f"no memory probe for device {dev}; pass kv_blocks= or kv_memory=")
    total, avail, source = host_memory(meminfo, cgroup_root, proc_cgroup)
    return MemoryInfo("cpu", total, avail, source)


# -- shapes --------------------------------------------------------------------------

FLOAT_PREFILL_CHUNK = 512
# Quantized linears expand every weight once per forward: a prompt up to this long pays it once.
EXPANDED_PREFILL_CHUNK = 2048
# The most of the available memory a longer chunk's activations may take from the KV cache.
PREFILL_MEMORY_SHARE = 1 / 16


# How K/V rows are held: "auto" (the model's dtype, the default) or "int8" (codes and a
# float32 scale a row, edge/kernels/kv_int8.py).
KV_DTYPES = ("auto", "int8")


def parse_kv_dtype(text: str | None) -> str:
    """``auto`` (or empty / None: the model's dtype) or ``int8``."""
    t = (text or "auto").strip().lower()
    if t not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {text!r}")
    return t


# Bytes an element of each dtype takes (torch's names): sizes from names, without torch.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1, "int32": 4, "float64": 8}


def dtype_bytes(dtype: "torch.dtype | str") -> int:
    """Bytes of one element of ``dtype`` (a torch dtype or its name)."""
    return DTYPE_BYTES[str(dtype).removeprefix("torch.")]


# Stored KV dtype -> (bytes of an element, bytes of the scales one token keeps per KV head).
KV_ELEMENT_BYTES = {"float32": (4, 0), "bfloat16": (2, 0), "float16": (2, 0), "int8": (1, 4)}


def kv_bytes_per_token(cfg: "ModelConfig", kv_dtype: "torch.dtype | str") -> int:
    """Bytes one token's K and V take across all layers stored in ``kv_dtype`` (a torch
    dtype or one of ``KV_ELEMENT_BYTES``: an int8 cache keeps a scale per token and KV head)."""
    element, scale = KV_ELEMENT_BYTES[str(kv_dtype).removeprefix("torch.")]
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * element + scale)


def kv_row_bytes(head_dim: int, dtype: "torch.dtype | str", kv_dtype: str = "auto") -> int:
    """Bytes of one stored row (a token's KV head, K or V): ``head_dim`` values of
    ``dtype``, or with ``kv_dtype="int8"`` ``head_dim`` codes and a float32 scale."""
    stored = "int8" if parse_kv_dtype(kv_dtype) == "int8" else dtype
    element, scale = KV_ELEMENT_BYTES[str(stored).removeprefix("torch.")]
    return head_dim * element + scale


def kv_block_bytes(cfg: "ModelConfig", page_size: int, dtype: "torch.dtype | str", kv_dtype: str = "auto") -> int:
    """Bytes of one block across all layers, K and V (= ``BlockPool.block_bytes()``)."""
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * kv_row_bytes(cfg.head_dim, dtype, kv_dtype)


def blocks_per_sequence(max_seq_len: int, page_size: int) -> int:
    return -(-max_seq_len // page_size)


def estimate_activation_bytes(
    cfg: "ModelConfig",
    prefill_chunk: int,
    max_seq_len: int,
    dtype: "torch.dtype",
    dequant_elements: int = 0,
) -> int:
    """Peak activation bytes of the worst forward pass, estimated from shapes: a
    ``prefill_chunk``-token chunk at the end of a ``max_seq_len`` context with the torch
    reference attention (gathered K/V, float32 scores), or the MLP, whichever is larger,
    plus the float temporary of the int8 reference linear (``dequant_elements`` of the
    largest quantized weight chunk) and the logits; times ``ACTIVATION_MARGIN``."""
    b = dtype_bytes(dtype)
    t, length = min(prefill_chunk, max_seq_len), max_seq_len
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    residual = 2 * t * h * b  # x and the normed h
    attention = (
        4 * t * qkv * b  # qkv, roped q/k and their temporaries
        + length * cfg.kv_size * 2 * (b + 4)  # gathered K/V and their float32 copies
        + t * cfg.q_size * 4 * 2  # float32 q and output
        + 3 * cfg.num_heads * t * length * 4  # scores, masked, softmax (float32)
    )
    mlp = t * (2 * inter + 2 * inter + h) * b  # gate_up, silu(gate), product, down
    dequant = dequant_elements * (4 + b)
    logits = 2 * cfg.vocab_size * 4
    return int((residual + max(attention, mlp) + dequant + logits) * ACTIVATION_MARGIN) + ACTIVATION_FLOOR


def chunk_activation_bytes(cfg: "ModelConfig", tokens: int, dtype: "torch.dtype") -> int:
    """Activations of a ``tokens``-token prefill chunk with the CUDA attention (no score
    matrix): the residual stream and the normed input, and the larger of the
    attention's (qkv, its roped copy, the output and its projection) and the MLP's
    (gate_up, the SwiGLU product, the down projection)."""
    b = dtype_bytes(dtype)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    attention = 2 * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size + h
    mlp = 3 * inter + h
    return tokens * (2 * h + max(attention, mlp)) * b


def default_prefill_chunk(
    cfg: "ModelConfig", dtype: "torch.dtype", max_seq_len: int, expands: bool, memory: MemoryInfo | None = None
) -> int:
    """Tokens a prefill forward takes at most: ``FLOAT_PREFILL_CHUNK``, or where the
    linears expand their weights once per forward (``expands``) up to
    ``EXPANDED_PREFILL_CHUNK`` (no more than ``max_seq_len``), halved (not below the float
    chunk) while :func:`chunk_activation_bytes` exceeds ``PREFILL_MEMORY_SHARE`` of
    ``memory.available``."""
    if not expands:
        return FLOAT_PREFILL_CHUNK
    chunk = max(FLOAT_PREFILL_CHUNK, min(EXPANDED_PREFILL_CHUNK, max_seq_len))
    while (
        chunk > FLOAT_PREFILL_CHUNK
        and memory is not None
        and chunk_activation_bytes(cfg, chunk, dtype) > memory.available * PREFILL_MEMORY_SHARE
    ):
        chunk = max(FLOAT_PREFILL_CHUNK, chunk // 2)
    return chunk


# -- the budget ----------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBudget:
    kind: str  # integrated | discrete | cpu | explicit
    source: str  # where "available" came from, or which explicit option sized the pool
    total: int
    available: int
    utilization: float
    weights: int
    activations: int
    graphs: int
    kv_bytes: int
    block_bytes: int
    num_blocks: int
    page_size: int
    max_seq_len: int
    capped: bool = False
    reserve: int = 0  # kept free for the OS and other processes (integrated GPU)
    headroom: int = 0  # bytes the probe left for the KV cache, before any cap (0: explicit size)

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def full_sequences(self) -> float:
        return self.num_blocks / blocks_per_sequence(self.max_seq_len, self.page_size)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tokens": self.tokens, "full_sequences": round(self.full_sequences, 2)}

    def describe(self) -> str:
        cap = f" (capped at {self.full_sequences:g} sequences)" if self.capped else ""
        return (
            f"KV budget [{self.kind}, {self.source}]: total {fmt_bytes(self.total)}, "
            f"available {fmt_bytes(self.available)} x {self.utilization:g}, reserve {fmt_bytes(self.reserve)}, "
            f"weights {fmt_bytes(self.weights)}, "
            f"activations {fmt_bytes(self.activations)}, graphs {fmt_bytes(self.graphs)} -> "
            f"headroom {fmt_bytes(self.headroom)}, KV {fmt_bytes(self.kv_bytes)}{cap} = {self.num_blocks} blocks x "
            f"{self.page_size} tokens = {self.tokens} tokens "
            f"({self.full_sequences:.1f} sequences of {self.max_seq_len})"
        )


def compute_budget(
    *,
    block_bytes: int,
    page_size: int,
    max_seq_len: int,
    memory: MemoryInfo | None = None,
    weights: int = 0,
    activations: int = 0,
    graphs: int = 0,
    utilization: float = DEFAULT_UTILIZATION,
    kv_blocks: int | None = None,
    kv_memory: int | str | None = None,
    max_blocks: int | None = None,
    reserve: int = 0,
) -> MemoryBudget:
    """The block count for a pool of ``block_bytes`` blocks (pure arithmetic).

    ``kv_blocks`` / ``kv_memory`` set it explicitly; otherwise
    ``(min(available * utilization, available - reserve) - activations - graphs) //
    block_bytes``, capped at ``max_blocks`` if given: at least ``reserve`` bytes and
    ``1 - utilization`` of what is available stay free. Raises BudgetError when the result
    cannot hold one ``max_seq_len`` sequence, naming every figure.
    """
    if not 0 < utilization <= 1:
        raise BudgetError(f"memory utilization must be in (0, 1], got {utilization}")
    if reserve < 0:
        raise BudgetError(f"memory reserve must be >= 0, got {reserve}")
    if kv_blocks is not None and kv_memory is not None:
        raise BudgetError("give kv_blocks or kv_memory, not both")
    if block_bytes < 1 or page_size < 1 or max_seq_len < 1:
        raise BudgetError(f"bad pool geometry: block {block_bytes} B, page {page_size}, max_seq_len {max_seq_len}")
    per_seq = blocks_per_sequence(max_seq_len, page_size)
    need = per_seq * block_bytes
    total = memory.total if memory else 0
    available = memory.available if memory else 0
    usable = min(int(available * utilization), available - reserve)
    headroom = usable - activations - graphs if memory else None
    capped = False

    if kv_blocks is not None:
        if isinstance(kv_blocks, bool) or int(kv_blocks) != kv_blocks or kv_blocks < 1:
            raise BudgetError(f"kv_blocks must be a positive integer, got {kv_blocks!r}")
        num_blocks, kind, source = int(kv_blocks), "explicit", f"kv_blocks={kv_blocks}"
        if num_blocks < per_seq:
            raise BudgetError(
                f"kv_blocks={num_blocks} ({num_blocks * page_size} tokens) cannot hold one full-context "
                f"sequence: max_seq_len {max_seq_len} needs {per_seq} blocks of {page_size} tokens "
                f"({fmt_bytes(need)}); raise kv_blocks or lower max_seq_len"
            )
    elif kv_memory is not None:
        nbytes = parse_bytes(kv_memory)
        num_blocks, kind, source = nbytes // block_bytes, "explicit", f"kv_memory={fmt_bytes(nbytes)}"
        if num_blocks < per_seq:
            raise BudgetError(
                f"kv_memory {fmt_bytes(nbytes)} holds {num_blocks} blocks of {fmt_bytes(block_bytes)} "
                f"({num_blocks * page_size} tokens); one full-context sequence of {max_seq_len} tokens "
                f"needs {per_seq} blocks = {fmt_bytes(need)}; raise kv_memory or lower max_seq_len"
            )
    else:
        if memory is None:
            raise BudgetError("no memory figures to size the KV pool from; pass kv_blocks= or kv_memory=")
        kind, source = memory.kind, memory.source
        num_blocks = max(0, headroom) // block_bytes
        if num_blocks < per_seq:
            raise BudgetError(
                f"not enough memory for one full-context sequence: {memory.kind} memory available "
                f"{fmt_bytes(available)} (of {fmt_bytes(total)}, {memory.source}): the lower of "
                f"{fmt_bytes(available * utilization)} (x utilization {utilization:g}) and "
                f"{fmt_bytes(available - reserve)} (less the reserve {fmt_bytes(reserve)} kept free), "
                f"minus activations {fmt_bytes(activations)} and graph "
                f"buffers {fmt_bytes(graphs)} leaves {fmt_bytes(max(0, headroom))} for the KV cache; "
                f"max_seq_len {max_seq_len} needs {per_seq} blocks x {fmt_bytes(block_bytes)} = {fmt_bytes(need)} "
                f"(weights already loaded: {fmt_bytes(weights)}). Lower max_seq_len, use a smaller dtype or "
                f"int8 weights, free memory, lower --memory-reserve or raise the utilization"
            )
        if max_blocks is not None and num_blocks > max_blocks:
            num_blocks, capped = max(max_blocks, per_seq), True
    if memory is not None and kind == "explicit" and num_blocks * block_bytes > max(0, headroom):
        log.warning(
            "%s asks for %s of KV cache but only %s of %s memory looks free after activations (%s)",
            source,
            fmt_bytes(num_blocks * block_bytes),
            fmt_bytes(max(0, headroom)),
            memory.kind,
            memory.source,
        )
    return MemoryBudget(
        kind=kind,
        source=source,
        total=total,
        available=available,
        utilization=utilization,
        weights=weights,
        activations=activations,
        graphs=graphs,
        kv_bytes=num_blocks * block_bytes,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        page_size=page_size,
        max_seq_len=max_seq_len,
        capped=capped,
        reserve=reserve,
        headroom=max(0, headroom) if memory is not None and kind != "explicit" else 0,
    )


def default_budget(
    memory: MemoryInfo | None,
    *,
    block_bytes: int,
    page_size: int,
    max_seq_len: int,
    reserve: int | str | None = None,
    **figures: Any,
) -> MemoryBudget:
    """:func:`compute_budget` under the engine's policy for the kind of memory: shared
    memory (CPU, integrated GPU) is capped at ``SHARED_MEMORY_SEQUENCES`` full contexts,
    and an integrated GPU keeps ``reserve`` (default ``DEFAULT_RESERVE``) free.
    ``figures``: weights, activations, graphs, utilization, kv_blocks, kv_memory."""
    kept = parse_reserve(DEFAULT_RESERVE if reserve is None else reserve)
    shared = memory is not None and memory.kind in ("cpu", "integrated")
    return compute_budget(
        block_bytes=block_bytes,
        page_size=page_size,
        max_seq_len=max_seq_len,
        memory=memory,
        max_blocks=SHARED_MEMORY_SEQUENCES * blocks_per_sequence(max_seq_len, page_size) if shared else None,
        reserve=kept if memory is not None and memory.kind == "integrated" else 0,
        **figures,
    )


# -- warm-up on a GPU ----------------------------------------------------------------


class _ScratchKV:
    """A ``SequenceKV`` over a one-block pool whose table maps every position to block
    0: the warm-up reads and writes as much as a full context would, in no memory."""

    def __init__(self, ops, k_pool, v_pool, table, length: int, scale: float) -> None:  # noqa: ANN001
        self.ops, self.k, self.v, self.table, self.length, self.scale = ops, k_pool, v_pool, table, length, scale

    def reserve(self, n: int) -> None:
        pass

    def advance(self, n: int) -> None:
        self.length += n

    def release(self) -> None:
        pass

    def pages(self, layer: int):  # noqa: ANN201
        from edge.kernels.reference import PagedKV

        return PagedKV(self.k[layer], self.v[layer], self.table)

    def attend_rope(self, layer: int, qkv, rope):  # noqa: ANN001, ANN201
        if qkv.shape[0] != 1:
            return None  # prefill chunks: qk_norm_rope, then attend
        out = self.ops.decode_attention_rope(
            qkv, rope, self.k[layer], self.v[layer], self.table, self.length + 1, self.scale
        )
        return out.unsqueeze(0)

    def attend(self, layer: int, q, k, v):  # noqa: ANN001, ANN201
        kp, vp = self.k[layer], self.v[layer]
        if k is not None:
            self.ops.write_kv(kp, vp, self.table, k, v, self.length)
        if q.shape[0] == 1:
            return self.ops.decode_attention(q[0], kp, vp, self.table, self.length + 1, self.scale).unsqueeze(0)
        return self.ops.prefill_attention(q, kp, vp, self.table, self.length, self.scale)


def measure_activations(
    model: "Model", ops, page_size: int, max_seq_len: int, prefill_chunk: int, kv_dtype: str = "auto"  # noqa: ANN001
) -> tuple[int, int]:
    """(prefill peak, decode peak) bytes above the baseline, measured on a CUDA device
    by a ``prefill_chunk``-token prefill at the end of a full context and one decode
    step (on a one-block pool of ``kv_dtype``). The caching allocator is emptied
    afterwards."""
    import torch

    from edge.kernels.kv_int8 import Int8KV

    dev, cfg = model.device, model.cfg
    if dev.type != "cuda":
        raise BudgetError("measure_activations needs a CUDA device; the CPU budget estimates from shapes")
    shape = (cfg.num_layers, 1, page_size, cfg.num_kv_heads, cfg.head_dim)
    if parse_kv_dtype(kv_dtype) == "int8":
        k_pool = Int8KV(torch.zeros(shape, device=dev, dtype=torch.int8), torch.zeros(shape[:-1], device=dev))
        v_pool = Int8KV(torch.zeros(shape, device=dev, dtype=torch.int8), torch.zeros(shape[:-1], device=dev))
    else:
        k_pool = torch.zeros(shape, device=dev, dtype=model.dtype)
        v_pool = torch.zeros(shape, device=dev, dtype=model.dtype)
    table = torch.zeros(blocks_per_sequence(max_seq_len, page_size), dtype=torch.int32, device=dev)
    t = min(prefill_chunk, max_seq_len - 1) if max_seq_len > 1 else 1
    ids = torch.zeros(t, dtype=torch.long, device=dev)
    kv = _ScratchKV(ops, k_pool, v_pool, table, max_seq_len - 1 - t if max_seq_len > 1 else 0, cfg.head_dim**-0.5)
    try:
        with torch.inference_mode():
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            pos = torch.arange(kv.length, kv.length + t, device=dev)
            hidden = model.forward(ids, pos, kv)
            model.logits(hidden[-1:])
            kv.advance(t)
            del hidden
            torch.cuda.synchronize(dev)
            prefill = torch.cuda.max_memory_allocated(dev) - base
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            pos = torch.arange(kv.length, kv.length + 1, device=dev)
            hidden = model.forward(ids[:1], pos, kv)
            model.logits(hidden)
            del hidden
            torch.cuda.synchronize(dev)
            decode = torch.cuda.max_memory_allocated(dev) - base
    finally:
        del k_pool, v_pool, table, kv
        torch.cuda.empty_cache()
    return int(prefill), int(decode)


def plan_kv_budget(
    model: "Model",
    ops,  # noqa: ANN001 - the attention kernel module (edge.kernels.reference or CUDA)
    *,
    page_size: int,
    max_seq_len: int,
    prefill_chunk: int,
    kv_blocks: int | None = None,
    kv_memory: int | str | None = None,
    utilization: float = DEFAULT_UTILIZATION,
    memory: MemoryInfo | Callable[[], MemoryInfo] | None = None,
    cuda_graph: bool = False,
    reserve: int | str | None = None,
    kv_dtype: str = "auto",
    vision_activations: int = 0,
) -> MemoryBudget:
    """The engine's budget: measure (GPU) or estimate (CPU) activations, probe memory
    (unless ``memory`` is given), compute the block count of a pool of ``kv_dtype``
    (int8: about twice the blocks of a bfloat16 pool). See the module docstring.
    ``vision_activations``: the vision tower's peak (edge/runtime/memory_plan.py
    ``tower_peak``); the tower runs before a prefill chunk's layers, so the larger counts."""
    from edge.quant.int4 import BLOCK_ROWS, Int4Weight
    from edge.quant.int4 import DEQUANT_CHUNK_ELEMENTS as INT4_CHUNK_ELEMENTS
    from edge.quant.q8_0 import DEQUANT_CHUNK_ELEMENTS, Int8Weight

    cfg, dev = model.cfg, model.device
    block = kv_block_bytes(cfg, page_size, model.dtype, kv_dtype)
    weights = model.weight_bytes()
    graphs = 0
    if dev.type == "cuda":
        prefill_peak, decode_peak = measure_activations(model, ops, page_size, max_seq_len, prefill_chunk, kv_dtype)
        activations = max(prefill_peak, decode_peak)
        if cuda_graph:
            graphs = GRAPH_SLOTS * decode_peak + GRAPH_OVERHEAD
    else:
        # The float temporaries of the reference linears' largest expansion (int8 or int4).
        deq = max(
            [min(w.weight.numel(), max(1, DEQUANT_CHUNK_ELEMENTS // w.in_features) * w.in_features)
             for w in model.w.values() if isinstance(w, Int8Weight)]
            + [min(w.packed.shape[0], max(1, INT4_CHUNK_ELEMENTS // (BLOCK_ROWS * w.in_features)))
               * BLOCK_ROWS * w.in_features for w in model.w.values() if isinstance(w, Int4Weight)],
            default=0,
        )
        activations = estimate_activation_bytes(cfg, prefill_chunk, max_seq_len, model.dtype, deq)
    activations = max(activations, vision_activations)
    if callable(memory):
        memory = memory()
    if memory is None:
        try:
            memory = probe_memory(dev)
        except (OSError, BudgetError) as exc:
            if kv_blocks is None and kv_memory is None:
                raise BudgetError(f"cannot probe memory ({exc}); pass kv_blocks= or kv_memory=") from exc
            memory = None
    return default_budget(
        memory,
        block_bytes=block,
        page_size=page_size,
        max_seq_len=max_seq_len,
        weights=weights,
        activations=activations,
        graphs=graphs,
        utilization=utilization,
        kv_blocks=kv_blocks,
        kv_memory=kv_memory,
        reserve=reserve,
    )
