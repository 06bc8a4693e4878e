"""The scheduler's policy and pacing, stepped by hand: no threads, no model, a fake clock.

``Sim`` does with each action what the loop does, at the level of block accounting
(a real BlockPool, PagedSequence and PrefixCache on the CPU, no model), on a serial
device whose decode step takes ``step`` seconds and whose prefill chunk of n tokens
takes ``a + b * n``: the times the pacing is judged against are the model's own.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

import pytest
import torch

from edge.model.config import ModelConfig
from edge.errors import DuplicateRequestId, QueueFull
from edge.model.kv import KVOutOfMemory
from edge.runtime.kv_paged import BlockPool, PagedKVCache
from edge.scheduling.prefix import PrefixCache
from edge.sampling import SamplingParams
from edge.scheduling.pacing import Pacing
from edge.scheduling.policy import (
    Activate,
    Admit,
    Decode,
    End,
    Idle,
    Prefill,
    Request,
    RoundDone,
    SchedulerPolicy,
    SlotState,
)

PS = 16


def paged_cache(num_blocks: int) -> PagedKVCache:
    cfg = ModelConfig(
        architecture="qwen3", vocab_size=4096, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=4096,
        tie_word_embeddings=True, qkv_bias=False, qk_norm=False,
    )
    return PagedKVCache(BlockPool(cfg, num_blocks, PS, torch.device("cpu"), torch.float32), 4096, 1.0)


@dataclass
class Device:
    """A serial device (one thing at a time, as the CPU): times in seconds."""

    step: float = 0.005
    a: float = 0.006  # fixed cost of a prefill chunk
    b: float = 0.00015  # cost per prefill token
    slowdown: float = 1.0  # decode steps while a prompt is prefilled behind them (cold caches)

    def chunk(self, n: int) -> float:
        return self.a + self.b * n


class Sim:
    """Runs the policy's actions against block accounting and a fake clock."""

    def __init__(self, policy: SchedulerPolicy, cache: PagedKVCache, device: Device | None = None) -> None:
        self.policy = policy
        self.cache = cache
        self.device = device or Device()
        self.now = 0.0
        self.seqs: dict[int, object] = {}
        self.generated: dict[str, list[int]] = {}
        self.emitted_at: dict[str, list[float]] = {}
        self.ended: dict[str, tuple[str, str | None]] = {}
        self.ready_at: dict[str, float] = {}
        self._next = 0

    def submit(self, rid: str, prompt: list[int] | int, max_tokens: int) -> Request:
        ids = prompt if isinstance(prompt, list) else [3 + (self._next + i) % 3000 for i in range(prompt)]
        self._next += 7919
        req = Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), self.now)
        self.policy.enqueue(req)
        return req

    def step(self):  # noqa: ANN201 - one Action
        action = self.policy.next_action(self.now)
        match action:
            case End(request=req, slot=slot, reason=reason, message=message):
                if slot is not None:
                    self._release(slot, req)
                self._deliver(req, reason, message)
            case Admit(slot=slot, shared=shared):
                seq = self.cache.new_sequence()
                seq.share_prefix(list(shared))
                self.seqs[slot] = seq
            case Prefill(slot=slot, start=start, stop=stop, background=background):
                self._prefill(slot, start, stop, background)
            case Activate(slot=slot):
                self._emit(slot)
            case Decode(slot=slot):
                seq = self.seqs[slot]
                seq.reserve(1)
                seq.advance(1)
                behind = any(s.state is SlotState.PREFILLING for s in self.policy.slots)
                self.now += self.device.step * (self.device.slowdown if behind else 1.0)
                self.policy.decoded(slot, self.now, len(seq.blocks))
                self._emit(slot)
        return action

    def round(self) -> list:
        actions = [self.step()]
        while not isinstance(actions[-1], (RoundDone, Idle)):
            actions.append(self.step())
        return actions

    def run_until(self, cond, rounds: int = 100_000) -> None:  # noqa: ANN001
        for _ in range(rounds):
            if cond():
                return
            if isinstance(self.round()[-1], Idle):
                break
        assert cond(), "the condition never held"

    def _prefill(self, slot: int, start: int, stop: int, background: bool) -> None:
        seq, req = self.seqs[slot], self.policy.slots[slot].request
        assert seq.length == start
        try:
            seq.reserve(stop - start)
        except KVOutOfMemory:
            assert background, "the foreground never runs out in these tests"
            self.policy.background_blocked()
            return
        seq.advance(stop - start)
        took = self.device.chunk(stop - start)
        if background:
            self.policy.pacing.chunk_started(self.now)
        self.now += took
        if background:
            self.policy.pacing.chunk_done(stop - start, took)
        self.policy.prefilled(slot, stop, len(seq.blocks))
        if stop == len(req.prompt_ids):
            self.policy.ready(slot, seq.blocks)
            self.ready_at[req.id] = self.now

    def _emit(self, slot: int) -> None:
        req = self.policy.slots[slot].request
        out = self.generated.setdefault(req.id, [])
        out.append(5000 + len(out))
        self.emitted_at.setdefault(req.id, []).append(self.now)
        if len(out) == req.params.max_tokens:
            self.policy.vacate(slot)
            self._release(slot, req)
            self._deliver(req, "length", None)

    def _release(self, slot: int, req: Request) -> None:
        seq = self.seqs.pop(slot)
        written = (req.prompt_ids + self.generated.get(req.id, []))[: seq.length]
        self.policy.remember(written, seq.blocks[: seq.length // PS], follow_duplicates=True)
        seq.release()

    def _deliver(self, req: Request, reason: str, message: str | None) -> None:
        self.ended[req.id] = (reason, message)
        self.policy.delivered(req, reason)


def make_sim(
    num_blocks: int = 256,
    device: Device | None = None,
    queue_size: int = 4,
    governor=None,
    **pacing,
) -> Sim:
    cache = paged_cache(num_blocks)
    pool = cache.pool
    policy = SchedulerPolicy(
        Pacing(**({"max_chunk": 512} | pacing)),
        queue_size=queue_size,
        foreground_chunk=512,
        max_seq_len=4096,
        pool=pool,
        prefix_cache=PrefixCache(pool),
        governor=governor,
    )
    return Sim(policy, cache, device)


def states(sim: Sim) -> list[str]:
    return [s.state.value for s in sim.policy.slots]


# -- the ping-pong, action by action ------------------------------------------------------


def test_ping_pong_action_by_action() -> None:
    sim = make_sim()
    a = sim.submit("A", 40, max_tokens=100)
    b = sim.submit("B", 100, max_tokens=3)
    assert sim.step() == Admit(0, a, (), background=False)
    assert sim.step() == Prefill(0, 0, 40, background=False)
    assert sim.step() == Activate(0)  # A's first token goes out at once
    assert sim.step() == Decode(0)
    assert sim.step() == Admit(1, b, (), background=True)
    assert sim.step() == Prefill(1, 0, 16, background=True)  # one granule: no throughput known yet
    assert sim.step() == RoundDone()
    # The next chunk waits until A's tokens since this one started average at most 1.15x
    # its clean inter-token time (one 5 ms step): k tokens with a + 16 b + 5 k <= 5.75 k.
    rounds = [sim.round() for _ in range(math.ceil(sim.device.chunk(16) / (0.15 * sim.device.step)))]
    assert all(r == [Decode(0), RoundDone()] for r in rounds[:-1])
    assert rounds[-1][:2] == [Decode(0), Prefill(1, 16, 32, background=True)]  # budget: 2 x 5 ms
    sim.run_until(lambda: "B" in sim.ready_at)
    assert states(sim) == ["decoding", "ready"] and "A" not in sim.ended
    while "A" not in sim.ended:
        actions = sim.round()
    # The step that ends A is followed by B's first token in the same round.
    assert actions[:2] == [Decode(0), Activate(1)]
    sim.run_until(lambda: "B" in sim.ended)
    assert sim.ended == {"A": ("length", None), "B": ("length", None)}
    assert len(sim.generated["A"]) == 100 and len(sim.generated["B"]) == 3
    assert sim.round() == [Idle()]
    assert states(sim) == ["idle", "idle"] and sim.policy.finished == {"length": 2}


def test_cancel_in_every_state() -> None:
    sim = make_sim()
    a = sim.submit("A", 40, max_tokens=1000)
    b = sim.submit("B", 200, max_tokens=5)
    c = sim.submit("C", 20, max_tokens=5)
    sim.run_until(lambda: states(sim) == ["decoding", "prefilling"] and sim.policy.slots[1].prefilled >= 32)
    assert sim.policy.cancel("C")  # queued
    assert sim.step() == End(c, None, "cancelled")
    assert sim.policy.cancel("B")  # prefilling in the background
    assert sim.step() == End(b, 1, "cancelled")
    assert states(sim) == ["decoding", "idle"]
    # B's prefilled blocks stay in the prefix cache; a request with its prompt reuses them.
    b2 = sim.submit("B2", b.prompt_ids, max_tokens=5)
    sim.run_until(lambda: states(sim)[1] == "ready")
    assert sim.policy.slots[1].request is b2 and sim.policy.slots[1].cached_tokens >= 32
    assert sim.policy.cancel("B2")  # ready
    assert sim.step() == End(b2, 1, "cancelled")
    d = sim.submit("D", 30, max_tokens=4)
    sim.run_until(lambda: states(sim)[1] == "ready")
    assert sim.policy.slots[1].request is d
    assert sim.policy.cancel("A")  # decoding: the READY request takes over at once
    assert sim.step() == End(a, 0, "cancelled")
    assert sim.step() == Activate(1)
    assert not sim.policy.cancel("A") and not sim.policy.cancel("nope")
    sim.run_until(lambda: "D" in sim.ended)
    assert sim.ended["D"] == ("length", None) and len(sim.generated["D"]) == 4
    assert sim.policy.finished == {"cancelled": 4, "length": 1}
    assert sim.policy.requests == {}


def test_background_never_takes_the_active_requests_blocks() -> None:
    # 10 blocks: A holds 3 for its prompt and may need 10 in all (40 + 110 - 1 tokens),
    # so B may not take one until A has ended; then B is served in the foreground.
    sim = make_sim(num_blocks=10)
    sim.submit("A", 40, max_tokens=110)
    sim.submit("B", 30, max_tokens=2)
    sim.run_until(lambda: len(sim.generated.get("A", [])) == 20)
    assert states(sim) == ["decoding", "idle"] and len(sim.policy.queue) == 1
    assert sim.policy.background_waits >= 19
    sim.run_until(lambda: "B" in sim.ended)
    assert sim.ended["A"] == ("length", None) and sim.ended["B"] == ("length", None)


def test_prefix_reuse_at_admission() -> None:
    sim = make_sim()
    a = sim.submit("A", 40, max_tokens=6)
    sim.run_until(lambda: "A" in sim.ended)
    # A wrote 40 + 5 tokens: two full blocks, now cached. A's next turn starts on them.
    cached = sim.policy.prefix_cache.match(a.prompt_ids + sim.generated["A"], touch=False)
    assert len(cached) == 2
    b = sim.submit("B", a.prompt_ids + sim.generated["A"] + [7, 8, 9], max_tokens=2)
    assert sim.step() == Admit(0, b, tuple(cached), background=False)
    assert sim.policy.slots[0].cached_tokens == 32
    assert sim.step() == Prefill(0, 32, 49, background=False)  # only the uncached tail


def test_prompt_larger_than_the_pool_ends_at_admission() -> None:
    sim = make_sim(num_blocks=4)
    big = sim.submit("big", 65, max_tokens=1)
    action = sim.step()
    assert action == End(big, None, "error", action.message)
    assert "pool has only 4" in action.message and "5 KV blocks" in action.message


def test_governor_holds_background_prefill() -> None:
    class Governor:
        background = False

        def allow_background_prefill(self) -> bool:
            return self.background

    gov = Governor()
    sim = make_sim(governor=gov)
    sim.submit("A", 20, max_tokens=50)
    sim.submit("B", 20, max_tokens=2)
    sim.run_until(lambda: len(sim.generated.get("A", [])) == 10)
    assert states(sim) == ["decoding", "idle"] and len(sim.policy.queue) == 1
    gov.background = True
    sim.round()
    assert states(sim) == ["decoding", "prefilling"]


def test_queue_bound_and_duplicate_ids() -> None:
    sim = make_sim(queue_size=2)
    sim.submit("A", 10, max_tokens=1)
    with pytest.raises(DuplicateRequestId, match="already in flight"):
        sim.submit("A", 10, max_tokens=1)
    sim.submit("B", 10, max_tokens=1)
    with pytest.raises(QueueFull, match="queue is full"):
        sim.submit("C", 10, max_tokens=1)


def test_without_a_pool_one_slot_serves_in_turn() -> None:
    policy = SchedulerPolicy(Pacing(512), max_seq_len=4096)
    assert len(policy.slots) == 1
    a = Request("A", [1, 2, 3], SamplingParams(max_tokens=9), 0.0)
    b = Request("B", [4, 5], SamplingParams(max_tokens=2), 0.0)
    policy.enqueue(a)
    policy.enqueue(b)
    assert policy.next_action(0.0) == Admit(0, a, (), background=False)
    assert policy.next_action(0.0) == Prefill(0, 0, 3, background=False)
    policy.prefilled(0, 3, 0)
    policy.ready(0, [])
    assert policy.next_action(0.0) == Activate(0)
    for _ in range(3):
        assert policy.next_action(0.0) == Decode(0)
        assert policy.next_action(0.0) == RoundDone()  # no second slot to prefill B into
    policy.vacate(0)
    policy.delivered(a, "length")
    assert policy.next_action(0.0) == Admit(0, b, (), background=False)
    assert policy.slots[0].state is SlotState.PREFILLING


# -- pacing --------------------------------------------------------------------------------


def run_chunks(p: Pacing, device: Device, n_chunks: int) -> list[int]:
    sizes, now = [], 0.0
    for _ in range(n_chunks):
        n = p.chunk_tokens()
        sizes.append(n)
        p.chunk_started(now)
        now += device.chunk(n)
        p.chunk_done(n, device.chunk(n))
    return sizes


def test_chunks_converge_to_the_largest_that_fits_the_budget() -> None:
    device = Device(a=0.002, b=0.0001)
    p = Pacing(max_chunk=512, budget_s=0.011)
    sizes = run_chunks(p, device, 12)
    assert sizes[0] == 16  # the probe
    assert sizes[-3:] == [80, 80, 80]
    assert device.chunk(80) <= 0.011 < device.chunk(96)


def test_chunk_bounds() -> None:
    # A fixed cost above the budget: the chunk whose time it is about half of (in
    # granules); a large budget: the configured maximum.
    device = Device(a=0.020, b=0.0001)
    last = run_chunks(Pacing(max_chunk=512, budget_s=0.010), device, 8)[-1]
    assert device.a / device.chunk(last) >= 0.5 > device.a / device.chunk(last + 16)
    assert run_chunks(Pacing(max_chunk=96, budget_s=1.0), Device(a=0.001, b=0.0001), 8)[-1] == 96
    assert run_chunks(Pacing(max_chunk=8, budget_s=1.0), Device(), 3) == [8, 8, 8]


def test_default_budget_is_twice_the_clean_itl() -> None:
    p = Pacing(max_chunk=512)
    assert p.budget_s is None and p.chunk_tokens() == 16
    for t in (0.0, 0.004, 0.009, 0.015, 0.515):  # one outlier (a graph capture): the median ignores it
        p.token(t)
    assert p.itl_s == pytest.approx(0.0055) and p.budget_s == pytest.approx(0.011)
    p.chunk_started(0.6)
    p.token(0.7)  # a chunk runs meanwhile: not clean
    p.chunk_done(16, 0.004)
    p.token(0.8)  # the chunk ran since the last token: not clean either
    assert p.itl_s == pytest.approx(0.0055)
    p.token(0.806)
    assert p.itl_s == pytest.approx(0.006)
    assert p.chunk_tokens() == 48  # 16 tokens per 4 ms, 12 ms: 48


def test_next_chunk_waits_for_the_itl_target() -> None:
    p = Pacing(max_chunk=512, itl_target=1.2, min_share=0.05)
    p.token(0.0)
    p.token(0.005)  # clean ITL: 5 ms
    assert p.due(0.005)
    p.chunk_started(0.005)
    assert not p.due(100.0)  # its time is not known yet
    p.chunk_done(16, 0.004)
    now = 0.009
    for k in range(1, 5):  # 4 ms + 5 k ms within 6 k ms from k = 4 on
        now += 0.005
        p.token(now)
        assert p.due(now) == (k >= 4)
    # The floor keeps a prompt moving when the target is out of reach: with min_share
    # 0.5 a chunk may start once the last one took at most half the time since it started.
    q = Pacing(max_chunk=512, itl_target=1.2, min_share=0.5)
    q.token(0.0)
    q.token(0.005)
    q.chunk_started(0.005)
    q.chunk_done(16, 0.004)
    q.token(0.012)  # 7 ms into the cycle for one token: over 1.2 x 5 ms
    assert not q.due(0.0125) and q.due(0.0131)  # 4 ms busy in 8 ms
    with pytest.raises(ValueError, match="itl_target"):
        Pacing(max_chunk=512, itl_target=1.0)
    with pytest.raises(ValueError, match="budget"):
        Pacing(max_chunk=512, budget_s=0.0)


def itl_during_background_prefill(sim: Sim, prompt: int = 2048) -> tuple[float, float, float]:
    """Mean and largest inter-token time of A while B's prompt is prefilled behind it,
    and how long that prefill took."""
    sim.submit("A", 64, max_tokens=3000)
    sim.run_until(lambda: len(sim.generated.get("A", [])) >= 20)
    t0 = sim.now
    sim.submit("B", prompt, max_tokens=4)
    sim.run_until(lambda: "B" in sim.ready_at)
    times = [t for t in sim.emitted_at["A"] if t0 <= t <= sim.ready_at["B"]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return sum(gaps) / len(gaps), max(gaps), sim.ready_at["B"] - t0


@pytest.mark.parametrize("slowdown", [1.0, 1.08])
def test_inter_token_latency_during_a_2048_token_background_prefill(slowdown: float) -> None:
    """On a serial, CPU-like device (decode 5 ms, a chunk 6 ms + 0.15 ms a token), also
    when decode steps run 8 % slower while a prompt is prefilled behind them."""
    device = Device(slowdown=slowdown)
    sim = make_sim(num_blocks=512, device=device)
    mean, worst, took = itl_during_background_prefill(sim)
    step = device.step * slowdown  # the clean ITL while B is prefilled
    assert mean <= 1.15 * step + 1e-9  # the default ITL target
    assert mean <= 1.25 * device.step  # the service's promise against decoding alone
    # The 6 ms fixed cost is over half the 10 ms budget: chunks settle at 32 tokens,
    # where it is about half their time, not at the one granule that fits the budget;
    # the longest is the one 64-token probe that makes the fixed cost measurable.
    assert sim.policy.pacing.chunk_tokens() == 32
    assert worst <= step + device.chunk(64) + 1e-9
    # Done faster than 128 one-granule chunks, each followed by the tokens that pay for it.
    c = device.chunk(16)
    assert took <= 2048 / 16 * (c + (c / (0.15 * step) + 1) * step) + 1e-9
    # Fixed 512-token chunks back to back fail both bounds.
    mean_fixed, worst_fixed, _ = itl_during_background_prefill(make_sim(num_blocks=512, device=device, budget_s=10.0, itl_target=100.0))
    assert mean_fixed > 3 * device.step and worst_fixed > 10 * device.step


# -- a fixed cost per chunk (quantized weights expanded once a chunk) ----------------------


@dataclass
class NoisyDevice(Device):
    """Chunk times off by up to ``noise`` either way, uniformly (seeded)."""

    noise: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def chunk(self, n: int) -> float:
        return super().chunk(n) * self.rng.uniform(1.0 - self.noise, 1.0 + self.noise)


PROMPT = 3072  # long enough that the probes before the fixed cost is known are a minor part


def granule_throughput(device: Device, itl_target: float = 1.15) -> float:
    """Prompt tokens a second in one-granule chunks (the rate rule's fixed point when the
    fixed cost is over half the budget): each chunk, then the decode steps that pay for it."""
    c = device.chunk(16)
    return 16 / (c + math.ceil(c / ((itl_target - 1.0) * device.step)) * device.step)


def fits_budget(device: Device, budget: float, granule: int = 16) -> int:
    """The largest chunk in whole granules that the cost model runs within ``budget``."""
    return int((budget - device.a) / device.b) // granule * granule


@pytest.mark.parametrize(("a", "b", "budget"), [(0.0, 0.0001, 0.011), (0.0, 0.00004, 0.03), (0.0002, 0.0001, 0.011), (0.001, 0.00003, 0.02)])
def test_float_like_costs_keep_the_budget_sizing(a: float, b: float, budget: float) -> None:
    """No fixed cost to speak of: the largest chunk within the budget, as the rate rule
    gave, and no chunk (the doubled probe included) over the budget."""
    device = Device(a=a, b=b)
    sizes = run_chunks(Pacing(max_chunk=2048, budget_s=budget), device, 12)
    assert sizes[0] == 16 and sizes[-4:] == [fits_budget(device, budget)] * 4
    assert all(device.chunk(n) <= budget for n in sizes)
    if a == 0.0:  # the rate rule's own sequence: the probe, then the fitting chunk
        assert sizes[1:] == [fits_budget(device, budget)] * 11


def test_a_fixed_cost_over_the_budget_is_amortised() -> None:
    """The fixed cost is twice the 10 ms budget (2 x the 5 ms ITL): chunks grow until it
    is half their time, and the ITL target still holds on average, while the prompt is
    prefilled 10x faster than in one-granule chunks (the rate rule's fixed point here)."""
    device = Device(a=0.020, b=0.00003)
    sim = make_sim(num_blocks=512, device=device, max_chunk=2048)
    mean, worst, took = itl_during_background_prefill(sim, PROMPT)
    p = sim.policy.pacing
    assert p.fixed_s == pytest.approx(device.a) and p.per_token_s == pytest.approx(device.b)
    settled = p.chunk_tokens()
    assert device.a / device.chunk(settled) >= 0.5 > device.a / device.chunk(settled + 16)
    assert mean <= 1.15 * device.step + 1e-9 and mean <= 1.25 * device.step
    assert worst <= device.step + device.chunk(settled) + 1e-9
    assert PROMPT / took >= 10 * granule_throughput(device)


@pytest.mark.parametrize("seed", range(4))
def test_noisy_chunk_times_keep_sizes_stable(seed: int) -> None:
    """Chunk times off by up to 20 % either way: the sizes settle around the noiseless
    ones and stay there (no collapse to the probe, no runaway), with a fixed cost twice
    the budget and with none."""

    def settled_sizes(device: Device, budget: float) -> list[int]:
        p, sizes = Pacing(max_chunk=2048, budget_s=budget), []
        for _ in range(200):
            n = p.chunk_tokens()
            sizes.append(n)
            p.chunk_started(0.0)
            p.chunk_done(n, device.chunk(n))
        return sizes[10:]

    clean = Device(a=0.020, b=0.00003)
    late = settled_sizes(NoisyDevice(a=clean.a, b=clean.b, seed=seed), 0.010)
    ideal = clean.a / clean.b  # the fixed cost half the chunk's time
    assert 0.3 * ideal <= min(late) and max(late) <= 2.0 * ideal
    assert 0.4 <= clean.a / clean.chunk(statistics.mean(late)) <= 0.65
    assert statistics.pstdev(late) <= 0.25 * statistics.mean(late)
    clean = Device(a=0.0, b=0.0001)
    late = settled_sizes(NoisyDevice(a=clean.a, b=clean.b, seed=seed), 0.011)
    assert all(0.6 * 0.011 <= clean.chunk(n) <= 1.3 * 0.011 for n in late)
    # The ITL target holds on average through the noise, and the prefill stays 10x faster.
    noisy = NoisyDevice(a=0.020, b=0.00003, seed=seed)
    mean, _, took = itl_during_background_prefill(make_sim(num_blocks=512, device=noisy, max_chunk=2048), PROMPT)
    assert mean <= 1.25 * noisy.step
    assert PROMPT / took >= 10 * granule_throughput(Device(a=noisy.a, b=noisy.b))
