"""The live miss counter counts what `kvledger explain` counts over the same
events, on its thread or not, with a bounded memory of keys; and stops,
rather than stalls or breaks serving, when its fold cannot keep up."""

from __future__ import annotations

import random
import threading

import pytest

from kvledger.adapters.log_tools.misses import MissLedger, totals
from kvledger.adapters.miss_counter import MissCounter
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.events import types as ev
from tests.adapters.test_misses import SMALL
from tests.engine.builders import SIMULATED_CONFIGS


def _steps(config, seed: int) -> tuple[list[list[ev.Event]], dict[str, int]]:
    """A simulated workload's events, step by step, and explain's missed tokens by cause."""
    ledger = MissLedger(config)
    steps: list[list[ev.Event]] = [[]]

    def observe(seq, event, state, effects):
        ledger.observe(seq, event, state, effects)
        steps[-1].append(event)
        if isinstance(event, ev.StepScheduled):
            steps.append([])

    sim = Simulator(config, prefix_caching=seed % 2 == 0, observe=observe)
    run_random(sim, random.Random(seed), steps=120, arrivals=0.8, max_tokens=12, fail_rate=0.1, reset_rate=0.03,
               damage_rate=0.05, foreign_rate=0.05)
    final = [a for a in ledger.admissions if a.load_job not in ledger._loads]  # a load still running: not yet
    assert len(final) >= len(ledger.admissions) - 4
    by_cause = {cause: entry["tokens"] for cause, entry in totals(final)["missed_by_cause"].items()}
    return steps, by_cause


def _counted(counter: MissCounter, steps: list[list[ev.Event]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for events in steps:
        counter.feed(events)
        for cause, tokens in counter.take().items():  # taken as vLLM does, every step
            counts[cause] = counts.get(cause, 0) + tokens
    counter.close()
    for cause, tokens in counter.take().items():
        counts[cause] = counts.get(cause, 0) + tokens
    return counts


@pytest.mark.parametrize("config", [*SIMULATED_CONFIGS, SMALL], ids=lambda c: f"{len(c.groups)}g-{c.num_tier_slots}")
@pytest.mark.parametrize("background", [False, True], ids=["inline", "thread"])
def test_it_counts_what_explain_counts(config, background) -> None:
    steps, expected = _steps(config, seed=3)
    counter = MissCounter(config, background=background)
    assert _counted(counter, steps) == expected
    assert counter.stopped is None
    assert expected  # the workload misses, for more than one reason
    assert len(expected) > 2


@pytest.mark.fast
def test_a_small_memory_forgets_keys_but_counts_every_missed_token() -> None:
    steps, expected = _steps(SMALL, seed=5)
    counter = MissCounter(SMALL, max_keys=16, background=False)
    largest = 0
    counts: dict[str, int] = {}
    for events in steps:
        counter.feed(events)
        largest = max(largest, len(counter._ledger.keys))
        for cause, tokens in counter.take().items():
            counts[cause] = counts.get(cause, 0) + tokens
    assert largest <= 16  # after every event
    assert sum(counts.values()) == sum(expected.values())  # some causes may differ: their facts were forgotten
    assert counts["first_seen"] > expected["first_seen"]  # what it forgot, it takes for new


@pytest.mark.fast
def test_the_memory_bounds_the_ends_of_requests_too_where_they_name_few_keys() -> None:
    steps, _ = _steps(SMALL, seed=3)  # 35 keys named, 67 requests ended
    counter = MissCounter(SMALL, max_keys=40, background=False)
    for events in steps:
        counter.feed(events)
        assert len(counter._ledger.keys) <= 40 and len(counter._ledger._ended) <= 40
    assert len(counter._ledger.keys) == 35 and len(counter._ledger._ended) > 20


@pytest.mark.fast
def test_a_fold_that_falls_behind_stops_the_counter_not_the_caller(monkeypatch) -> None:
    steps, _ = _steps(SMALL, seed=1)
    release = threading.Event()
    folding = threading.Event()
    fold = MissCounter._fold

    def slow_fold(self, events):
        folding.set()
        release.wait(10)
        fold(self, events)

    monkeypatch.setattr(MissCounter, "MAX_QUEUED", 2)
    monkeypatch.setattr(MissCounter, "_fold", slow_fold)
    counter = MissCounter(SMALL)
    counter.feed(steps[0])
    assert folding.wait(10)
    for events in steps[1:4]:  # two wait, the third finds the queue full
        counter.feed(events)
    assert counter.stopped == "the fold fell 2 batches of events behind"
    counter.feed(steps[4])  # ignored from now on
    release.set()
    counter.close()
    assert counter.take() == {}
    assert counter._thread is None


@pytest.mark.fast
def test_a_fold_that_raises_stops_the_counter() -> None:
    counter = MissCounter(SMALL, background=False)
    counter.feed([object()])  # type: ignore[list-item]  # no event: the reducer has no handler for it
    assert counter.stopped is not None and counter.stopped.startswith("KeyError")
    counter.feed(steps_of_nothing := [ev.StepScheduled(step_index=0, request_ids=(), num_computed_tokens=(), num_scheduled_tokens=())])
    assert steps_of_nothing
    assert counter.take() == {}
