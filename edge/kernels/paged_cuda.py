"""CUDA paged-attention kernels with the semantics of :mod:`edge.kernels.reference`.

Drop-in replacements for the reference functions on CUDA tensors (the engine swaps
them in when :func:`available` says so):

- :func:`write_kv` -- one launch writes K/V ``[T, kv_heads, D]`` of positions
  ``[start, start + T)`` to their pages; with ``pos`` (device int32 ``[1]``) the start
  is read on the device (graph-safe decode write).
- :func:`prefill_attention` -- causal attention of a chunk ``q [T, q_heads, D]`` at
  positions ``[start, start + T)`` against the paged prefix and itself.
- :func:`decode_attention` -- one query token ``q [q_heads, D]`` against ``[0, kv_len)``;
  with ``pos`` the length ``*pos + 1`` is read on the device, the launch does not depend
  on it, and ``out=`` lets a CUDA graph write to a static buffer.
- :func:`decode_attention_rope` -- the same from the qkv projection's row: the step's
  q/k norm + RoPE and K/V store run inside the attention launch (one launch per layer
  fewer than ``qk_norm_rope`` + :func:`decode_attention`).

Layouts: per-layer pools ``[num_blocks, page_size, kv_heads, head_dim]`` (contiguous;
a layer slice of ``[layers, num_blocks, page, kv_heads, D]`` is fine), ``page_size`` a
power of two, block table int32 ``[max_blocks_per_seq]``, float16 / bfloat16 / float32,
head_dim 64 or 128, any GQA ratio. Nothing at or beyond the sequence length is read.

Call :func:`load` (or let the first call do it) before capturing a CUDA graph: it
compiles (NVRTC, disk-cached) and loads the kernels, which must not happen during
capture.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from edge.kernels import fused_cuda, nvrtc
from edge.kernels.nvrtc import KernelCompileError, KernelsUnavailable
from edge.kernels.reference import PagedKV, Rope

__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "MAX_SPLITS",
    "KernelCompileError",
    "KernelsUnavailable",
    "available",
    "decode_attention",
    "decode_attention_rope",
    "decode_splits",
    "graph_decode_options",
    "set_decode_tuning",
    "load",
    "prefill_attention",
    "write_kv",
]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128)
MAX_SPLITS = 128  # most splits a launch takes (bounds the partials' workspace)
_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_GROUP_TILES = (1, 2, 4, 8)
_DECODE_THREADS = 128
_PREFILL_THREADS = 128
_PREFILL_ROWS = 64
_KV_THREADS = 256
_LOG2E = 1.4426950408889634

# Decode implementation for float16/bfloat16: "tc" (tensor cores, paged_decode_tc.cu)
# or "simt" (CUDA cores, paged_decode.cu; float32 always uses it). Compile-time knobs of
# both kernels (EDGE_TC_* / EDGE_DECODE_*, see the sources) and the split policy; change
# them with set_decode_tuning() (tools/bench.py sweeps them).
DECODE_TUNING: dict[str, Any] = {
    "impl": "tc",
    # Warps of a tensor-core CTA; a stage holds 16 keys a warp. 8 warps (one CTA an SM at
    # ~173 registers) against 4 (two an SM): int8 8B decode on an H100 +2.4 % at context
    # 128, +3.6 % at 1024, +0.3-0.9 % at 4096-8000, because a short context's keys fit one
    # or two 128-key stages of one CTA a KV head; attention-after-attention at 8192
    # keys (tools/bench.py kernels) is 3 % slower (docs/kernels.md, eighth session).
    "EDGE_TC_WARPS": 8,
    "min_split_rows": 64,  # host-length launches: no split shorter than this
    # Cap on the one-wave split count (more splits: more partials to merge; 16 and 48-64
    # measured slower, docs/kernels.md).
    "max_splits": 32,
    # Deepest K/V pipeline of the tensor-core kernel; fewer where shared memory would
    # not hold EDGE_TC_MIN_BLOCKS CTAs an SM (tc_stages). At 8 warps 2 stages (139 KB a
    # CTA) against 1: int8 decode +2.2 % at context 2048, equal at 128. 3 stages (209 KB)
    # keep the next overlapped GEMV's CTAs from starting beside them: int8 decode -5 to
    # -8 %, and attention-after-attention at 8192 keys stays at 65-67 % (docs/kernels.md,
    # tenth session).
    "tc_max_stages": 2,
    # CTAs per KV head that merge the splits, each a share of the outputs, when the whole
    # grid is resident at once (else 1: a merger waits for every split of its head).
    # 8 vs 1: 8192 keys 15.9 vs 18.3 us, decode +2-3 % (docs/kernels.md).
    "mergers": 8,
    # Device-length (graph) launches: fewest keys per active split; the launch carries
    # max_splits and the kernel runs only as many as the length fills (active_splits).
    # 256 (two 8-warp stages, no split merge below 257 keys): +1.5 % int8 decode at
    # context 128 against 64 and 128 (docs/kernels.md, eighth session).
    "graph_min_split_rows": 256,
    # decode_attention_rope: the q/k norm + RoPE + K/V store inside the attention launch
    # (False: qk_norm_rope's launch, then decode_attention).
    "rope_in_attention": True,
}
# EDGE_DECODE_TUNING='{"max_splits": 16, "EDGE_TC_WARPS": 2}' (JSON) changes the
# defaults of a process: a candidate tuning can run the whole GPU test suite.
if os.environ.get("EDGE_DECODE_TUNING"):
    DECODE_TUNING.update(json.loads(os.environ["EDGE_DECODE_TUNING"]))
_DEFAULT_TUNING = dict(DECODE_TUNING)


def set_decode_tuning(**knobs: Any) -> dict[str, Any]:
    """Set decode knobs: ``impl`` ("tc" | "simt"), ``min_split_rows``, ``max_splits``,
    and kernel defines (``EDGE_TC_WARPS=2``, ``EDGE_DECODE_STAGES=4``, ...). Knobs not
    given return to their defaults. Returns the previous setting; kernels compile on
    next use."""
    prev = dict(DECODE_TUNING)
    DECODE_TUNING.clear()
    DECODE_TUNING.update(_DEFAULT_TUNING)
    DECODE_TUNING.update(knobs)
    if DECODE_TUNING["impl"] not in ("tc", "simt"):
        raise ValueError(f"impl must be 'tc' or 'simt', got {DECODE_TUNING['impl']!r}")
    _plans.clear()
    return prev


def _defines(prefix: str) -> dict[str, int]:
    return {k: int(v) for k, v in DECODE_TUNING.items() if k.startswith(prefix)}


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


def _group_tile(group: int) -> int:
    for gt in _GROUP_TILES:
        if group <= gt:
            return gt
    return _GROUP_TILES[-1]


def _variant(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    return {"EDGE_DTYPE": _DTYPE_CODE[dtype], "EDGE_HEAD_DIM": head_dim}


def _decode_kernel(dev: int, dtype: torch.dtype, head_dim: int, gt: int) -> Any:
    defines = {**_variant(dtype, head_dim), **_defines("EDGE_DECODE_")}
    return nvrtc.get_kernel(dev, "paged_decode.cu", f"paged_decode_g{gt}", defines)


def _tc_warps() -> int:
    return int(DECODE_TUNING["EDGE_TC_WARPS"])


def _tc_min_blocks(warps: int) -> int:
    """Resident CTAs an SM the kernel's register budget is set for (its
    EDGE_TC_MIN_BLOCKS default)."""
    return int(DECODE_TUNING.get("EDGE_TC_MIN_BLOCKS", 1 if warps >= 8 else 2 if warps >= 4 else 4))


def _tc_static_smem(warps: int, head_dim: int) -> int:
    """Static shared memory of paged_decode_tc.cu beside its dynamic pipeline, rounded
    up: the warps' row maxima and sums, a flag, and the RoPE variant's 16 rotated query
    heads."""
    return 2 * warps * 16 * 4 + 16 * head_dim * 2 + 64


def tc_smem_bytes(dtype: torch.dtype, head_dim: int, warps: int, stages: int) -> int:
    """Dynamic shared memory of paged_decode_tc.cu (its TcCfg::SMEM_BYTES): ``stages``
    K+V stages of 16 * warps padded rows, or the warps' float32 outputs if larger."""
    esize = torch.empty((), dtype=dtype).element_size()
    pipe = stages * 2 * 16 * warps * (head_dim + 8) * esize
    return max(pipe, warps * 16 * head_dim * 4)


