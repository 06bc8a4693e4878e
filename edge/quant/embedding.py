"""An embedding table held as int8 groups (q8_0 rows), for quantized models whose
embedding would otherwise be a large share of the weights (Qwen3-8B: 1.2 GB in bf16).

A lookup dequantizes only the rows asked for: ``(q * scale)`` group-wise in float32,
rounded once to the model's dtype (what :func:`edge.quant.q8_0.dequantize` gives for those
rows). A tied lm_head multiplies by the same :class:`edge.quant.q8_0.Int8Weight`."""

from __future__ import annotations

import torch

from edge.quant.q8_0 import Int8Weight


class Int8Embedding:
    """``table`` (an Int8Weight ``[vocab, hidden]``) looked up as rows of ``dtype``."""

    __slots__ = ("table", "dtype")

    def __init__(self, table: Int8Weight, dtype: torch.dtype) -> None:
        self.table = table
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def shape(self) -> torch.Size:
        return self.table.shape

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.table.tensors()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]`` rows of ``dtype`` (no host synchronisation)."""
        ids = ids.long()
        q = self.table.weight.index_select(0, ids)
        s = self.table.scale.index_select(0, ids).float()
        t, hidden = q.shape
        w = q.float().view(t, s.shape[1], hidden // s.shape[1]) * s.unsqueeze(-1)
        return w.view(t, hidden).to(self.dtype)

    def __repr__(self) -> str:
        return f"Int8Embedding(shape={tuple(self.shape)}, group_size={self.table.group_size}, dtype={self.dtype})"
