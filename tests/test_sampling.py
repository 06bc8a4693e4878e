"""Sampling: greedy, seeds, top-k/top-p support sets, repetition penalty, stops."""

from __future__ import annotations

import pytest
import torch

from edge.runtime.engine import Engine
from edge.sampling import SamplerState, SamplingError, SamplingParams, StopChecker, sample

VOCAB = 50


def draw(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    state = SamplerState(VOCAB, torch.device("cpu"))
    state.load(params, [])
    return [int(sample(logits, state, params.greedy)) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(VOCAB)
    assert draw(logits, SamplingParams(), 3) == [int(logits.argmax())] * 3


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = torch.zeros(VOCAB)
    a = draw(logits, SamplingParams(temperature=1.0, seed=11), 64)
    b = draw(logits, SamplingParams(temperature=1.0, seed=11), 64)
    c = draw(logits, SamplingParams(temperature=1.0, seed=12), 64)
    assert a == b
    assert a != c
    assert len(set(a)) > 20, "uniform logits should spread over the vocabulary"


def test_top_k_support_set() -> None:
    logits = torch.linspace(0, 1, VOCAB)
    tokens = draw(logits, SamplingParams(temperature=5.0, top_k=4, seed=1), 400)
    assert set(tokens) == {VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4}


def test_top_p_support_set() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs.clamp(min=1e-12))
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=2), 400)
    # 0.5 + 0.3 reaches 0.75: the nucleus is exactly the first two tokens
    assert set(tokens) == {0, 1}
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=0.01, seed=2), 50)
    assert set(tokens) == {0}, "the most likely token always survives"


def test_sampling_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    tokens = draw(torch.log(probs.clamp(min=1e-12)), SamplingParams(temperature=1.0, seed=5), 3000)
    freq = torch.bincount(torch.tensor(tokens), minlength=3)[:3].float() / len(tokens)
    torch.testing.assert_close(freq, probs[:3], atol=0.03, rtol=0)


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.zeros(VOCAB)
    logits[7] = 1.0
    logits[8] = 0.9
    state = SamplerState(VOCAB, torch.device("cpu"))
    state.load(SamplingParams(repetition_penalty=2.0), prompt_ids=[7])
    assert int(sample(logits, state, greedy=True)) == 8  # 1.0 / 2 < 0.9
    assert int(sample(logits, state, greedy=True)) == 7  # 8 is now seen: 0.45 < 0.5


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(top_k=1 << 63), "top_k"),  # past an int64
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_params_name_the_parameter(kw, match) -> None:
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kw).validate()


def test_stop_checker_holds_back_partial_stop_strings() -> None:
    stop = StopChecker(SamplingParams(stop=["END"]), eos_token_ids=set())
    shown = [stop.on_text(t) for t in ["Hello E", "N", "D and more"]]
    assert shown == ["Hello ", "", ""]
    assert stop.finish_reason == "stop"


def test_stop_checker_releases_text_that_was_not_a_stop() -> None:
    stop = StopChecker(SamplingParams(stop=["END"]), eos_token_ids=set())
    assert stop.on_text("the E") == "the "
    assert stop.on_text("ND") == ""
    stop2 = StopChecker(SamplingParams(stop=["END"]), eos_token_ids=set())
    assert stop2.on_text("the E") + stop2.on_text("x") == "the Ex"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained()


def test_max_tokens_and_seeded_generation(engine: Engine) -> None:
    params = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    a = engine.generate("Robots", params)
    b = engine.generate("Robots", params)
    assert len(a.token_ids) == 9 and a.finish_reason == "length"
    assert a.token_ids == b.token_ids and a.text == b.text


def test_stop_token_id_ends_generation(engine: Engine) -> None:
    free = engine.generate("Robots", SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    stopper = free[5]
    r = engine.generate("Robots", SamplingParams(max_tokens=12, stop_token_ids=[stopper], ignore_eos=True))
    assert r.finish_reason == "stop"
    assert r.token_ids == free[: free.index(stopper)]


def test_stop_string_truncates_the_text(engine: Engine) -> None:
    free = engine.generate("Robots", SamplingParams(max_tokens=24, ignore_eos=True)).text
    needle = free[len(free) // 2 : len(free) // 2 + 2]
    r = engine.generate("Robots", SamplingParams(max_tokens=24, stop=[needle], ignore_eos=True))
    assert r.finish_reason == "stop"
    assert r.text == free[: free.index(needle)]
    streamed = "".join(c.text for c in engine.stream("Robots", SamplingParams(max_tokens=24, stop=[needle], ignore_eos=True)))
    assert streamed == r.text


def test_max_tokens_zero_only_prefills(engine: Engine) -> None:
    r = engine.generate("Robots", SamplingParams(max_tokens=0))
    assert r.token_ids == [] and r.finish_reason == "length" and r.usage.prompt_tokens > 0
