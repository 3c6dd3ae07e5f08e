"""Part digests: each sees every change in its own slice of the large tables,
none in another's, and every part sees a change in the small ones.

A live engine host takes one part per digest record, so a table entry that no part
covers, or a part that misses its own entries, would let a replay diverge
unnoticed. The state is `rich` (64 device blocks, 32 tier slots), cut into 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.adapters.engine_host import EngineHost
from kvledger.adapters.log_files import open_log
from kvledger.engine import digest as digest_module
from kvledger.engine import reducer
from kvledger.engine.digest import digest, matches, part_digest, parts_for
from kvledger.engine.replay import replay
from kvledger.engine.state import State
from kvledger.events import types as ev
from tests.engine.test_invariants import rich

PARTS = 4
ROOT = Path(__file__).resolve().parents[2]


def owner(n: int, index: int, parts: int = PARTS) -> int:
    """The part whose slice of an `n`-row table holds row `index`."""
    return next(p for p in range(parts) if n * p // parts <= index < n * (p + 1) // parts)


def changed_parts(state: State, mutate: Callable[[object], None]) -> set[int]:
    before = [part_digest(state, p, PARTS) for p in range(PARTS)]
    other = state.clone()
    mutate(other.core)
    return {p for p in range(PARTS) if part_digest(other, p, PARTS) != before[p]}


BLOCK_COLUMNS = ("block_refs", "block_pins", "block_generation", "block_group")


@pytest.mark.parametrize("column", BLOCK_COLUMNS)
def test_each_block_entry_changes_its_own_part_only(column: str) -> None:
    state = rich().state
    n = state.core.config.num_device_blocks
    for block in range(n):
        def bump(core, block=block):
            getattr(core, column)[block] += 1

        assert changed_parts(state, bump) == {owner(n, block)}, (column, block)


def test_each_block_key_and_lazy_key_changes_its_own_part_only() -> None:
    state = rich().state
    n = state.core.config.num_device_blocks
    for block in range(n):
        def rekey(core, block=block):
            core.block_key[block] = b"\x07" * 17

        def lazy(core, block=block):
            core.lazy_keys[block] = b"\x07" * 17

        assert changed_parts(state, rekey) == {owner(n, block)}
        # A new lazy key also changes the count every part holds.
        assert changed_parts(state, lazy) == set(range(PARTS))


def test_each_slot_entry_changes_its_own_part_only() -> None:
    """Slots past `next_fresh_slot` were never used (free, no key): the slices
    cut the used ones, and the count itself is in every part."""
    state = rich().state
    m = state.core.next_fresh_slot
    assert m >= PARTS
    for slot in range(m):
        def restate(core, slot=slot):
            core.slot_state[slot] = (core.slot_state[slot] + 1) % 3

        def rekey(core, slot=slot):
            core.slot_key[slot] = b"\x09" * 17

        assert changed_parts(state, restate) == {owner(m, slot)}
        assert changed_parts(state, rekey) == {owner(m, slot)}


def test_an_index_entry_pointing_elsewhere_changes_the_part_of_its_slot() -> None:
    state = rich().state
    core = state.core
    m = core.next_fresh_slot
    indexed = sorted(core.slot_of_key.items(), key=lambda item: item[1])
    assert len(indexed) >= 2
    (key_a, slot_a), (_, slot_b) = indexed[0], indexed[-1]

    def repoint(core):
        core.slot_of_key[key_a] = slot_b  # same size; slot_a no longer indexed

    assert changed_parts(state, repoint) == {owner(m, slot_a)}


def test_free_stack_policy_and_requests_change_their_own_parts() -> None:
    state = rich().state
    core = state.core
    stack = len(core.free_slots)
    assert stack >= 1
    for index in range(stack):
        def reslot(c, index=index):
            c.free_slots[index] += 100

        assert changed_parts(state, reslot) == {owner(stack, index)}
    rids = sorted(core.requests)
    for index, rid in enumerate(rids):
        def recompute(c, rid=rid):
            c.requests[rid].changed()  # as the reducer does before it changes a request
            c.requests[rid].num_computed_tokens += 1

        assert changed_parts(state, recompute) == {owner(len(rids), index)}
    keys = list(core.policy._order)
    assert len(keys) == 2

    def reorder(c):
        c.policy._order = dict.fromkeys(reversed(keys))

    assert changed_parts(state, reorder) == {owner(2, 0), owner(2, 1)}


@pytest.mark.parametrize("mutate", [
    lambda c: setattr(c, "step_index", c.step_index + 1),
    lambda c: setattr(c, "next_fresh_slot", c.next_fresh_slot + 1),
    lambda c: setattr(c.jobs[2], "pending_workers", 3),
    lambda c: setattr(c.stats, "evictions", c.stats.evictions + 1),
    lambda c: c.slot_loads.update({0: 9}),
    lambda c: c.block_writer.update({40: 2}),
    lambda c: c.free_slots.append(31),
    lambda c: c.slot_of_key.pop(next(iter(c.slot_of_key))),
], ids=["step", "fresh", "job", "stats", "slot_loads", "writer", "free_count", "index_size"])
def test_small_tables_are_in_every_part(mutate) -> None:
    assert changed_parts(rich().state, mutate) == set(range(PARTS))


def test_record_form_and_matching() -> None:
    state = rich().state
    text = part_digest(state, 1, PARTS)
    assert text.startswith("1/4:") and matches(state, text)
    assert matches(state, digest(state))  # full digests (schema 1 logs) still match
    assert not matches(state, "1/4:" + "0" * 32)
    with pytest.raises(ValueError, match="malformed digest"):
        matches(state, "4/4:00")
    with pytest.raises(ValueError, match="part 4 of 4"):
        part_digest(state, 4, PARTS)


def test_parts_scale_with_the_largest_table() -> None:
    assert parts_for(rich().config) == 1
    assert parts_for(rich(num_tier_slots=digest_module.PART_ROWS * 3 + 1).config) == 4


def _record(path: Path, parts_rows: int, monkeypatch: pytest.MonkeyPatch) -> list[ev.Event]:
    engine = rich()
    monkeypatch.setattr(digest_module, "PART_ROWS", parts_rows)
    with EngineHost(engine.config, log_path=path, fmt="jsonl", digest_interval=1) as host:
        for event in engine.log:
            host.apply(event)
    return engine.log


def test_a_recorded_log_with_part_digests_replays_clean(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "parts.jsonl"
    _record(path, 16, monkeypatch)  # 64 blocks / 16 rows: 4 parts
    header, records = open_log(path)
    records = list(records)
    recorded = [r.digest for r in records if hasattr(r, "digest")]
    assert {d.split(":")[0] for d in recorded[:-1]} == {f"{p}/4" for p in range(4)}
    assert ":" not in recorded[-1] and hasattr(records[-1], "digest")  # the end mark: a full digest
    result = replay(header.config, records, check_invariants=True)
    assert result.ok and result.digests_checked == len(recorded) and result.ends_with_full_digest


def test_replay_under_a_changed_engine_names_the_diverged_part(tmp_path: Path, monkeypatch) -> None:
    """An engine that differs in one block's generation (as a changed reducer
    would): the first digest of the part holding that block reports it."""
    path = tmp_path / "parts.jsonl"
    _record(path, 16, monkeypatch)
    header, records = open_log(path)
    original = reducer._HANDLERS[ev.BlocksAllocated]

    def drifted(core, event, out):
        original(core, event, out)
        core.block_generation[40] += 1  # block 40: part 2 of 4 (blocks 32-47)

    monkeypatch.setitem(reducer._HANDLERS, ev.BlocksAllocated, drifted)
    result = replay(header.config, list(records))
    assert result.first_problem is not None and result.first_problem.kind == "digest"
    assert "part 2/4 of the state differs" in result.first_problem.detail


@pytest.mark.slow
def test_part_digests_are_independent_of_hash_seed() -> None:
    code = ("from tests.engine.test_invariants import rich\n"
            "from kvledger.engine.digest import part_digest\n"
            "s = rich().state\n"
            "print([part_digest(s, p, 3) for p in range(3)])\n")
    outputs = set()
    for seed in ("0", "4242"):
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        outputs.add(done.stdout)
    assert len(outputs) == 1


@pytest.mark.parametrize("scenario, seed", [("full", 1), ("hybrid", 2), ("mamba", 3)])
def test_a_requests_digest_text_is_its_canonical_repr_after_every_event(scenario: str, seed: int) -> None:
    """The digest's text of a request keeps its hashes' part between digests; every change to
    the hashes (appends, rewinds, rekeying resets, snapshots' restores) must drop it. After each
    event of seeded runs with resets and failures, each request's text equals `repr(canonical())`,
    and the digests of a snapshot's restore and of a clone equal the state's."""
    import random

    from kvledger.adapters.cli.log_commands import SCENARIOS
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from kvledger.engine.snapshot import capture, restore
    from kvledger.events.config import EngineConfig

    config = EngineConfig.from_dict(dict(SCENARIOS[scenario]))
    checked = 0

    def observe(seq, event, state, effects) -> None:
        nonlocal checked
        for request in state.core.requests.values():
            assert request.canonical_repr() == repr(request.canonical()), (seq, event)
            checked += 1

    sim = Simulator(config, observe=observe)
    run_random(sim, random.Random(seed), steps=80, arrivals=0.9, max_tokens=20, fail_rate=0.1, reset_rate=0.05)
    assert checked > 1000
    assert digest(restore(config, capture(sim.state))) == digest(sim.state) == digest(sim.state.clone())


_TEXT_LEAVES = st.one_of(st.binary(max_size=24), st.integers(), st.text(max_size=4), st.none(), st.booleans())


@given(st.recursive(_TEXT_LEAVES, lambda inner: st.lists(inner, max_size=5).map(tuple), max_leaves=40))
def test_the_policys_text_is_its_repr(value: object) -> None:
    """A digest hashes the policy's order through `text_of`, which keeps each key's repr:
    the text must be `repr`'s, whatever the value and whatever was kept before."""
    from kvledger.engine.digest import text_of

    assert text_of(value) == repr(value)
    assert text_of(value) == repr(value)  # again, from what it kept


def test_the_kept_key_texts_follow_the_tier_not_every_key_it_ever_held() -> None:
    """Keys that left the policy's order are forgotten once the kept texts pass four times
    what the order can hold (at least KEY_TEXTS_MIN): on a small tier, every key that ever
    passed through it had been kept, up to KEY_TEXTS_MAX, growing a scheduler for hours."""
    import random

    from kvledger.adapters.testing.simulator import Simulator, run_random
    from tests.adapters.test_misses import SMALL

    sim = Simulator(SMALL)
    rng = random.Random(0)
    digest_module._key_texts.clear()
    passed: set[bytes] = set()
    largest = 0
    for i in range(3_000):
        run_random(sim, rng, steps=5, arrivals=1.0, docs=10_000, max_prompt_blocks=4)
        passed.update(sim.state.core.slot_of_key)
        part_digest(sim.state, i % PARTS, PARTS)
        largest = max(largest, len(digest_module._key_texts))
    assert len(passed) > 2 * digest_module.KEY_TEXTS_MIN  # without the bound, all of them
    assert largest <= digest_module.KEY_TEXTS_MIN + 2 * SMALL.num_tier_slots
