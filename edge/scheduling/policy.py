"""Scheduling decisions of the two-slot ping-pong: no threads, no device, no clock.

Slots go idle -> prefilling -> ready -> decoding -> idle (any state -> idle on cancel,
error or finish). At most one slot decodes: the active one. While it decodes, the
other slot prefills the head of the queue in the background, in chunks paced by
``Pacing``, and then waits READY with its first token sampled; when the active request
ends, the READY slot becomes active at once, so its time to first token is a switch,
not a prefill. With nothing decoding, the head of the queue is prefilled in the
foreground, in big chunks. An engine without a block pool (contiguous KV) has one slot.

The loop asks ``next_action(now)`` for one step at a time, does the device work, and
reports what only the device can tell (a chunk ran, a first token was read, a request
ended). A decision changes the state when it is made (an admitted request has left the
queue; a cancelled one has left its slot). A round is: the pending cancels, then one
decode step of the active slot and at most one background chunk, or, with nothing
decoding, one foreground step; ``RoundDone`` or ``Idle`` ends it.

Memory: full blocks of every request stay in the prefix cache when it ends, and the
cache gives blocks back least recently used when the pool runs short. Background work
never takes blocks the active request may still need (its worst case up to
``max_tokens``): it waits instead. A prompt that cannot fit even an empty pool ends
with ``error`` at admission.

Not thread-safe: the scheduler holds one lock around every call.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge.errors import DuplicateRequestId, QueueFull
from edge.runtime.kv_paged import BlockPool
from edge.scheduling.prefix import PrefixCache
from edge.sampling import SamplingParams
from edge.scheduling.pacing import Pacing
from edge.scheduling.request import RequestHandle

if TYPE_CHECKING:
    from edge.model.vision.runtime import MultimodalPrompt
    from edge.structured.matcher import GrammarMatcher

log = logging.getLogger(__name__)


class SlotState(str, enum.Enum):
    IDLE = "idle"
    PREFILLING = "prefilling"
    READY = "ready"
    DECODING = "decoding"


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    t_submit: float  # time.perf_counter(), the clock of Generation's timings
    handle: RequestHandle | None = None  # where the loop streams its chunks
    cancelled: bool = False
    finished: bool = False
    mm: MultimodalPrompt | None = None  # a prompt with images (edge/vision)
    grammar: GrammarMatcher | None = None  # structured output's matcher (edge/structured)

    @property
    def cache_ids(self) -> list[int]:
        """What the prefix cache keys the prompt by (image tokens by image content)."""
        return self.prompt_ids if self.mm is None else self.mm.key_ids

    @property
    def rope_delta(self) -> int:
        """RoPE position minus sequence position after the prompt (nonzero after images)."""
        return 0 if self.mm is None else self.mm.rope_delta


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.IDLE
    request: Request | None = None
    prefilled: int = 0  # prompt tokens whose K/V the sequence holds, reused ones included
    cached_tokens: int = 0  # of those, reused from the prefix cache
    blocks: int = 0  # KV blocks the sequence holds
    first_token_pending: bool = False  # prompt done; its first token is still on the device

    def vacate(self) -> None:
        self.state = SlotState.IDLE
        self.request = None
        self.prefilled = self.cached_tokens = self.blocks = 0
        self.first_token_pending = False


# -- actions: what the loop does next ----------------------------------------------------


@dataclass(frozen=True)
class Idle:
    """Nothing to do: wait for news (a request, a cancel, a call)."""


@dataclass(frozen=True)
class RoundDone:
    """A busy round ended: go round again at once."""


@dataclass(frozen=True)
class End:
    """End ``request`` (queued when ``slot`` is None; its slot is already vacated)."""

    request: Request
    slot: int | None
    reason: str
    message: str | None = None


@dataclass(frozen=True)
class Admit:
    """Start ``request`` in ``slot`` on the cached prefix ``shared`` (block ids)."""

    slot: int
    request: Request
    shared: tuple[int, ...]
    background: bool


@dataclass(frozen=True)
class Prefill:
    """Run prompt tokens ``[start, stop)`` of the slot's request."""

    slot: int
    start: int
    stop: int
    background: bool


@dataclass(frozen=True)
class AwaitFirstToken:
    """Nothing decodes: wait for the slot's first token (prefilled in the background)."""

    slot: int


@dataclass(frozen=True)
class Activate:
    """The READY slot decodes from now on: send its first token."""

    slot: int


@dataclass(frozen=True)
class Decode:
    """One decode step of the active slot."""

    slot: int


Action = Idle | RoundDone | End | Admit | Prefill | AwaitFirstToken | Activate | Decode


@dataclass
class _Round:
    decoded: bool = False
    background: bool = False  # a background chunk was run or refused this round
    foreground: bool = False


