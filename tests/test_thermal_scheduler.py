"""The real thermal governor and energy meter driving the real scheduler: a scripted
temperature ramp normal -> soft -> hard -> normal, and joules per request equal to the
integral of scripted power."""

from __future__ import annotations

import time

import pytest

from edge.runtime.engine import Engine
from edge.monitor import EnergyMeter, FakeSource, Sampler, ThermalGovernor
from edge.monitor.governor import DeviceTooHot
from edge.sampling import SamplingParams
from edge.scheduling import Scheduler


class Clock:
    """Monitor time under the test's control."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def wait_for(cond, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(page_size=16)


def states(sched: Scheduler) -> list[str]:
    return [s["state"] for s in sched.stats()["slots"]]


def test_temperature_ramp_drives_the_scheduler(engine: Engine) -> None:
    temp = {"c": 50.0}
    clock = Clock()
    sampler = Sampler(FakeSource(temperatures=lambda _i: temp["c"], power_w=10.0), clock=clock)
    gov = ThermalGovernor(soft_c=80, hard_c=90, hysteresis_c=5, max_decode_delay_s=0.02)
    sampler.add_hook(gov)
    sched = Scheduler(engine, queue_size=4, prefill_chunk=16, governor=gov)
    sched.start()
    try:
        sampler.sample_once()
        assert gov.state == "normal"
        a = sched.submit(list(range(10, 30)), SamplingParams(max_tokens=120, ignore_eos=True))
        wait_for(lambda: "decoding" in states(sched))

        temp["c"] = 84.0  # soft: background prefill pauses, decode slows
        sampler.sample_once()
        assert gov.state == "soft" and gov.decode_delay_s() > 0
        b = sched.submit(list(range(40, 90)), SamplingParams(max_tokens=4, ignore_eos=True))
        time.sleep(0.3)
        assert not a.finished, "decode should still be running (slowed)"
        assert states(sched).count("prefilling") == 0 and states(sched).count("ready") == 0
        assert sched.stats()["queue_depth"] == 1, "the second request must wait, not prefill"

        temp["c"] = 93.0  # hard: new requests refused, the active answer goes on
        sampler.sample_once()
        assert gov.state == "hard"
        with pytest.raises(DeviceTooHot, match="93"):
            sched.submit([5, 6, 7], SamplingParams(max_tokens=2))

        temp["c"] = 84.0  # below hard - hysteresis: soft again, still no background work
        sampler.sample_once()
        assert gov.state == "soft"
        temp["c"] = 70.0  # below soft - hysteresis: normal
        sampler.sample_once()
        assert gov.state == "normal" and gov.decode_delay_s() == 0
        ra, rb = a.result(60), b.result(60)
        assert ra.finish_reason == "length" and len(ra.token_ids) == 120, "active request finished"
        assert rb.finish_reason == "length" and len(rb.token_ids) == 4
        c = sched.submit([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)).result(30)
        assert c.finish_reason == "length"
    finally:
        sched.stop()


def test_energy_per_request_is_the_integral_of_power(engine: Engine) -> None:
    clock = Clock()
    power = lambda t: 10.0 + 2.0 * t  # noqa: E731 - scripted W as a function of time
    sampler = Sampler(FakeSource(power_w=power, index_by="time"), clock=clock)
    meter = EnergyMeter(clock=clock)
    sampler.add_hook(meter)
    sched = Scheduler(engine, queue_size=2, energy=meter)
    sched.start()
    try:
        for t in (0.0, 0.5, 1.0):
            clock.t = t
            sampler.sample_once()
        handle = sched.submit(list(range(10, 20)), SamplingParams(max_tokens=10_000, ignore_eos=True))  # begins at t=1
        wait_for(lambda: handle.finished or "decoding" in states(sched))
        for t in (1.5, 2.0, 2.5, 3.0):
            clock.t = t
            sampler.sample_once()
        handle.cancel()  # ends at t=3
        r = handle.result(30)
    finally:
        sched.stop()
    assert r.finish_reason == "cancelled"
    expected = (10.0 * 3 + 3.0**2) - (10.0 * 1 + 1.0**2)  # integral of 10 + 2t from 1 to 3
    assert r.usage.energy_j == pytest.approx(expected, rel=1e-9)
    assert r.usage.energy_j_per_token == pytest.approx(expected / r.usage.completion_tokens)
