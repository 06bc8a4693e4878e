"""The verify step with a GPU-resident position, captured as one CUDA graph per token count.

A verify step feeds T = k + 1 tokens (the newest token and k proposals) at positions
[pos, pos + T) of the slot's sequence and scores every one of them. As in the decode
graph (edge/runtime/graph.py), the position and the block table live in static device buffers:
the step reads ``pos`` on the device (``verify_attention_rope``: the q/k norms, RoPE,
the K/V store at ``pos + i`` and the paged attention, token i against keys [0, pos + i]),
so one graph per T replays at any length, and blocks are reserved and
their table entries synced outside the graph before the replay. The T input ids come
from the host (the proposer runs there): one host-to-device copy of T ids per step,
none for the position.

Two graphs per T: ``argmax`` (greedy without penalties: the argmax of every row on the
device, the number of leading proposals equal to it, and ``pos`` advanced past the
kept tokens, all inside the graph; the host reads T ids in one small copy) and
``logits`` (float32 logits of every row for the accept/reject rule on the host, which
then sets ``pos`` to the kept length).

On the reference backend (the CPU) the same body runs eagerly; ``path`` says which ran.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from edge.runtime.graph import capturing
from edge.kernels.reference import PagedKV, Rope
from edge.runtime.kv_paged import PagedSequence
from edge.runtime.step_wait import StepWait

if TYPE_CHECKING:
    from edge.runtime.engine import Engine

log = logging.getLogger(__name__)

# Verify graphs are captured for up to this many proposals unless the service asks for more.
DEFAULT_GRAPH_PROPOSALS = 8


class VerifyStepKV:
    """``SequenceKV`` of the verify step: attention at the device-resident position from
    the qkv rows (``verify_attention_rope``: the q/k norms, RoPE and the K/V store in the
    attention launch where the kernels plan it)."""

    def __init__(self, decoder: "VerifyDecoder") -> None:
        self.d = decoder

    def pages(self, layer: int) -> PagedKV:
        pool = self.d.cache.pool
        return PagedKV(pool.k[layer], pool.v[layer], self.d.table)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        if k is not None:
            raise AssertionError("the verify step stores K/V in its attention (or qk_norm_rope), not in attend")
        d = self.d
        pool = d.cache.pool
        return d.attention.verify_attention(
            q, pool.k[layer], pool.v[layer], d.table, d.pos, d.cache.scale, out=d.attn_out[layer, : q.shape[0]]
        )

    def attend_rope(self, layer: int, qkv: torch.Tensor, rope: Rope) -> torch.Tensor:
        d = self.d
        pool = d.cache.pool
        return d.attention.verify_attention_rope(
            qkv, rope, pool.k[layer], pool.v[layer], d.table, d.pos, d.cache.scale, out=d.attn_out[layer, : qkv.shape[0]]
        )


class VerifyDecoder:
    """Static buffers and verify graphs (T = 1 .. ``max_proposals`` + 1) of one slot.

    ``path`` is "graph" when the engine decodes through CUDA graphs, else "eager" (the
    reference backend, or graphs turned off): the same body, run directly."""

    def __init__(self, engine: "Engine", max_proposals: int, pool: object | None = None) -> None:
        if engine.kv is None:
            raise ValueError("the verify step needs a paged KV cache")
        if max_proposals < 1:
            raise ValueError(f"max_proposals must be positive, got {max_proposals}")
        self.engine = engine
        self.model = engine.model
        self.cache = engine.kv
        self.graphed = engine.cuda_graph
        self.path = "graph" if self.graphed else "eager"
        # Verify graphs launch as the decode graphs do (overlapped where the backend
        # overlaps them: sm_90, float and int8 models).
        self.kernels = engine.backend.graph if self.graphed else engine.backend.eager
        self.attention = self.kernels.attention
        self.max_proposals = max_proposals
        cfg, dev = engine.cfg, engine.device
        width = max_proposals + 1
        self.ids = torch.zeros(width, dtype=torch.long, device=dev)
        self.offsets = torch.arange(width, dtype=torch.int32, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)
        self.table = torch.zeros(self.cache.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.best = torch.zeros(width, dtype=torch.long, device=dev)
        self.logits = torch.zeros(width, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.attn_out = torch.empty(cfg.num_layers, width, cfg.num_heads, cfg.head_dim, device=dev, dtype=engine.dtype)
        cuda = dev.type == "cuda"
        self.host_ids = torch.zeros(width, dtype=torch.long, pin_memory=cuda)
        self.host_best = torch.zeros(width, dtype=torch.long, pin_memory=cuda)
        self._host_ids_np = self.host_ids.numpy()  # the step's ids written without a tensor per step
        # Blocking: the host sleeps until the copy is done instead of spinning a core.
        self._staged = torch.cuda.Event(blocking=engine.blocking_waits) if cuda else None
        # The readback is on the critical path (the next proposals need it): polled with
        # short naps (edge/runtime/step_wait.py), not a driver wake-up; a busy poll without them.
        self._read = torch.cuda.Event() if cuda else None
        self.waits = StepWait() if engine.blocking_waits else StepWait(nap_s=0.0)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        # Kernels each captured graph launches per replay, by name.
        self.captured_kernels: dict[tuple[int, bool], dict[str, int]] = {}
        self.mempool = pool
        self.bound: PagedSequence | None = None
        self.kv = VerifyStepKV(self)
        self.capture_stream = engine.new_stream() if self.graphed else None
        self.steps = 0  # verify steps run (graph replays or eager bodies)

    # -- binding --------------------------------------------------------------------------

    def bind(self, seq: PagedSequence) -> None:
        """Make ``seq`` the slot's sequence: its table syncs into the static table from now
        on, and ``pos`` is set to its length on the device (a fill, no copy)."""
        n = len(seq.blocks)
        self.table[:n].copy_(seq.table.device[:n])
        seq.table.device = self.table
        self.pos.fill_(seq.length)
        self.bound = seq

    def unbind(self) -> None:
        self.bound = None

    # -- one step -------------------------------------------------------------------------

    def run(self, seq: PagedSequence, tokens: list[int], argmax: bool) -> list[int] | torch.Tensor:
        """Feed ``tokens`` (the newest token, then the proposals) at ``seq.length``.
        ``argmax``: returns the T greedy ids (host list) and ``pos`` already points past
        the kept tokens; else returns the float32 logits ``[T, vocab]`` (a static buffer,
        valid until the next step) and the caller must :meth:`settle`. ``seq.length``
        grows by T either way; KVOutOfMemory leaves ``seq`` unchanged."""
        t = len(tokens)
        if not 1 <= t <= self.max_proposals + 1:
            raise ValueError(f"a verify step takes 1..{self.max_proposals + 1} tokens, got {t}")
        if self.bound is not seq:
            self.bind(seq)
        seq.reserve(t)  # may raise KVOutOfMemory; nothing has been launched then
        if self._staged is not None:
            self._staged.synchronize()  # the last step's copy out of host_ids is done
        self._host_ids_np[:t] = tokens
        self.ids[:t].copy_(self.host_ids[:t], non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        if self.graphed:
            self._graph(t, argmax).replay()
        else:
            self._body(t, argmax)
        seq.advance(t)
        self.steps += 1
        if not argmax:
            return self.logits[:t]
        self.host_best[:t].copy_(self.best[:t], non_blocking=True)
        if self._read is not None:
            self._read.record()
            self.waits.wait(self._read)
        return self.host_best[:t].tolist()

    def settle(self, seq: PagedSequence) -> None:
        """After a ``logits`` step and its rollback: the next step starts at ``seq.length``."""
        self.pos.fill_(seq.length)

    def _body(self, t: int, argmax: bool) -> None:
        kern = self.kernels
        ids = self.ids[:t]
        positions = self.pos + self.offsets[:t]  # int32, on the device
        hidden, norm = self.model.hidden(ids, positions, self.kv, kern)
        if argmax:
            best = self.model.greedy_token(hidden, out=self.best[:t], norm=norm, kernels=kern)
            # Proposals standing before the first that differs from the target's argmax:
            # the kept tokens are the input and those, so the next step starts after them.
            missed = torch.cumsum(best[: t - 1] != ids[1:], 0)
            kept = (missed == 0).sum(dtype=torch.int32)
            self.pos.add_(kept + 1)
        else:
            self.logits[:t].copy_(self.model.logits(hidden, norm, kern))

    def _graph(self, t: int, argmax: bool) -> torch.cuda.CUDAGraph:
        key = (t, argmax)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        if self.bound is None or self.bound.length + t > len(self.bound.blocks) * self.cache.pool.page_size:
            raise AssertionError("capture needs a bound sequence with the step's blocks reserved")
        # Warm up once on the capture stream (lazy library init and the kernels' per-stream
        # workspaces must exist before capture), then undo what the warm-up advanced.
        saved = self.pos.clone()
        side = self.capture_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(t, argmax)
        torch.cuda.current_stream().wait_stream(side)
        self.pos.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        before = self.engine.backend.launch_counts()
        with capturing(graph, self.mempool, side):
            self._body(t, argmax)
        after = self.engine.backend.launch_counts()
        self.captured_kernels[key] = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        self.graphs[key] = graph
        log.debug("captured the verify graph of %d tokens (%s)", t, "argmax" if argmax else "logits")
        return graph

    def capture_all(self) -> int:
        """Capture the graphs of every token count and both modes on a scratch sequence,
        so no request pays a capture. Returns how many were captured (0 when eager)."""
        if not self.graphed:
            return 0
        seq = self.engine.kv.new_sequence()
        seq.slot = None
        try:
            seq.reserve(1)
            seq.advance(1)  # one position of scratch context (its K/V is never read back)
            self.bind(seq)
            seq.reserve(self.max_proposals + 1)  # the blocks every warm-up step writes
            made = 0
            for t in range(1, self.max_proposals + 2):
                for argmax in (True, False):
                    if (t, argmax) not in self.graphs:
                        self._graph(t, argmax)
                        made += 1
            torch.cuda.current_stream().synchronize()
            return made
        finally:
            self.bound = None
            seq.release()
