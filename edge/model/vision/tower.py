"""The vision towers of Qwen3-VL and Qwen2.5-VL in plain torch (fp32 on the CPU, the
model's dtype, bf16, on a GPU), numerics as transformers computes them.

Both: a patch embedding (a Conv3d whose stride equals its kernel, so one matmul), 2-D
rotary embeddings (the head dim split between the patch's row and column), pre-norm
attention blocks that see one image at a time, and a merger that concatenates each 2 x 2
block of neighbouring patches and projects it to the decoder's width: one token per block.

- Qwen3-VL adds a learned position table, bilinearly resampled to the image's grid, and
  DeepStack: the outputs of a few blocks, merged by their own mergers, are added to the
  decoder's hidden states at the image tokens after its first layers.
- Qwen2.5-VL attends within windows of ``window_size`` pixels except in a few
  full-attention blocks; patches are permuted window by window for the blocks and the
  merged tokens permuted back at the end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from edge.kernels.reference import rms_norm
from edge.model.vision.config import VisionConfig

Grid = tuple[int, int, int]

NORM_EPS = 1e-6

_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True)
class ImageFeatures:
    """What the decoder takes from one image: ``embeds [tokens, hidden]`` for its
    placeholder tokens and, for Qwen3-VL, one ``[tokens, hidden]`` DeepStack feature per
    early decoder layer."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


def vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tower tensor (names relative to the tower's prefix) with its shape."""
    h, inter, m = cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit * cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (h, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
    }
    qwen3 = cfg.kind == "qwen3_vl"
    if qwen3:
        shapes["patch_embed.proj.bias"] = (h,)
        shapes["pos_embed.weight"] = (cfg.num_position_embeddings, h)
    for i in range(cfg.depth):
        p = f"blocks.{i}."
        shapes |= {p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,)}
        shapes |= {p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,)}
        shapes |= {p + "norm1.weight": (h,), p + "norm2.weight": (h,)}
        if qwen3:
            shapes |= {p + "norm1.bias": (h,), p + "norm2.bias": (h,)}
            shapes |= {p + "mlp.linear_fc1.weight": (inter, h), p + "mlp.linear_fc1.bias": (inter,)}
            shapes |= {p + "mlp.linear_fc2.weight": (h, inter), p + "mlp.linear_fc2.bias": (h,)}
        else:
            for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                shapes |= {p + f"mlp.{name}.weight": shape, p + f"mlp.{name}.bias": (shape[0],)}
    mergers = ["merger."] + [f"deepstack_merger_list.{j}." for j in range(len(cfg.deepstack_visual_indexes))]
    for j, p in enumerate(mergers):
        if qwen3:
            norm = h if j == 0 else m  # the DeepStack mergers normalise after the 2 x 2 concatenation
            shapes |= {p + "norm.weight": (norm,), p + "norm.bias": (norm,)}
            shapes |= {p + "linear_fc1.weight": (m, m), p + "linear_fc1.bias": (m,)}
            shapes |= {p + "linear_fc2.weight": (cfg.out_hidden_size, m), p + "linear_fc2.bias": (cfg.out_hidden_size,)}
        else:
            shapes |= {p + "ln_q.weight": (h,), p + "mlp.0.weight": (m, m), p + "mlp.0.bias": (m,)}
            shapes |= {p + "mlp.2.weight": (cfg.out_hidden_size, m), p + "mlp.2.bias": (cfg.out_hidden_size,)}
    return shapes


class TowerPass:
    """One tower pass run a block at a time, so that a long pass can share the device
    with another conversation's decoding (the scheduler runs it in slices)."""

    def __init__(self, steps: Generator[None, None, list[ImageFeatures]]) -> None:
        self._steps = steps
        self.result: list[ImageFeatures] | None = None

    def step(self) -> bool:
        """Run the next block (the merger with the last); True once the features are ready."""
        if self.result is None:
            with torch.inference_mode():
                try:
                    next(self._steps)
                except StopIteration as done:
                    self.result = done.value
        return self.result is not None


