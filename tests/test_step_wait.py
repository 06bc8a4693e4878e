"""edge.step_wait.StepWait on a fake clock: it sleeps through most of a step of a known
shape and polls the rest, never sleeps past the step's expected end, learns each
shape's duration separately, and polls only when told not to sleep."""

from __future__ import annotations

import pytest

from edge.step_wait import POLL_MARGIN_S, POLL_SHARE, SMOOTHING, StepWait


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


class Step:
    """An event that completes at ``done`` on the clock; each query costs ``poll_s``."""

    def __init__(self, clock: Clock, done: float, poll_s: float = 1e-6) -> None:
        self.clock, self.done, self.poll_s = clock, done, poll_s

    def query(self) -> bool:
        self.clock.now += self.poll_s
        return self.clock.now >= self.done


def _step(w: StepWait, clock: Clock, key: int, seconds: float) -> float:
    launched = clock.now
    w.wait(Step(clock, launched + seconds), launched, key)
    return clock.now - launched


def test_first_step_polls_then_later_steps_sleep_most_of_it() -> None:
    clock = Clock()
    w = StepWait(clock=clock, sleep=clock.sleep)
    took = _step(w, clock, 5, 0.010)
    assert clock.sleeps == [] and took == pytest.approx(0.010, abs=2e-6)
    assert w.expected[5] == pytest.approx(0.010, abs=2e-6)
    polls = w.polls
    took = _step(w, clock, 5, 0.010)
    assert took == pytest.approx(0.010, abs=2e-6), "the step is not overslept"
    assert clock.sleeps == [pytest.approx(0.010 * (1 - POLL_SHARE) - POLL_MARGIN_S, abs=2e-6)]
    assert w.polls - polls < polls / 5, "most of the step was slept, not polled"


def test_a_shorter_step_is_not_overslept_by_more_than_the_sleep_ahead() -> None:
    clock = Clock()
    w = StepWait(clock=clock, sleep=clock.sleep)
    _step(w, clock, 2, 0.010)
    took = _step(w, clock, 2, 0.004)  # much shorter than expected: woken after the sleep
    assert took == pytest.approx(0.010 * (1 - POLL_SHARE) - POLL_MARGIN_S, abs=2e-6)
    assert w.expected[2] == pytest.approx(0.010 + SMOOTHING * (took - 0.010), abs=2e-6)


def test_shapes_are_learned_apart_and_polling_only_never_sleeps() -> None:
    clock = Clock()
    w = StepWait(clock=clock, sleep=clock.sleep)
    _step(w, clock, 2, 0.002)
    _step(w, clock, 9, 0.020)
    assert w.expected[2] == pytest.approx(0.002, abs=2e-6) and w.expected[9] == pytest.approx(0.020, abs=2e-6)
    _step(w, clock, 2, 0.002)
    assert clock.sleeps == [pytest.approx(0.002 * (1 - POLL_SHARE) - POLL_MARGIN_S, abs=2e-6)]
    clock2 = Clock()
    spin = StepWait(sleeps=False, clock=clock2, sleep=clock2.sleep)
    for _ in range(3):
        assert _step(spin, clock2, 2, 0.002) == pytest.approx(0.002, abs=2e-6)
    assert clock2.sleeps == [] and spin.slept_s == 0.0
