"""Argument checks shared by the GEMV wrappers (int8_cuda, int4_cuda)."""

from __future__ import annotations

import torch


def is_vector(t: torch.Tensor, x: torch.Tensor, shape: int | tuple[int, ...], align: int = 1) -> bool:
    """``t`` contiguous, of ``x``'s dtype and device, ``shape`` (an int: ``t.numel()``)."""
    ok_shape = t.numel() == shape if isinstance(shape, int) else tuple(t.shape) == shape
    return ok_shape and t.dtype == x.dtype and t.device == x.device and t.is_contiguous() and t.data_ptr() % align == 0


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of ``a`` and ``b`` overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