def tc_stages(dev: int, dtype: torch.dtype, head_dim: int) -> int:
    """Pipeline depth of the tensor-core decode kernel on this device: ``EDGE_TC_STAGES``
    when tuned, else the most stages (at most ``tc_max_stages``) that still let
    ``EDGE_TC_MIN_BLOCKS`` CTAs share an SM (by default 2 on an H100 / H200 and on Orin's
    164 KB an SM at head_dim 128; with ``tc_max_stages=3``: 3 on an H100 / H200)."""
    if "EDGE_TC_STAGES" in DECODE_TUNING:
        return int(DECODE_TUNING["EDGE_TC_STAGES"])
    warps = _tc_warps()
    ctas = _tc_min_blocks(warps)
    per_sm, optin, reserved = nvrtc.shared_memory(dev)
    stages = 1
    for n in range(2, int(DECODE_TUNING["tc_max_stages"]) + 1):
        need = tc_smem_bytes(dtype, head_dim, warps, n) + _tc_static_smem(warps, head_dim)
        if need <= optin and ctas * (need + reserved) <= per_sm:
            stages = n
    return stages


def _decode_tc_kernel(
    dev: int, dtype: torch.dtype, head_dim: int, rope: bool = False
) -> tuple[Any, int]:
    """The tensor-core decode kernel (``rope``: with the step's q/k norm + RoPE) for
    this device and the dynamic shared memory its launches pass."""
    stages = tc_stages(dev, dtype, head_dim)
    defines = {
        **_variant(dtype, head_dim),
        **_defines("EDGE_TC_"),
        "EDGE_TC_STAGES": stages,
    }
    name = "paged_decode_tc_rope" if rope else "paged_decode_tc"
    kernel = nvrtc.get_kernel(dev, "paged_decode_tc.cu", name, defines)
    smem = tc_smem_bytes(dtype, head_dim, _tc_warps(), stages)
    nvrtc.allow_dynamic_smem(kernel, dev, smem)
    return kernel, smem


