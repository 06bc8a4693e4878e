"""Multimodal RoPE: three position axes (time, height, width) per token, as transformers'
``get_rope_index`` assigns them, and the cos/sin tables they give.

Text tokens have all three axes equal, counting on from the previous token. An image's
merged tokens sit on its grid: time = p, height = p + row, width = p + column, where p
is the position after the text before it; the text after it resumes at p + max(rows,
columns). So a prompt with images ends at a position smaller than its length, by
``-delta``; every later token (all three axes equal again) is ordinary RoPE at
``sequence position + delta``.

Each rotary frequency takes its angle from one axis: Qwen2.5-VL gives the first
``mrope_section[0]`` frequencies to time, the next to height, the rest to width; Qwen3-VL
interleaves them (t, h, w, t, h, w, ...) over the first ``3 x section`` and gives the
tail to time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edge.model.config import rope_cos_sin

Span = tuple[int, int, tuple[int, int, int]]  # (first token, end, merged grid (t, h, w))


def rope_positions(length: int, images: Sequence[Span]) -> tuple[torch.Tensor, int]:
    """Positions ``[3, length]`` (int64) of a prompt of ``length`` tokens whose images
    occupy the given spans (in order), and the rope delta for the tokens after it."""
    parts = []
    pos = cursor = 0
    for start, end, (t, h, w) in images:
        if start < cursor or end - start != t * h * w:
            raise ValueError(f"image span [{start}, {end}) does not fit grid {(t, h, w)} after token {cursor}")
        parts.append(torch.arange(pos, pos + start - cursor).expand(3, -1))
        pos += start - cursor
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(torch.stack((tt, hh, ww)).reshape(3, -1) + pos)
        pos += max(h, w)
        cursor = end
    if cursor > length:
        raise ValueError(f"image span ends at {cursor}, past the prompt's {length} tokens")
    parts.append(torch.arange(pos, pos + length - cursor).expand(3, -1))
    positions = torch.cat(parts, dim=1)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


def frequency_axes(section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """The axis (0 time, 1 height, 2 width) each of the ``sum(section)`` frequencies reads."""
    half = sum(section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


def mrope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed-sin tables ``[T, head_dim]`` (rows in prompt order) for positions
    ``[3, T]``: the layout of ``Model.cos`` / ``Model.sin_signed``, angles in float64."""
    angles = positions.to(torch.float64)[:, :, None] * inv_freq.to(torch.float64)  # [3, T, D/2]
    picked = angles.gather(0, axes.view(1, 1, -1).expand(1, angles.shape[1], -1))[0]
    cos, sin_signed = rope_cos_sin(picked)
    return cos.to(device=device, dtype=dtype), sin_signed.to(device=device, dtype=dtype)
