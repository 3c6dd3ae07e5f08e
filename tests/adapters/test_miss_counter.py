"""The live miss counter counts what `kvledger explain` counts over the same
events, fed as the connector feeds it (a step's events, the effects the
engine answered them with, and where each event's end), with a bounded
memory of keys; and stops, rather than breaks serving, when its fold raises."""

from __future__ import annotations

import random
import threading

import attrs
import pytest

from kvledger.adapters.log_tools.misses import MissLedger, totals
from kvledger.adapters.miss_counter import MAX_KEYS, MIN_KEYS, MissCounter, default_keys
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine.reducer import reduce_step
from kvledger.engine.state import initial_state
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


class Served:
    """The engine as the connector runs it: a step's events in one `reduce_step`,
    the counter fed what it answered."""

    def __init__(self, config, counter: MissCounter) -> None:
        self.state = initial_state(config)
        self.counter = counter

    def apply(self, events: list[ev.Event]) -> None:
        ends: list[int] = []
        self.state, effects = reduce_step(self.state, events, ends=ends)
        self.counter.feed(events, effects, ends)


def _counted(config, counter: MissCounter, steps: list[list[ev.Event]]) -> dict[str, int]:
    served = Served(config, counter)
    counts: dict[str, int] = {}
    for events in steps:
        served.apply(events)
        for cause, tokens in counter.take().items():  # taken as vLLM does, every step
            counts[cause] = counts.get(cause, 0) + tokens
    counter.close()
    for cause, tokens in counter.take().items():
        counts[cause] = counts.get(cause, 0) + tokens
    return counts


@pytest.mark.parametrize("config", [*SIMULATED_CONFIGS, SMALL], ids=lambda c: f"{len(c.groups)}g-{c.num_tier_slots}")
def test_it_counts_what_explain_counts(config) -> None:
    steps, expected = _steps(config, seed=3)
    counter = MissCounter(config)
    assert _counted(config, counter, steps) == expected
    assert counter.stopped is None
    assert expected  # the workload misses, for more than one reason
    assert len(expected) > 2


@pytest.mark.fast
def test_a_small_memory_forgets_keys_but_counts_every_missed_token() -> None:
    steps, expected = _steps(SMALL, seed=5)
    counter = MissCounter(SMALL, max_keys=16)
    served = Served(SMALL, counter)
    largest = 0
    counts: dict[str, int] = {}
    for events in steps:
        served.apply(events)
        largest = max(largest, len(counter._ledger.keys))
        for cause, tokens in counter.take().items():
            counts[cause] = counts.get(cause, 0) + tokens
    assert largest <= 16  # after every event
    assert sum(counts.values()) == sum(expected.values())  # some causes may differ: their facts were forgotten
    assert counts["first_seen"] > expected["first_seen"]  # what it forgot, it takes for new


@pytest.mark.fast
def test_the_memory_bounds_the_ends_of_requests_too_where_they_name_few_keys() -> None:
    steps, _ = _steps(SMALL, seed=3)  # 35 keys named, 67 requests ended
    counter = MissCounter(SMALL, max_keys=40)
    served = Served(SMALL, counter)
    for events in steps:
        served.apply(events)
        assert len(counter._ledger.keys) <= 40 and len(counter._ledger._ended) <= 40
    assert len(counter._ledger.keys) == 35 and len(counter._ledger._ended) > 20


@pytest.mark.fast
def test_its_memory_follows_what_the_tiers_hold() -> None:
    """By default it remembers four times the blocks every tier holds, host memory and
    each tier below, within MIN_KEYS and MAX_KEYS: a small fleet replica's counter once
    grew its scheduler for hours towards a fixed 262,144 keys."""
    assert MissCounter(SMALL).max_keys == MIN_KEYS  # a few slots: the floor
    tiers = attrs.evolve(SMALL, num_tier_slots=8_192, lower_tiers=({"name": "1:fs", "num_blocks": 4_096},
                                                                   {"name": "2:valkey", "num_blocks": 20_000}))
    assert default_keys(tiers) == 4 * (8_192 + 4_096 + 20_000)
    assert MissCounter(tiers).max_keys == 4 * (8_192 + 4_096 + 20_000)
    assert default_keys(attrs.evolve(SMALL, num_tier_slots=1 << 20)) == MAX_KEYS
    assert MissCounter(tiers, max_keys=100).max_keys == 100  # `miss_memory_keys` set


