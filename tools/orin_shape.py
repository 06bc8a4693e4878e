"""Orin-shaped GPU runs on a larger GPU: restrict this process to an Orin's SM count.

An AGX Orin has 16 SMs, an Orin NX / Nano 8. A CUDA green context with that many SMs,
made current before any stream exists, confines every kernel of the process to them,
so launch plans (split counts, CTAs per wave) and bandwidth per SM look like a board's.
It changes no device setting. ``EDGE_TEST_SMS=16 pytest -m cuda`` runs the GPU tests
that way (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def restrict_sms(n: int) -> Any:
    """Make a green context of ``n`` SMs current for this process; returns it (keep it
    alive for the life of the process). Streams made later must come from
    :func:`stream_factory` (``Engine(stream_factory=...)``): torch's own stream pool
    may belong to the whole device."""
    import torch
    from torch.cuda.green_contexts import GreenContext

    torch.cuda.init()
    ctx = GreenContext.create(num_sms=n)
    if hasattr(ctx, "set_context"):
        ctx.set_context()
    if hasattr(ctx, "Stream"):
        torch.cuda.set_stream(ctx.Stream())
    return ctx


def stream_factory(ctx: Any) -> Callable[[int], Any]:
    """``Engine(stream_factory=...)`` for a green context: its streams (default priority)."""
    import torch

    def make(priority: int = 0) -> Any:
        if hasattr(ctx, "Stream"):
            return ctx.Stream()
        return torch.cuda.Stream(priority=priority)  # made while the green context is current

    return make
