"""Speculative decoding on the CPU: greedy output identical to plain decoding (prompt
lookup and draft models), rollback gives blocks back, the accept/reject rule samples the
target distribution (chi-square), API validation, the scheduler with stop strings,
cancel and the prefix cache."""

from __future__ import annotations

import json
import math

import pytest
import torch

from edge.serving.errors import BadRequest
from edge.serving.schema import (
    ChatCompletionRequest,
    parse_request,
    sampling_params,
    usage_body,
)
from edge.runtime.engine import Engine
from edge.errors import SamplingError
from edge.model.random_model import make_model
from edge.sampling import SamplerState, SamplingParams, sample
from edge.scheduling import Scheduler
from edge.speculative.params import SpeculativeParams
from edge.speculative.proposers import DraftModel, PromptLookup
from edge.speculative.verify import accept, verify

NGRAM = SpeculativeParams("ngram", 4)
DRAFT = SpeculativeParams("draft", 4)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(kv_cache="paged", page_size=4, num_blocks=256)


@pytest.fixture(scope="module")
def twin() -> Engine:
    """The target's own weights as a draft: every proposal must stand."""
    return Engine.from_pretrained(kv_cache="paged", page_size=4, num_blocks=128)


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Other random weights, same tokenizer: proposals are often wrong."""
    path = make_model(tmp_path_factory.mktemp("draft") / "tiny-seed1", seed=1)
    return Engine.from_pretrained(path, kv_cache="paged", page_size=4, num_blocks=128)


def prompt(seed: int, n: int, period: int = 0) -> list[int]:
    """Random ids; with ``period``, repeated so that prompt lookup has something to find."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 800, (period or n,), generator=g).tolist()
    return (ids * (n // len(ids) + 1))[:n]


def run(sched: Scheduler, ids: list[int], **kw):
    return sched.submit(ids, SamplingParams(ignore_eos=True, **kw)).result(timeout=120)


def stopped(sched: Scheduler) -> None:
    sched.stop()
    assert sched.pool.num_free == sched.pool.num_blocks, "blocks leaked"


# -- proposers -------------------------------------------------------------------------------


def test_prompt_lookup_continues_the_longest_earlier_match() -> None:
    lookup = PromptLookup(max_ngram=3)
    ctx = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert lookup.propose(ctx, 3) == [8, 9, 1]  # "6 7" occurred before, followed by 8 9 1
    assert lookup.propose(ctx, 10) == [8, 9, 1, 2, 6, 7]  # clipped at the context's end
    assert lookup.propose([1, 2, 3], 4) == []
    assert lookup.propose(ctx, 0) == []


# -- rollback --------------------------------------------------------------------------------


def test_rejected_tokens_roll_back_and_their_pages_go_back_to_the_pool(engine: Engine) -> None:
    pool = engine.kv.pool
    start_free = pool.num_free
    ids = prompt(3, 9)
    seq = engine.new_sequence()
    state = SamplerState(engine.cfg.vocab_size, engine.device)
    state.load(SamplingParams(), ids)
    logits = engine.prefill(seq, ids)
    first = int(logits.argmax())
    truth = engine.score([*ids, first])[-1].argmax().item()
    wrong = [(truth + 1) % engine.cfg.vocab_size] + [7] * 7  # the first proposal is wrong: all 8 go
    verdict = verify(engine, seq, first, wrong, state, greedy=True)
    assert verdict.accepted == 0 and verdict.tokens == [truth]
    assert seq.length == len(ids) + 1
    assert len(seq.blocks) == math.ceil(seq.length / pool.page_size)
    assert pool.num_free == start_free - len(seq.blocks)
    seq.release()
    assert pool.num_free == start_free


@pytest.mark.parametrize("argmax", [False, True])
def test_verify_step_scores_every_token_as_a_prefill_does(engine: Engine, argmax: bool) -> None:
    """The verify decoder's step (the body its CUDA graphs capture, run eagerly here)
    against ``Engine.score`` of the whole context: logits of every fed token, and the
    device position left after the kept tokens."""
    ids = prompt(61, 13)
    seq = engine.new_sequence(slot=0)
    decoder = engine.verify_decoder(seq)
    assert decoder.path == "eager" and decoder.max_proposals == 8
    state = SamplerState(engine.cfg.vocab_size, engine.device)
    state.load(SamplingParams(), ids)
    context = list(ids)
    engine.prefill(seq, ids)
    try:
        for t in (1, 4, 9, 2):
            fed = prompt(70 + t, t)
            want = engine.score([*context, *fed])[-t:]
            out = decoder.run(seq, fed, argmax)
            assert seq.length == len(context) + t
            if argmax:
                assert out == want.argmax(dim=-1).tolist()
                kept = next((i for i in range(t - 1) if out[i] != fed[i + 1]), t - 1)
                assert int(decoder.pos) == len(context) + kept + 1
                seq.rollback(t - 1 - kept)
                context += fed[: kept + 1]
            else:
                torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
                seq.rollback(t - 1)
                decoder.settle(seq)
                context += fed[:1]
            assert int(decoder.pos) == seq.length
    finally:
        decoder.unbind()
        seq.release()
    with pytest.raises(ValueError, match="1..9 tokens"):
        decoder.run(seq, list(range(10)), argmax)


# -- greedy identity --------------------------------------------------------------------------

CASES = [(11, 5, 0, 17), (12, 23, 6, 30), (13, 40, 9, 9), (14, 3, 0, 25)]  # seed, prompt len, period, tokens


@pytest.mark.parametrize("method", ["ngram", "twin", "stranger"])
def test_greedy_output_is_identical_to_plain_decoding(engine, twin, stranger, method) -> None:
    draft = {"ngram": None, "twin": twin, "stranger": stranger}[method]
    spec = NGRAM if draft is None else DRAFT
    requests = [(prompt(seed, n, period), {"max_tokens": tokens}) for seed, n, period, tokens in CASES]
    # The repetition penalty takes the one-token-at-a-time acceptance path.
    requests.append((prompt(15, 20, 5), {"max_tokens": 20, "repetition_penalty": 1.3}))
    # Plain decoding first: the engine serves one caller at a time.
    wants = [engine.generate(ids, ignore_eos=True, **kw) for ids, kw in requests]
    fast = Scheduler(engine, speculative=spec, draft=draft)
    fast.start()
    try:
        gots = [run(fast, ids, **kw) for ids, kw in requests]
    finally:
        stopped(fast)
    for (ids, kw), want, got in zip(requests, wants, gots):
        assert got.token_ids == want.token_ids, (len(ids), kw)
        assert got.finish_reason == want.finish_reason == "length"
        stats = got.usage.speculative
        assert stats["steps"] < kw["max_tokens"], "speculation never produced more than one token per step"
        if method == "twin":
            assert stats["acceptance_rate"] == 1.0
        # No CUDA graphs on the reference backend: the same verify step ran eagerly, and says so.
        assert stats["verify"] == "eager"
        assert stats.get("draft") == (None if draft is None else "eager")
    assert twin.kv.pool.num_free == twin.kv.pool.num_blocks
    assert stranger.kv.pool.num_free == stranger.kv.pool.num_blocks


def test_draft_proposer_rolls_its_own_kv_back(twin: Engine) -> None:
    draft = DraftModel(twin)
    ctx = prompt(21, 10)
    first = draft.propose(ctx, 4)
    assert draft.seq.length == len(ctx) + 3  # the last proposal is never fed
    # The target kept two proposals and drew another token: the draft forgets the rest.
    again = draft.propose([*ctx, *first[:2], 5], 4)
    assert draft.fed[: len(ctx) + 3] == [*ctx, *first[:2], 5]
    assert draft.seq.length == len(draft.fed) == len(ctx) + 3 + 3
    want = twin.score([*ctx, *first[:2], 5])[-1].argmax().item()
    assert again[0] == want
    draft.close()
    assert twin.kv.pool.num_free == twin.kv.pool.num_blocks


class _RingDecoder:
    """A slot decoder stand-in for the draft's graph path: step i's token is 100 + i,
    known only once read; records launches and reads, and fails the launch after
    ``room`` steps as a full KV pool does."""

    RING = 4

    def __init__(self, room: int = 99) -> None:
        self.events: list[str] = []
        self.room = room
        self.launched = self.read_upto = 0
        self.most_inflight = 0

    def bind(self, seq, sampler, token) -> None:
        self.events.append("bind")

    def launch(self, seq, greedy: bool) -> int:
        from edge.model.kv import KVOutOfMemory

        if self.launched == self.room:
            raise KVOutOfMemory("full")
        self.launched += 1
        self.most_inflight = max(self.most_inflight, self.launched - self.read_upto)
        self.events.append("L")
        return (self.launched - 1) % self.RING

    def read(self, slot: int) -> int:
        assert slot == self.read_upto % self.RING, "read in launch order"
        self.read_upto += 1
        self.events.append("R")
        return 100 + self.read_upto - 1


def test_draft_graph_steps_launch_ahead_of_their_reads(twin: Engine) -> None:
    """The draft's graph steps take their token from the previous one on the device, so
    up to the ring's depth are launched before the first is read (none past k); the
    tokens, and the fed ones, come out in order; a full pool stops the launches, the
    steps in flight are still read, and the proposals so far are returned."""
    from edge.model.kv import KVOutOfMemory

    draft = DraftModel(twin)
    for k, room, want_events in (
        (4, 99, ["bind", "L", "L", "L", "R", "R", "R"]),
        (7, 99, ["bind", "L", "L", "L", "L", "R", "L", "R", "L", "R", "R", "R", "R"]),
    ):
        dec = _RingDecoder(room)
        draft.decoder = dec
        out, fed_before = [7], len(draft.fed)
        draft._decode_graph(torch.tensor([7]), k, out)
        assert out == [7, *range(100, 100 + k - 1)] and dec.events == want_events, (k, dec.events)
        assert draft.fed[fed_before:] == out[:-1]  # each step's input, in order
        assert dec.most_inflight == min(k - 1, dec.RING)
    dec = _RingDecoder(room=2)
    draft.decoder = dec
    out = [7]
    with pytest.raises(KVOutOfMemory):
        draft._decode_graph(torch.tensor([7]), 6, out)
    assert out == [7, 100, 101] and dec.events == ["bind", "L", "L", "R", "R"]
    draft.decoder = None
    draft.close()


# -- sampled: the accept/reject rule -----------------------------------------------------------

VOCAB = 6
TEMPERATURE = 0.8
DRAWS = 3000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(1 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(stat))


def draws(logits: torch.Tensor, proposals: list[list[int]], draft_probs: torch.Tensor | None) -> list[list[int]]:
    state = SamplerState(VOCAB, torch.device("cpu"))
    out = []
    for seed, proposed in enumerate(proposals):
        state.load(SamplingParams(temperature=TEMPERATURE, seed=seed), [])
        out.append(accept(logits, proposed, state, greedy=False, draft_probs=draft_probs).tokens)
    return out


@pytest.mark.parametrize("proposer", ["point mass", "distribution"])
def test_speculative_sampling_follows_the_target_distribution(proposer: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g) * 1.5
    target = torch.softmax(logits / TEMPERATURE, dim=-1)  # what plain sampling draws from
    q = None
    if proposer == "point mass":
        fixed = [int(target[0].argsort()[-2]), 2]  # the second most likely: rejections happen
        proposals = [fixed] * DRAWS
    else:  # proposals drawn from the proposer's own distribution, as a sampling draft does
        q = torch.softmax(torch.randn(2, VOCAB, generator=g), dim=-1)
        proposals = torch.multinomial(q, DRAWS, replacement=True, generator=g).T.tolist()
    out = draws(logits, proposals, q)
    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=VOCAB).float()
    assert chi_square_p(first, target[0]) > 1e-3
    # After an accepted first proposal, the next token follows the target's next row.
    second = [t[1] for t, d in zip(out, proposals) if t[0] == d[0]]
    assert len(second) > 300
    counts = torch.bincount(torch.tensor(second), minlength=VOCAB).float()
    assert chi_square_p(counts, target[1]) > 1e-3
    # The test has power: keeping every proposal would fail it.
    kept = torch.bincount(torch.tensor([d[0] for d in proposals]), minlength=VOCAB).float()
    assert chi_square_p(kept, target[0]) < 1e-3


def test_sampled_speculation_is_reproducible_with_a_seed(engine: Engine) -> None:
    sched = Scheduler(engine, speculative=NGRAM)
    sched.start()
    try:
        ids = prompt(31, 24, 6)
        a = run(sched, ids, max_tokens=20, temperature=0.9, seed=5)
        b = run(sched, ids, max_tokens=20, temperature=0.9, seed=5)
        c = run(sched, ids, max_tokens=20, temperature=0.9, seed=6)
    finally:
        stopped(sched)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_sampling_without_proposals_is_plain_sampling() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    for seed in range(20):
        s1, s2 = SamplerState(VOCAB, torch.device("cpu")), SamplerState(VOCAB, torch.device("cpu"))
        params = SamplingParams(temperature=1.0, seed=seed)
        s1.load(params, [])
        s2.load(params, [])
        assert accept(logits, [], s1, greedy=False).tokens == [int(sample(logits[0], s2, greedy=False))]


# -- scheduler: stop strings, cancel, prefix cache ---------------------------------------------


def test_stop_strings_and_prefix_cache_match_plain_decoding(engine: Engine) -> None:
    ids = prompt(41, 32, 8)
    full = engine.generate(ids, max_tokens=24, ignore_eos=True)
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop
    want = engine.generate(ids, max_tokens=24, ignore_eos=True, stop=[stop])
    fast = Scheduler(engine, speculative=NGRAM)
    fast.start()
    try:
        got = run(fast, ids, max_tokens=24, stop=[stop])
        again = run(fast, ids, max_tokens=24, stop=[stop])  # the prompt's blocks come from the cache
    finally:
        stopped(fast)
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason) == (want.text, "stop")
    assert again.text == want.text and again.usage.cached_tokens > 0


