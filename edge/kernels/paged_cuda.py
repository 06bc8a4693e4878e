"""CUDA paged-attention kernels with the semantics of :mod:`edge.kernels.reference`.

:class:`PagedAttentionCuda` is a backend's attention; its methods are drop-in
replacements for the reference functions on CUDA tensors:

- ``write_kv`` -- one launch writes K/V ``[T, kv_heads, D]`` of positions
  ``[start, start + T)`` to their pages; with ``pos`` (device int32 ``[1]``) the start
  is read on the device (graph-safe decode write).
- ``prefill_attention`` -- causal attention of a chunk ``q [T, q_heads, D]`` at
  positions ``[start, start + T)`` against the paged prefix and itself.
- ``decode_attention`` -- one query token ``q [q_heads, D]`` against ``[0, kv_len)``;
  with ``pos`` the length ``*pos + 1`` is read on the device, the launch does not depend
  on it, and ``out=`` lets a CUDA graph write to a static buffer.
- ``decode_attention_rope`` -- the same from the qkv projection's row: the step's
  q/k norm + RoPE and K/V store run inside the attention launch.

Layouts: per-layer pools ``[num_blocks, page_size, kv_heads, head_dim]`` (contiguous;
a layer slice of ``[layers, num_blocks, page, kv_heads, D]`` is fine), ``page_size`` a
power of two, block table int32 ``[max_blocks_per_seq]``, float16 / bfloat16 / float32,
head_dim 64 or 128, any GQA ratio. Nothing at or beyond the sequence length is read.
A pool pair may instead be :class:`~edge.kernels.kv_int8.Int8KV` (int8 codes and a
float32 scale a row, scales ``[num_blocks, page_size, kv_heads]``): every method takes
it with queries of any of the three dtypes, through the ``*_q8`` kernels (a second
compile of each source with ``CFG_KV_INT8``).

Constructing the object compiles (NVRTC, disk-cached) and loads every kernel it needs,
which must not happen during a graph capture. Its :class:`DecodeTuning` is fixed for
its life; a different tuning is a different object (tools/bench.py sweeps that way).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from edge.kernels import nvrtc
from edge.kernels.kv_int8 import Int8KV
from edge.kernels.launcher import Launcher
from edge.kernels.nvrtc import UnplannedArguments
from edge.kernels.reference import PagedKV, Rope

__all__ = ["DTYPES", "HEAD_DIMS", "MAX_SPLITS", "DecodeTuning", "PagedAttentionCuda", "tc_smem_bytes"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128)
MAX_SPLITS = 128  # most splits a launch takes (bounds the partials' workspace)
_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
_GROUP_TILES = (1, 2, 4, 8)
_DECODE_THREADS = 128
_PREFILL_THREADS = 128
_PREFILL_ROWS = 64
_KV_THREADS = 256
_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """The decode attention's plan: kernel choice, compile-time knobs and split policy
    (docs/kernels.md has the measurements behind each default)."""

    # "tc" (tensor cores, paged_decode_tc.cu) or "simt" (CUDA cores, paged_decode.cu;
    # float32 always uses it).
    impl: str = "tc"
    # Warps of a tensor-core CTA; a stage holds 16 keys a warp. 8: one CTA an SM, so a
    # short context's keys fit one or two stages of one CTA a KV head.
    tc_warps: int = 8
    # Deepest K/V pipeline; fewer where shared memory would not hold tc_min_blocks CTAs
    # an SM. Deeper keeps the next overlapped GEMV's CTAs from starting beside them.
    # Int8 pools go twice as deep: their stages are half the bytes, and the bytes in
    # flight are what streams the keys.
    tc_max_stages: int = 2
    tc_stages: int | None = None  # a fixed depth instead of the derived one
    tc_min_blocks: int | None = None  # resident CTAs an SM the registers are set for
    min_split_rows: int = 64  # host-length launches: no split shorter than this
    max_splits: int = 32  # cap on the one-wave split count (more: more partials to merge)
    # CTAs per KV head that merge the splits, each a share of the outputs, when the
    # whole grid is resident at once (else 1).
    mergers: int = 8
    # Device-length (graph) launches: fewest keys per active split; the launch carries
    # max_splits and the kernel runs only as many as the length fills.
    graph_min_split_rows: int = 256
    # The q/k norm + RoPE + K/V store inside the attention launch (False: the fused
    # qk_norm_rope launch, then decode attention).
    rope_in_attention: bool = True
    # Extra CFG_DECODE_* defines of paged_decode.cu (benchmark sweeps).
    simt_defines: tuple[tuple[str, int], ...] = ()
    # Row tiles a verify CTA may take (1 or 2). Two where a KV head has several and the
    # one-tile grid fills a wave with no room for a second split: each of its CTAs then
    # streams the whole length, a pair copies every K/V stage once for both tiles and
    # halves the grid (on few SMs it ran in two waves). Where a wave holds several
    # splits, single tiles spread the keys wider (docs/benchmarks.md).
    verify_tiles: int = 2

    def __post_init__(self) -> None:
        if self.impl not in ("tc", "simt"):
            raise ValueError(f"impl must be 'tc' or 'simt', got {self.impl!r}")
        if not 1 <= self.max_splits <= MAX_SPLITS:
            raise ValueError(f"max_splits must be in [1, {MAX_SPLITS}], got {self.max_splits}")
        if self.verify_tiles not in (1, 2) or self.tc_warps % self.verify_tiles:
            raise ValueError(f"verify_tiles must be 1 or 2 and divide tc_warps ({self.tc_warps}), got {self.verify_tiles}")

    def min_blocks(self) -> int:
        if self.tc_min_blocks is not None:
            return self.tc_min_blocks
        return 1 if self.tc_warps >= 8 else 2 if self.tc_warps >= 4 else 4


def _group_tile(group: int) -> int:
    for gt in _GROUP_TILES:
        if group <= gt:
            return gt
    return _GROUP_TILES[-1]


def _variant(dtype: torch.dtype, head_dim: int, q8: bool = False) -> dict[str, int]:
    return {"CFG_DTYPE": _DTYPE_CODE[dtype], "CFG_HEAD_DIM": head_dim, **({"CFG_KV_INT8": 1} if q8 else {})}


def _q8(name: str, q8: bool) -> str:
    """A kernel's name in the int8-KV program."""
    return name + "_q8" if q8 else name