def _prefill_kernel(dev: int, dtype: torch.dtype, head_dim: int) -> Any:
    return nvrtc.get_kernel(
        dev, "paged_prefill.cu", "paged_prefill", _variant(dtype, head_dim)
    )


def _kv_kernel(dev: int) -> Any:
    return nvrtc.get_kernel(dev, "kv_write.cu", "kv_write")


def load(
    device: Any = None,
    dtypes: Iterable[torch.dtype] = (torch.float16, torch.bfloat16),
    head_dims: Iterable[int] = HEAD_DIMS,
) -> None:
    """Compile (or fetch from the disk cache) and load every kernel for ``device`` and
    the given dtypes / head dims. Raises KernelsUnavailable (what is missing) or
    KernelCompileError. Call before capturing CUDA graphs."""
    dev = nvrtc.device_index(device, "the CUDA kernels")
    nvrtc.check_available(dev)
    _kv_kernel(dev)
    for dtype in dtypes:
        if dtype not in _DTYPE_CODE:
            raise ValueError(f"unsupported dtype {dtype}; supported: {DTYPES}")
        for hd in head_dims:
            if hd not in HEAD_DIMS:
                raise ValueError(f"unsupported head_dim {hd}; supported: {HEAD_DIMS}")
            for gt in _GROUP_TILES:
                _decode_kernel(dev, dtype, hd, gt)
            if dtype != torch.float32:
                _decode_tc_kernel(dev, dtype, hd)
                _decode_tc_kernel(dev, dtype, hd, rope=True)
                _prefill_kernel(dev, dtype, hd)


def available(device: Any = None) -> bool:
    """True when the kernels can run on ``device`` (cuda-python, NVRTC, headers, GPU
    present and the kernel sources compile)."""
    return nvrtc.loads(load, device)


# ---------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------


