"""CUDA-graph decode with a GPU-resident position.

One decode step — embedding, every layer, logits, sampling — is captured once per
slot and sampling mode, then replayed. All inputs live in static device buffers: the
token id, ``pos``, the slot's block table and the sampler state. The graph itself
writes the sampled token into the next step's input and advances ``pos``, so a step
inside a page copies nothing from the host; with the CUDA kernels it also writes the
token into the host's pinned ring, so nothing but the replay and an event goes on the
stream per step (a device-to-host copy between replays costs a few microseconds). At a page
crossing the host allocates the block and syncs its one table entry *before* replay
(forgetting that reads garbage at every page crossing).

The step runs the backend's graph kernels (``Backend.graph``). Because ``pos`` and the
table change only between replays, those launch overlapped where the device can
(sm_90+, ``Engine(overlap_launches=...)``): each kernel starts its weight or K/V stream
while the previous one is finishing.
"""

from __future__ import annotations

import contextlib
import gc
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from edge.kernels.reference import PagedKV, Rope
from edge.model.kv import KVOutOfMemory
from edge.runtime.kv_paged import PagedSequence
from edge.sampling import SamplerState, sample

if TYPE_CHECKING:
    from edge.runtime.engine import Engine


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: object, stream: torch.cuda.Stream) -> Iterator[None]:
    """``torch.cuda.graph`` as the decoders capture: in thread_local error mode, so another
    thread's CUDA calls (the other slot, a draft model, the API's workers) cannot
    invalidate it, and with Python's cyclic collector paused, because a collection inside
    the capture may free an unreachable old graph, whose destruction the capture forbids
    (it invalidates the capture)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
    finally:
        if collecting:
            gc.enable()


class GraphStepKV:
    """``SequenceKV.attend`` for the captured step: position read from device memory."""

    def __init__(self, decoder: "SlotDecoder") -> None:
        self.d = decoder
        self.ops = decoder.kernels.attention

    def pages(self, layer: int) -> PagedKV:
        return PagedKV(self.d.cache.pool.k[layer], self.d.cache.pool.v[layer], self.d.table)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        d = self.d
        pool, ops = d.cache.pool, self.ops
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        if k is not None:
            ops.write_kv(k_pool, v_pool, d.table, k, v, 0, pos=d.pos)
        out = ops.decode_attention(
            q[0], k_pool, v_pool, d.table, d.cache.max_seq_len, d.cache.scale, pos=d.pos, out=d.attn_out[layer]
        )
        return out.unsqueeze(0)

    def attend_rope(self, layer: int, qkv: torch.Tensor, rope: Rope) -> torch.Tensor:
        d = self.d
        pool = d.cache.pool
        out = self.ops.decode_attention_rope(
            qkv, rope, pool.k[layer], pool.v[layer], d.table, d.cache.max_seq_len, d.cache.scale,
            pos=d.pos, out=d.attn_out[layer],
        )
        return out.unsqueeze(0)


class SlotDecoder:
    """Static buffers and captured graphs of one scheduler slot."""

    RING = 4  # pinned token slots: steps that may be in flight before the host reads

    def __init__(self, engine: "Engine", pool: object | None = None) -> None:
        self.engine = engine
        self.model = engine.model
        self.kernels = engine.backend.graph
        self.cache = engine.kv
        dev = engine.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)
        self.table = torch.zeros(self.cache.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.sampler = SamplerState(engine.cfg.vocab_size, dev)
        cfg = engine.cfg
        self.attn_out = torch.empty(cfg.num_layers, cfg.num_heads, cfg.head_dim, device=dev, dtype=engine.dtype)
        self.host_tokens = torch.zeros(self.RING, dtype=torch.long, pin_memory=True)
        # With the CUDA kernels the step itself writes its token into host_tokens (slot
        # ring_pos % RING, fused_cuda.decode_step_end); else a copy follows each replay.
        self.publishes = self.kernels.layer.decode_step_end is not None
        self.ring_pos = torch.zeros(1, dtype=torch.int32, device=dev)
        # One per pinned slot; blocking: the host sleeps in read() instead of spinning a core.
        self._copied = [torch.cuda.Event(blocking=engine.blocking_waits) for _ in range(self.RING)]
        self._ring = 0
        self.graphs: dict[tuple[bool, bool], torch.cuda.CUDAGraph] = {}
        # Kernels each captured graph launches per replay, by name (from the launcher's counts).
        self.captured_kernels: dict[tuple[bool, bool], dict[str, int]] = {}
        self.mempool = pool
        self.bound: PagedSequence | None = None
        self.inflight: deque[int] = deque()  # ring slots of launched steps whose token is unread
        self.kv = GraphStepKV(self)
        # A vision-language model decodes after images at RoPE position pos + delta
        # (edge/model/vision/mrope.py): the step reads the slot's own cos/sin tables, which
        # ``bind`` shifts by the request's delta (a device copy), so ``pos`` still
        # indexes both the KV slot and the tables.
        vision = engine.vision
        rows = self.cache.max_seq_len
        self.rope = None if vision is None else tuple(t[:rows].clone() for t in vision.decode_rope(0))
        self.rope_delta = 0
        # Every graph of the slot is captured on this stream: its kernel workspaces are
        # the slot's own, and never another slot's.
        self.capture_stream = engine.new_stream()

    # -- binding a request -----------------------------------------------------------

    def bind(self, seq: PagedSequence, sampler: SamplerState, token: torch.Tensor, rope_delta: int = 0) -> None:
        """Make ``seq`` the slot's sequence: its table syncs straight into the static
        table from now on; sampler state and the first token are copied on the device.
        One small host-to-device copy (``pos``) per request, none per step.
        ``rope_delta``: the RoPE offset of a prompt with images (edge/vision)."""
        if rope_delta != self.rope_delta:
            if self.rope is None:
                raise ValueError("rope_delta needs a vision-language engine")
            for table, shifted in zip(self.rope, self.engine.vision.decode_rope(rope_delta)):
                table.copy_(shifted[: table.shape[0]])
            self.rope_delta = rope_delta
        n = len(seq.blocks)
        self.table[:n].copy_(seq.table.device[:n])
        seq.table.device = self.table
        self.pos.fill_(seq.length)
        self.ring_pos.fill_(self._ring)
        self.token.copy_(token.view(1))
        s = self.sampler
        for name in ("temperature", "top_k", "top_p", "penalty", "seed", "step", "seen"):
            getattr(s, name).copy_(getattr(sampler, name))
        s.use_penalty = sampler.use_penalty
        self.bound = seq
        self.inflight.clear()

    # -- one step --------------------------------------------------------------------

    def _body(self, greedy: bool) -> None:
        kern = self.kernels
        hidden, norm = self.model.hidden(self.token, self.pos, self.kv, kern, rope=self.rope)  # int32 positions
        if greedy and not self.sampler.use_penalty:
            # The token straight from the lm_head (an int8 one's kernel skips the
            # logits and takes the final norm); greedy decoding never reads the
            # sampler's noise step.
            self.model.greedy_token(hidden, out=self.token, norm=norm, kernels=kern)
        else:
            self.token.copy_(sample(self.model.logits(hidden, norm, kern)[0], self.sampler, greedy))
        if self.publishes:
            kern.layer.decode_step_end(self.token, self.host_tokens, self.ring_pos, self.pos)
        else:
            self.pos.add_(1)

    def _graph(self, greedy: bool) -> torch.cuda.CUDAGraph:
        key = (greedy, self.sampler.use_penalty)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        # Warm up once on the capture stream (lazy cuBLAS/kernel init must not happen
        # during capture, and the kernels' per-stream workspaces, zeroed when made,
        # must exist before it, or their zeroing would be replayed every step), at the
        # bound position whose block is already reserved, then undo the state the
        # warm-up advanced.
        state = (self.token, self.pos, self.ring_pos, self.sampler.step, self.sampler.seen)
        saved = [t.clone() for t in state]
        side = self.capture_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(greedy)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        before = self.engine.backend.launch_counts()
        with capturing(graph, self.mempool, side):
            self._body(greedy)
        after = self.engine.backend.launch_counts()
        self.captured_kernels[key] = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        self.graphs[key] = graph
        return graph

    def capture_all(self) -> int:
        """Capture every graph this slot can need (greedy and sampled, with and without
        penalties) on a scratch sequence, so no request pays a capture. Returns the
        number of graphs captured."""
        engine = self.engine
        seq = engine.kv.new_sequence()
        seq.slot = None
        sampler = SamplerState(engine.cfg.vocab_size, engine.device)
        try:
            seq.reserve(1)
            seq.advance(1)  # one position of scratch context (its K/V is never read back)
            made = 0
            for penalty in (False, True):
                sampler.use_penalty = penalty
                self.bind(seq, sampler, torch.zeros(1, dtype=torch.long, device=engine.device))
                seq.reserve(1)  # the block the warm-up step writes, as launch() does
                for greedy in (True, False):
                    if (greedy, penalty) not in self.graphs:
                        self._graph(greedy)
                        made += 1
                self.bound = None
            torch.cuda.current_stream().synchronize()
            return made
        finally:
            self.bound = None
            seq.release()

    def launch(self, seq: PagedSequence, greedy: bool) -> int:
        """Reserve (and sync) the block for this step outside the graph, replay, and
        start copying the sampled token to pinned memory. Returns the ring slot to
        ``read`` the token from, without waiting."""
        if self.bound is not seq:
            raise AssertionError("launch on a sequence that is not bound to this slot")
        seq.reserve(1)  # may raise KVOutOfMemory; nothing has been launched then
        self._graph(greedy).replay()
        seq.advance(1)
        slot = self._ring
        self._ring = (self._ring + 1) % self.RING
        if not self.publishes:
            # Stream order makes this copy read the token before the next replay rewrites it.
            self.host_tokens[slot : slot + 1].copy_(self.token, non_blocking=True)
        self._copied[slot].record()
        return slot

    def read(self, slot: int) -> int:
        """The token a launched step sampled (waits for that step only)."""
        self._copied[slot].synchronize()
        return int(self.host_tokens[slot])

    def next_token(self, seq: PagedSequence, greedy: bool) -> int:
        """The next token of the bound sequence, keeping one step ahead: the step after
        it is launched before this one is read, so the GPU does not wait for the host.
        A step launched past the end of the request is dropped by ``unbind``."""
        if not self.inflight:
            self.inflight.append(self.launch(seq, greedy))  # KVOutOfMemory propagates
        try:
            self.inflight.append(self.launch(seq, greedy))
        except KVOutOfMemory:
            pass  # not speculating; the next call raises if there is still no room
        return self.read(self.inflight.popleft())

    def unbind(self, seq: PagedSequence) -> None:
        """Detach ``seq``. Steps launched but never read are rolled back: their K/V
        beyond ``length`` is simply never read."""
        if self.inflight:
            seq.length -= len(self.inflight)
            seq.truncate_blocks()
        self.inflight.clear()
        self.bound = None
