"""Linear projections: one implementation per weight format, chosen by the backend.

A weight's format is ``"float"`` for a plain tensor, else its ``FORMAT`` (``"q8_0"``
for :class:`edge.quant.q8_0.Int8Weight`). :class:`Linears` holds the backend's choice for
each format and dispatches on it; every implementation has the semantics of
:func:`edge.quant.q8_0.fused_linear_reference` (a plain linear, with optional ``norm`` of
the input, ``swiglu`` of a ``[gate; up]`` output and an in-place ``residual`` add).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from edge.quant.q8_0 import Int8Weight, Norm, fused_linear_reference, int8_linear_reference


class LinearImpl(Protocol):
    """What the backend asks of the linear of one weight format."""

    name: str
    # Whether a prefill chunk expands each weight it multiplies (a cost paid once per
    # forward, whatever the chunk's length: the engine's prefill chunk follows it).
    expands_weights: bool

    def linear(
        self,
        x: torch.Tensor,
        w: Any,
        bias: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor: ...

    def fuses(self, x: torch.Tensor, w: Any) -> bool:
        """Whether norm / residual / SwiGLU run inside this implementation's kernel for
        ``x`` (only then does folding them into the projections save launches)."""
        ...

    def argmax(
        self, x: torch.Tensor, w: Any, bias: torch.Tensor | None, out: torch.Tensor | None, *, norm: Norm | None = None
    ) -> torch.Tensor | None:
        """Greedy token ids without the logits, or None (the caller computes logits)."""
        ...


def weight_format(w: Any) -> str:
    return "float" if isinstance(w, torch.Tensor) else w.FORMAT


class ComposedLinear:
    """A plain matmul (``matmul(x, w, bias)``), the fusions composed of the layer ops
    around it: no kernel of its own takes them."""

    name = "composed"
    expands_weights = False

    def __init__(self, layer_ops: Any) -> None:
        self.ops = layer_ops

    def matmul(self, x: torch.Tensor, w: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def linear(
        self,
        x: torch.Tensor,
        w: Any,
        bias: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        if norm is None and residual is None and not swiglu:
            return self.matmul(x, w, bias)
        return fused_linear_reference(
            x, w, bias, norm=norm, residual=residual, swiglu=swiglu, ops=self.ops, matmul=self.matmul
        )

    def fuses(self, x: torch.Tensor, w: Any) -> bool:
        return False

    def argmax(
        self, x: torch.Tensor, w: Any, bias: torch.Tensor | None, out: torch.Tensor | None, *, norm: Norm | None = None
    ) -> torch.Tensor | None:
        return None


class FloatLinear(ComposedLinear):
    """``F.linear`` (cuBLAS on a GPU)."""

    name = "torch F.linear"

    def matmul(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, bias)


class Int8ReferenceLinear(ComposedLinear):
    """The torch reference W8A16 linear (dequantize, then ``F.linear``)."""

    name = "int8 torch reference (dequantize + F.linear)"

    def matmul(self, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_linear_reference(x, w, bias)


class Linears:
    """The backend's linear for each weight format."""

    def __init__(self, impls: Mapping[str, LinearImpl]) -> None:
        self.impls = dict(impls)

    def impl(self, w: Any) -> LinearImpl:
        fmt = weight_format(w)
        try:
            return self.impls[fmt]
        except KeyError:
            raise TypeError(f"this backend has no linear for {fmt} weights (has {sorted(self.impls)})") from None

    def __call__(
        self,
        x: torch.Tensor,
        w: Any,
        bias: torch.Tensor | None = None,
        *,
        norm: Norm | None = None,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        return self.impl(w).linear(x, w, bias, norm=norm, residual=residual, swiglu=swiglu)

    def fuses(self, x: torch.Tensor, w: Any) -> bool:
        return self.impl(w).fuses(x, w)

    def expands(self, weights: Any) -> bool:
        """Whether a prefill chunk expands any of ``weights`` (see :class:`LinearImpl`)."""
        return any(self.impl(w).expands_weights for w in weights)

    def greedy_token(
        self, x: torch.Tensor, w: Any, out: torch.Tensor | None = None, *, norm: Norm | None = None
    ) -> torch.Tensor:
        """Greedy token ids ``[T]`` (int64): ``argmax(self(x, w, norm=norm))``, the first
        of equal maxima, from the kernel's argmax epilogue where it has one."""
        impl = self.impl(w)
        ids = impl.argmax(x, w, None, out, norm=norm)
        if ids is not None:
            return ids
        ids = torch.argmax(impl.linear(x, w, norm=norm), dim=-1)
        return ids if out is None else out.copy_(ids)

    def describe(self) -> dict[str, str]:
        return {fmt: impl.name for fmt, impl in self.impls.items()}
