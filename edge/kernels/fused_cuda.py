"""CUDA fused decoder-layer ops (``fused.cu``) with the semantics of the functions of
the same names in :mod:`edge.kernels.reference`, as methods of :class:`FusedCuda`:

- ``embedding(ids, table)`` -- the rows of token ids read on the device, in a launch
  that lets the first projection start its weight stream beside it.
- ``rms_norm(x, weight, eps)`` -- RMSNorm of each row, times ``weight``.
- ``add_rms_norm(x, residual, weight, eps)`` -- ``x += residual`` in place (the
  residual stream), returns ``rms_norm(x) * weight``: one kernel instead of two.
- ``qk_norm_rope(qkv, qk_norm_weight | None, cos, sin_signed, positions, heads,
  kv_heads, head_dim, eps)`` -- q and k of a fused qkv row, Qwen3 per-head RMSNorm
  (when the weight is given) and RoPE at device positions, as contiguous
  ``q [T, heads, D]`` and ``k [T, kv_heads, D]``: one kernel instead of ~6.
- ``silu_mul(gate_up)`` -- ``silu(gate) * up``: one kernel instead of two.

float16 / bfloat16 / float32 CUDA tensors, rows up to :data:`MAX_HIDDEN` elements,
head_dim 64 or 128. Which model shapes these take is decided once, by
:func:`shape_support` when the engine plans its backend; a call outside the plan
raises :class:`~edge.kernels.nvrtc.UnplannedArguments` rather than running anything
else.

Graph-safe: a launch allocates only its outputs (through torch, so inside a capture
they come from the graph's pool), reads nothing back to the host, and its grid depends
only on shapes. Build the object (it loads every kernel) before capturing a graph.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from edge.kernels.kv_int8 import Int8KV
from edge.kernels.launcher import Launcher
from edge.kernels.nvrtc import UnplannedArguments
from edge.kernels.reference import PagedKV

__all__ = ["DTYPES", "HEAD_DIMS", "MAX_HIDDEN", "FusedCuda", "shape_support"]

SOURCE = "fused.cu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128)
_SUFFIX = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
_MAX_VEC = 4  # kMaxVec in fused.cu: 16-byte vectors per thread in the norm kernels
_NORM_MAX_THREADS = 1024
MAX_HIDDEN = {dt: _MAX_VEC * _NORM_MAX_THREADS * 16 // torch.finfo(dt).bits * 8 for dt in DTYPES}
_SILU_THREADS = 128
_QK_WARPS = 4
_NAMES = ("rms_norm", "add_rms_norm", "silu_mul")

def _aligned(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


@functools.lru_cache(maxsize=256)
def _norm_threads(nvec: int) -> int:
    """Threads per row: about two 16-byte vectors each, a multiple of 32, <= 1024."""
    per_two = (nvec + 1) // 2
    return min(_NORM_MAX_THREADS, max(32, (per_two + 31) // 32 * 32))


def _norm_ok(x: torch.Tensor, weight: torch.Tensor | None, *others: torch.Tensor) -> bool:
    if x.device.type != "cuda" or x.dtype not in _SUFFIX or weight is None:
        return False
    h = x.shape[-1] if x.dim() else 0
    if x.numel() == 0 or h * x.element_size() % 16 or h > MAX_HIDDEN[x.dtype]:
        return False
    if weight.dtype != x.dtype or weight.device != x.device or weight.shape != (h,) or not weight.is_contiguous():
        return False
    for o in others:
        if o.dtype != x.dtype or o.device != x.device or o.shape != x.shape or not o.is_contiguous():
            return False
    return x.is_contiguous() and _aligned(x, weight, *others)


_EMBED_THREADS = 256


def shape_support(dtype: torch.dtype, hidden: int, intermediate: int, head_dim: int) -> dict[str, str | None]:
    """Which ops the kernels take for a model of these sizes: op name -> None (the
    kernel) or why not (the plan then names the reference for that op)."""
    es = torch.empty((), dtype=dtype).element_size()
    if dtype not in _SUFFIX:
        why = f"no fused kernels for {dtype}"
        return dict.fromkeys(("embedding", "rms_norm", "add_rms_norm", "silu_mul", "qk_norm_rope"), why)
    rows = None if hidden * es % 16 == 0 else f"hidden size {hidden} is not a multiple of 16 bytes"
    norm = rows or (None if hidden <= MAX_HIDDEN[dtype] else f"hidden size {hidden} > {MAX_HIDDEN[dtype]}")
    silu = None if intermediate * es % 16 == 0 else f"intermediate size {intermediate} is not a multiple of 16 bytes"
    rope = None if head_dim in HEAD_DIMS else f"head_dim {head_dim} (kernels: {HEAD_DIMS})"
    return {"embedding": rows, "rms_norm": norm, "add_rms_norm": norm, "silu_mul": silu, "qk_norm_rope": rope}


class FusedCuda:
    """The fused layer kernels of one backend (all loaded at construction)."""

    name = "cuda"

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self._k = {n: launcher.kernel(SOURCE, n) for n in ("embedding", "decode_step_end")}
        for sfx in _SUFFIX.values():
            for n in _NAMES:
                self._k[f"{n}_{sfx}"] = launcher.kernel(SOURCE, f"{n}_{sfx}")
            for d in HEAD_DIMS:
                self._k[f"qk_norm_rope_{sfx}_d{d}"] = launcher.kernel(SOURCE, f"qk_norm_rope_{sfx}_d{d}")

    def with_launcher(self, launcher: Launcher) -> "FusedCuda":
        """The same kernels launched through ``launcher`` (an overlapped sibling)."""
        other = object.__new__(FusedCuda)
        other.launcher, other._k = launcher, self._k
        return other

    def _launch_norm(self, name: str, x: torch.Tensor, pointers: tuple[int, ...], eps: float) -> torch.Tensor:
        """One CTA per row of ``x``; ``pointers`` are the kernel's inputs after ``out``."""
        h = x.shape[-1]
        out = torch.empty_like(x)
        self.launcher.launch(
            self._k[f"{name}_{_SUFFIX[x.dtype]}"],
            x.numel() // h,
            _norm_threads(h * x.element_size() // 16),
            (out.data_ptr(), *pointers, np.float32(eps), np.int32(h)),
        )
        return out

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rows ``table[ids]`` (``[T]`` int64 / int32 ids -> ``[T, hidden]``), one launch
        that reads the ids on the device and lets the next kernel start beside it. A
        quantized table (:class:`edge.quant.embedding.Int8Embedding`) dequantizes its rows."""
        if not isinstance(table, torch.Tensor):
            return table.rows(ids)
        row_bytes = table.shape[-1] * table.element_size() if table.dim() == 2 else 0
        if not (
            table.device.type == "cuda"
            and table.dim() == 2
            and row_bytes % 16 == 0
            and table.is_contiguous()
            and _aligned(table)
            and ids.device == table.device
            and ids.dim() == 1
            and ids.dtype in (torch.int64, torch.int32)
            and ids.is_contiguous()
            and 0 < ids.numel() < 65536
        ):
            raise UnplannedArguments(f"embedding of {tuple(ids.shape)} ids from a {tuple(table.shape)} table")
        out = torch.empty(ids.numel(), table.shape[1], dtype=table.dtype, device=table.device)
        vecs = row_bytes // 16
        self.launcher.launch(
            self._k["embedding"],
            (-(-vecs // _EMBED_THREADS), ids.numel()),
            _EMBED_THREADS,
            (out.data_ptr(), table.data_ptr(), ids.data_ptr(), np.int32(ids.dtype == torch.int64),
             np.int64(table.shape[0]), np.int32(vecs)),
        )
        return out

    def decode_step_end(
        self, token: torch.Tensor, ring: torch.Tensor, ring_pos: torch.Tensor, pos: torch.Tensor
    ) -> None:
        """The end of a graph decode step, one launch: ``ring[ring_pos % len(ring)] =
        token`` straight into pinned host memory (the host reads that slot once the
        step's event has completed, so no copy follows the replay), then ``ring_pos`` and
        ``pos`` += 1. ``token``: int64 ``[1]``; ``ring``: pinned int64 host tensor;
        ``ring_pos``, ``pos``: int32 ``[1]``, all on/for ``token``'s device."""
        for name, t, dtype in (("token", token, torch.int64), ("ring_pos", ring_pos, torch.int32), ("pos", pos, torch.int32)):
            if t.device != token.device or t.dtype != dtype or t.numel() != 1:
                raise ValueError(f"{name} must be one {dtype} element on {token.device}, got {t.dtype} {tuple(t.shape)}")
        if not (ring.device.type == "cpu" and ring.is_pinned() and ring.dtype == torch.int64 and ring.is_contiguous()):
            raise ValueError("ring must be a contiguous pinned int64 host tensor")
        self.launcher.launch(
            self._k["decode_step_end"],
            1,
            32,
            (token.data_ptr(), ring.data_ptr(), ring_pos.data_ptr(), np.int32(ring.numel()), pos.data_ptr()),
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm of every row of ``x [..., hidden]`` times ``weight [hidden]``."""
        if not _norm_ok(x, weight):
            raise UnplannedArguments(f"rms_norm of {x.dtype} {tuple(x.shape)}")
        return self._launch_norm("rms_norm", x, (x.data_ptr(), weight.data_ptr()), eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += residual`` in place, then RMSNorm of every row of ``x`` times ``weight``."""
        if not _norm_ok(x, weight, residual) or residual.data_ptr() == x.data_ptr():
            raise UnplannedArguments(f"add_rms_norm of {x.dtype} {tuple(x.shape)}")
        return self._launch_norm("add_rms_norm", x, (x.data_ptr(), residual.data_ptr(), weight.data_ptr()), eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [..., 2 * I]`` (gate first) -> ``[..., I]``."""
        x = gate_up
        inter = x.shape[-1] // 2 if x.dim() else 0
        if not (
            x.device.type == "cuda"
            and x.dtype in _SUFFIX
            and x.numel() > 0
            and x.shape[-1] % 2 == 0
            and inter * x.element_size() % 16 == 0
            and x.is_contiguous()
            and _aligned(x)
        ):
            raise UnplannedArguments(f"silu_mul of {x.dtype} {tuple(x.shape)}")
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
        vecs = out.numel() * x.element_size() // 16
        self.launcher.launch(
            self._k[f"silu_mul_{_SUFFIX[x.dtype]}"],
            -(-vecs // _SILU_THREADS),
            _SILU_THREADS,
            (out.data_ptr(), x.data_ptr(), np.int32(inter), np.int64(vecs)),
        )
        return out

    def qk_norm_rope(
        self,
        qkv: torch.Tensor,
        qk_norm_weight: torch.Tensor | None,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        positions: torch.Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float = 1e-6,
        cache: PagedKV | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head RMSNorm (if ``qk_norm_weight``) and RoPE of the q and k parts of
        ``qkv [T, (heads + 2 kv_heads) * D]`` at ``positions`` (int64/int32 ``[T]`` on the
        device): contiguous ``(q [T, heads, D], k [T, kv_heads, D])``; with ``cache``, k
        and v go into the pool rows of ``positions`` in the same launch (quantized into an
        int8 pool) and k is returned as None. Positions outside the tables are clamped on
        the device (the reference raises)."""
        d = head_dim
        w = qk_norm_weight
        if not (
            _qk_ok(qkv, w, cos, sin_signed, positions, heads, kv_heads, d)
            and (cache is None or _pool_ok(cache, qkv, kv_heads, d))
        ):
            raise UnplannedArguments(f"qk_norm_rope of {qkv.dtype} {tuple(qkv.shape)}, head_dim {d}")
        t = qkv.shape[0]
        q = torch.empty((t, heads, d), dtype=qkv.dtype, device=qkv.device)
        k = None if cache is not None else torch.empty((t, kv_heads, d), dtype=qkv.dtype, device=qkv.device)
        self.launcher.launch(
            self._k[f"qk_norm_rope_{_SUFFIX[qkv.dtype]}_d{d}"],
            (-(-(heads + kv_heads * (1 if cache is None else 2)) // _QK_WARPS), t),
            32 * _QK_WARPS,
            (
                q.data_ptr(),
                0 if k is None else k.data_ptr(),
                qkv.data_ptr(),
                0 if w is None else w.data_ptr(),
                cos.data_ptr(),
                sin_signed.data_ptr(),
                positions.data_ptr(),
                np.int32(positions.dtype == torch.int64),
                np.int32(heads),
                np.int32(kv_heads),
                np.int64(qkv.stride(0)),
                np.int32(cos.shape[0]),
                np.float32(eps),
                *((0, 0, 0, 0, 0, np.int32(0)) if cache is None else _pool_args(cache)),
            ),
        )
        return q, k


def _qk_ok(
    qkv: torch.Tensor,
    w: torch.Tensor | None,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
    d: int,
) -> bool:
    return (
        qkv.device.type == "cuda"
        and qkv.dtype in _SUFFIX
        and d in HEAD_DIMS
        and qkv.dim() == 2
        and 0 < qkv.shape[0] <= 65535
        and qkv.shape[1] >= (heads + kv_heads) * d
        and qkv.stride(1) == 1
        and qkv.stride(0) * qkv.element_size() % 16 == 0
        and positions.dtype in (torch.int64, torch.int32)
        and positions.dim() == 1
        and positions.shape[0] == qkv.shape[0]
        and positions.is_contiguous()
        and positions.device == qkv.device
        and cos.dtype == sin_signed.dtype == qkv.dtype
        and cos.device == sin_signed.device == qkv.device
        and cos.shape == sin_signed.shape
        and cos.dim() == 2
        and cos.shape[1] == d
        and cos.is_contiguous()
        and sin_signed.is_contiguous()
        and _aligned(qkv, cos, sin_signed)
        and (
            w is None
            or (
                w.dtype == qkv.dtype
                and w.device == qkv.device
                and w.shape == (heads + kv_heads, d)
                and w.is_contiguous()
                and _aligned(w)
            )
        )
    )


def _pool_args(cache: PagedKV) -> tuple:
    """The kernel's pool arguments: k, v rows (int8 codes), k, v scales (0: float pools),
    table, log2(page)."""
    k_pool, v_pool, table = cache
    if isinstance(k_pool, Int8KV):
        rows = (k_pool.codes.data_ptr(), v_pool.codes.data_ptr(), k_pool.scales.data_ptr(), v_pool.scales.data_ptr())
    else:
        rows = (k_pool.data_ptr(), v_pool.data_ptr(), 0, 0)
    return (*rows, table.data_ptr(), np.int32(k_pool.shape[1].bit_length() - 1))


def _pool_ok(cache: PagedKV, qkv: torch.Tensor, kv_heads: int, d: int) -> bool:
    """Whether the kernel can write into these pools (the model's dtype, or int8 rows)."""
    k_pool, v_pool, table = cache
    page = k_pool.shape[1] if k_pool.dim() == 4 else 0
    q8 = isinstance(k_pool, Int8KV)
    if q8 != isinstance(v_pool, Int8KV):
        return False
    rows = (k_pool.codes, v_pool.codes, k_pool.scales, v_pool.scales) if q8 else (k_pool, v_pool)
    return (
        k_pool.shape == v_pool.shape
        and k_pool.dim() == 4
        and tuple(k_pool.shape[2:]) == (kv_heads, d)
        and page > 0
        and page & (page - 1) == 0
        and (q8 or k_pool.dtype == v_pool.dtype == qkv.dtype)
        and k_pool.device == v_pool.device == table.device == qkv.device
        and all(r.is_contiguous() for r in rows)
        and table.dtype == torch.int32
        and table.dim() == 1
        and table.is_contiguous()
        and _aligned(*rows[:2])
        and all(r.data_ptr() % 4 == 0 for r in rows[2:])  # scales: read and written one float at a time
    )
