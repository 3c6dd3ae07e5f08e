"""A restore's stages on the scheduler's clock: each wait measured once, and
only for requests that were restored."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # the adapter's package checks vLLM's version
from kvledger.adapters.vllm.restore_timing import RestoreTimes  # noqa: E402

pytestmark = pytest.mark.vllm  # not in the fast subset, which runs without vLLM


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_stage_of_a_restore_is_measured_once() -> None:
    clock = Clock()
    times = RestoreTimes(clock)
    times.asked("r")
    times.answered("r", None)  # ask again next step: a shared tier's lookup is on its way
    clock.now = 0.010
    times.asked("r")  # asked again: the first question still counts
    times.answered("r", 64)
    clock.now = 0.011
    times.admitted("r", 64)
    times.load_started(7, "r", promoted=True)
    clock.now = 0.061
    times.scheduled({"r": 16})  # still loading: not yet
    times.load_ended(7, ok=True)
    times.admitted("r", 0)  # vLLM allocates the rest of the prompt once the load is in
    clock.now = 0.081
    times.scheduled({"r": 16, "other": 1})
    times.scheduled({"r": 1})  # a later step: measured already
    taken = times.take()
    assert [stage for stage, _ in taken] == ["lookup", "admission", "load_promoted", "first_step"]
    assert [seconds for _, seconds in taken] == pytest.approx([0.010, 0.001, 0.050, 0.020])
    assert times.take() == []
    assert list(times.recent) == [pytest.approx({"lookup": 0.010, "admission": 0.001, "load_promoted": 0.050,
                                                  "first_step": 0.020})]


def test_misses_failed_loads_and_hits_left_unused_are_not_restores() -> None:
    clock = Clock()
    times = RestoreTimes(clock)
    times.asked("miss")
    times.answered("miss", 0)
    times.asked("unused")
    times.answered("unused", 64)
    times.admitted("unused", 0)  # vLLM allocated without the hit
    times.asked("failed")
    times.answered("failed", 64)
    times.admitted("failed", 64)
    times.load_started(3, "failed", promoted=False)
    times.load_ended(3, ok=False)  # recomputed
    times.load_ended(3, ok=True)  # another worker's report: the job is gone already
    times.asked("gone")
    times.answered("gone", 64)
    times.forget("gone")  # finished or aborted before its hit was admitted
    times.scheduled({"miss": 1, "unused": 1, "failed": 1, "gone": 1})
    assert times.take() == [] and not times._marks and not times._jobs
