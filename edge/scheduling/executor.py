"""The device work behind the scheduler's actions: admission, prefill chunks, decode
steps, endings.

``ActionRunner.execute`` does what one action of ``SchedulerPolicy`` asks with the
engine, on the streams of ``streams.py``, turns sampled tokens into chunks on the
request's handle, and reports what happened back to the policy (under the
scheduler's lock, which guards the policy). It runs on the loop thread only.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from edge.runtime.engine import Engine
from edge.model.generation import Chunk, Generation, Usage
from edge.model.kv import KVOutOfMemory, SequenceKV
from edge.runtime.kv_paged import PagedSequence
from edge.sampling import SamplerState, sample
from edge.scheduling.policy import (
    Action,
    Activate,
    Admit,
    AwaitFirstToken,
    Decode,
    End,
    Prefill,
    Request,
    SchedulerPolicy,
)
from edge.scheduling.streams import (
    ChunkTimer,
    CudaStreams,
    HostStreams,
    Lane,
    PendingToken,
)
from edge.speculative.decoding import (
    SpeculativeDecoder,
    SpeculativeStats,
    make_proposer,
)

if TYPE_CHECKING:
    from edge.model.vision.runtime import MultimodalPrompt

log = logging.getLogger(__name__)


def _blocks(seq: SequenceKV | None) -> list[int]:
    return seq.blocks if isinstance(seq, PagedSequence) else []


class _SlotRun:
    """The device side of one slot: sampler, sequence, generation, last token."""

    def __init__(self, index: int, engine: Engine, host_token: torch.Tensor) -> None:
        self.index = index
        self.sampler = SamplerState(engine.cfg.vocab_size, engine.device)
        self.lane = Lane()
        self.host_token = host_token  # pinned: where a background first token lands
        self.reset()

    def reset(self) -> None:
        self.request: Request | None = None
        self.seq: SequenceKV | None = None
        self.gen: Generation | None = None
        self.cached_tokens = 0
        self.next_input: torch.Tensor | None = None  # the last sampled token, on the device
        self.first_token: int | None = None
        self.pending: PendingToken | None = None  # a background first token on its way
        self.spec: SpeculativeDecoder | None = None  # set when the request decodes speculatively


class ActionRunner:
    """Runs the policy's actions on ``engine``; see the module docstring.
    ``energy``: ``end(id) -> J | None``, read when a request ends."""

    def __init__(
        self,
        engine: Engine,
        policy: SchedulerPolicy,
        lock: threading.Lock,
        streams: HostStreams | CudaStreams,
        energy=None,
        draft: Engine | None = None,
        beat: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self._beat = beat  # the loop's heartbeat, kept fresh through long vision-tower work
        self.draft = draft  # the draft model of speculative requests with method "draft"
        self.speculative = SpeculativeStats()  # totals over finished requests (/metrics)
        self.policy = policy
        self._lock = lock
        self.streams = streams
        self.energy = energy
        self.pool = engine.kv.pool if engine.kv is not None else None
        self._runs = [_SlotRun(s.index, engine, streams.pinned_token()) for s in policy.slots]
        self._timing: tuple[ChunkTimer, int] | None = None  # the background chunk being timed, its tokens

    def end_slot(self, index: int, reason: str, message: str | None = None) -> None:
        """End the request in slot ``index`` (shutdown)."""
        run = self._runs[index]
        if run.gen is not None:
            self._finish(run, reason, message)

    def execute(self, action: Action) -> None:
        """Do the device work of one of the policy's actions and report back."""
        match action:
            case End(request=req, slot=None, reason=reason, message=message):
                self.end_unstarted(req, reason, message)
            case End(slot=int(slot), reason=reason, message=message):
                self._finish(self._runs[slot], reason, message)
            case Admit():
                self._admit(action)
            case Prefill():
                self._prefill(action)
            case AwaitFirstToken(slot=slot):
                self._take_first_token(self._runs[slot])
            case Activate(slot=slot):
                self._activate(self._runs[slot])
            case Decode(slot=slot):
                self._decode(self._runs[slot])
            case _:
                raise AssertionError(f"unknown action {action!r}")

    def poll_device(self) -> None:
        """Learn what the device finished: a background chunk's time, first tokens."""
        self._poll_timing()
        for run in self._runs:
            if run.pending is not None and run.pending.done():
                self._take_first_token(run)

    def _poll_timing(self) -> None:
        if self._timing is None:
            return
        timer, tokens = self._timing
        elapsed = timer.elapsed_s()
        if elapsed is None:
            return
        self._timing = None
        with self._lock:
            self.policy.pacing.chunk_done(tokens, elapsed)

    # -- admission and prefill ---------------------------------------------------------------

    def _admit(self, action: Admit) -> None:
        run, req = self._runs[action.slot], action.request
        try:
            with self.streams.on(run.lane, high=not action.background):
                run.seq = self.engine.new_sequence(slot=action.slot)
                if action.shared:
                    run.seq.share_prefix(list(action.shared))
                gen = self.engine.new_generation(req.prompt_ids, req.params, run.sampler, req.grammar)
                spec = req.params.speculative
                if spec is not None:
                    proposer = make_proposer(spec, self.draft, action.slot)
                    run.spec = SpeculativeDecoder(
                        self.engine, run.seq, spec, run.sampler, req.params.greedy, proposer
                    )
        except Exception as exc:
            log.exception("request %s: admission failed", req.id)
            if run.seq is not None:
                run.seq.release()
            if run.spec is not None:
                run.spec.close()
            run.reset()
            with self._lock:
                self.policy.vacate(action.slot)
            self.end_unstarted(req, "error", f"internal error: {type(exc).__name__}: {exc}")
            return
        gen.t_start = req.t_submit  # time to first token counts from submission
        run.request, run.gen = req, gen
        run.cached_tokens = len(action.shared) * self.policy.page_size

    def _prefill(self, action: Prefill) -> None:
        run = self._runs[action.slot]
        req, gen, seq = run.request, run.gen, run.seq
        assert req is not None and gen is not None and seq is not None
        prompt = req.prompt_ids
        try:
            if seq.length != action.start:
                raise AssertionError(f"the policy prefills from {action.start}, the sequence holds {seq.length}")
            with self.streams.on(run.lane, high=not action.background, carry=run.next_input):
                if action.background and req.mm is not None and not self._tower_slice(req.mm, action):
                    return  # the images' tower runs in slices first, a slice a round
                logits = self._forward(seq, prompt[action.start : action.stop], action.background, req.mm)
                with self._lock:
                    self.policy.prefilled(action.slot, action.stop, len(_blocks(seq)))
                if action.stop < len(prompt):
                    return
                gen.mark_prefilled(run.cached_tokens)
                if req.params.max_tokens == 0:
                    self._finish(run, "length")  # prefill only: warms the prefix cache
                    return
                token = sample(logits, run.sampler, req.params.greedy, self._bitmask(gen))
                run.next_input = token
                pending = self.streams.defer(token, run.host_token)
        except KVOutOfMemory as exc:
            if action.background:
                with self._lock:
                    self.policy.background_blocked()
                return  # blocks are short: wait
            size = f" ({self.pool.num_blocks} blocks of {self.pool.page_size})" if self.pool is not None else ""
            self._finish(run, "error", f"prompt of {len(prompt)} tokens does not fit in the KV block pool{size}: {exc}")
            return
        except Exception as exc:
            self._fail(run, exc)
            return
        run.pending = pending
        if action.background and not pending.done():
            # Do not stall the decode loop on the low stream: the token is read when
            # its event has completed (``poll_device``).
            with self._lock:
                self.policy.first_token_pending(action.slot)
            return
        self._take_first_token(run)

    def _forward(
        self, seq: SequenceKV, ids: list[int], background: bool, mm: MultimodalPrompt | None = None
    ) -> torch.Tensor:
        """``engine.forward`` (``mm``: the prompt's images); a background chunk is timed
        for the pacing."""
        if not background:
            return self.engine.forward(seq, ids, mm=mm, progress=self._beat)
        with self._timed_chunk(len(ids)):
            return self.engine.forward(seq, ids, mm=mm, progress=self._beat)

    def _tower_slice(self, mm: MultimodalPrompt, action: Prefill) -> bool:
        """Before a background chunk with images: a slice of their vision-tower passes,
        about one chunk's time budget, so that the decoding conversation keeps its pace
        through a long pass. True when the features are ready (nothing ran)."""
        if not mm.towers_due(action.start, action.stop):
            return True
        with self._timed_chunk(0):
            self.engine.run_towers(mm, action.start, action.stop, self.policy.pacing.budget_s, progress=self._beat)
        return False

    @contextlib.contextmanager
    def _timed_chunk(self, tokens: int) -> Iterator[None]:
        """Time the background work in the block for the pacing, as ``tokens`` prompt tokens
        when it completes (0 for tower work: its time paces, but is not fitted)."""
        timer = self.streams.timer()
        with self._lock:
            self.policy.pacing.chunk_started(time.perf_counter())
        ran = 0
        try:
            yield
            ran = tokens
        finally:
            timer.stop()
            self._timing = (timer, ran)
            self._poll_timing()  # known at once on the CPU

    def _take_first_token(self, run: _SlotRun) -> None:
        """The prompt is in the cache and the first token is known: READY."""
        assert run.pending is not None
        try:
            run.first_token = run.pending.wait()
        except Exception as exc:
            run.pending = None
            self._fail(run, exc)
            return
        run.pending = None
        with self._lock:
            self.policy.ready(run.index, _blocks(run.seq))

    # -- decoding ----------------------------------------------------------------------------

    def _activate(self, run: _SlotRun) -> None:
        gen = run.gen
        assert gen is not None and run.first_token is not None
        try:
            chunk = gen.feed(run.first_token)
        except Exception as exc:
            self._fail(run, exc)
            return
        self._emit(run, chunk)

    def _emit(self, run: _SlotRun, chunk: Chunk) -> None:
        """Stream what a token made visible; end the request when it is done."""
        assert run.request is not None and run.gen is not None
        if chunk.token_ids or chunk.text:
            run.request.handle._push(chunk)
        if run.gen.done:
            self._finish(run)

    def _decode(self, run: _SlotRun) -> None:
        assert run.request is not None and run.gen is not None and run.seq is not None
        assert run.next_input is not None
        try:
            chunk = self._speculative_step(run) if run.spec is not None else self._decode_step(run)
        except KVOutOfMemory as exc:
            self._finish(run, "length", f"generation stopped: {exc}")
            return
        except Exception as exc:
            self._fail(run, exc)
            return
        self._emit(run, chunk)

    def _decode_step(self, run: _SlotRun) -> Chunk:
        req, gen, seq = run.request, run.gen, run.seq
        assert req is not None and gen is not None and seq is not None and run.next_input is not None
        with self.streams.on(run.lane, high=True, carry=run.next_input):
            token = self.engine.decode(seq, run.next_input, run.sampler, req.params.greedy, rope_delta=req.rope_delta,
                                       bitmask=gen.next_mask())
            self._prepare_masks(run)
            value = self.streams.read(token)
        run.next_input = token
        with self._lock:
            self.policy.decoded(run.index, time.perf_counter(), len(_blocks(seq)))
        return gen.feed(value)

    def _speculative_step(self, run: _SlotRun) -> Chunk:
        """One verify step (the slot's verify graph for this step's token count): its
        tokens in one chunk."""
        req, gen, seq, spec = run.request, run.gen, run.seq, run.spec
        assert req is not None and gen is not None and seq is not None and spec is not None
        with self.streams.on(run.lane, high=True, carry=run.next_input):
            budget = gen.stop.max_tokens - gen.stop.count
            tokens = spec.step(req.prompt_ids + gen.token_ids, budget, gen.grammar)
            run.next_input = torch.tensor([tokens[-1]], device=self.engine.device)
        with self._lock:
            self.policy.decoded(run.index, time.perf_counter(), len(_blocks(seq)))
        ids: list[int] = []
        text = ""
        for n, token in enumerate(tokens, start=1):
            chunk = gen.feed(token)
            ids += chunk.token_ids
            text += chunk.text
            if gen.done:
                spec.keep(n)  # stop string, stop token or max_tokens inside the step
                break
        return Chunk(ids, text)

    def _bitmask(self, gen: Generation) -> torch.Tensor | None:
        mask = gen.next_mask()
        return None if mask is None else self.engine.bitmask_tensor(mask)

    def _prepare_masks(self, running: _SlotRun) -> None:
        """While ``running``'s step is on the device, compute the other constrained
        slots' next masks (each is computed once per grammar state)."""
        for run in self._runs:
            gen = run.gen
            if run is not running and gen is not None and gen.grammar is not None and not gen.done:
                gen.next_mask()

    def _fail(self, run: _SlotRun, exc: BaseException) -> None:
        rid = run.request.id if run.request is not None else "?"
        log.error("request %s failed: %s", rid, exc, exc_info=exc)
        with contextlib.suppress(Exception):
            self.streams.drain_all()  # let an asynchronous device error surface here
        self._finish(run, "error", f"internal error: {type(exc).__name__}: {exc}", cache=False)

    def _finish(self, run: _SlotRun, reason: str | None = None, message: str | None = None, cache: bool = True) -> None:
        """End the slot's request: release (or cache) its blocks, then send the final chunk."""
        req, gen = run.request, run.gen
        assert req is not None and gen is not None
        if run.spec is not None:
            gen.usage.speculative = run.spec.stats.as_dict() | run.spec.describe()
            self.speculative.add(run.spec.stats)
        try:
            final = gen.finish(reason, message)
        except Exception as exc:  # never leave a stream without its end
            log.exception("request %s: finish failed", req.id)
            final = Chunk([], "", finish_reason=reason or "error", usage=gen.usage, message=message or str(exc))
        with self._lock:
            self.policy.vacate(run.index)
        self._release(run, cache)
        self._deliver_final(req, final)

    def _release(self, run: _SlotRun, cache: bool) -> None:
        seq, req, gen = run.seq, run.request, run.gen
        assert seq is not None
        try:
            self.streams.drain(run.lane)  # no kernel may still write blocks we give away
            self.engine.settle(seq)  # drop a decode step launched ahead of the finish
            if cache and req is not None and gen is not None and isinstance(seq, PagedSequence):
                written = (req.cache_ids + gen.token_ids)[: seq.length]
                full = seq.length // self.policy.page_size
                with self._lock:
                    self.policy.remember(written, seq.blocks[:full], follow_duplicates=True)
        except Exception:
            log.exception("request %s: releasing its sequence failed", req.id if req is not None else "?")
        finally:
            self.engine.end_sequence(seq)
            if run.spec is not None:
                run.spec.close()
            run.reset()

    def end_unstarted(self, req: Request, reason: str, message: str | None = None) -> None:
        usage = Usage(prompt_tokens=len(req.prompt_ids), seed=req.params.seed)
        usage.total_ms = (time.perf_counter() - req.t_submit) * 1e3
        self._deliver_final(req, Chunk([], "", finish_reason=reason, usage=usage, message=message))

    def _deliver_final(self, req: Request, final: Chunk) -> None:
        if self.energy is not None and final.usage is not None:
            try:
                joules = self.energy.end(req.id)
            except Exception:
                log.exception("energy meter failed")
                joules = None
            if joules is not None:
                u = final.usage
                u.energy_j = joules
                u.energy_j_per_token = joules / u.completion_tokens if u.completion_tokens else None
        with self._lock:
            self.policy.delivered(req, final.finish_reason or "length")
        if req.handle is not None:
            req.handle._push(final)
