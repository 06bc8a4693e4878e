"""Two-slot ping-pong scheduler.

One loop thread owns the engine. Two slots share the engine's block pool, each with
its own ``SamplerState`` and ``PagedSequence``. At most one slot DECODES (the active
one). While it decodes, the other slot PREFILLS the head of the queue in chunks,
interleaved with the decode steps (one decode step, then one prefill chunk), on a
low-priority CUDA stream when there is a GPU, and then waits READY with its first
token already sampled. When the active request ends, the READY slot becomes active
in the same loop iteration and its first token goes to the client at once: its time
to first token is a switch, not a prefill. An idle engine prefills a new request at
once, at full priority and in big chunks, with no decode to interleave.

Slot states: idle -> prefilling -> ready -> decoding -> idle (any state -> idle on
cancel, error or finish). Callers talk to the loop only through thread-safe state: a
bounded FIFO (``submit``), cancel flags (``cancel``), and per-request output lists
(``RequestHandle``) that the loop appends to without ever waiting for a consumer.

Memory: full blocks of every request (prompt, and generated tokens whose K/V were
written) stay in the prefix cache when it ends, whatever the reason (errors excepted);
the cache gives blocks back least recently used when the pool runs short. Background
prefill never takes blocks the active request may still need (its worst case up to
``max_tokens``): it waits instead. A decode that finds no block even after eviction
ends with ``length`` and a message; a prompt that cannot fit even an empty pool ends
with ``error``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from edge.engine import Engine
from edge.generation import Chunk, Generation, Usage
from edge.kv import KVOutOfMemory
from edge.kv.paged import PagedSequence
from edge.kv.prefix import PrefixCache
from edge.sampling import SamplerState, SamplingParams, sample
from edge.errors import DuplicateRequestId, InvalidPrompt, QueueFull, SchedulerStopped
from edge.scheduler.request import RequestHandle

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # the loop goes round (heartbeat) at least this often when idle


class SlotState(str, enum.Enum):
    IDLE = "idle"
    PREFILLING = "prefilling"
    READY = "ready"
    DECODING = "decoding"


@dataclass(eq=False)
class _Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    t_submit: float  # time.perf_counter(), the clock of Generation's timings
    cancelled: bool = False
    finished: bool = False


class _Slot:
    def __init__(self, index: int, engine: Engine) -> None:
        self.index = index
        self.sampler = SamplerState(engine.cfg.vocab_size, engine.device)
        # A fresh sequence per request (``Engine.new_sequence(slot=i)``: the slot index
        # selects the slot's CUDA-graph decoder, which binds each new sequence); an idle
        # slot holds an empty one so that accounting code never meets None.
        self.seq: PagedSequence = engine.new_sequence(slot=index)  # type: ignore[assignment]
        self.state = SlotState.IDLE
        self.req: _Request | None = None
        self.gen: Generation | None = None
        self.cached_tokens = 0
        self.next_input: torch.Tensor | None = None  # the last sampled token, on the device
        self.first_token: int | None = None
        self.pending: tuple[torch.Tensor, Any] | None = None  # (pinned host token, CUDA event)
        self.stream: Any = None  # CUDA stream of this slot's latest work
        self.host_token = torch.empty(1, dtype=torch.long, pin_memory=engine.device.type == "cuda")

    def reset(self) -> None:
        self.state = SlotState.IDLE
        self.req = None
        self.gen = None
        self.cached_tokens = 0
        self.next_input = None
        self.first_token = None
        self.pending = None


class Scheduler:
    """Serve requests on ``engine`` from a loop thread; see the module docstring.

    ``prefill_chunk``: tokens per background prefill chunk (default: the engine's).
    ``background_share``: on a GPU, the largest fraction of time background prefill
    may keep the device busy while a request decodes. Stream priority alone does not
    protect decode: a prefill GEMM's blocks hold the SMs, and every one of the
    hundreds of small decode kernels waits for some to drain.
    ``governor``: ``allow_background_prefill()``, ``decode_delay_s()``,
    ``check_admission()`` (may raise). ``energy``: ``begin(id)``, ``end(id) -> J|None``.
    """

    def __init__(
        self,
        engine: Engine,
        queue_size: int = 8,
        prefill_chunk: int | None = None,
        prefix_cache: bool = True,
        governor=None,
        energy=None,
        background_share: float = 0.2,
    ) -> None:
        if not 0.0 < background_share <= 1.0:
            raise ValueError(f"background_share must be in (0, 1], got {background_share}")
        if engine.kv is None:
            raise ValueError("the scheduler needs an engine with kv_cache='paged'")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.engine = engine
        self.pool = engine.kv.pool
        self.page_size = self.pool.page_size
        self.queue_size = queue_size
        self.prefill_chunk = prefill_chunk or engine.prefill_chunk
        self.governor = governor
        self.energy = energy
        if self.pool.reclaimer is not None:
            log.warning("the engine's block pool already has a reclaimer (another scheduler not stopped?); replacing it")
            self.pool.reclaimer = None
        self.prefix_cache: PrefixCache | None = PrefixCache(self.pool) if prefix_cache else None
        self._slots = [_Slot(0, engine), _Slot(1, engine)]
        self._cuda = engine.device.type == "cuda"
        if self._cuda:
            # Lower number = higher priority; out-of-range values are clamped by CUDA.
            self._high = torch.cuda.Stream(engine.device, priority=-5)
            self._low = torch.cuda.Stream(engine.device, priority=0)
        # Shared with caller threads, under _lock.
        self._lock = threading.Lock()
        self._queue: deque[_Request] = deque()
        self._requests: dict[str, _Request] = {}
        self._finished: Counter[str] = Counter()
        self._cancel_pending = False
        self._calls: deque[tuple[Callable[[], Any], dict]] = deque()
        self._stopping = False
        self._shut_down = False
        self._wake = threading.Event()  # anything new for the loop
        self._urgent = threading.Event()  # cancel/stop: cut a thermal decode delay short
        self._thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()
        self.background_waits = 0  # background chunks deferred for lack of blocks
        self.background_share = background_share
        self._bg_chunk: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # last chunk's GPU span
        self._bg_resume = 0.0  # perf_counter time before which no background chunk starts

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
        QueueFull, DuplicateRequestId, SchedulerStopped (edge/errors.py) or the
        governor's DeviceTooHot on the caller's thread."""
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
                raise SchedulerStopped("scheduler is stopped")
            if len(self._queue) >= self.queue_size:
                raise QueueFull(
                    f"request queue is full ({len(self._queue)} of {self.queue_size} waiting "
                    f"behind the two slots); retry later"
                )
            rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex[:16]}"
            if rid in self._requests:
                raise DuplicateRequestId(f"request id {rid!r} is already in flight")
            handle = RequestHandle(rid, self)
            req = _Request(rid, ids, params, handle, time.perf_counter())
            if self.energy is not None:
                self.energy.begin(rid)
            self._requests[rid] = req
            self._queue.append(req)
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> bool:
        """End a request in any state with a ``cancelled`` final chunk; True if it was
        known and not finished."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return False
            req.cancelled = True
            self._cancel_pending = True
            running = self._thread is not None and self._thread.is_alive()
        if not running and not self._shut_down:
            self._cancel_queued()  # no loop yet: only queued requests exist; end them here
        self._urgent.set()
        self._wake.set()
        return True

    def clear_prefix_cache(self, timeout: float = 5.0) -> int:
        """Drop the prefix cache (on the loop thread); returns the blocks dropped."""
        if self.prefix_cache is None:
            return 0
        return self._call(self.prefix_cache.clear, timeout)

    def _call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` on the loop thread (or here when no loop runs) and return its value."""
        box: dict = {}
        done = threading.Event()
        box["done"] = done
        with self._lock:
            running = self._thread is not None and self._thread.is_alive() and not self._stopping
            if running:
                self._calls.append((fn, box))
        if not running:
            return fn()
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("scheduler loop did not answer")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stats(self) -> dict:
        with self._lock:
            queue_depth = len(self._queue)
            finished = dict(self._finished)
        slots = []
        for s in self._slots:
            req = s.req
            slots.append({"state": s.state.value, "request_id": req.id if req is not None else None})
        pool = self.pool
        free = pool.num_free
        cached = len(self.prefix_cache) if self.prefix_cache is not None else 0
        evictable = self.prefix_cache.num_evictable() if self.prefix_cache is not None else 0
        thread = self._thread
        return {
            "queue_depth": queue_depth,
            "queue_size": self.queue_size,
            "slots": slots,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_blocks - free - evictable,  # held by live requests
            "kv_blocks_cached": cached,  # held by the prefix cache (some may be in use too)
            "kv_blocks_evictable": evictable,
            "kv_blocks_free": free,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
            "requests_finished": finished,
            "background_waits": self.background_waits,
            "alive": thread is not None and thread.is_alive(),
            "last_heartbeat": self._heartbeat,
        }

    # -- loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.engine.device)
        with torch.no_grad():
            while not self._stopping:
                self._heartbeat = time.monotonic()
                self._wake.clear()
                try:
                    busy = self._iteration()
                except Exception:  # a bug outside any one request: keep serving
                    log.exception("scheduler loop iteration failed")
                    busy = False
                if not busy:
                    self._wake.wait(IDLE_WAIT_S)
            self._heartbeat = time.monotonic()
            self._shutdown()

    def _iteration(self) -> bool:
        self._run_calls()
        self._process_cancels()
        self._poll_pending()
        active = self._active() or self._promote_ready()
        if active is None:
            return self._serve_idle()
        self._decode_step(active)
        delay = self.governor.decode_delay_s() if self.governor is not None else 0.0
        if delay > 0:
            self._urgent.clear()
            if not self._cancel_pending:
                self._urgent.wait(delay)  # cut short by cancel or stop
        self._process_cancels()
        self._background()
        return True

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, box = self._calls.popleft()
            try:
                box["value"] = fn()
            except Exception as exc:
                box["error"] = exc
            box["done"].set()

    def _active(self) -> _Slot | None:
        for s in self._slots:
            if s.state is SlotState.DECODING:
                return s
        return None

    def _slot_in(self, state: SlotState) -> _Slot | None:
        for s in self._slots:
            if s.state is state:
                return s
        return None

    def _promote_ready(self) -> _Slot | None:
        """With no active slot, make the READY one active (its first token goes out now)."""
        while self._active() is None:
            ready = self._slot_in(SlotState.READY)
            if ready is None:
                return None
            self._activate(ready)
        return self._active()

    def _serve_idle(self) -> bool:
        """No request is decoding: prefill one at full priority."""
        slot = self._slot_in(SlotState.PREFILLING)
        if slot is None:
            slot = self._slot_in(SlotState.IDLE)
            if slot is None or not self._admit(slot, background=False):
                return False
            if slot.state is not SlotState.PREFILLING:
                return True  # ended at admission
        if slot.pending is not None:
            self._resolve_pending(slot, wait=True)
        else:
            self._prefill_chunk(slot, background=False)
        return True

    def _background(self) -> None:
        """One prefill chunk for the non-active slot, if allowed and possible."""
        active = self._active()
        if active is None:
            return  # the next iteration serves the queue at full priority
        if self.governor is not None and not self.governor.allow_background_prefill():
            return
        other = self._slots[1 - active.index]
        if other.state is SlotState.IDLE:
            if not self._admit(other, background=True) or other.state is not SlotState.PREFILLING:
                return
        if other.state is SlotState.PREFILLING and other.pending is None and self._background_due():
            if not self._cuda:
                self._prefill_chunk(other, background=True)
                return
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._low)
            self._prefill_chunk(other, background=True)
            end.record(self._low)
            self._bg_chunk = (start, end)

    def _background_due(self) -> bool:
        """Duty cycle on a GPU: after a chunk that kept the device busy for c seconds,
        the next may start only c * (1 - share) / share seconds after it finished."""
        if not self._cuda:
            return True  # the CPU loop already alternates one decode step, one chunk
        if self._bg_chunk is not None:
            start, end = self._bg_chunk
            if not end.query():
                return False
            busy_s = start.elapsed_time(end) / 1e3
            share = self.background_share
            self._bg_resume = time.perf_counter() + busy_s * (1.0 - share) / share
            self._bg_chunk = None
        return time.perf_counter() >= self._bg_resume

    # -- admission and prefill ---------------------------------------------------------------

    def _admit(self, slot: _Slot, background: bool) -> bool:
        """Move the queue's head into ``slot``; False when nothing happened."""
        with self._lock:
            if not self._queue:
                return False
            req = self._queue[0]
        if req.cancelled:
            self._cancel_queued()
            return True
        prompt, ps = req.prompt_ids, self.page_size
        blocks_needed = -(-len(prompt) // ps)
        if blocks_needed > self.pool.num_blocks:
            self._pop(req)
            self._finish_unstarted(
                req,
                "error",
                f"prompt of {len(prompt)} tokens needs {blocks_needed} KV blocks of {ps} tokens; "
                f"the pool has only {self.pool.num_blocks}",
            )
            return True
        cache = self.prefix_cache
        # At least the last prompt token is always prefilled, so that logits exist.
        shared = cache.match(prompt[: len(prompt) - 1], touch=False) if cache is not None else []
        if background:
            refcount = self.pool.refcount
            taken = sum(1 for b in shared if refcount[b] == 1)  # evictable blocks we would pin
            start = len(shared) * ps
            first = min(self.prefill_chunk, len(prompt) - start)
            need = -(-(start + first) // ps) - len(shared)
            if not self._headroom_ok(need + taken):
                self.background_waits += 1
                return False
        self._pop(req)
        try:
            if cache is not None and shared:
                shared = cache.match(prompt[: len(prompt) - 1])
            with self._on(slot, high=not background):  # device work on the prefill's stream
                slot.seq = self.engine.new_sequence(slot=slot.index)  # type: ignore[assignment]
                slot.seq.share_prefix(shared)
                gen = self.engine.new_generation(prompt, req.params, slot.sampler)
            gen.t_start = req.t_submit  # time to first token counts from submission
        except Exception as exc:
            slot.seq.release()
            log.exception("request %s: admission failed", req.id)
            self._finish_unstarted(req, "error", f"internal error: {type(exc).__name__}: {exc}")
            return True
        slot.req, slot.gen = req, gen
        slot.cached_tokens = len(shared) * ps
        slot.state = SlotState.PREFILLING
        return True

    def _pop(self, req: _Request) -> None:
        with self._lock:
            if self._queue and self._queue[0] is req:
                self._queue.popleft()
            else:
                self._queue.remove(req)

    def _headroom_ok(self, need: int) -> bool:
        """May background work take ``need`` more blocks without starving the active
        request of the blocks it may still need (up to its max_tokens)?"""
        reserve = 0
        active = self._active()
        if active is not None and active.req is not None:
            req = active.req
            final_len = min(len(req.prompt_ids) + req.params.max_tokens - 1, self.engine.max_seq_len)
            reserve = max(0, -(-final_len // self.page_size) - len(active.seq.blocks))
        available = self.pool.num_free
        if available - need >= reserve:
            return True  # the common case; counting evictable blocks scans the pool
        if self.prefix_cache is not None:
            available += self.prefix_cache.num_evictable()
        return available - need >= reserve

    @contextlib.contextmanager
    def _on(self, slot: _Slot, high: bool) -> Iterator[None]:
        """Run ``slot``'s work on the high- or low-priority stream (no-op on the CPU);
        a slot moving between streams orders the new one after the old."""
        if not self._cuda:
            yield
            return
        stream = self._high if high else self._low
        if slot.stream is not None and slot.stream is not stream:
            stream.wait_stream(slot.stream)
            if slot.next_input is not None and slot.next_input.is_cuda:
                slot.next_input.record_stream(stream)
        slot.stream = stream
        with torch.cuda.stream(stream):
            yield

    def _prefill_chunk(self, slot: _Slot, background: bool) -> None:
        req, gen, seq = slot.req, slot.gen, slot.seq
        assert req is not None and gen is not None
        prompt = req.prompt_ids
        size = self.prefill_chunk if background else max(self.prefill_chunk, self.engine.prefill_chunk)
        ids = prompt[seq.length : seq.length + size]
        if background and not self._headroom_ok(seq.blocks_needed(len(ids))):
            self.background_waits += 1
            return  # retry on a later iteration (or in the foreground once alone)
        try:
            with self._on(slot, high=not background):
                logits = self.engine.forward(seq, ids)
                if seq.length < len(prompt):
                    return
                gen.mark_prefilled(slot.cached_tokens)
                if req.params.max_tokens == 0:
                    self._finish(slot, "length")  # prefill only: warms the prefix cache
                    return
                token = sample(logits, slot.sampler, req.params.greedy)
                slot.next_input = token
                if background and self._cuda:
                    # Do not stall the decode loop on the low stream: read the token
                    # when its event has completed (``_poll_pending``).
                    host = slot.host_token
                    host.copy_(token, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._low)
                    slot.pending = (host, event)
                    return
                first = int(token)
        except KVOutOfMemory as exc:
            if background:
                self.background_waits += 1
                return  # blocks are short: wait
            self._finish(
                slot,
                "error",
                f"prompt of {len(prompt)} tokens does not fit in the KV block pool "
                f"({self.pool.num_blocks} blocks of {self.page_size}): {exc}",
            )
            return
        except Exception as exc:
            self._fail(slot, exc)
            return
        self._prefilled(slot, first, activate=not background)

    def _poll_pending(self) -> None:
        for slot in self._slots:
            if slot.pending is not None and slot.pending[1].query():
                self._resolve_pending(slot, wait=False)

    def _resolve_pending(self, slot: _Slot, wait: bool) -> None:
        assert slot.pending is not None
        host, event = slot.pending
        if wait:
            event.synchronize()
        slot.pending = None
        self._prefilled(slot, int(host[0]), activate=False)

    def _prefilled(self, slot: _Slot, first: int, activate: bool) -> None:
        """The prompt is in the cache and the first token sampled: READY (or active)."""
        req, seq = slot.req, slot.seq
        assert req is not None
        slot.first_token = first
        if self.prefix_cache is not None:
            full = len(req.prompt_ids) // self.page_size
            try:
                self.prefix_cache.insert(req.prompt_ids, seq.blocks[:full])
            except Exception:
                log.exception("prefix cache insert failed")
        slot.state = SlotState.READY
        if activate:
            self._activate(slot)

    # -- decoding ----------------------------------------------------------------------------

    def _activate(self, slot: _Slot) -> None:
        gen = slot.gen
        assert gen is not None and slot.first_token is not None
        slot.state = SlotState.DECODING
        try:
            chunk = gen.feed(slot.first_token)
        except Exception as exc:
            self._fail(slot, exc)
            return
        if chunk.token_ids or chunk.text:
            slot.req.handle._push(chunk)
        if gen.done:
            self._finish(slot)

    def _decode_step(self, slot: _Slot) -> None:
        req, gen = slot.req, slot.gen
        assert req is not None and gen is not None and slot.next_input is not None
        try:
            with self._on(slot, high=True):
                token = self.engine.decode(slot.seq, slot.next_input, slot.sampler, req.params.greedy)
                value = int(token)
            slot.next_input = token
            chunk = gen.feed(value)
        except KVOutOfMemory as exc:
            self._finish(slot, "length", f"generation stopped: {exc}")
            self._promote_ready()
            return
        except Exception as exc:
            self._fail(slot, exc)
            self._promote_ready()
            return
        if chunk.token_ids or chunk.text:
            req.handle._push(chunk)
        if gen.done:
            self._finish(slot)
            self._promote_ready()

    # -- endings -----------------------------------------------------------------------------

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        rid = slot.req.id if slot.req is not None else "?"
        log.error("request %s failed: %s", rid, exc, exc_info=exc)
        if self._cuda:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.engine.device)
        self._finish(slot, "error", f"internal error: {type(exc).__name__}: {exc}", cache=False)

    def _finish(self, slot: _Slot, reason: str | None = None, message: str | None = None, cache: bool = True) -> None:
        """End the slot's request: release (or cache) its blocks, then send the final chunk."""
        req, gen = slot.req, slot.gen
        assert req is not None and gen is not None
        try:
            final = gen.finish(reason, message)
        except Exception as exc:  # never leave a stream without its end
            log.exception("request %s: finish failed", req.id)
            usage = gen.usage
            final = Chunk([], "", finish_reason=reason or "error", usage=usage, message=message or str(exc))
        self._release(slot, cache)
        self._deliver_final(req, final)

    def _release(self, slot: _Slot, cache: bool) -> None:
        seq, req, gen = slot.seq, slot.req, slot.gen
        try:
            if self._cuda and slot.stream is not None:
                slot.stream.synchronize()  # no kernel may still write blocks we give away
            self.engine.settle(seq)  # drop a decode step launched ahead of the finish
            if cache and self.prefix_cache is not None and req is not None and gen is not None:
                written = (req.prompt_ids + gen.token_ids)[: seq.length]
                full = seq.length // self.page_size
                self.prefix_cache.insert(written, seq.blocks[:full], follow_duplicates=True)
        except Exception:
            log.exception("prefix cache insert failed")
        finally:
            self.engine.end_sequence(seq)
            slot.reset()

    def _finish_unstarted(self, req: _Request, reason: str, message: str | None = None) -> None:
        usage = Usage(prompt_tokens=len(req.prompt_ids), seed=req.params.seed)
        usage.total_ms = (time.perf_counter() - req.t_submit) * 1e3
        self._deliver_final(req, Chunk([], "", finish_reason=reason, usage=usage, message=message))

    def _deliver_final(self, req: _Request, final: Chunk) -> None:
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
            req.finished = True
            if self._requests.get(req.id) is req:
                del self._requests[req.id]
            self._finished[final.finish_reason or "length"] += 1
        req.handle._push(final)

    def _cancel_queued(self) -> None:
        with self._lock:
            queued = [r for r in self._queue if r.cancelled]
            for r in queued:
                self._queue.remove(r)
        for r in queued:
            self._finish_unstarted(r, "cancelled")

    def _process_cancels(self) -> None:
        with self._lock:
            if not self._cancel_pending:
                return
            self._cancel_pending = False
        self._cancel_queued()
        was_active = self._active()
        for slot in self._slots:
            if slot.req is not None and slot.req.cancelled:
                self._finish(slot, "cancelled")
        if was_active is not None and self._active() is None:
            self._promote_ready()

    def _shutdown(self) -> None:
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            self._stopping = True
            queued = list(self._queue)
            self._queue.clear()
            calls = list(self._calls)
            self._calls.clear()
        for r in queued:
            self._finish_unstarted(r, "cancelled", "scheduler stopped")
        for slot in self._slots:
            if slot.req is not None:
                self._finish(slot, "cancelled", "scheduler stopped")
        for _, box in calls:
            box["error"] = RuntimeError("scheduler stopped")
            box["done"].set()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            if self.pool.reclaimer is self.prefix_cache:
                self.pool.reclaimer = None
