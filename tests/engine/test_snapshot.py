"""Snapshots: the state restored exactly, and a run resumed from one decides
every later event as the uninterrupted run did."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine.digest import digest
from kvledger.engine.key_order import KeyOrder
from kvledger.engine.reducer import reduce
from kvledger.engine.snapshot import SnapshotError, capture, restore
from kvledger.engine.state import initial_state
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig
from tests.engine.builders import SIMULATED_CONFIGS

IDS = ["full", "swa", "swa-pin-arc", "mamba", "swa-mixed", "swa-lazy", "full-fs", "swa-fs-arc", "swa-threshold", "swa-fs-budget"]


def _trace(config: EngineConfig, seed: int, steps: int = 80) -> list[ev.Event]:
    log: list[ev.Event] = []
    sim = Simulator(config, record=log.append)
    run_random(sim, random.Random(seed), steps=steps, arrivals=0.9, max_tokens=30, completion_rate=0.3,
               fail_rate=0.1, reset_rate=0.02, damage_rate=0.05 if config.lower_tiers else 0.0,
               foreign_rate=0.05 if config.lower_tiers else 0.0)
    return log


def _through_bytes(data: list) -> Any:
    """As a log carries it: msgpack, read back with tuples for arrays."""
    return msgpack.unpackb(msgpack.packb(data, use_bin_type=True), raw=False, use_list=False,
                           strict_map_key=False)


def same(a: object, b: object, where: str = "state") -> None:
    """Equal values of the same types all the way down, dicts in the same order."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, KeyOrder):  # its runs are laid out by its history: the same keys in the same order
        assert list(a) == list(b), f"{where}: keys or their order differ"
        return
    # A class compiled by mypyc lists its attributes in __mypyc_attrs__, not __slots__.
    slots = getattr(type(a), "__slots__", None) or getattr(type(a), "__mypyc_attrs__", None)
    if slots is not None and not isinstance(a, (list, tuple, dict, set, bytes, str, int)):
        for name in slots:
            same(getattr(a, name), getattr(b, name), f"{where}.{name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys or their order differ"
        for key in a:
            same(a[key], b[key], f"{where}[{key!r}]")  # type: ignore[index]
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b)):  # type: ignore[call-overload]
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.fast
@pytest.mark.parametrize("config", SIMULATED_CONFIGS, ids=IDS)
def test_a_restored_state_is_the_same_state(config: EngineConfig) -> None:
    events = _trace(config, seed=3)
    state = initial_state(config)
    for i, event in enumerate(events):
        state, _ = reduce(state, event)
        if i % 17 == 0 or i == len(events) - 1:
            same(state.core, restore(config, _through_bytes(capture(state))).core, f"after event {i}: core")
    assert state.core.jobs or state.core.requests or state.core.stats.stores


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(config=st.sampled_from(SIMULATED_CONFIGS), seed=st.integers(0, 2**16), cut=st.floats(0, 1))
def test_a_run_resumed_from_a_snapshot_is_the_uninterrupted_run(config: EngineConfig, seed: int,
                                                                  cut: float) -> None:
    events = _trace(config, seed)
    at = int(cut * len(events))
    whole = initial_state(config)
    expected: list[tuple[tuple, str]] = []
    for i, event in enumerate(events):
        whole, effects = reduce(whole, event)
        if i >= at:
            expected.append((effects, digest(whole)))
        if i == at - 1:
            snapshot = _through_bytes(capture(whole))
    resumed = restore(config, snapshot) if at else initial_state(config)
    for i, event in enumerate(events[at:]):
        resumed, effects = reduce(resumed, event)
        assert (effects, digest(resumed)) == expected[i], f"event {at + i} decided differently"


@pytest.mark.fast
def test_snapshots_of_another_version_or_config_are_refused() -> None:
    full, arc = SIMULATED_CONFIGS[0], SIMULATED_CONFIGS[3]
    data = list(capture(initial_state(full)))
    with pytest.raises(SnapshotError, match="version 99"):
        restore(full, [99, *data[1:]])
    with pytest.raises(SnapshotError, match="device block column"):
        restore(arc, data)  # 24 device blocks recorded, 32 configured
    with pytest.raises(SnapshotError, match="malformed"):
        restore(full, [data[0], *data[2:]])


@pytest.mark.fast
def test_a_new_field_of_the_state_is_not_forgotten() -> None:
    """A field added to the state must be added to the snapshot too (or here, as derived
    from the config): then this list changes with it."""
    from kvledger.engine.state import Core, Job, LowerTier, OfferTracker, RequestState, Stats

    def fields(cls: type) -> tuple[str, ...]:  # a class compiled by mypyc has __mypyc_attrs__ instead
        return getattr(cls, "__slots__", None) or cls.__mypyc_attrs__  # type: ignore[attr-defined]

    assert sorted(fields(Core)) == sorted((
        "config", "groups", "alignment", "step_index", "epoch", "next_job_id",
        "block_sizes", "key_rules", "store_rules", "free_rules",  # derived from the config
        "block_refs", "block_pins", "block_generation", "block_group", "block_key",
        "block_readers", "block_writer", "lazy_keys",
        "slot_of_key", "slot_key", "slot_state", "slot_loads", "free_slots", "next_fresh_slot", "policy",
        "offers", "restore_costs", "pressure", "lower", "spill_reads", "requests", "jobs", "stats"))
    # RequestState: next_free_tokens (from free_floor), hashes_repr and canonical_text (caches of the
    # digest's text) are not kept
    assert len(fields(RequestState)) == 18 and len(fields(Job)) == 15
    assert fields(LowerTier) == ("name", "capacity", "held", "writing", "reading", "counts")
    assert fields(OfferTracker) == ("counts", "last")
    assert len(fields(Stats)) == 15