def test_cancel_ends_a_speculative_request_and_frees_its_blocks(engine: Engine) -> None:
    sched = Scheduler(engine, speculative=NGRAM)
    sched.start()
    try:
        handle = sched.submit(prompt(51, 16, 4), SamplingParams(max_tokens=400, ignore_eos=True))
        assert next(iter(handle)).token_ids  # decoding has started
        handle.cancel()
        result = handle.result(timeout=60)
    finally:
        stopped(sched)
    assert result.finish_reason == "cancelled"
    assert len(result.token_ids) < 400


def test_draft_requests_need_a_draft_model(engine: Engine) -> None:
    sched = Scheduler(engine)
    try:
        with pytest.raises(SamplingError, match="draft model"):
            sched.submit([5, 6, 7], SamplingParams(speculative=DRAFT))
    finally:
        stopped(sched)
    with pytest.raises(ValueError, match="draft model"):
        Scheduler(engine, speculative=DRAFT)


def test_a_request_turns_the_server_default_off(engine: Engine) -> None:
    """A server started with --speculative: {"method": "off"} decodes that request plainly
    (no speculative usage), the next request without a choice speculates again."""
    sched = Scheduler(engine, speculative=NGRAM)
    sched.start()
    try:
        ids = prompt(61, 24, 6)
        plain = run(sched, ids, max_tokens=12, speculative=SpeculativeParams("off"))
        default = run(sched, ids, max_tokens=12)
    finally:
        stopped(sched)
    assert plain.usage.speculative is None
    assert default.usage.speculative is not None and default.usage.speculative["steps"] > 0
    assert plain.token_ids == default.token_ids  # greedy: the same tokens either way