def _tc_static_smem(warps: int, head_dim: int) -> int:
    """Static shared memory of paged_decode_tc.cu beside its dynamic pipeline, rounded
    up: the warps' row maxima and sums, a flag, and the RoPE variant's 16 rotated query
    heads."""
    return 2 * warps * 16 * 4 + 16 * head_dim * 2 + 64


def tc_smem_bytes(
    dtype: torch.dtype, head_dim: int, warps: int, stages: int, tiles: int = 1, q8: bool = False
) -> int:
    """Dynamic shared memory of paged_decode_tc.cu (its TcCfg::SMEM_BYTES): ``stages``
    K+V stages of 16 padded rows a warp of one of ``tiles`` row tiles (``q8``: int8 rows
    of head_dim + 16 bytes, then the rows' float32 scales), or the warps' float32 outputs
    if larger."""
    keys = 16 * (warps // tiles)
    if q8:
        pipe = stages * 2 * keys * (head_dim + 16) + stages * 2 * keys * 4
    else:
        pipe = stages * 2 * keys * (head_dim + 8) * torch.empty((), dtype=dtype).element_size()
    return max(pipe, warps * 16 * head_dim * 4)


def tc_stages(
    tuning: DecodeTuning, shared_memory: tuple[int, int, int], dtype: torch.dtype, head_dim: int, q8: bool = False
) -> int:
    """Pipeline depth of the tensor-core decode kernel: ``tuning.tc_stages`` when set,
    else the most stages (at most ``tc_max_stages``, twice that over int8 pools: the same
    bytes in flight) that still let ``min_blocks`` CTAs share an SM (``shared_memory``:
    per SM, per-CTA opt-in, reserved per CTA)."""
    if tuning.tc_stages is not None:
        return tuning.tc_stages
    per_sm, optin, reserved = shared_memory
    stages = 1
    for n in range(2, tuning.tc_max_stages * (2 if q8 else 1) + 1):
        need = tc_smem_bytes(dtype, head_dim, tuning.tc_warps, n, q8=q8) + _tc_static_smem(tuning.tc_warps, head_dim)
        if need <= optin and tuning.min_blocks() * (need + reserved) <= per_sm:
            stages = n
    return stages


# ---------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------


def _check_pools(
    k_pool: torch.Tensor | Int8KV, v_pool: torch.Tensor | Int8KV, block_table: torch.Tensor
) -> tuple[int, int, int, int]:
    if isinstance(k_pool, Int8KV) or isinstance(v_pool, Int8KV):
        _check_int8_pools(k_pool, v_pool)
        k_pool, v_pool = k_pool.codes, v_pool.codes  # their geometry is checked below
    elif not isinstance(k_pool, torch.Tensor) or not isinstance(v_pool, torch.Tensor):
        raise TypeError("k_pool and v_pool must be tensors (or both Int8KV)")
    elif k_pool.dtype not in _DTYPE_CODE:
        raise ValueError(f"pools must share one dtype of {DTYPES} (or be Int8KV), got {k_pool.dtype}")
    if k_pool.dim() != 4:
        raise ValueError(
            f"k_pool must be [num_blocks, page_size, kv_heads, head_dim], got {tuple(k_pool.shape)}"
        )
    if v_pool.shape != k_pool.shape:
        raise ValueError(
            f"v_pool shape {tuple(v_pool.shape)} != k_pool shape {tuple(k_pool.shape)}"
        )
    if k_pool.dtype != v_pool.dtype:
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


def _check_int8_pools(k_pool: Any, v_pool: Any) -> None:
    if not (isinstance(k_pool, Int8KV) and isinstance(v_pool, Int8KV)):
        raise TypeError("k_pool and v_pool must both be Int8KV or both tensors")
    for name, p in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not p.is_contiguous():
            raise ValueError(f"{name}'s codes and scales must be contiguous (a layer slice of the pool is)")
        if p.scales.device != p.codes.device or p.scales.data_ptr() % 4:
            raise ValueError(f"{name}'s scales must be float32 on the codes' device")


def _q8_pools(k_pool: Any) -> bool:
    return isinstance(k_pool, Int8KV)


def _pool_ptrs(k_pool: Any, v_pool: Any) -> tuple[int, ...]:
    """The kernels' pool arguments: the rows (codes), then for int8 pools the scales."""
    if isinstance(k_pool, Int8KV):
        return k_pool.codes.data_ptr(), v_pool.codes.data_ptr(), k_pool.scales.data_ptr(), v_pool.scales.data_ptr()
    return k_pool.data_ptr(), v_pool.data_ptr()


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
    x: torch.Tensor, pool: torch.Tensor | Int8KV, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """``x`` as the KV write kernel reads it: ``dtype``, rows contiguous and 16-byte aligned."""
    if x.dim() != 3 or tuple(x.shape[1:]) != shape:
        raise ValueError(
            f"{name} must be [T, {shape[0]}, {shape[1]}], got {tuple(x.shape)}"
        )
    if x.device != pool.device:
        raise ValueError(f"{name} is on {x.device}, pools on {pool.device}")
    if x.dtype != dtype:
        x = x.to(dtype)  # as the reference does
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


def _check_q(
    q: torch.Tensor, k_pool: torch.Tensor | Int8KV, kvh: int, d: int, what: str
) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError("q must be a tensor")
    if _q8_pools(k_pool):
        if q.dtype not in _DTYPE_CODE:
            raise ValueError(f"q dtype {q.dtype} is not one of {DTYPES}")
    elif q.dtype != k_pool.dtype:
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


def _check_qkv(qkv: torch.Tensor, k_pool: torch.Tensor | Int8KV) -> None:
    """qkv rows of the pools' dtype (any of DTYPES for int8 pools), on their device."""
    if qkv.device != k_pool.device or (qkv.dtype != k_pool.dtype if not _q8_pools(k_pool) else qkv.dtype not in _DTYPE_CODE):
        pools = "int8" if _q8_pools(k_pool) else str(k_pool.dtype)
        raise ValueError(f"qkv is {qkv.dtype} on {qkv.device}, pools {pools} on {k_pool.device}")


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


def _check_rope(rope: Rope, kvh: int) -> None:
    if rope.kv_heads != kvh or rope.heads % kvh:
        raise ValueError(f"rope is for {rope.heads} / {rope.kv_heads} heads, pools hold {kvh} KV heads")


def _rope_args(rope: Rope, qkv: torch.Tensor, d: int, what: str) -> tuple:
    """The RoPE kernels' trailing arguments (norm weights, cos, sin, table rows, eps), or
    UnplannedArguments (``what``) when the kernel cannot read qkv and the tables in place."""
    tables = (rope.cos, rope.sin_signed) + (() if rope.qk_norm is None else (rope.qk_norm,))
    if not (qkv.is_contiguous() and qkv.data_ptr() % 16 == 0 and all(_fits_rope(t, qkv, d) for t in tables)):
        raise UnplannedArguments(f"{what} its kernel cannot read in place")
    norm_ptr = 0 if rope.qk_norm is None else rope.qk_norm.data_ptr()
    return norm_ptr, rope.cos.data_ptr(), rope.sin_signed.data_ptr(), np.int32(rope.cos.shape[0]), np.float32(rope.eps)


class _DecodePlan:
    """Launch constants of the decode kernel for one (dtype, head_dim, q_heads,
    kv_heads, page, tokens > 1, rope, int8 pools) under one tuning."""

    def __init__(
        self,
        att: "PagedAttentionCuda",
        dtype: torch.dtype,
        d: int,
        q_heads: int,
        kvh: int,
        page: int,
        multi: bool,
        rope: bool,
        q8: bool = False,
    ) -> None:
        tuning = att.tuning
        self.kvh = kvh
        self.group = q_heads // kvh
        self.log2_page = page.bit_length() - 1
        tc = att.tc_path(dtype, multi)
        self.rope = rope and tc and tuning.rope_in_attention
        if tc:
            tile = 16  # query heads per m16 tile
            self.kernel, self.smem = att.decode_tc_kernel(dtype, d, self.rope, q8)
            self.threads = 32 * tuning.tc_warps
        else:
            tile = _group_tile(self.group)
            self.kernel = att.decode_simt_kernel(dtype, d, tile, q8)
            self.threads = _DECODE_THREADS
            self.smem = 0
        self.ctas = kvh * ((self.group + tile - 1) // tile)
        self.counters = self.ctas  # arrivals per group (common.cuh, last_arrival)
        occ = nvrtc.max_active_blocks(self.kernel, self.threads, att.launcher.device_index, dynamic_smem=self.smem)
        self.wave = occ * att.sms
        # One full wave of CTAs: every split resident at once, each streaming its range.
        self.split_cap = tuning.max_splits
        self.max_splits = self.wave_splits(self.ctas)
        self.min_rows = tuning.min_split_rows
        self.merge_cap = tuning.mergers
        self.graph_min_rows = tuning.graph_min_split_rows

    def splits(self, kv_len: int | None) -> int:
        if kv_len is None:
            return self.max_splits
        return max(1, min(self.max_splits, -(-kv_len // self.min_rows)))

    def wave_splits(self, ctas: int, wave: int | None = None) -> int:
        """Splits of a grid of ``ctas`` CTAs a split that one wave (default this plan's
        kernel's) holds, at most the cap."""
        return max(1, min(self.split_cap, (self.wave if wave is None else wave) // ctas))

    def mergers(self, splits: int, tokens: int, ctas: int | None = None, wave: int | None = None) -> int:
        """The kernel's ``mergers``: how many CTAs per group merge the splits, each a
        share, waiting for every split of its group: one below 16 splits, else one per 2
        splits up to the cap. 0 when the grid (``ctas`` a split, default this plan's per
        token) is larger than one wave (default this plan's kernel's): a waiting merger
        could then hold the slot a split it waits for needs, so the last CTA to arrive
        merges alone."""
        if (self.ctas * tokens if ctas is None else ctas) * splits > (self.wave if wave is None else wave):
            return 0
        if splits < 16:
            return 1
        return max(1, min(splits // 2, self.merge_cap))


class PagedAttentionCuda:
    """The paged attention kernels of one backend, loaded at construction for
    ``dtypes`` x ``head_dims``, planned with one :class:`DecodeTuning`."""

    def __init__(
        self,
        launcher: Launcher,
        layer_ops: Any,
        tuning: DecodeTuning = DecodeTuning(),
        dtypes: Iterable[torch.dtype] = (torch.float16, torch.bfloat16),
        head_dims: Iterable[int] = HEAD_DIMS,
        sms: int | None = None,
        kv_int8: bool = False,
    ) -> None:
        """``layer_ops`` gives ``qk_norm_rope`` where RoPE is planned outside the
        attention launch; ``sms`` is the SM count plans fill (default: what the
        launcher sees); ``kv_int8`` loads the int8-pool kernels too (else they load at
        their first call)."""
        self.launcher = launcher
        self.ops = layer_ops
        self.tuning = tuning
        self.sms = int(sms) if sms is not None else launcher.sm_count()
        self._smem = launcher.shared_memory()
        self._plans: dict[tuple, _DecodePlan] = {}
        self._verify_waves: dict[tuple, int] = {}  # (dtype, head_dim, rope, tiles) -> resident verify CTAs
        self.kv_kernel = launcher.kernel("kv_write.cu", "kv_write")
        self.dtypes = tuple(dtypes)
        for dtype in self.dtypes:
            if dtype not in _DTYPE_CODE:
                raise ValueError(f"unsupported dtype {dtype}; supported: {DTYPES}")
            for hd in head_dims:
                if hd not in HEAD_DIMS:
                    raise ValueError(f"unsupported head_dim {hd}; supported: {HEAD_DIMS}")
                for q8 in (False, True) if kv_int8 else (False,):
                    for gt in _GROUP_TILES:
                        self.decode_simt_kernel(dtype, hd, gt, q8)
                    if dtype != torch.float32:
                        self.decode_tc_kernel(dtype, hd, q8=q8)
                        self.decode_tc_kernel(dtype, hd, rope=True, q8=q8)
                        self.prefill_kernel(dtype, hd, q8)
                if kv_int8:
                    self.kv_q8_kernel(dtype, hd)

    @property
    def name(self) -> str:
        t = self.tuning
        if t.impl == "simt":
            return "paged_cuda (simt)"
        return f"paged_cuda (tc, {t.tc_warps} warps, rope {'in' if t.rope_in_attention else 'beside'} attention)"

    def with_launcher(self, launcher: Launcher, layer_ops: Any) -> "PagedAttentionCuda":
        """The same kernels and plans launched through ``launcher`` (an overlapped sibling)."""
        other = object.__new__(PagedAttentionCuda)
        other.__dict__.update(self.__dict__)
        other.launcher, other.ops = launcher, layer_ops
        return other

    # -- kernels ------------------------------------------------------------------------

    def decode_simt_kernel(self, dtype: torch.dtype, head_dim: int, gt: int, q8: bool = False) -> Any:
        defines = {**_variant(dtype, head_dim, q8), **dict(self.tuning.simt_defines)}
        return self.launcher.kernel("paged_decode.cu", f"paged_decode{'_q8' if q8 else ''}_g{gt}", defines)

    def tc_stages(self, dtype: torch.dtype, head_dim: int, q8: bool = False) -> int:
        return tc_stages(self.tuning, self._smem, dtype, head_dim, q8)

    def decode_tc_kernel(
        self, dtype: torch.dtype, head_dim: int, rope: bool = False, q8: bool = False
    ) -> tuple[Any, int]:
        """The tensor-core decode kernel (``rope``: with the step's q/k norm + RoPE;
        ``q8``: over int8 pools) and the dynamic shared memory its launches pass."""
        return self._tc_kernel(dtype, head_dim, "paged_decode_tc_rope" if rope else "paged_decode_tc", q8=q8)

    def verify_tc_kernel(
        self, dtype: torch.dtype, head_dim: int, rope: bool = False, tiles: int = 1, q8: bool = False
    ) -> tuple[Any, int]:
        """The tensor-core kernel of a verify step (several query tokens; ``rope``: from the
        qkv rows, with the step's q/k norms, RoPE and K/V store; ``tiles`` row tiles a
        CTA; ``q8``: over int8 pools) and its dynamic shared memory."""
        name = "paged_verify_tc" + ("_pair" if tiles == 2 else "") + ("_rope" if rope else "")
        return self._tc_kernel(dtype, head_dim, name, tiles, q8)

    def kv_q8_kernel(self, dtype: torch.dtype, head_dim: int) -> Any:
        """The KV write into int8 pools of K/V rows of ``dtype``."""
        return self.launcher.kernel("kv_write.cu", f"kv_write_q8_{_SUFFIX[dtype]}_d{head_dim}")

    def verify_rope_tokens(self) -> int:
        """The most tokens one fused verify launch takes (a warp holds two of the step's
        K/V rows); more go through ``qk_norm_rope`` and :meth:`verify_attention`."""
        return 2 * self.tuning.tc_warps

    def _tc_kernel(
        self, dtype: torch.dtype, head_dim: int, name: str, tiles: int = 1, q8: bool = False
    ) -> tuple[Any, int]:
        t = self.tuning
        stages = self.tc_stages(dtype, head_dim, q8)
        defines = {
            **_variant(dtype, head_dim, q8),
            "CFG_TC_WARPS": t.tc_warps,
            "CFG_TC_MIN_BLOCKS": t.min_blocks(),
            "CFG_TC_STAGES": stages,
        }
        kernel = self.launcher.kernel("paged_decode_tc.cu", _q8(name, q8), defines)
        smem = tc_smem_bytes(dtype, head_dim, t.tc_warps, stages, tiles, q8)
        self.launcher.allow_dynamic_smem(kernel, smem)
        return kernel, smem

    def prefill_kernel(self, dtype: torch.dtype, head_dim: int, q8: bool = False) -> Any:
        return self.launcher.kernel("paged_prefill.cu", _q8("paged_prefill", q8), _variant(dtype, head_dim, q8))

    def tc_path(self, dtype: torch.dtype, multi: bool) -> bool:
        """Whether decode runs the tensor-core kernel (the only one with the RoPE variant)."""
        return dtype != torch.float32 and not multi and self.tuning.impl == "tc"

    def _plan(
        self,
        dtype: torch.dtype,
        d: int,
        q_heads: int,
        kvh: int,
        page: int,
        multi: bool = False,
        rope: bool = False,
        q8: bool = False,
    ) -> _DecodePlan:
        key = (dtype, d, q_heads, kvh, page, multi, rope, q8)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _DecodePlan(self, dtype, d, q_heads, kvh, page, multi, rope, q8)
        return plan

    def decode_splits(
        self,
        dtype: torch.dtype,
        head_dim: int,
        q_heads: int,
        kv_heads: int,
        kv_len: int | None,
        page_size: int = 16,
        kv_int8: bool = False,
    ) -> int:
        """Split count the decode launch uses: one full wave of CTAs (resident CTAs per
        SM x SMs / CTAs per split), at most ``max_splits``, and for a host length
        (``kv_len`` not None) no split shorter than ``min_split_rows``. ``kv_len=None``
        gives the device-length (graph) count, which depends on nothing that changes
        between steps. ``kv_int8``: the int8-pool kernel's."""
        return self._plan(dtype, head_dim, q_heads, kv_heads, page_size, q8=kv_int8).splits(kv_len)

    def graph_decode_options(
        self, dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int, page_size: int = 16, kv_int8: bool = False
    ) -> dict[str, int]:
        """Keyword arguments of the decode calls that make a host-length launch identical
        to a device-length (graph) one: its split count and its fewest keys per active
        split. Eager decode passes them so that it produces the graph's tokens."""
        plan = self._plan(dtype, head_dim, q_heads, kv_heads, page_size, q8=kv_int8)
        return {"num_splits": plan.splits(None), "min_split_rows": plan.graph_min_rows}

    # -- KV write -----------------------------------------------------------------------

    def write_kv(
        self,
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
        q8 = _q8_pools(k_pool)
        source_dtype = k.dtype if q8 else k_pool.dtype  # int8 pools quantize the rows as given
        if q8 and k.dtype not in _DTYPE_CODE:
            raise ValueError(f"k/v dtype {k.dtype} is not one of {DTYPES}")
        k = _kv_source(k, k_pool, "k", (kvh, d), source_dtype)
        v = _kv_source(v, v_pool, "v", (kvh, d), source_dtype)
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
        es = k.element_size()
        if q8:
            if t > 65535:
                raise ValueError("an int8 KV write takes at most 65535 tokens a launch")
            self.launcher.launch(
                self.kv_q8_kernel(k.dtype, d),
                (-(-2 * kvh // (_KV_THREADS // 32)), t),
                _KV_THREADS,
                (
                    *_pool_ptrs(k_pool, v_pool), block_table.data_ptr(), k.data_ptr(), v.data_ptr(), pos_ptr,
                    np.int32(0 if pos is not None else start), np.int32(kvh), np.int64(k.stride(0) * es),
                    np.int64(k.stride(1) * es), np.int64(v.stride(0) * es), np.int64(v.stride(1) * es),
                    np.int32(page.bit_length() - 1),
                ),
            )
            return
        row_vecs = d * es // 16
        total = t * kvh * row_vecs
        blocks = min((total + _KV_THREADS - 1) // _KV_THREADS, 65535)
        self.launcher.launch(
            self.kv_kernel,
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

    # -- decode -------------------------------------------------------------------------

    def _workspace(self, device: torch.device, words: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The split merge's flagged 8-byte words (common.cuh), filled with ones (not yet
        written) when made and left that way by every launch, and self-resetting arrival
        counters (zeroed once), for the current stream, grown by doubling."""

        def fits(cur: tuple[torch.Tensor, torch.Tensor]) -> bool:
            return cur[0].numel() >= words and cur[1].numel() >= counters

        def make(cur: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
            nw = max(words, 1 << 15, 2 * cur[0].numel() if cur is not None else 0)
            nc = max(counters, 1024, 2 * cur[1].numel() if cur is not None else 0)
            return (
                torch.full((nw,), -1, dtype=torch.int64, device=device),
                torch.zeros(nc, dtype=torch.int32, device=device),
            )

        return self.launcher.scratch("decode_split_words", fits, make)

    def _launch_decode(
        self,
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
            ws, cnt = self._workspace(
                k_pool.device, tokens * splits * plan.group * plan.kvh * k_pool.shape[3], tokens * plan.counters
            )
            ws_ptr, cnt_ptr = ws.data_ptr(), cnt.data_ptr()
        self.launcher.launch(
            plan.kernel,
            (plan.ctas, splits, tokens),
            plan.threads,
            (
                out.data_ptr(),
                q.data_ptr(),
                *_pool_ptrs(k_pool, v_pool),
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

    def decode_attention(
        self,
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
        host ``kv_len`` is ignored) and the launch configuration is fixed, so the call can
        be captured in a CUDA graph and replayed as ``pos`` advances. ``out`` is an
        optional preallocated output (static buffer for graphs). ``num_splits`` overrides
        the split count (1..MAX_SPLITS; tests use it to compare launches);
        ``min_split_rows`` (default: the graph's with ``pos``, else 1) makes the kernel run
        only the splits the length fills with that many keys each."""
        _nb, page, kvh, d = _check_pools(k_pool, v_pool, block_table)
        if q.dim() not in (2, 3) or (q.dim() == 3 and q.shape[0] != 1):
            raise ValueError(f"q must be [q_heads, D] or [1, q_heads, D], got {tuple(q.shape)}")
        _check_q(q, k_pool, kvh, d, "decode")
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        else:
            _check_out(out, tuple(q.shape), q.dtype, q.device)
        plan = self._plan(q.dtype, d, q.shape[-2], kvh, page, q8=_q8_pools(k_pool))
        self._decode(plan, out, _dense(q), k_pool, v_pool, block_table, kv_len, scale, pos, num_splits, min_split_rows)
        return out

    def decode_attention_rope(
        self,
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
        """:func:`edge.kernels.reference.decode_attention_rope` on CUDA: the decode
        token's qkv row ``[1, (heads + 2 kv_heads) * D]`` -> attention ``[heads, D]``, its
        key (normalised, rotated) and value stored at position kv_len - 1 on the way. One
        launch of the tensor-core kernel where the tuning plans RoPE inside attention,
        else the layer ops' ``qk_norm_rope`` and :meth:`decode_attention`."""
        _nb, page, kvh, d = _check_pools(k_pool, v_pool, block_table)
        _check_rope(rope, kvh)
        heads = rope.heads
        width = (heads + 2 * kvh) * d
        if qkv.dim() != 2 or qkv.shape[0] != 1 or qkv.shape[1] < width:
            raise ValueError(f"qkv must be [1, >= {width}] (one token), got {tuple(qkv.shape)}")
        _check_qkv(qkv, k_pool)
        shape = (heads, d)
        if out is None:
            out = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
        else:
            _check_out(out, shape, qkv.dtype, qkv.device)
        plan = self._plan(qkv.dtype, d, heads, kvh, page, rope=True, q8=_q8_pools(k_pool))
        options = {"num_splits": num_splits, "min_split_rows": min_split_rows}
        if not plan.rope:
            # torch.full: a fill launch with the value as its argument, not a host-to-device copy
            positions = pos if pos is not None else torch.full((1,), int(kv_len) - 1, dtype=torch.int32, device=qkv.device)
            q = self._qk_norm_rope(qkv, rope, positions, k_pool, v_pool, block_table)
            return self.decode_attention(q[0], k_pool, v_pool, block_table, kv_len, scale, pos, out, **options)
        rope_args = _rope_args(rope, qkv, d, f"decode_attention_rope of a {tuple(qkv.shape)} row")
        self._decode(plan, out, qkv, k_pool, v_pool, block_table, kv_len, scale, pos, num_splits, min_split_rows, rope_args)
        return out

    def _qk_norm_rope(self, qkv: torch.Tensor, rope: Rope, positions: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """RoPE beside attention: the layer ops' ``qk_norm_rope`` stores the keys and values
        of ``positions`` into the pools and returns the queries ``[T, heads, D]``."""
        q, _ = self.ops.qk_norm_rope(
            qkv, rope.qk_norm, rope.cos, rope.sin_signed, positions, rope.heads, rope.kv_heads, k_pool.shape[3],
            rope.eps, PagedKV(k_pool, v_pool, block_table),
        )
        return q

    def _decode(
        self,
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
        """The one-token decode launch of :meth:`decode_attention` (and its RoPE variant)."""
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
        self._launch_decode(
            plan, out, q, k_pool, v_pool, block_table, pos_ptr, 0 if pos is not None else kv_len, 1, splits,
            float(scale), int(min_split_rows), rope_args,
        )

    # -- speculative verify -------------------------------------------------------------

    def verify_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        pos: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`edge.kernels.reference.verify_attention` on CUDA: the T tokens of a
        verify step ``q [T, q_heads, D]`` at positions [*pos, *pos + T), token i against
        keys [0, *pos + i] (K/V already written) -> ``[T, q_heads, D]``. float16 /
        bfloat16: one launch of the tensor-core kernel with a KV head's (token, query
        head) pairs as the rows of its m16 tiles (each K/V row read once for all T
        tokens); float32 (or the CUDA-core tuning): the CUDA-core decode kernel with a
        token per grid row z (kv_len = *pos + 1 + z). Split as a graph launch is: the
        configuration depends on T only, the lengths are read on the device, so a CUDA
        graph per T replays at any position."""
        _nb, page, kvh, d = _check_pools(k_pool, v_pool, block_table)
        if q.dim() != 3:
            raise ValueError(f"q must be [T, q_heads, D], got {tuple(q.shape)}")
        _check_q(q, k_pool, kvh, d, "verify")
        t = q.shape[0]
        if not 1 <= t <= 65535:
            raise ValueError(f"a verify step takes 1..65535 tokens, got {t}")
        if pos is None:
            raise ValueError("verify_attention reads its position on the device: pass pos")
        pos_ptr = _check_pos(pos, k_pool.device)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        else:
            _check_out(out, tuple(q.shape), q.dtype, q.device)
        if self.tc_path(q.dtype, False):
            self._launch_verify_tc(out, _dense(q), k_pool, v_pool, block_table, pos_ptr, float(scale))
            return out
        plan = self._plan(q.dtype, d, q.shape[1], kvh, page, multi=True, q8=_q8_pools(k_pool))
        self._launch_decode(
            plan, out, _dense(q), k_pool, v_pool, block_table, pos_ptr, 0, t, plan.splits(None), float(scale),
            plan.graph_min_rows,
        )
        return out

    def verify_attention_rope(
        self,
        qkv: torch.Tensor,
        rope: Rope,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        pos: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`edge.kernels.reference.verify_attention_rope` on CUDA: the verify step's
        qkv rows ``[T, (heads + 2 kv_heads) * D]`` at positions [*pos, *pos + T) ->
        attention ``[T, heads, D]``, their keys (normalised, rotated) and values stored on
        the way. One launch of the tensor-core verify kernel where the tuning plans RoPE
        inside attention and T <= :meth:`verify_rope_tokens`, else the layer ops'
        ``qk_norm_rope`` and :meth:`verify_attention`."""
        _nb, page, kvh, d = _check_pools(k_pool, v_pool, block_table)
        _check_rope(rope, kvh)
        heads = rope.heads
        width = (heads + 2 * kvh) * d
        if qkv.dim() != 2 or qkv.shape[1] != width or not 1 <= qkv.shape[0] <= 65535:
            raise ValueError(f"qkv must be [1..65535, {width}], got {tuple(qkv.shape)}")
        _check_qkv(qkv, k_pool)
        if pos is None:
            raise ValueError("verify_attention_rope reads its position on the device: pass pos")
        pos_ptr = _check_pos(pos, k_pool.device)
        t = qkv.shape[0]
        shape = (t, heads, d)
        if out is None:
            out = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
        else:
            _check_out(out, shape, qkv.dtype, qkv.device)
        # RoPE inside attention where the decode plan has it, for as many tokens as a launch holds.
        q8 = _q8_pools(k_pool)
        if not (self._plan(qkv.dtype, d, heads, kvh, page, rope=True, q8=q8).rope and t <= self.verify_rope_tokens()):
            positions = pos + torch.arange(t, dtype=torch.int32, device=qkv.device)  # a launch, not a copy
            q = self._qk_norm_rope(qkv, rope, positions, k_pool, v_pool, block_table)
            return self.verify_attention(q, k_pool, v_pool, block_table, pos, scale, out)
        rope_args = _rope_args(rope, qkv, d, f"verify_attention_rope of {tuple(qkv.shape)} rows")
        self._launch_verify_tc(out, qkv, k_pool, v_pool, block_table, pos_ptr, float(scale), (t, heads, d), rope_args)
        return out

    def _launch_verify_tc(self, out: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          block_table: torch.Tensor, pos_ptr: int, scale: float,
                          shape: tuple[int, int, int] | None = None, rope_args: tuple = ()) -> None:
        """One tensor-core verify launch: ceil(T * group / 16) row tiles a KV head, in
        pairs a CTA where there are several and one CTA a tile would fill a wave
        (``verify_tiles``), as many splits as one wave holds. With ``rope_args`` q is the
        qkv rows of ``shape`` (T, q_heads, D)."""
        t, q_heads, d = q.shape if shape is None else shape
        kvh, page = k_pool.shape[2], k_pool.shape[1]
        q8 = _q8_pools(k_pool)
        plan = self._plan(q.dtype, d, q_heads, kvh, page, q8=q8)  # the decode plan: split caps
        row_tiles = -(-(t * plan.group) // 16)
        rope = bool(rope_args)
        ctas, (kernel, smem, wave) = kvh * row_tiles, self._verify_wave(q.dtype, d, rope, 1, plan.threads, q8)
        if self.tuning.verify_tiles == 2 and row_tiles > 1 and ctas >= wave:
            ctas, (kernel, smem, wave) = kvh * -(-row_tiles // 2), self._verify_wave(q.dtype, d, rope, 2, plan.threads, q8)
        splits = plan.wave_splits(ctas, wave)
        ws_ptr = cnt_ptr = 0
        if splits > 1:
            ws, cnt = self._workspace(k_pool.device, splits * t * q_heads * d, ctas)
            ws_ptr, cnt_ptr = ws.data_ptr(), cnt.data_ptr()
        self.launcher.launch(
            kernel,
            (ctas, splits),
            plan.threads,
            (
                out.data_ptr(), q.data_ptr(), *_pool_ptrs(k_pool, v_pool), block_table.data_ptr(), pos_ptr,
                np.int32(0), np.int32(kvh), np.int32(plan.group), np.int32(plan.log2_page),
                np.float32(scale * _LOG2E), ws_ptr, cnt_ptr, np.int32(plan.mergers(splits, 1, ctas, wave)),
                np.int32(plan.graph_min_rows), np.int32(t), *rope_args,
            ),
            shmem=smem,
        )

    def _verify_wave(
        self, dtype: torch.dtype, d: int, rope: bool, tiles: int, threads: int, q8: bool = False
    ) -> tuple[Any, int, int]:
        """The verify kernel of ``tiles`` row tiles a CTA, its dynamic shared memory and
        one wave of it (its registers are not the decode kernel's): a merger waits for its
        splits only when all of them are resident."""
        kernel, smem = self.verify_tc_kernel(dtype, d, rope, tiles, q8)
        key = (dtype, d, rope, tiles, q8)
        wave = self._verify_waves.get(key)
        if wave is None:
            occ = nvrtc.max_active_blocks(kernel, threads, self.launcher.device_index, dynamic_smem=smem)
            wave = self._verify_waves[key] = self.sms * occ
        return kernel, smem, wave

    # -- prefill ------------------------------------------------------------------------

    def prefill_attention(
        self,
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
        q8 = _q8_pools(k_pool)
        if q.dtype == torch.float32:
            # No tensor-core path for float32: token i is a decode of length start + i + 1.
            if t > 65535:
                raise ValueError("float32 prefill chunks are limited to 65535 tokens")
            plan = self._plan(q.dtype, d, q_heads, kvh, page, multi=True, q8=q8)
            self._launch_decode(plan, out, q, k_pool, v_pool, block_table, 0, start + 1, t, 1, float(scale), 1)
            return out
        group = q_heads // kvh
        row_tiles = (t * group + _PREFILL_ROWS - 1) // _PREFILL_ROWS
        self.launcher.launch(
            self.prefill_kernel(q.dtype, d, q8),
            (row_tiles, kvh),
            _PREFILL_THREADS,
            (
                out.data_ptr(),
                q.data_ptr(),
                *_pool_ptrs(k_pool, v_pool),
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
