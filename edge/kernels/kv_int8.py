"""KV rows held in int8: the format and its torch reference.

A K or V row (one token's KV head, ``head_dim`` values) is stored as ``head_dim`` int8
codes and one float32 scale, symmetric, from the row's largest magnitude:

    scale = amax / 127,   code = round(x * (127 / amax))  (0 when amax is 0)

in float32 from the model-dtype value, rounding half to even: every CUDA store
(``kv_write.cu``, ``qk_norm_rope`` in ``fused.cu``, the RoPE variants of
``paged_decode_tc.cu``) computes exactly these codes and scales. A reader sees
``code * scale`` in float32 (:func:`dequantize`); the kernels apply the key scale to
the scores and the value scale to the probabilities, never rounding a dequantized row
to the model dtype. Codes lie in [-127, 127]: -128 is never stored, and a poisoned
pool holds it (with NaN scales) in rows nothing wrote.

:class:`Int8KV` is what a pool or a contiguous cache holds in place of a K (or V)
tensor: codes ``[..., kv_heads, head_dim]`` and scales ``[..., kv_heads]``, indexed
together, so ``pool.k[layer]`` is a layer's int8 pool as ``pool.k[layer]`` is a layer's
float pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CODE_MAX", "POISON_CODE", "SCALE_BYTES", "Int8KV", "dequantize", "quantize_rows"]

CODE_MAX = 127
POISON_CODE = -128
SCALE_BYTES = 4  # one float32 scale a row


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., D]`` (any float dtype) -> (codes int8 ``[..., D]``, scales float32
    ``[...]``) as the module docstring defines them."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scales = amax / CODE_MAX
    # A true division (``127 / tensor`` would be a reciprocal times 127, off by an ulp).
    inv = torch.where(amax > 0, torch.full_like(amax, CODE_MAX) / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv.unsqueeze(-1)).clamp_(-CODE_MAX, CODE_MAX).to(torch.int8)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes * scales`` in float32: ``[..., D]`` from codes ``[..., D]`` and scales ``[...]``."""
    return codes.float() * scales.unsqueeze(-1)


@dataclass(frozen=True)
class Int8KV:
    """K or V rows as int8 codes ``[..., kv_heads, head_dim]`` with float32 scales
    ``[..., kv_heads]`` (the leading dimensions are the pool's or the cache's: layers,
    blocks, page rows, or layers, positions). Indexing slices both."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.int8 or self.scales.dtype != torch.float32:
            raise ValueError(f"Int8KV holds int8 codes and float32 scales, got {self.codes.dtype} / {self.scales.dtype}")
        if tuple(self.codes.shape[:-1]) != tuple(self.scales.shape) or self.codes.device != self.scales.device:
            raise ValueError(
                f"codes {tuple(self.codes.shape)} and scales {tuple(self.scales.shape)} do not describe the same rows"
            )

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: torch.device | str) -> "Int8KV":
        """Uninitialized rows of ``shape`` (..., kv_heads, head_dim)."""
        return cls(torch.empty(shape, dtype=torch.int8, device=device), torch.empty(shape[:-1], device=device))

    def __getitem__(self, index: Any) -> "Int8KV":
        return Int8KV(self.codes[index], self.scales[index])

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dim(self) -> int:
        return self.codes.dim()

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def is_contiguous(self) -> bool:
        return self.codes.is_contiguous() and self.scales.is_contiguous()

    def store(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize ``x [T, ..., D]`` into flat rows ``rows`` (of the first dimension of
        this view flattened with the next one: a layer's ``[blocks * page]``, or
        positions); ``rows`` int64 ``[T]``."""
        codes, scales = quantize_rows(x)
        self.codes.view(-1, *self.codes.shape[-2:]).index_copy_(0, rows, codes)
        self.scales.view(-1, self.scales.shape[-1]).index_copy_(0, rows, scales)

    def load(self, rows: torch.Tensor) -> torch.Tensor:
        """Float32 ``[T, ..., D]`` of flat rows ``rows`` (as :meth:`store` numbers them)."""
        codes = self.codes.view(-1, *self.codes.shape[-2:]).index_select(0, rows)
        scales = self.scales.view(-1, self.scales.shape[-1]).index_select(0, rows)
        return dequantize(codes, scales)

    def poison(self, dim: int, index: torch.Tensor) -> None:
        """Fill the rows ``index`` along ``dim`` with what no store writes: codes -128,
        NaN scales (a reader that touches them produces NaN)."""
        self.codes.index_fill_(dim, index, POISON_CODE)
        self.scales.index_fill_(dim, index, float("nan"))
