"""Contiguous KV cache: one ``[layers, max_seq_len, kv_heads, head_dim]`` buffer per K and V.

The baseline every paged path is diffed against. With ``kv_dtype="int8"`` it holds
int8 codes and a scale a row (edge/kernels/kv_int8.py), quantized and read back
through the same torch functions the reference backend's paged pools use.
"""

from __future__ import annotations

import torch

from edge.model.config import ModelConfig
from edge.runtime.budget import parse_kv_dtype
from edge.kernels.kv_int8 import Int8KV
from edge.kernels.reference import causal_attention
from edge.model.kv import KVOutOfMemory


class ContiguousKV:
    def __init__(
        self, cfg: ModelConfig, max_seq_len: int, device: torch.device, dtype: torch.dtype, kv_dtype: str = "auto"
    ) -> None:
        shape = (cfg.num_layers, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        self.kv_dtype = parse_kv_dtype(kv_dtype)
        if self.kv_dtype == "int8":
            self.k: torch.Tensor | Int8KV = Int8KV.empty(shape, device)
            self.v: torch.Tensor | Int8KV = Int8KV.empty(shape, device)
        else:
            self.k = torch.empty(shape, device=device, dtype=dtype)
            self.v = torch.empty(shape, device=device, dtype=dtype)
        self.max_seq_len = max_seq_len
        self.scale = cfg.head_dim**-0.5
        self.length = 0

    def reserve(self, n: int) -> None:
        if self.length + n > self.max_seq_len:
            raise KVOutOfMemory(
                f"sequence of {self.length + n} tokens exceeds the contiguous cache's {self.max_seq_len}"
            )

    def pages(self, layer: int) -> None:
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, end = self.length, self.length + q.shape[0]
        if isinstance(self.k, Int8KV):
            rows = torch.arange(start, end, device=q.device)
            kl, vl = self.k[layer], self.v[layer]
            kl.store(rows, k)
            vl.store(rows, v)
            everything = torch.arange(end, device=q.device)
            return causal_attention(q, kl.load(everything), vl.load(everything), start, self.scale)
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return causal_attention(q, self.k[layer, :end], self.v[layer, :end], start, self.scale)

    def attend_rope(self, layer: int, qkv: torch.Tensor, rope: object) -> None:
        return None  # the baseline keeps the separate qk_norm_rope

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens (rejected speculative tokens)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        self.length -= n

    def release(self) -> None:
        self.length = 0
