"""The scheduler: one loop thread owns the engine and does what the policy decides.

Callers talk to the loop only through thread-safe state: ``submit`` queues a request
(bounded), ``cancel`` marks one, ``call`` runs a function on the loop thread and
returns a ``concurrent.futures.Future``. Each request's chunks go to its
``RequestHandle``, which the loop appends to without ever waiting for a consumer.

The decisions (admission, slot states, prefix reuse) are ``SchedulerPolicy``'s
(policy.py), the pacing of background prefill ``Pacing``'s (pacing.py), the device work
of each decision ``ActionRunner``'s (executor.py), the CUDA streams and events
streams.py's. ``edge generate`` and ``edge serve`` both drive generation through it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from edge.runtime.engine import Engine
from edge.errors import SamplingError, SchedulerStopped
from edge.scheduling.prefix import PrefixCache
from edge.sampling import SamplingParams
from edge.scheduling.executor import ActionRunner
from edge.scheduling.pacing import Pacing
from edge.scheduling.policy import Decode, Idle, Request, RoundDone, SchedulerPolicy
from edge.scheduling.request import InvalidPrompt, RequestHandle
from edge.scheduling.streams import device_streams
from edge.speculative.params import SpeculativeParams

if TYPE_CHECKING:
    from edge.model.vision.runtime import MultimodalPrompt
    from edge.structured.matcher import GrammarMatcher

log = logging.getLogger(__name__)

T = TypeVar("T")


class Scheduler:
    """Serve requests on ``engine`` from a loop thread; see the module docstring and
    edge/scheduling/policy.py for the rules.

    ``prefill_chunk``: the largest background prefill chunk in tokens (default: the
    engine's). ``prefill_budget_ms``: the time one background chunk may take (default:
    twice the active conversation's inter-token latency, as measured). ``itl_target``:
    the active conversation's mean inter-token latency while a prompt is prefilled
    behind it, as a multiple of its latency between chunks (pacing.py). ``prefix_cache``: reuse the KV of repeated prefixes (default: when
    the engine's KV cache is paged). ``governor``: ``allow_background_prefill()``,
    ``decode_delay_s()``, ``check_admission()`` (may raise). ``energy``: ``begin(id)``,
    ``end(id) -> J | None``. ``idle_wait_s``: the loop goes round (heartbeat) at least
    this often when idle. ``speculative``: the speculative decoding of requests that do
    not choose (None: plain decoding); ``draft``: the draft model (same vocabulary, paged
    KV) of method "draft". Requests with images decode plainly.
    """

    def __init__(
        self,
        engine: Engine,
        queue_size: int = 8,
        prefill_chunk: int | None = None,
        prefix_cache: bool | None = None,
        governor=None,
        energy=None,
        itl_target: float = 1.15,
        prefill_budget_ms: float | None = None,
        idle_wait_s: float = 0.5,
        speculative: SpeculativeParams | None = None,
        draft: Engine | None = None,
    ) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        if prefill_budget_ms is not None and not prefill_budget_ms > 0:
            raise ValueError(f"prefill_budget_ms must be positive, got {prefill_budget_ms}")
        if draft is not None:
            if draft.cfg.vocab_size != engine.cfg.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({draft.cfg.vocab_size}) differs from the model's "
                    f"({engine.cfg.vocab_size})"
                )
            if draft.kv is None or draft.kv is engine.kv:
                raise ValueError("the draft model needs its own engine with kv_cache='paged'")
        if speculative is not None:
            speculative.validate()
            if speculative.method == "draft" and draft is None:
                raise ValueError("speculative method 'draft' needs a draft model")
        self.speculative = speculative
        self.draft = draft
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
        pacing = Pacing(chunk, None if prefill_budget_ms is None else prefill_budget_ms / 1e3, itl_target)
        # Shared with caller threads, under _lock; the policy is only ever used under it.
        self._lock = threading.Lock()
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
        self.runner = ActionRunner(engine, self.policy, self._lock, device_streams(engine), energy, draft, self._beat)
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._stopping = False
        self._shut_down = False
        self._wake = threading.Event()  # anything new for the loop
        self._urgent = threading.Event()  # cancel/stop: cut a thermal decode delay short
        self._thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()

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

    def submit(
        self,
        prompt_ids: list[int] | MultimodalPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        grammar: GrammarMatcher | None = None,
    ) -> RequestHandle:
        """Queue a request (token ids, or a prompt with images from ``engine.vision``;
        ``grammar``: a structured-output matcher, edge/structured);
        raises SamplingError, PromptTooLong, InvalidPrompt, QueueFull,
        DuplicateRequestId, SchedulerStopped (edge/errors.py) or the governor's
        DeviceTooHot on the caller's thread."""
        params = dataclasses.replace(params)  # ours to resolve (seed); callers may reuse theirs
        params.validate()
        mm = None if isinstance(prompt_ids, list) else prompt_ids
        if params.speculative is not None and params.speculative.off:
            params.speculative = None  # the request opts out of the server's default
        elif params.speculative is None and mm is None:
            params.speculative = self.speculative
        elif params.speculative is not None:
            if mm is not None:
                raise SamplingError("speculative decoding does not support prompts with images")
            if params.speculative.method == "draft" and self.draft is None:
                raise SamplingError("speculative method 'draft' needs a draft model; this server has none")
        ids = [int(t) for t in (prompt_ids if mm is None else mm.ids)]
        self.engine.check_prompt(ids, params.max_tokens)
        params.max_tokens = min(params.max_tokens, self.engine.completion_room(len(ids)))
        vocab = self.engine.cfg.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidPrompt(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if self.governor is not None:
            self.governor.check_admission()
        with self._lock:
            if self._stopping:
                raise SchedulerStopped("scheduler is stopped")
            rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex[:16]}"
            handle = RequestHandle(rid, self)
            self.policy.enqueue(Request(rid, ids, params, time.perf_counter(), handle, mm=mm, grammar=grammar))
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
            self.runner.end_unstarted(req, "cancelled")
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
            "speculative": self.runner.speculative.as_dict(),
            "alive": thread is not None and thread.is_alive(),
            "last_heartbeat": self._heartbeat,
        }

    # -- loop --------------------------------------------------------------------------------

    def _beat(self) -> None:
        """The loop is making progress (called between rounds and between vision-tower blocks)."""
        self._heartbeat = time.monotonic()

    def _run(self) -> None:
        self.runner.streams.bind_thread()
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
        self.runner.poll_device()
        while True:
            with self._lock:
                action = self.policy.next_action(time.perf_counter())
            if isinstance(action, Idle):
                return False
            if isinstance(action, RoundDone):
                return True
            self.runner.execute(action)
            if isinstance(action, Decode):
                self._thermal_delay()

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

    def _thermal_delay(self) -> None:
        delay = self.governor.decode_delay_s() if self.governor is not None else 0.0
        if delay <= 0:
            return
        self._urgent.clear()
        with self._lock:
            cancel_pending = self.policy.cancel_pending
        if not cancel_pending:
            self._urgent.wait(delay)  # cut short by cancel or stop

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
            self.runner.end_unstarted(req, "cancelled", "scheduler stopped")
        for slot in occupied:
            self.runner.end_slot(slot.index, "cancelled", "scheduler stopped")
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(SchedulerStopped("scheduler stopped"))
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            if self.pool is not None and self.pool.reclaimer is self.prefix_cache:
                self.pool.reclaimer = None