# -- API ------------------------------------------------------------------------------------


def chat(**extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def test_api_speculative_field_reaches_the_sampling_params() -> None:
    req = parse_request(chat(speculative={"method": "ngram", "num_tokens": 6}), ChatCompletionRequest)
    assert sampling_params(req, 3, 64).speculative == SpeculativeParams("ngram", 6)
    assert sampling_params(parse_request(chat(), ChatCompletionRequest), 3, 64).speculative is None
    off = sampling_params(parse_request(chat(speculative={"method": "off"}), ChatCompletionRequest), 3, 64)
    assert off.speculative is not None and off.speculative.off


@pytest.mark.parametrize(
    "value,param",
    [
        ({"method": "medusa"}, "speculative"),
        ({"method": "ngram", "num_tokens": 0}, "speculative"),
        ({"method": "ngram", "num_tokens": 17}, "speculative"),
        ({"method": "ngram", "num_tokens": "4"}, "speculative.num_tokens"),
        ({"method": "ngram", "num_token": 4}, "speculative.num_token"),
        ({"num_tokens": 4}, "speculative.method"),
        ("ngram", "speculative"),
    ],
)
def test_api_bad_speculative_values_are_a_400_naming_the_field(value, param) -> None:
    with pytest.raises(BadRequest) as info:
        sampling_params(parse_request(chat(speculative=value), ChatCompletionRequest), 3, 64)
    assert info.value.param == param
    assert "\n" not in str(info.value)


def test_usage_carries_the_speculative_counts() -> None:
    from edge.model.generation import Usage

    body = usage_body(Usage(prompt_tokens=3, completion_tokens=5, speculative={"steps": 2, "acceptance_rate": 0.5}))
    assert body["speculative"] == {"steps": 2, "acceptance_rate": 0.5}
    assert "speculative" not in usage_body(Usage())


def test_service_default_setting_parses_and_refuses_bad_values() -> None:
    from edge.settings import resolve

    s, _ = resolve({}, environ={"EDGE_SPECULATIVE": "ngram:6", "EDGE_DRAFT_MODEL": "/models/qwen3-0.6b"})
    assert (s.speculative, s.draft_model) == (SpeculativeParams("ngram", 6), "/models/qwen3-0.6b")
    assert resolve({"speculative": "off"}, environ={"EDGE_SPECULATIVE": "draft"})[0].speculative is None
    for bad in ("eagle:4", "ngram:0", "ngram:x"):
        with pytest.raises(ValueError, match="EDGE_SPECULATIVE"):
            resolve({}, environ={"EDGE_SPECULATIVE": bad})


# -- tools/bench.py speculative -----------------------------------------------------------------


def test_bench_speculative_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    import bench

    args = bench.build_parser().parse_args(
        ["speculative", "--device", "cpu", "--context", "16", "--max-k", "2", "--reps", "1",
         "--tokens", "8", "--max-seq-len", "128"]
    )
    out = json.loads(json.dumps(args.func(args)))  # what the command prints
    assert out["mode"] == "speculative" and out["backend"] == "reference"
    assert out["model"] == "tiny"  # the CPU's default preset (the GPU's, qwen3-8b, would not fit a small host)
    assert out["decode"]["step_ms"] > 0 and out["plain"]["tok_s"] > 0
    assert [r["k"] for r in out["verify"]] == [1, 2]
    assert all(r["step_ms"] > 0 and r["vs_decode"] > 0 and r["path"] == "eager" for r in out["verify"])
    for run in [*out["perfect_proposer"], out["prompt_lookup"]]:
        assert run["identical"] and run["tok_s"] > 0 and run["speedup"] > 0
    # The perfect proposer's proposals all stand, and more than one a step.
    assert all(r["acceptance_rate"] == 1.0 and r["tokens_per_step"] > 1.5 for r in out["perfect_proposer"])
    assert out["prompt_lookup"]["acceptance_rate"] > 0.5  # the model copies from its prompt
    assert out["projections"]["projection"] is True
    assert [r["tokens_per_step"] for r in out["projections"]["rows"]] == [2.0, 3.0]
    assert all(r["tok_s"] > 0 for r in out["projections"]["rows"])