def _blocks_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class SchedulerPolicy:
    """The decisions of the scheduler; see the module docstring.

    ``foreground_chunk``: prompt tokens per chunk with nothing decoding. ``pool`` and
    ``prefix_cache``: block accounting (None: no pool, one slot, no reuse).
    ``governor``: ``allow_background_prefill()``.
    """

    def __init__(
        self,
        pacing: Pacing,
        *,
        queue_size: int = 8,
        foreground_chunk: int = 512,
        max_seq_len: int,
        pool: BlockPool | None = None,
        prefix_cache: PrefixCache | None = None,
        governor=None,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if foreground_chunk < 1:
            raise ValueError(f"foreground_chunk must be positive, got {foreground_chunk}")
        if prefix_cache is not None and pool is None:
            raise ValueError("a prefix cache needs a block pool")
        self.pacing = pacing
        self.queue_size = queue_size
        self.foreground_chunk = foreground_chunk
        self.max_seq_len = max_seq_len
        self.pool = pool
        self.page_size = pool.page_size if pool is not None else 1
        self.prefix_cache = prefix_cache
        self.governor = governor
        self.slots = [Slot(i) for i in range(2 if pool is not None else 1)]
        self.queue: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # submitted and not yet delivered
        self.finished: Counter[str] = Counter()
        self.background_waits = 0  # background work deferred for lack of blocks
        self._cancel_pending = False
        self._round = _Round()

    # -- requests -------------------------------------------------------------------------

    def enqueue(self, req: Request) -> None:
        if len(self.queue) >= self.queue_size:
            raise QueueFull(
                f"request queue is full ({len(self.queue)} of {self.queue_size} waiting "
                f"behind the {len(self.slots)} slot(s)); retry later"
            )
        if req.id in self.requests:
            raise DuplicateRequestId(f"request id {req.id!r} is already in flight")
        self.requests[req.id] = req
        self.queue.append(req)

    def cancel(self, request_id: str) -> bool:
        """Mark a request cancelled; True if it was known and not finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        req.cancelled = True
        self._cancel_pending = True
        return True

    def take_cancelled_queued(self) -> list[Request]:
        """Remove and return the cancelled requests still in the queue."""
        out = [r for r in self.queue if r.cancelled]
        for r in out:
            self.queue.remove(r)
        return out

    def drain(self) -> tuple[list[Request], list[Slot]]:
        """Shutdown: empty the queue; return it and the occupied slots (still occupied)."""
        queued = list(self.queue)
        self.queue.clear()
        return queued, [s for s in self.slots if s.request is not None]

    # -- reports from the loop ------------------------------------------------------------

    def prefilled(self, slot: int, tokens: int, blocks: int) -> None:
        """A chunk ran: the sequence now holds ``tokens`` prompt tokens in ``blocks``."""
        s = self.slots[slot]
        s.prefilled, s.blocks = tokens, blocks

    def first_token_pending(self, slot: int) -> None:
        """The prompt is done; its first token is being read back from the device."""
        self.slots[slot].first_token_pending = True

    def ready(self, slot: int, blocks: Sequence[int]) -> None:
        """The first token is known: cache the prompt's full blocks; READY."""
        s = self.slots[slot]
        assert s.request is not None
        keys = s.request.cache_ids
        self.remember(keys, blocks[: len(keys) // self.page_size])
        s.first_token_pending = False
        s.state = SlotState.READY

    def decoded(self, slot: int, now: float, blocks: int) -> None:
        """A decode step gave its token at ``now``; the sequence holds ``blocks``."""
        self.slots[slot].blocks = blocks
        self.pacing.token(now)

    def background_blocked(self) -> None:
        """A background chunk found no free block: it waits."""
        self.background_waits += 1

    def vacate(self, slot: int) -> None:
        """The slot's request ended (the loop releases its sequence)."""
        self.slots[slot].vacate()

    def delivered(self, req: Request, reason: str) -> None:
        """The final chunk of ``req`` is out."""
        req.finished = True
        if self.requests.get(req.id) is req:
            del self.requests[req.id]
        self.finished[reason] += 1

    def remember(self, tokens: Sequence[int], blocks: Sequence[int], follow_duplicates: bool = False) -> None:
        """Keep full ``blocks`` (holding ``tokens``) in the prefix cache for reuse."""
        if self.prefix_cache is None or not blocks:
            return
        try:
            self.prefix_cache.insert(tokens, blocks, follow_duplicates=follow_duplicates)
        except Exception:  # a cache failure costs reuse, never the request
            log.exception("prefix cache insert failed")

    # -- decisions ------------------------------------------------------------------------

    def active(self) -> Slot | None:
        return self._slot_in(SlotState.DECODING)

    @property
    def cancel_pending(self) -> bool:
        return self._cancel_pending

    def next_action(self, now: float) -> Action:
        """The loop's next step (``now``: the pacing clock, seconds)."""
        if self._cancel_pending:
            action = self._next_cancel()
            if action is not None:
                return action
            self._cancel_pending = False
        active = self.active()
        if active is None:
            ready = self._slot_in(SlotState.READY)
            if ready is not None:
                ready.state = SlotState.DECODING
                self.pacing.stream_started()
                self.pacing.token(now)  # its first token
                return Activate(ready.index)
            if self._round.foreground:
                return self._end_round(RoundDone())
            return self._foreground()
        if not self._round.decoded:
            self._round.decoded = True
            return Decode(active.index)
        action = self._background(active, now)
        return action if action is not None else self._end_round(RoundDone())

    def _end_round(self, action: Idle | RoundDone) -> Idle | RoundDone:
        self._round = _Round()
        return action

    def _slot_in(self, state: SlotState) -> Slot | None:
        return next((s for s in self.slots if s.state is state), None)

    def _next_cancel(self) -> End | None:
        for req in self.queue:
            if req.cancelled:
                self.queue.remove(req)
                return End(req, None, "cancelled")
        for s in self.slots:
            if s.request is not None and s.request.cancelled:
                req = s.request
                s.vacate()
                return End(req, s.index, "cancelled")
        return None

    def _foreground(self) -> Action:
        slot = self._slot_in(SlotState.PREFILLING)
        if slot is None:
            idle = self._slot_in(SlotState.IDLE)
            action = self._admit(idle, background=False) if idle is not None else None
            return action if action is not None else self._end_round(Idle())
        self._round.foreground = True
        if slot.first_token_pending:
            return AwaitFirstToken(slot.index)
        assert slot.request is not None
        stop = min(slot.prefilled + self.foreground_chunk, len(slot.request.prompt_ids))
        return Prefill(slot.index, slot.prefilled, stop, background=False)

    def _background(self, active: Slot, now: float) -> Action | None:
        """At most one background step for the slot that is not decoding."""
        if self._round.background or len(self.slots) < 2:
            return None
        if self.governor is not None and not self.governor.allow_background_prefill():
            return None
        other = self.slots[1 - active.index]
        if other.state is SlotState.IDLE:
            return self._admit(other, background=True)
        if other.state is not SlotState.PREFILLING or other.first_token_pending or not self.pacing.due(now):
            return None
        assert other.request is not None
        stop = min(other.prefilled + self.pacing.chunk_tokens(), len(other.request.prompt_ids))
        self._round.background = True
        if not self._headroom_ok(_blocks_for(stop, self.page_size) - other.blocks):
            self.background_waits += 1
            return None  # retry on a later round (or in the foreground once alone)
        return Prefill(other.index, other.prefilled, stop, background=True)

    def _admit(self, slot: Slot, background: bool) -> Action | None:
        """Move the queue's head into ``slot``; None when nothing happened."""
        if not self.queue:
            return None
        req = self.queue[0]
        if req.cancelled:
            self.queue.popleft()
            return End(req, None, "cancelled")
        prompt, ps = req.prompt_ids, self.page_size
        if self.pool is not None and _blocks_for(len(prompt), ps) > self.pool.num_blocks:
            self.queue.popleft()
            return End(
                req,
                None,
                "error",
                f"prompt of {len(prompt)} tokens needs {_blocks_for(len(prompt), ps)} KV blocks of {ps} tokens; "
                f"the pool has only {self.pool.num_blocks}",
            )
        cache = self.prefix_cache
        keys = req.cache_ids
        # At least the last prompt token is always prefilled, so that logits exist.
        shared = cache.match(keys[: len(keys) - 1], touch=False) if cache is not None else []
        if background:
            assert self.pool is not None
            refcount = self.pool.refcount
            taken = sum(1 for b in shared if refcount[b] == 1)  # evictable blocks we would pin
            start = len(shared) * ps
            first = min(self.pacing.chunk_tokens(), len(prompt) - start)
            if not self._headroom_ok(_blocks_for(start + first, ps) - len(shared) + taken):
                self.background_waits += 1
                self._round.background = True
                return None
        self.queue.popleft()
        if cache is not None and shared:
            shared = cache.match(keys[: len(keys) - 1])  # the same blocks, now most recently used
        slot.state = SlotState.PREFILLING
        slot.request = req
        slot.prefilled = slot.cached_tokens = len(shared) * ps
        slot.blocks = len(shared)
        slot.first_token_pending = False
        return Admit(slot.index, req, tuple(shared), background)

    def _headroom_ok(self, need: int) -> bool:
        """May background work take ``need`` more blocks without starving the active
        request of the blocks it may still need (up to its max_tokens)?"""
        if self.pool is None:
            return True
        reserve = 0
        active = self.active()
        if active is not None and active.request is not None:
            req = active.request
            final_len = min(len(req.prompt_ids) + req.params.max_tokens - 1, self.max_seq_len)
            reserve = max(0, _blocks_for(final_len, self.page_size) - active.blocks)
        available = self.pool.num_free
        if available - need >= reserve:
            return True  # the common case; counting evictable blocks scans the pool
        if self.prefix_cache is not None:
            available += self.prefix_cache.num_evictable()
        return available - need >= reserve

    # -- statistics -----------------------------------------------------------------------

    def describe_slots(self) -> list[dict]:
        return [
            {"state": s.state.value, "request_id": s.request.id if s.request is not None else None}
            for s in self.slots
        ]
