"""KV-cache backends: contiguous (the baseline) and paged (block pool + block tables)."""

from __future__ import annotations

from typing import Protocol

import torch

from edge.kernels.reference import PagedKV, Rope


class KVOutOfMemory(RuntimeError):
    """Logical OOM: the cache has no room for the tokens asked for.

    Raised before anything is written, with the sequence left as it was, so the
    caller can evict cached blocks, wait, or end the request with reason ``length``.
    """


class SequenceKV(Protocol):
    """The KV state of one sequence, as the model's forward pass sees it."""

    length: int  # tokens whose K/V are stored

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more tokens; raise KVOutOfMemory without side effects."""

    def pages(self, layer: int) -> PagedKV | None:
        """Where a kernel producing this layer's K/V may store them itself (then
        ``attend`` gets None for k and v), or None when ``attend`` must store them."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """Store k/v ``[T, kv_heads, D]`` at positions [length, length+T) (None: already
        stored through ``pages``) and return causal attention of q ``[T, q_heads, D]``
        over positions [0, length+T)."""

    def attend_rope(self, layer: int, qkv: torch.Tensor, rope: Rope) -> torch.Tensor | None:
        """Attention ``[T, heads, D]`` straight from the qkv projection rows ``[T, (heads +
        2 kv_heads) * D]`` (a decode token; the verify step's tokens), the q/k norm, RoPE
        and K/V store included (one kernel on CUDA), or None when this cache does not do
        that for these rows (prefill chunks): the caller then runs ``qk_norm_rope`` and
        :meth:`attend`."""

    def advance(self, n: int) -> None:
        """Commit ``n`` tokens written by the last forward pass."""

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` committed tokens (rejected speculative tokens)."""

    def release(self) -> None:
        """Drop everything the sequence holds (O(blocks held))."""