def _check_pools(
    k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor
) -> tuple[int, int, int, int]:
    if not isinstance(k_pool, torch.Tensor) or not isinstance(v_pool, torch.Tensor):
        raise TypeError("k_pool and v_pool must be tensors")
    if k_pool.dim() != 4:
        raise ValueError(
            f"k_pool must be [num_blocks, page_size, kv_heads, head_dim], got {tuple(k_pool.shape)}"
        )
    if v_pool.shape != k_pool.shape:
        raise ValueError(
            f"v_pool shape {tuple(v_pool.shape)} != k_pool shape {tuple(k_pool.shape)}"
        )
    if k_pool.dtype != v_pool.dtype or k_pool.dtype not in _DTYPE_CODE:
        raise ValueError(
            f"pools must share one dtype of {DTYPES}, got {k_pool.dtype} / {v_pool.dtype}"
        )
    if k_pool.device.type != "cuda" or v_pool.device != k_pool.device:
        raise ValueError(
            f"pools must be on one CUDA device, got {k_pool.device} / {v_pool.device}"
        )
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError(
            "pools must be contiguous (a layer slice of [layers, blocks, page, heads, D] is)"
        )
    nb, page, kvh, d = k_pool.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} not supported; supported: {HEAD_DIMS}")
    if page <= 0 or page & (page - 1):
        raise ValueError(f"page_size must be a power of two, got {page}")
    if nb * page >= 2**31:
        raise ValueError(
            f"pool of {nb} x {page} rows is too large (kernels index rows with int32)"
        )
    if k_pool.data_ptr() % 16 or v_pool.data_ptr() % 16:
        raise ValueError("pools must be 16-byte aligned")
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.dtype != torch.int32
        or block_table.dim() != 1
    ):
        raise ValueError("block_table must be a 1-D int32 tensor [max_blocks_per_seq]")
    if block_table.device != k_pool.device:
        raise ValueError(
            f"block_table is on {block_table.device}, pools on {k_pool.device}"
        )
    if not block_table.is_contiguous():
        raise ValueError("block_table must be contiguous")
    return nb, page, kvh, d


def _check_pos(pos: torch.Tensor | None, device: torch.device) -> int:
    if pos is None:
        return 0
    if (
        not isinstance(pos, torch.Tensor)
        or pos.dtype != torch.int32
        or pos.numel() != 1
    ):
        raise ValueError("pos must be an int32 tensor with one element")
    if pos.device != device:
        raise ValueError(f"pos is on {pos.device}, pools on {device}")
    return pos.data_ptr()


def _check_len(name: str, length: int, page: int, block_table: torch.Tensor) -> None:
    need = (length + page - 1) // page
    if need > block_table.numel():
        raise ValueError(
            f"{name}={length} needs {need} blocks of {page}, block_table holds {block_table.numel()}"
        )


# ---------------------------------------------------------------------------------------
# KV write
# ---------------------------------------------------------------------------------------


