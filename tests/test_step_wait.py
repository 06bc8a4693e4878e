"""edge.runtime.step_wait.StepWait: polls until the event completes, naps between polls (none
with nap 0), and returns at once for a finished step."""

from __future__ import annotations

import pytest

from edge.runtime.step_wait import NAP_S, StepWait


class Step:
    """An event that completes on its ``done``-th query."""

    def __init__(self, done: int) -> None:
        self.done, self.queries = done, 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries >= self.done


def test_polls_with_naps_until_done() -> None:
    naps: list[float] = []
    w = StepWait(sleep=naps.append)
    step = Step(5)
    w.wait(step)
    assert step.queries == 5 and w.polls == 5
    assert naps == [NAP_S] * 4, "a nap between polls, none after the last"


def test_a_finished_step_returns_without_napping() -> None:
    naps: list[float] = []
    w = StepWait(sleep=naps.append)
    w.wait(Step(1))
    assert naps == [] and w.polls == 1


def test_busy_poll_never_sleeps_and_bad_naps_are_refused() -> None:
    naps: list[float] = []
    w = StepWait(nap_s=0.0, sleep=naps.append)
    w.wait(Step(40))
    assert naps == [] and w.polls == 40
    with pytest.raises(ValueError, match="nap_s"):
        StepWait(nap_s=-1.0)