class _Observed:
    """The counter's ledger with `observe` replaced (a compiled ledger's methods cannot be)."""

    def __init__(self, ledger: object, observe: object) -> None:
        self._ledger = ledger
        self.observe = observe

    def __getattr__(self, name: str) -> object:
        return getattr(self._ledger, name)


@pytest.mark.fast
def test_a_fold_that_raises_stops_the_counter() -> None:
    counter = MissCounter(SMALL)
    counter.feed([ev.StepScheduled(step_index=0, request_ids=(), num_computed_tokens=(), num_scheduled_tokens=())],
                 (object(),), [1])  # type: ignore[arg-type]  # no effect the ledger's table names
    # The compiled ledger refuses it by its type (TypeError), the source by its table (KeyError).
    assert counter.stopped is not None and counter.stopped.startswith(("KeyError", "TypeError"))
    steps, _ = _steps(SMALL, seed=1)
    Served(SMALL, counter).apply(steps[0])  # ignored from now on
    assert counter.take() == {} and counter._ledger is None


def test_in_the_background_it_counts_the_same_off_the_feeding_thread() -> None:
    config = SIMULATED_CONFIGS[0]
    steps, expected = _steps(config, seed=3)
    counter = MissCounter(config, background=True)
    folded_on: set[str] = set()
    observe = counter._ledger.observe

    def observed(*args) -> None:
        folded_on.add(threading.current_thread().name)
        observe(*args)

    counter._ledger = _Observed(counter._ledger, observed)  # type: ignore[assignment]
    served = Served(config, counter)
    for events in steps:
        served.apply(events)
    assert counter.settle()
    counts = counter.take()
    assert counts == expected and counter.stopped is None
    assert folded_on == {"kvledger-misses"}
    assert counter.cpu_seconds > 0
    counter.close()
    assert not any(t.name == "kvledger-misses" for t in threading.enumerate())


@pytest.mark.fast
def test_closing_folds_what_is_queued_and_ends_the_thread() -> None:
    steps, expected = _steps(SMALL, seed=3)
    counter = MissCounter(SMALL, background=True)
    assert _counted(SMALL, counter, steps) == expected  # the last counts taken after close
    assert counter._thread is None and not any(t.name == "kvledger-misses" for t in threading.enumerate())
    counter.close()  # twice: nothing left to do


@pytest.mark.fast
def test_a_fold_that_falls_too_far_behind_stops_the_counter_and_drops_its_queue() -> None:
    steps, _ = _steps(SMALL, seed=3)
    counter = MissCounter(SMALL, background=True, max_queued=50)
    gate = threading.Event()
    observe = counter._ledger.observe
    counter._ledger = _Observed(counter._ledger, lambda *args: (gate.wait(10), observe(*args)))  # type: ignore[assignment]
    served = Served(SMALL, counter)
    for events in steps[:40]:  # the fold waits on the gate: the queue grows past 50 events
        served.apply(events)
    assert counter.stopped is not None and "fell" in counter.stopped and "behind the engine" in counter.stopped
    assert not counter._queue and counter._ledger is None
    gate.set()
    served.apply(steps[40])  # serving goes on; nothing more is queued
    assert not counter._queue
    counter.close()


@pytest.mark.fast
def test_counts_not_yet_taken_keep_the_connector_busy_until_taken() -> None:
    steps, expected = _steps(SMALL, seed=3)
    counter = MissCounter(SMALL, background=True)
    served = Served(SMALL, counter)
    assert not counter.unpublished()
    for events in steps:
        served.apply(events)
    assert counter.unpublished()  # its admissions queued or counted, not taken
    assert counter.settle() and counter.unpublished()  # folded: counted, not taken
    assert counter.take() == expected
    assert not counter.unpublished()
    idle = [ev.StepScheduled(step_index=10_000, request_ids=(), num_computed_tokens=(), num_scheduled_tokens=())]
    served.apply(idle)  # an idle step's batch can count nothing: vLLM may stop stepping
    assert not counter.unpublished()
    counter.close()