def _kv_source(
    x: torch.Tensor, pool: torch.Tensor, name: str, shape: tuple[int, ...]
) -> torch.Tensor:
    if x.dim() != 3 or tuple(x.shape[1:]) != shape:
        raise ValueError(
            f"{name} must be [T, {shape[0]}, {shape[1]}], got {tuple(x.shape)}"
        )
    if x.device != pool.device:
        raise ValueError(f"{name} is on {x.device}, pools on {pool.device}")
    if x.dtype != pool.dtype:
        x = x.to(pool.dtype)  # as the reference does
    es = x.element_size()
    ok = (
        x.stride(2) == 1
        and x.data_ptr() % 16 == 0
        and (x.stride(0) * es) % 16 == 0
        and (x.stride(1) * es) % 16 == 0
    )
    return x if ok else _dense(x)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (a fresh copy when a view is misaligned)."""
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    pos: torch.Tensor | None = None,
) -> None:
    """Write K/V ``[T, kv_heads, head_dim]`` of positions [start, start+T) into their
    pages in one launch. With ``pos`` (int32 CUDA ``[1]``) the start position is read
    on the device and ``start`` is ignored (graph-safe)."""
    _nb, page, kvh, d = _check_pools(k_pool, v_pool, block_table)
    k = _kv_source(k, k_pool, "k", (kvh, d))
    v = _kv_source(v, v_pool, "v", (kvh, d))
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens, v has {v.shape[0]}")
    t = k.shape[0]
    pos_ptr = _check_pos(pos, k_pool.device)
    if pos is None:
        start = int(start)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        _check_len("start + T", start + t, page, block_table)
    if t == 0:
        return
    dev = k_pool.device.index
    kern = _kv_kernel(dev)
    es = k.element_size()
    row_vecs = d * es // 16
    total = t * kvh * row_vecs
    blocks = min((total + _KV_THREADS - 1) // _KV_THREADS, 65535)
    nvrtc.launch(
        dev,
        kern,
        blocks,
        _KV_THREADS,
        (
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            block_table.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            pos_ptr,
            np.int32(0 if pos is not None else start),
            np.int32(t),
            np.int32(kvh),
            np.int32(row_vecs),
            np.int64(k.stride(0) * es),
            np.int64(k.stride(1) * es),
            np.int64(v.stride(0) * es),
            np.int64(v.stride(1) * es),
            np.int32(int(math.log2(page))),
        ),
    )


# ---------------------------------------------------------------------------------------
# decode (and the float32 prefill path, which is the decode kernel over T tokens)
# ---------------------------------------------------------------------------------------

def _workspace(device: torch.device, words: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split merge's flagged 8-byte words (common.cuh), filled with ones (not yet
    written) when made and left that way by every launch, and self-resetting arrival
    counters (zeroed once), for the current stream (``nvrtc.stream_scratch``), grown by
    doubling."""

    def fits(cur: tuple[torch.Tensor, torch.Tensor]) -> bool:
        return cur[0].numel() >= words and cur[1].numel() >= counters

    def make(cur: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        nw = max(words, 1 << 15, 2 * cur[0].numel() if cur is not None else 0)
        nc = max(counters, 1024, 2 * cur[1].numel() if cur is not None else 0)
        return torch.full((nw,), -1, dtype=torch.int64, device=device), torch.zeros(nc, dtype=torch.int32, device=device)

    return nvrtc.stream_scratch("decode_split_words", device.index, fits, make)


class _DecodePlan:
    """Per (device, dtype, head_dim, q_heads, kv_heads, page, tokens > 1) launch
    constants of the decode kernel."""

    __slots__ = (
        "counters",
        "ctas",
        "wave",
        "dev",
        "group",
        "kernel",
        "kvh",
        "log2_page",
        "merge_cap",
        "graph_min_rows",
        "max_splits",
        "min_rows",
        "rope",
        "smem",
        "threads",
    )

    def __init__(
        self,
        dev: int,
        dtype: torch.dtype,
        d: int,
        q_heads: int,
        kvh: int,
        page: int,
        multi: bool,
        rope: bool,
    ) -> None:
        self.dev = dev
        self.kvh = kvh
        self.group = q_heads // kvh
        self.log2_page = page.bit_length() - 1
        self.rope = rope and _tc_path(dtype, multi) and bool(DECODE_TUNING["rope_in_attention"])
        if _tc_path(dtype, multi):
            tile = 16  # query heads per m16 tile
            self.kernel, self.smem = _decode_tc_kernel(dev, dtype, d, self.rope)
            self.threads = 32 * _tc_warps()
        else:
            tile = _group_tile(self.group)
            self.kernel = _decode_kernel(dev, dtype, d, tile)
            self.threads = _DECODE_THREADS
            self.smem = 0
        self.ctas = kvh * ((self.group + tile - 1) // tile)
        self.counters = self.ctas  # arrivals per group (common.cuh, last_arrival)
        occ = nvrtc.max_active_blocks(self.kernel, self.threads, dev, dynamic_smem=self.smem)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.wave = occ * sms
        # One full wave of CTAs: every split resident at once, each streaming its range.
        cap = min(MAX_SPLITS, int(DECODE_TUNING["max_splits"]))
        self.max_splits = max(1, min(cap, self.wave // self.ctas))
        self.min_rows = int(DECODE_TUNING["min_split_rows"])
        self.merge_cap = int(DECODE_TUNING["mergers"])
        self.graph_min_rows = int(DECODE_TUNING["graph_min_split_rows"])

    def splits(self, kv_len: int | None) -> int:
        if kv_len is None:
            return self.max_splits
        return max(1, min(self.max_splits, -(-kv_len // self.min_rows)))

    def mergers(self, splits: int, tokens: int) -> int:
        """The kernel's ``mergers``: how many CTAs per group merge the splits, each a
        share, waiting for every split of its group. Several only from 16 splits (at 8
        one merger is faster: 5.3 vs 6.0-6.2 us at 512 keys), at most one per 2 splits.
        (16 splits of 8192 keys, H100: 8 mergers 16.8-16.9 us, 4: 17.3, 16: 18.6-18.8.)
        0 when the grid is larger than one wave: a waiting merger could then hold the slot
        a split it waits for needs, so the last CTA to arrive merges alone."""
        if self.ctas * splits * tokens > self.wave:
            return 0
        if splits < 16:
            return 1
        return max(1, min(splits // 2, self.merge_cap))


def _tc_path(dtype: torch.dtype, multi: bool) -> bool:
    """Whether decode runs the tensor-core kernel (the only one with the RoPE variant)."""
    return dtype != torch.float32 and not multi and DECODE_TUNING["impl"] == "tc"


_plans: dict[tuple, _DecodePlan] = {}


def _plan(
    dev: int,
    dtype: torch.dtype,
    d: int,
    q_heads: int,
    kvh: int,
    page: int,
    multi: bool = False,
    rope: bool = False,
) -> _DecodePlan:
    key = (dev, dtype, d, q_heads, kvh, page, multi, rope)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _DecodePlan(dev, dtype, d, q_heads, kvh, page, multi, rope)
    return plan


def decode_splits(
    device: Any,
    dtype: torch.dtype,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    kv_len: int | None,
    page_size: int = 16,
) -> int:
    """Split count the decode launch uses: one full wave of CTAs (resident CTAs per SM x
    SMs / CTAs per split), at most ``MAX_SPLITS``, and for a host length (``kv_len`` not
    None) no split shorter than 64 rows. ``kv_len=None`` gives the device-length (graph)
    count, which depends on nothing that changes between steps."""
    return _plan(
        nvrtc.device_index(device, "the CUDA kernels"), dtype, head_dim, q_heads, kv_heads, page_size
    ).splits(kv_len)


def graph_decode_options(
    device: Any, dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int, page_size: int = 16
) -> dict[str, int]:
    """Keyword arguments of :func:`decode_attention` / :func:`decode_attention_rope` that
    make a host-length launch identical to a device-length (graph) one: its split count
    and its fewest keys per active split. Eager decode passes them so that it produces
    the graph's tokens."""
    plan = _plan(nvrtc.device_index(device, "the CUDA kernels"), dtype, head_dim, q_heads, kv_heads, page_size)
    return {"num_splits": plan.splits(None), "min_split_rows": plan.graph_min_rows}


def _launch_decode(
    plan: _DecodePlan,
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    pos_ptr: int,
    host_len: int,
    tokens: int,
    splits: int,
    scale: float,
    min_rows: int,
    rope_args: tuple = (),
) -> None:
    ws_ptr = cnt_ptr = 0
    if splits > 1:
        ws, cnt = _workspace(
            k_pool.device, tokens * splits * plan.group * plan.kvh * k_pool.shape[3], tokens * plan.counters
        )
        ws_ptr, cnt_ptr = ws.data_ptr(), cnt.data_ptr()
    nvrtc.launch(
        plan.dev,
        plan.kernel,
        (plan.ctas, splits, tokens),
        plan.threads,
        (
            out.data_ptr(),
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            block_table.data_ptr(),
            pos_ptr,
            np.int32(host_len),
            np.int32(plan.kvh),
            np.int32(plan.group),
            np.int32(plan.log2_page),
            np.float32(scale * _LOG2E),
            ws_ptr,
            cnt_ptr,
            np.int32(plan.mergers(splits, tokens)),
            np.int32(min_rows),
            *rope_args,
        ),
        shmem=plan.smem,
    )


def _check_q(
    q: torch.Tensor, k_pool: torch.Tensor, kvh: int, d: int, what: str
) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError("q must be a tensor")
    if q.dtype != k_pool.dtype:
        raise ValueError(f"q dtype {q.dtype} != pool dtype {k_pool.dtype}")
    if q.device != k_pool.device:
        raise ValueError(f"q is on {q.device}, pools on {k_pool.device}")
    if q.shape[-1] != d:
        raise ValueError(f"q head_dim {q.shape[-1]} != pool head_dim {d} ({what})")
    qh = q.shape[-2]
    if qh % kvh:
        raise ValueError(f"q_heads {qh} is not a multiple of kv_heads {kvh}")


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"out must be {shape} {dtype} on {device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError("out must be contiguous and 16-byte aligned")


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: int,
    scale: float,
    pos: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    min_split_rows: int | None = None,
) -> torch.Tensor:
    """One query token ``q [q_heads, D]`` (or ``[1, q_heads, D]``) against positions
    [0, kv_len) -> same shape as q.

    With ``pos`` (int32 CUDA ``[1]``) kv_len = ``*pos + 1`` is read on the device (the
    host ``kv_len`` is ignored) and the launch configuration is fixed, so the call can be
    captured in a CUDA graph and replayed as ``pos`` advances. ``out`` is an optional
    preallocated output (static buffer for graphs). ``num_splits`` overrides the
    flash-decoding split count (1..MAX_SPLITS; tests use it to compare launches);
    ``min_split_rows`` (default: the graph's with ``pos``, else 1) makes the kernel run
    only the splits the length fills with that many keys each (graph_decode_options)."""
    _nb, page, kvh, d = _check_pools(k_pool, v_pool, block_table)
    if q.dim() not in (2, 3) or (q.dim() == 3 and q.shape[0] != 1):
        raise ValueError(
            f"q must be [q_heads, D] or [1, q_heads, D], got {tuple(q.shape)}"
        )
    _check_q(q, k_pool, kvh, d, "decode")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_out(out, tuple(q.shape), q.dtype, q.device)
    plan = _plan(k_pool.device.index, k_pool.dtype, d, q.shape[-2], kvh, page)
    _decode(plan, out, _dense(q), k_pool, v_pool, block_table, kv_len, scale, pos, num_splits, min_split_rows)
    return out


def decode_attention_rope(
    qkv: torch.Tensor,
    rope: Rope,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: int,
    scale: float,
    pos: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    min_split_rows: int | None = None,
) -> torch.Tensor:
    """:func:`edge.kernels.reference.decode_attention_rope` on CUDA: the decode token's
    qkv row ``[1, (heads + 2 kv_heads) * D]`` -> attention ``[heads, D]``, its key
    (normalised, rotated) and value stored at position kv_len - 1 on the way. One launch
    of the tensor-core kernel; where that kernel does not run (float32, ``impl="simt"``,
    rows it cannot read in place) ``qk_norm_rope`` and :func:`decode_attention`.
    ``pos``, ``out``, ``num_splits`` and ``min_split_rows`` as in :func:`decode_attention`."""
    _nb, page, kvh, d = _check_pools(k_pool, v_pool, block_table)
    heads = rope.heads
    if rope.kv_heads != kvh or heads % kvh:
        raise ValueError(f"rope is for {heads} / {rope.kv_heads} heads, pools hold {kvh} KV heads")
    width = (heads + 2 * kvh) * d
    if qkv.dim() != 2 or qkv.shape[0] != 1 or qkv.shape[1] < width:
        raise ValueError(f"qkv must be [1, >= {width}] (one token), got {tuple(qkv.shape)}")
    if qkv.dtype != k_pool.dtype or qkv.device != k_pool.device:
        raise ValueError(f"qkv is {qkv.dtype} on {qkv.device}, pools {k_pool.dtype} on {k_pool.device}")
    shape = (heads, d)
    if out is None:
        out = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
    else:
        _check_out(out, shape, qkv.dtype, qkv.device)
    plan = _plan(k_pool.device.index, k_pool.dtype, d, heads, kvh, page, rope=True)
    options = {"num_splits": num_splits, "min_split_rows": min_split_rows}
    tables = (rope.cos, rope.sin_signed) + (() if rope.qk_norm is None else (rope.qk_norm,))
    in_place = plan.rope and qkv.is_contiguous() and qkv.data_ptr() % 16 == 0
    if not (in_place and all(_fits_rope(t, qkv, d) for t in tables)):
        # torch.full: a fill launch with the value as its argument, not a host-to-device copy
        positions = pos if pos is not None else torch.full((1,), int(kv_len) - 1, dtype=torch.int32, device=qkv.device)
        q, _ = fused_cuda.qk_norm_rope(
            qkv, rope.qk_norm, rope.cos, rope.sin_signed, positions, heads, kvh, d, rope.eps,
            PagedKV(k_pool, v_pool, block_table),
        )
        return decode_attention(q[0], k_pool, v_pool, block_table, kv_len, scale, pos, out, **options)
    norm_ptr = 0 if rope.qk_norm is None else rope.qk_norm.data_ptr()
    rope_args = (norm_ptr, rope.cos.data_ptr(), rope.sin_signed.data_ptr(), np.int32(rope.cos.shape[0]), np.float32(rope.eps))
    _decode(plan, out, qkv, k_pool, v_pool, block_table, kv_len, scale, pos, num_splits, min_split_rows, rope_args)
    return out


def _fits_rope(t: torch.Tensor, qkv: torch.Tensor, d: int) -> bool:
    """A table the RoPE kernel reads in place: contiguous rows of head_dim, qkv's dtype."""
    return (
        t.dtype == qkv.dtype
        and t.device == qkv.device
        and t.dim() == 2
        and t.shape[1] == d
        and t.is_contiguous()
        and t.data_ptr() % 16 == 0
    )


def _decode(
    plan: _DecodePlan,
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: int,
    scale: float,
    pos: torch.Tensor | None,
    num_splits: int | None,
    min_split_rows: int | None,
    rope_args: tuple = (),
) -> None:
    """The one-token decode launch of :func:`decode_attention` (and its RoPE variant)."""
    page = k_pool.shape[1]
    pos_ptr = _check_pos(pos, k_pool.device)
    if pos is None:
        kv_len = int(kv_len)
        if kv_len < 1:
            raise ValueError(f"kv_len must be >= 1, got {kv_len}")
        _check_len("kv_len", kv_len, page, block_table)
    if num_splits is None:
        splits = plan.splits(None if pos is not None else kv_len)
    else:
        splits = int(num_splits)
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {splits}")
    if min_split_rows is None:
        min_split_rows = plan.graph_min_rows if pos is not None else 1
    elif int(min_split_rows) < 1:
        raise ValueError(f"min_split_rows must be >= 1, got {min_split_rows}")
    _launch_decode(
        plan,
        out,
        q,
        k_pool,
        v_pool,
        block_table,
        pos_ptr,
        0 if pos is not None else kv_len,
        1,
        splits,
        float(scale),
        int(min_split_rows),
        rope_args,
    )


# ---------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------


def prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk ``q [T, q_heads, D]`` at positions [start, start+T)
    against the paged prefix and itself (its K/V must already be written) ->
    ``[T, q_heads, D]`` in q's dtype."""
    _nb, page, kvh, d = _check_pools(k_pool, v_pool, block_table)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, q_heads, D], got {tuple(q.shape)}")
    _check_q(q, k_pool, kvh, d, "prefill")
    q = _dense(q)
    start = int(start)
    t, q_heads, _ = q.shape
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    _check_len("start + T", start + t, page, block_table)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_out(out, tuple(q.shape), q.dtype, q.device)
    if t == 0:
        return out
    if k_pool.dtype == torch.float32:
        # No tensor-core path for float32: token i is a decode of length start + i + 1.
        if t > 65535:
            raise ValueError("float32 prefill chunks are limited to 65535 tokens")
        plan = _plan(
            k_pool.device.index, k_pool.dtype, d, q_heads, kvh, page, multi=True
        )
        _launch_decode(
            plan, out, q, k_pool, v_pool, block_table, 0, start + 1, t, 1, float(scale), 1
        )
        return out
    dev = k_pool.device.index
    kern = _prefill_kernel(dev, k_pool.dtype, d)
    group = q_heads // kvh
    row_tiles = (t * group + _PREFILL_ROWS - 1) // _PREFILL_ROWS
    nvrtc.launch(
        dev,
        kern,
        (row_tiles, kvh),
        _PREFILL_THREADS,
        (
            out.data_ptr(),
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            block_table.data_ptr(),
            np.int32(t),
            np.int32(start),
            np.int32(kvh),
            np.int32(group),
            np.int32(int(math.log2(page))),
            np.float32(float(scale) * _LOG2E),
        ),
    )
    return out