class VisionTower:
    """A loaded tower: ``tower(pixels, grids)`` -> one :class:`ImageFeatures` per image."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = weights
        w0 = weights["patch_embed.proj.weight"]
        self.device, self.dtype = w0.device, w0.dtype
        self.act = _ACT[cfg.hidden_act]
        # The patch embedding as a matmul over flattened [channels, temporal, patch, patch].
        self.patch_weight = w0.reshape(cfg.hidden_size, cfg.patch_dim)
        half = cfg.head_dim // 2  # each axis rotates a quarter of the head dim's pairs
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))

    def __call__(
        self, pixels: torch.Tensor, grids: Sequence[Grid], progress: Callable[[], None] | None = None
    ) -> list[ImageFeatures]:
        """``progress`` is called after each block: a long tower pass on a slow board keeps
        the engine loop's heartbeat fresh (the service's watchdog reads it)."""
        run = self.start(pixels, grids)
        while not run.step():
            if progress is not None:
                progress()
        assert run.result is not None
        return run.result

    def start(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> TowerPass:
        """A pass over ``pixels`` that runs a block a call (:meth:`TowerPass.step`)."""
        n = sum(t * h * w for t, h, w in grids)
        if pixels.dim() != 2 or pixels.shape != (n, self.cfg.patch_dim):
            raise ValueError(f"pixels must be [{n}, {self.cfg.patch_dim}] for grids {list(grids)}, got {tuple(pixels.shape)}")
        return TowerPass(self._steps(pixels, list(grids)))

    def _steps(self, pixels: torch.Tensor, grids: list[Grid]) -> Generator[None, None, list[ImageFeatures]]:
        cfg = self.cfg
        x = F.linear(pixels.to(self.device, self.dtype), self.patch_weight, self.w.get("patch_embed.proj.bias"))
        rows, cols = _block_order_positions(grids, cfg.spatial_merge_size, self.device)
        if cfg.kind == "qwen3_vl":
            x = x + self._position_embedding(grids).to(x.dtype)
        cos, sin = self._rotary(rows, cols)
        seqs = _image_bounds(grids)
        deepstack: list[torch.Tensor] = []
        if cfg.kind == "qwen3_vl":
            merged = yield from self._qwen3_blocks(x, cos, sin, seqs, deepstack)
        else:
            merged = yield from self._qwen2_5_blocks(x, cos, sin, seqs, grids)
        sizes = [t * h * w // cfg.merge_unit for t, h, w in grids]
        per_layer = [f.split(sizes) for f in deepstack]
        return [
            ImageFeatures(e, tuple(layer[i] for layer in per_layer)) for i, e in enumerate(merged.split(sizes))
        ]

    # -- shared pieces ----------------------------------------------------------------

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[N, head_dim]`` (float32): the first half of each half-dim run
        rotates by the patch's row, the second by its column."""
        inv = self.inv_freq.to(self.device)
        freqs = torch.cat((rows[:, None].float() * inv, cols[:, None].float() * inv), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _block(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"blocks.{i}."
        n, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
        qkv = F.linear(self._norm(x, p + "norm1"), w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"])
        q, k, v = qkv.view(n, 3, heads, d).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = segment_attention(q, k, v, bounds).reshape(n, heads * d)
        x = x + F.linear(attn, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        h = self._norm(x, p + "norm2")
        if cfg.kind == "qwen3_vl":
            mid = self.act(F.linear(h, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"]))
            return x + F.linear(mid, w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])
        gate = F.linear(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.gate_proj.bias"])
        up = F.linear(h, w[p + "mlp.up_proj.weight"], w[p + "mlp.up_proj.bias"])
        return x + F.linear(self.act(gate) * up, w[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.cfg.kind == "qwen3_vl":
            return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], NORM_EPS)
        return rms_norm(x, self.w[name + ".weight"], NORM_EPS)

    def _merge(self, x: torch.Tensor, p: str, post_shuffle: bool = False) -> torch.Tensor:
        """A merger: each 2 x 2 block of patches (consecutive rows of ``x``) -> one token."""
        w, width = self.w, self.cfg.merge_unit * self.cfg.hidden_size
        if self.cfg.kind == "qwen2_5_vl":
            h = rms_norm(x, w[p + "ln_q.weight"], NORM_EPS).view(-1, width)
            return F.linear(F.gelu(F.linear(h, w[p + "mlp.0.weight"], w[p + "mlp.0.bias"])), w[p + "mlp.2.weight"], w[p + "mlp.2.bias"])
        h = x.view(-1, width) if post_shuffle else x
        h = F.layer_norm(h, (h.shape[-1],), w[p + "norm.weight"], w[p + "norm.bias"], NORM_EPS).view(-1, width)
        h = F.gelu(F.linear(h, w[p + "linear_fc1.weight"], w[p + "linear_fc1.bias"]))
        return F.linear(h, w[p + "linear_fc2.weight"], w[p + "linear_fc2.bias"])

    # -- Qwen3-VL ---------------------------------------------------------------------

    def _position_embedding(self, grids: Sequence[Grid]) -> torch.Tensor:
        """The learned ``side x side`` position table resampled to each grid (bilinear,
        corners aligned), in merge-block order: ``[N, hidden]`` float32."""
        side = int(self.cfg.num_position_embeddings**0.5)
        table = self.w["pos_embed.weight"]
        out = []
        for t, h, w in grids:
            taps_h, wts_h = _bilinear_taps(h, side, self.device)
            taps_w, wts_w = _bilinear_taps(w, side, self.device)
            index = (taps_h[:, None, :, None] * side + taps_w[None, :, None, :]).reshape(h, w, 4)
            weight = (wts_h[:, None, :, None] * wts_w[None, :, None, :]).reshape(h, w, 4)
            m = self.cfg.spatial_merge_size
            order = _block_order(h, w, m, self.device)
            index, weight = index.reshape(h * w, 4)[order], weight.reshape(h * w, 4)[order]
            emb = (F.embedding(index, table) * weight[:, :, None]).sum(1)
            out.append(emb.repeat(t, 1))
        return torch.cat(out)

    def _qwen3_blocks(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqs: list[int], deepstack: list[torch.Tensor]
    ) -> Generator[None, None, torch.Tensor]:
        """The blocks, a yield after each; the deepstack features are appended to ``deepstack``."""
        for i in range(self.cfg.depth):
            x = self._block(x, i, cos, sin, seqs)
            if i in self.cfg.deepstack_visual_indexes:
                j = self.cfg.deepstack_visual_indexes.index(i)
                deepstack.append(self._merge(x, f"deepstack_merger_list.{j}.", post_shuffle=True))
            yield
        return self._merge(x, "merger.")

    # -- Qwen2.5-VL -------------------------------------------------------------------

    def _qwen2_5_blocks(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqs: list[int], grids: Sequence[Grid]
    ) -> Generator[None, None, torch.Tensor]:
        cfg = self.cfg
        order, windows = window_order(grids, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)
        order = order.to(self.device)
        mu = cfg.merge_unit

        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, mu, t.shape[-1])[order].view(-1, t.shape[-1])

        x, cos, sin = permute(x), permute(cos), permute(sin)
        for i in range(cfg.depth):
            x = self._block(x, i, cos, sin, seqs if i in cfg.fullatt_block_indexes else windows)
            yield
        return self._merge(x, "merger.")[torch.argsort(order)]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate_half layout) in float32 of ``x [N, heads, D]``, cast back."""
    f = x.float()
    half = f.shape[-1] // 2
    rotated = torch.cat((-f[..., half:], f[..., :half]), dim=-1)
    return (f * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment ``[bounds[i], bounds[i+1])`` of
    ``q, k, v [N, heads, D]`` -> ``[N, heads, D]``. Segments of equal length run as one
    batched call (windows are mostly of one size)."""
    _, heads, d = q.shape
    if len(bounds) == 2:
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
        return o[0].transpose(0, 1)
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in pairwise(bounds):
        if end > start:
            by_length[end - start].append(start)
    out = torch.empty_like(q)
    for length, starts in by_length.items():
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        qs, ks, vs = (t[idx].view(len(starts), length, heads, d).transpose(1, 2) for t in (q, k, v))
        out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(-1, heads, d)
    return out


def _image_bounds(grids: Sequence[Grid]) -> list[int]:
    """Attention segments of full attention: one per frame of each image."""
    bounds = [0]
    for t, h, w in grids:
        bounds += [bounds[-1] + (f + 1) * h * w for f in range(t)]
    return bounds


def _block_order(h: int, w: int, m: int, device: torch.device) -> torch.Tensor:
    """Raster indices of an ``h x w`` grid in merge-block order (blocks raster, then
    the ``m x m`` patches of a block raster)."""
    return torch.arange(h * w, device=device).view(h // m, m, w // m, m).transpose(1, 2).flatten()


def _block_order_positions(grids: Sequence[Grid], m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch, patches in merge-block order, frames repeated."""
    rows, cols = [], []
    for t, h, w in grids:
        order = _block_order(h, w, m, device)
        rows.append((order // w).repeat(t))
        cols.append((order % w).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def _bilinear_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of ``size`` target positions, the two source rows of a ``side``-row table
    and their weights, corners aligned (position 0 -> row 0, size-1 -> row side-1)."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    # The hat kernel as transformers evaluates it (1 - distance), rounding included.
    return taps, (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)


def window_order(
    grids: Sequence[Grid], merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merged-token order that puts each window's tokens
    together (windows raster within an image, tokens raster within a window), and the
    window bounds in patches."""
    side = window_size // merge // patch_size  # merged tokens per window side
    order: list[torch.Tensor] = []
    bounds = [0]
    offset = 0
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        index = torch.arange(t * lh * lw).view(t, lh, lw) + offset
        for f in range(t):
            for r in range(0, lh, side):
                for c in range(0, lw, side):
                    window = index[f, r : r + side, c : c + side].flatten()
                    order.append(window)
                    bounds.append(bounds[-1] + window.numel() * merge * merge)
        offset += t * lh * lw
    return torch.cat(order), bounds
