"""The scheduler: one loop thread owns the engine and does what the policy decides.

Callers talk to the loop only through thread-safe state: ``submit`` queues a request
(bounded), ``cancel`` marks one, ``call`` runs a function on the loop thread and
returns a ``concurrent.futures.Future``. Each request's chunks go to its
``RequestHandle``, which the loop appends to without ever waiting for a consumer.

The decisions (admission, slot states, prefix reuse) are ``SchedulerPolicy``'s, the
pacing of background prefill is ``Pacing``'s, the CUDA streams and events are
``streams.py``'s; this module runs the engine and turns its results into chunks.
``edge generate`` and ``edge serve`` both drive generation through it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from edge.engine import Engine
from edge.generation import Chunk, Generation, Usage
from edge.kv import KVOutOfMemory, SequenceKV
from edge.kv.paged import PagedSequence
from edge.kv.prefix import PrefixCache
from edge.sampling import SamplerState, SamplingParams, sample
from edge.scheduler.pacing import Pacing
from edge.scheduler.policy import (
    Action,
    Activate,
    Admit,
    AwaitFirstToken,
    Decode,
    End,
    Idle,
    Prefill,
    Request,
    RoundDone,
    SchedulerPolicy,
)
from edge.scheduler.request import InvalidPrompt, RequestHandle
from edge.scheduler.streams import ChunkTimer, Lane, PendingToken, device_streams

log = logging.getLogger(__name__)

T = TypeVar("T")


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


class Scheduler:
    """Serve requests on ``engine`` from a loop thread; see the module docstring and
    edge/scheduler/policy.py for the rules.

    ``prefill_chunk``: the largest background prefill chunk in tokens (default: the
    engine's). ``prefill_budget_ms``: the time one background chunk may take (default:
    two decode steps of the active conversation, as measured). ``background_share``:
    the largest fraction of the device's time background prefill may take while a
    request decodes. ``prefix_cache``: reuse the KV of repeated prefixes (default: when
    the engine's KV cache is paged). ``governor``: ``allow_background_prefill()``,
    ``decode_delay_s()``, ``check_admission()`` (may raise). ``energy``: ``begin(id)``,
    ``end(id) -> J | None``. ``idle_wait_s``: the loop goes round (heartbeat) at least
    this often when idle.
    """

    def __init__(
        self,
        engine: Engine,
        queue_size: int = 8,
        prefill_chunk: int | None = None,
        prefix_cache: bool | None = None,
        governor=None,
        energy=None,
        background_share: float = 0.2,
        prefill_budget_ms: float | None = None,
        idle_wait_s: float = 0.5,
    ) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        if prefill_budget_ms is not None and not prefill_budget_ms > 0:
            raise ValueError(f"prefill_budget_ms must be positive, got {prefill_budget_ms}")
        pool = engine.kv.pool if engine.kv is not None else None
        if prefix_cache is None:
            prefix_cache = pool is not None
        if prefix_cache and pool is None:
            raise ValueError("the prefix cache needs an engine with kv_cache='paged'")
        if pool is not None and pool.reclaimer is not None:
            log.warning("the engine's block pool already has a reclaimer (another scheduler not stopped?); replacing it")
            pool.reclaimer = None
        self.engine = engine
        self.pool = pool
        self.governor = governor
        self.energy = energy
        self.idle_wait_s = idle_wait_s
        chunk = prefill_chunk or engine.prefill_chunk
        pacing = Pacing(chunk, None if prefill_budget_ms is None else prefill_budget_ms / 1e3, background_share)
        self.prefix_cache: PrefixCache | None = PrefixCache(pool) if prefix_cache and pool is not None else None
        self.policy = SchedulerPolicy(
            pacing,
            queue_size=queue_size,
            foreground_chunk=max(chunk, engine.prefill_chunk),
            max_seq_len=engine.max_seq_len,
            pool=pool,
            prefix_cache=self.prefix_cache,
            governor=governor,
        )
        self.streams = device_streams(engine.device)
        self._runs = [_SlotRun(s.index, engine, self.streams.pinned_token()) for s in self.policy.slots]
        # Shared with caller threads, under _lock; the policy is only ever used under it.
        self._lock = threading.Lock()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._stopping = False
        self._shut_down = False
        self._wake = threading.Event()  # anything new for the loop
        self._urgent = threading.Event()  # cancel/stop: cut a thermal decode delay short
        self._thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()
        self._timing: tuple[ChunkTimer, int] | None = None  # the background chunk being timed, its tokens

    # -- caller side -------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._stopping:
                raise RuntimeError("scheduler was stopped; create a new one")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="edge-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel queued and in-flight requests (``cancelled``), stop the loop, give the
        prefix cache's blocks back to the pool."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake.set()
        self._urgent.set()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("scheduler loop did not stop within %.1f s", timeout)
                return
        self._shutdown()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        """Queue a request; raises SamplingError, PromptTooLong, InvalidPrompt,
        QueueFull, DuplicateRequest or the governor's DeviceTooHot on the caller's thread."""
        params = dataclasses.replace(params)  # ours to resolve (seed); callers may reuse theirs
        params.validate()
        ids = [int(t) for t in prompt_ids]
        self.engine.check_prompt(ids, params.max_tokens)
        vocab = self.engine.cfg.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidPrompt(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if self.governor is not None:
            self.governor.check_admission()
        with self._lock:
            if self._stopping:
                raise RuntimeError("scheduler is stopped")
            rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex[:16]}"
            handle = RequestHandle(rid, self)
            self.policy.enqueue(Request(rid, ids, params, time.perf_counter(), handle))
            if self.energy is not None:
                self.energy.begin(rid)
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> bool:
        """End a request in any state with a ``cancelled`` final chunk; True if it was
        known and not finished."""
        with self._lock:
            if not self.policy.cancel(request_id):
                return False
            running = self._thread is not None and self._thread.is_alive()
            # No loop yet: only queued requests exist; end them here.
            queued = self.policy.take_cancelled_queued() if not running and not self._shut_down else []
        for req in queued:
            self._end_unstarted(req, "cancelled")
        self._urgent.set()
        self._wake.set()
        return True

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the loop thread (here, when no loop runs); its future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            running = self._thread is not None and self._thread.is_alive() and not self._stopping
            if running:
                self._calls.append((fn, future))
        if running:
            self._wake.set()
        else:
            self._run_call(fn, future)
        return future

    def clear_prefix_cache(self, timeout: float = 5.0) -> int:
        """Drop the prefix cache (on the loop thread); returns the blocks dropped."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        try:
            return self.call(cache.clear).result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("scheduler loop did not answer") from None

    def stats(self) -> dict:
        with self._lock:
            queue_depth = len(self.policy.queue)
            finished = dict(self.policy.finished)
            slots = self.policy.describe_slots()
            waits = self.policy.background_waits
            pacing = self.policy.pacing.describe()
        pool, cache = self.pool, self.prefix_cache
        total = pool.num_blocks if pool is not None else 0
        free = pool.num_free if pool is not None else 0
        evictable = cache.num_evictable() if cache is not None else 0
        thread = self._thread
        return {
            "queue_depth": queue_depth,
            "queue_size": self.policy.queue_size,
            "slots": slots,
            "kv_blocks_total": total,
            "kv_blocks_used": total - free - evictable,  # held by live requests
            "kv_blocks_cached": len(cache) if cache is not None else 0,  # some may be in use too
            "kv_blocks_evictable": evictable,
            "kv_blocks_free": free,
            "prefix_cache": cache.stats() if cache is not None else None,
            "requests_finished": finished,
            "background_waits": waits,
            "background_prefill": pacing,
            "alive": thread is not None and thread.is_alive(),
            "last_heartbeat": self._heartbeat,
        }

    # -- loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        self.streams.bind_thread()
        with torch.no_grad():
            while not self._stopping:
                self._heartbeat = time.monotonic()
                self._wake.clear()
                try:
                    busy = self._round()
                except Exception:  # a bug outside any one request: keep serving
                    log.exception("scheduler loop iteration failed")
                    busy = False
                if not busy:
                    self._wake.wait(self.idle_wait_s)
            self._heartbeat = time.monotonic()
            self._shutdown()

    def _round(self) -> bool:
        """The policy's actions up to the end of a round; False when there was nothing to do."""
        self._run_calls()
        self._poll_device()
        while True:
            with self._lock:
                action = self.policy.next_action(time.perf_counter())
            if isinstance(action, Idle):
                return False
            if isinstance(action, RoundDone):
                return True
            self._execute(action)

    def _execute(self, action: Action) -> None:
        match action:
            case End(request=req, slot=None, reason=reason, message=message):
                self._end_unstarted(req, reason, message)
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

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            self._run_call(fn, future)

    @staticmethod
    def _run_call(fn: Callable[[], T], future: concurrent.futures.Future[T]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)

    def _poll_device(self) -> None:
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
            self.policy.pacing.chunk_done(tokens, elapsed, time.perf_counter())

    # -- admission and prefill ---------------------------------------------------------------

    def _admit(self, action: Admit) -> None:
        run, req = self._runs[action.slot], action.request
        try:
            with self.streams.on(run.lane, high=not action.background):
                run.seq = self.engine.new_sequence(slot=action.slot)
                if action.shared:
                    run.seq.share_prefix(list(action.shared))
                gen = self.engine.new_generation(req.prompt_ids, req.params, run.sampler)
        except Exception as exc:
            log.exception("request %s: admission failed", req.id)
            if run.seq is not None:
                run.seq.release()
            run.reset()
            with self._lock:
                self.policy.vacate(action.slot)
            self._end_unstarted(req, "error", f"internal error: {type(exc).__name__}: {exc}")
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
                logits = self._forward(seq, prompt[action.start : action.stop], action.background)
                with self._lock:
                    self.policy.prefilled(action.slot, action.stop, len(_blocks(seq)))
                if action.stop < len(prompt):
                    return
                gen.mark_prefilled(run.cached_tokens)
                if req.params.max_tokens == 0:
                    self._finish(run, "length")  # prefill only: warms the prefix cache
                    return
                token = sample(logits, run.sampler, req.params.greedy)
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
            # its event has completed (``_poll_device``).
            with self._lock:
                self.policy.first_token_pending(action.slot)
            return
        self._take_first_token(run)

    def _forward(self, seq: SequenceKV, ids: list[int], background: bool) -> torch.Tensor:
        """``engine.forward``; a background chunk is timed for the pacing."""
        if not background:
            return self.engine.forward(seq, ids)
        timer = self.streams.timer()
        with self._lock:
            self.policy.pacing.chunk_started()
        ran = 0
        try:
            logits = self.engine.forward(seq, ids)
            ran = len(ids)
            return logits
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
        req, gen, seq = run.request, run.gen, run.seq
        assert req is not None and gen is not None and seq is not None and run.next_input is not None
        try:
            t0 = time.perf_counter()
            with self.streams.on(run.lane, high=True, carry=run.next_input):
                token = self.engine.decode(seq, run.next_input, run.sampler, req.params.greedy)
                value = self.streams.read(token)
            seconds = time.perf_counter() - t0
            run.next_input = token
            with self._lock:
                self.policy.decoded(run.index, seconds, len(_blocks(seq)))
            chunk = gen.feed(value)
        except KVOutOfMemory as exc:
            self._finish(run, "length", f"generation stopped: {exc}")
            return
        except Exception as exc:
            self._fail(run, exc)
            return
        self._emit(run, chunk)
        self._thermal_delay()

    def _thermal_delay(self) -> None:
        delay = self.governor.decode_delay_s() if self.governor is not None else 0.0
        if delay <= 0:
            return
        self._urgent.clear()
        with self._lock:
            cancel_pending = self.policy.cancel_pending
        if not cancel_pending:
            self._urgent.wait(delay)  # cut short by cancel or stop

    # -- endings -----------------------------------------------------------------------------

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
                written = (req.prompt_ids + gen.token_ids)[: seq.length]
                full = seq.length // self.policy.page_size
                with self._lock:
                    self.policy.remember(written, seq.blocks[:full], follow_duplicates=True)
        except Exception:
            log.exception("request %s: releasing its sequence failed", req.id if req is not None else "?")
        finally:
            self.engine.end_sequence(seq)
            run.reset()

    def _end_unstarted(self, req: Request, reason: str, message: str | None = None) -> None:
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

    def _shutdown(self) -> None:
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            self._stopping = True
            queued, occupied = self.policy.drain()
            calls = list(self._calls)
            self._calls.clear()
        for req in queued:
            self._end_unstarted(req, "cancelled", "scheduler stopped")
        for slot in occupied:
            run = self._runs[slot.index]
            if run.gen is not None:
                self._finish(run, "cancelled", "scheduler stopped")
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("scheduler stopped"))
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            if self.pool is not None and self.pool.reclaimer is self.prefix_cache:
                self.pool.reclaimer = None
