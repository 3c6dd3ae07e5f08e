"""The transition tables, cell by cell, against the reducer; that the reducer
reads every row; and the rendered doc."""

from __future__ import annotations

import importlib
import os
import random
from pathlib import Path

import pytest

from kvledger.adapters.log_files import open_log
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine import checks, lower, queries, reducer, transitions
from kvledger.engine import effects as fx
from kvledger.engine.invariants import check
from kvledger.engine.replay import replay
from kvledger.engine.state import JobStage as J
from kvledger.engine.state import RequestStatus as R
from kvledger.engine.state import SlotState as S
from kvledger.engine.state import TierKeyState as K
from kvledger.engine.transitions import (
    JOB_MOVES,
    REQUEST_MOVES,
    SLOT_MOVES,
    TIER_KEY_MOVES,
    job_move,
    request_move,
    slot_move,
    tier_key_move,
)
from kvledger.events import types as ev
from tests.engine.builders import FULL, Engine, admits, chain, full_only_config, key, make_config, only
from tests.support.transitions_doc import render

A = chain(5, "a")
STATUSES: list[R | None] = [None, *R]
LOAD_JOB = 2  # the donor's store is job 1


def reach(status: R | None) -> Engine:
    """Prefix "a" in the tier, and request "r" (129 tokens of it) in `status`."""
    e = Engine()
    e.run_and_store("d", 128, (1, 2, 3, 4), (5, 6, 7, 8))
    e.finish("d")
    if status is None:
        return e
    e.add("r", 129, A[:4])
    if status is R.WAITING:
        return e
    if status in (R.LOADING, R.ABORTING):
        e.alloc("r", (9, 10, 11, 12, 13), (0, 0, 14, 15, 16), ext=128)
        if status is R.ABORTING:
            e.abort("r")
        return e
    e.alloc("r", (9, 10, 11, 12, 13), (14, 15, 16, 17, 18))
    if status is R.PREEMPTED:
        e.preempt("r")
    return e


def event_for(kind: str, e: Engine) -> ev.Event:
    """A well-formed event of `kind` for request "r", legal wherever the table allows it."""
    request = e.core.requests.get("r")
    running = request is not None and request.status is R.RUNNING
    if kind == "request_added":
        return ev.RequestAdded(request_id="r", num_prompt_tokens=129, block_hashes=A[:4])
    if kind == "block_hashes_appended":
        return ev.BlockHashesAppended(request_id="r", num_tokens=160, block_hashes=A[4:])
    if kind == "block_hashes_rewound":
        return ev.BlockHashesRewound(request_id="r", num_hashes=max(0, len(request.hashes) - 1) if request else 0)
    if kind == "blocks_touched":
        return ev.BlocksTouched(request_id="r", block_ids=((1,), (5,)))
    if kind == "blocks_allocated":
        table = ((20,), (21,)) if running else ((9, 10, 11, 12, 13), (14, 15, 16, 17, 18))
        return ev.BlocksAllocated(request_id="r", block_ids=table)
    if kind == "blocks_allocated+load":
        return ev.BlocksAllocated(request_id="r", block_ids=((9, 10, 11, 12, 13), (0, 0, 14, 15, 16)),
                                  num_external_tokens=128)
    if kind == "blocks_freed":
        return ev.BlocksFreed(request_id="r", block_ids=((), (14,)))
    if kind == "step_scheduled":
        return e.next_step_event(("r", 0, 129))
    if kind == "request_preempted":
        return ev.RequestPreempted(request_id="r")
    if kind == "request_resumed":
        return ev.RequestResumed(request_id="r")
    if kind == "request_finished":
        table = tuple(tuple(t) for t in request.table) if request else ((), ())
        return ev.RequestFinished(request_id="r", block_ids=table)
    if kind == "request_aborted":
        return ev.RequestAborted(request_id="r")
    if kind == "load_ended":
        return ev.LoadCompleted(job_id=LOAD_JOB)
    if kind == "load_failed+recompute":
        return ev.LoadFailed(job_id=LOAD_JOB, block_ids=(9,), keys=())
    raise AssertionError(f"no event builder for {kind!r}: teach test_transitions about it")


def status_of(e: Engine) -> R | None:
    request = e.core.requests.get("r")
    return request.status if request else None


def name(pair: tuple) -> str:
    status, kind = pair
    return f"{status.value if status else 'new'}-{kind}"


@pytest.mark.parametrize("pair", list(REQUEST_MOVES), ids=name)
def test_every_legal_request_move(pair):
    status, kind = pair
    e = reach(status)
    assert status_of(e) is status
    e.apply(event_for(kind, e))  # strict: a legal move must not raise
    assert status_of(e) is REQUEST_MOVES[pair]
    check(e.state)


JOB_KINDS = {"load_ended", "load_failed+recompute"}  # need a load job: see below
KINDS = list(dict.fromkeys(kind for _, kind in REQUEST_MOVES))
ILLEGAL = [(s, k) for s in STATUSES for k in KINDS if (s, k) not in REQUEST_MOVES and k not in JOB_KINDS]


@pytest.mark.parametrize("pair", ILLEGAL, ids=name)
def test_every_illegal_request_move_is_a_violation(pair):
    status, kind = pair
    e = reach(status)
    assert e.reject(event_for(kind, e)) == "illegal_request_event"
    assert status_of(e) is status


@pytest.mark.parametrize("status", [None, R.WAITING, R.RUNNING, R.PREEMPTED], ids=str)
def test_a_load_outcome_without_a_load_is_an_unknown_job(status):
    e = reach(status)
    assert e.reject(ev.LoadCompleted(job_id=LOAD_JOB)) == "unknown_job"
    assert e.reject(ev.LoadFailed(job_id=LOAD_JOB, block_ids=(9,), keys=())) == "unknown_job"


def test_a_failed_load_while_aborting_also_forgets_the_request():
    e = reach(R.ABORTING)
    e.apply(event_for("load_failed+recompute", e))
    assert status_of(e) is None


@pytest.mark.parametrize("failed_block, move, table", [
    (10, "load_ended", [[9, 10, 11, 12, 13]]),  # recomputed from the second block: the table stays
    # At position 0 no token is valid: vLLM frees the blocks and admits the request again.
    (9, "load_failed+recompute", [[]]),
], ids=["past-the-first-block", "at-the-first-block"])
def test_a_failed_load_with_one_group_ends_as_vllm_recomputes_it(failed_block, move, table):
    e = Engine(full_only_config())
    e.run_and_store("d", 128, (1, 2, 3, 4))
    e.finish("d")
    e.add("r", 129, A[:4])
    e.alloc("r", (9, 10, 11, 12, 13), ext=128)
    e.apply(ev.LoadFailed(job_id=LOAD_JOB, block_ids=(failed_block,), keys=()))
    assert status_of(e) is REQUEST_MOVES[(R.LOADING, move)]
    assert e.state.core.requests["r"].table == table


# The reducer reads every row: the legality check, the move and the step's
# status test each look the row up, and these recorders note which rows.


class _NotedTuple(tuple):
    """Statuses a kind meets; notes each (status, kind) a membership test finds."""

    def __contains__(self, status):
        found = tuple.__contains__(self, status)
        if found:
            self.noted.add((status, self.kind))
        return found


class _NotedDict(dict):
    """{status before: status after} of a kind; notes each row looked up."""

    def __getitem__(self, status):
        self.noted.add((status, self.kind))
        return dict.__getitem__(self, status)


def _noting(cls, items, kind: str, noted: set):
    table = cls(items)
    table.kind, table.noted = kind, noted
    return table


@pytest.fixture
def consulted(monkeypatch) -> set:
    """The rows of REQUEST_MOVES the reducer reads from here on, as (status, kind)."""
    noted: set = set()
    monkeypatch.setattr(checks, "LEGAL_FROM", {
        kind: _noting(_NotedTuple, statuses, kind, noted) for kind, statuses in checks.LEGAL_FROM.items()})
    monkeypatch.setattr(reducer, "_NEXT", {
        kind: _noting(_NotedDict, moves, kind, noted) for kind, moves in reducer._NEXT.items()})
    monkeypatch.setattr(reducer, "_STAYS", {
        kind: _noting(_NotedTuple, statuses, kind, noted) for kind, statuses in reducer._STAYS.items()})
    monkeypatch.setattr(reducer, "_STEPPABLE", _noting(_NotedTuple, reducer._STEPPABLE, "step_scheduled", noted))
    return noted


@pytest.mark.parametrize("pair", list(REQUEST_MOVES), ids=name)
def test_the_reducer_reads_every_row(pair, consulted):
    status, kind = pair
    e = reach(status)
    if kind != "step_scheduled":  # a step reads its row through `step_limit`, set as the request began running
        consulted.clear()
    e.apply(event_for(kind, e))
    assert pair in consulted, sorted(map(name, consulted))
    assert consulted <= set(REQUEST_MOVES), "the reducer read a row the table does not have"


# Rows that only events made by hand reach here: the simulator appends hashes
# only to running requests. The connector's planner (`engine/planner.py`) also
# appends an admission's new hashes just before admitting it, waiting or
# preempted; the loading row is legal, but neither produces it.
UNSIMULATED = {(R.WAITING, "block_hashes_appended"), (R.LOADING, "block_hashes_appended"),
               (R.PREEMPTED, "block_hashes_appended"),
               # The simulator has no streaming sessions; tests/engine/test_rewind.py drives these.
               (R.WAITING, "block_hashes_rewound"), (R.RUNNING, "block_hashes_rewound"),
               (R.PREEMPTED, "block_hashes_rewound")}
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_replays_and_simulated_runs_reach_every_other_row(consulted):
    golden = [path for path in sorted(GOLDEN.glob("*.jsonl")) if path.with_suffix(".expected.json").exists()]
    for path in golden + sorted((GOLDEN / "vllm").glob("*.jsonl.gz")):
        header, records = open_log(path)
        assert replay(header.config, records).first_problem is None, path.name
    for store_jobs in ("request", "step"):
        for config in (full_only_config(num_device_blocks=24, num_tier_slots=12, store_jobs=store_jobs),
                       make_config(world_size=2, store_jobs=store_jobs)):
            for seed in range(3):
                run_random(Simulator(config), random.Random(seed), steps=200, arrivals=0.9, max_tokens=30,
                           completion_rate=0.3, fail_rate=0.2, abort_rate=0.1)
    assert consulted <= set(REQUEST_MOVES)
    assert sorted(map(name, set(REQUEST_MOVES) - UNSIMULATED - consulted)) == []
    assert not UNSIMULATED & consulted, "a run reaches a row listed as unsimulated: take it off the list"


def test_request_move_lookup():
    assert request_move(R.RUNNING, "request_finished") == (True, None)
    assert request_move(R.WAITING, "request_finished") == (False, R.WAITING)
    assert request_move(None, "request_aborted") == (False, None)


# Slots


def slot_scenarios():
    """For each slot action, a run that performs it once on one slot: (engine, slot, before, act)."""
    k0 = key(A[0], 0)

    def stored_and_loading() -> Engine:
        e = Engine(full_only_config(num_tier_slots=4))
        e.run_and_store("d", 128, (1, 2, 3, 4))
        e.finish("d")
        e.add("l", 33, A[:1])
        return e

    def running() -> Engine:
        e = Engine(full_only_config(num_tier_slots=4))
        e.add("d", 128, A[:4])
        e.alloc("d", (1, 2, 3, 4))
        return e

    scenarios = {}

    e = running()
    scenarios["store_planned"] = (e, 0, lambda e: e.step(("d", 0, 128)))
    e = running()
    e.step(("d", 0, 128))
    scenarios["store_succeeded"] = (e, 0, lambda e: e.store_done(1))
    e = running()
    e.step(("d", 0, 128))
    scenarios["store_failed"] = (e, 0, lambda e: e.apply(ev.StoreFailed(job_id=1, keys=(k0,))))
    e = running()
    e.step(("d", 0, 128))
    e.apply(ev.CacheReset(epoch=1))
    scenarios["store_ended_stale"] = (e, 0, lambda e: e.store_done(1))
    e = stored_and_loading()
    scenarios["load_planned"] = (e, 0, lambda e: e.alloc("l", (5, 6), ext=32))
    e = stored_and_loading()
    e.alloc("l", (5, 6), ext=32)
    scenarios["load_ended"] = (e, 0, lambda e: e.load_done(2))
    e = stored_and_loading()
    scenarios["evicted"] = (e, 0, lambda e: e.apply(ev.CacheReset(epoch=1)))  # see also below
    e = stored_and_loading()
    e.alloc("l", (5, 6), ext=32)
    e.apply(ev.CacheReset(epoch=1))  # drops the key from the index; the load still reads it
    scenarios["released_orphan"] = (e, 0, lambda e: e.load_done(2))
    return scenarios


SCENARIOS = slot_scenarios()


def test_every_slot_action_has_a_scenario():
    assert {action for _, action in SLOT_MOVES} == set(SCENARIOS)


@pytest.mark.parametrize("pair", list(SLOT_MOVES), ids=lambda p: p[1])
def test_every_slot_move(pair):
    state, action = pair
    e, slot, act = slot_scenarios()[action]
    assert e.core.slot_state[slot] == state
    loads = e.core.slot_loads.get(slot, 0)
    act(e)
    assert e.core.slot_state[slot] == slot_move(state, action) == SLOT_MOVES[pair]
    delta = {"load_planned": 1, "load_ended": -1, "released_orphan": -1}.get(action, 0)
    assert e.core.slot_loads.get(slot, 0) == loads + delta
    check(e.state)


def test_a_slot_evicted_for_room_is_freed_and_taken_in_the_same_event():
    e, slot, _ = slot_scenarios()["evicted"]
    old = e.core.slot_key[slot]
    e.add("b", 32, tag="b")
    e.alloc("b", (7,))
    (evict, store) = e.step(("b", 0, 32))
    assert evict.keys == (old,) and store.target_slot_ids == ((slot,),)
    assert old not in e.core.slot_of_key
    assert e.core.slot_state[slot] == slot_move(slot_move(S.STORED, "evicted"), "store_planned")
    check(e.state)


def test_an_orphaned_slot_stays_stored_until_its_last_load_ends():
    e, slot, _ = slot_scenarios()["released_orphan"]
    assert e.core.slot_key[slot] not in e.core.slot_of_key
    assert e.core.slot_state[slot] == S.STORED and e.core.slot_loads[slot] == 1
    check(e.state)


# Keys in a lower tier


def _tiered(slots: int = 8, disk: int = 16) -> Engine:
    return Engine(make_config(groups=(FULL,), num_tier_slots=slots,
                              lower_tiers=({"name": "1:fs", "num_blocks": disk},)))


def _storing(e: Engine) -> fx.StartStore:
    e.add("a", 64)
    e.alloc("a", (1, 2))
    (store,) = e.step(("a", 0, 64))
    return store


def _writing() -> tuple[Engine, fx.StartSpill]:
    e = _tiered()
    (spill,) = only(e.store_done(_storing(e).job_id), fx.StartSpill)
    return e, spill


def _held(e: Engine, rid: str = "a", blocks=(1, 2, 3), tag: str = "a") -> None:
    e.run_and_store(rid, 32 * len(blocks), blocks, tag=tag)  # stored, then written through
    e.apply(ev.RequestFinished(request_id=rid, block_ids=(blocks,)))


def _reading(disk: int = 16) -> tuple[Engine, fx.StartLoad]:
    """A document on disk only (host memory refilled by another), and a load promoting it."""
    e = _tiered(disk=disk)
    _held(e)
    _held(e, "filler", (10, 11, 12, 13, 14, 15, 16, 17), tag="z")
    e.add("b", 100)
    (load,) = only(e.alloc("b", (20, 21, 22, 23), ext=96), fx.StartLoad)
    return e, load


def tier_key_scenarios() -> dict:
    """For each (state, action) of `TIER_KEY_MOVES`, a run that moves one key of
    tier 1 that way once: (engine, key, act)."""
    first = key(chain(1)[0], 0)

    def found(k: bytes):
        return lambda e: e.apply(ev.TierKeysFound(tier=1, keys=(k,)))

    scenarios = {}
    e = _tiered()
    store = _storing(e)
    scenarios[(K.ABSENT, "spill_planned")] = (e, store.keys[0][0], lambda e: e.store_done(store.job_id))
    for action, act in (
        ("spill_written", lambda e, spill: e.store_done(spill.job_id)),
        ("spill_failed", lambda e, spill: e.apply(ev.StoreFailed(job_id=spill.job_id, keys=(spill.keys[0][0],)))),
        ("reset", lambda e, spill: e.apply(ev.CacheReset(epoch=1))),
        ("found", lambda e, spill: e.apply(ev.TierKeysFound(tier=1, keys=(spill.keys[0][0],)))),
    ):
        e, spill = _writing()
        scenarios[(K.WRITING, action)] = (e, spill.keys[0][0], lambda e, act=act, spill=spill: act(e, spill))
    e, spill = _writing()
    e.apply(ev.CacheReset(epoch=1))
    scenarios[(K.WRITING, "spill_ended_stale")] = (e, spill.keys[0][0], lambda e: e.store_done(spill.job_id))
    other = key(chain(1, "other")[0], 0)
    scenarios[(K.ABSENT, "found")] = (_tiered(), other, found(other))
    e = _tiered()
    _held(e)
    scenarios[(K.HELD, "found")] = (e, first, found(first))
    e = _tiered()
    _held(e)
    scenarios[(K.HELD, "reset")] = (e, first, lambda e: e.apply(ev.CacheReset(epoch=1)))
    e = _tiered(slots=16, disk=4)
    _held(e)
    scenarios[(K.HELD, "evicted")] = (e, first, lambda e: _held(e, "b", (4, 5), tag="b"))
    e = _tiered()
    _held(e)
    _held(e, "filler", (10, 11, 12, 13, 14, 15, 16, 17), tag="z")
    e.add("b", 100)
    scenarios[(K.HELD, "read_planned")] = (e, first, lambda e: e.alloc("b", (20, 21, 22, 23), ext=96))
    for state in (K.HELD, K.ABSENT):
        for action in ("read_ended", "read_failed"):
            e, load = _reading()
            if state is K.ABSENT:
                e.apply(ev.CacheReset(epoch=1))  # removes the key while the load reads it
            act = ((lambda e, load=load: e.load_done(load.job_id)) if action == "read_ended" else
                   (lambda e, load=load: e.apply(ev.LoadFailed(job_id=load.job_id, block_ids=(20,),
                                                               keys=(load.keys[0][0],)))))
            scenarios[(state, action)] = (e, load.keys[0][0], act)
    return scenarios


def test_every_tier_key_move_has_a_scenario():
    assert set(TIER_KEY_MOVES) == set(tier_key_scenarios())


@pytest.mark.parametrize("pair", list(TIER_KEY_MOVES), ids=lambda p: f"{p[0].value}-{p[1]}")
def test_every_tier_key_move(pair):
    state, action = pair
    e, k, act = tier_key_scenarios()[pair]
    assert queries.tier_key_state(e.state, 1, k) is state
    reads = e.core.lower[0].reading.get(k, 0)
    act(e)
    assert queries.tier_key_state(e.state, 1, k) is tier_key_move(state, action) is TIER_KEY_MOVES[pair]
    delta = {"read_planned": 1, "read_ended": -1, "read_failed": -1}.get(action, 0)
    assert e.core.lower[0].reading.get(k, 0) == reads + delta
    check(e.state)


def test_a_key_being_read_is_not_evicted():
    e, load = _reading(disk=11)  # the disk full: the document's 3 keys (being read) and the filler's 8
    tier = e.core.lower[0]
    read = load.keys[0]
    assert len(tier.held) == tier.capacity and all(tier.reading.get(k) == 1 for k in read)
    e.add("c", 64, tag="c")
    e.alloc("c", (30, 31))
    (store,) = only(e.step(("c", 0, 64)), fx.StartStore)
    e.store_done(store.job_id)  # its spill needs room for two keys, while the load still reads
    assert tier.counts["evictions"] == 2
    assert all(queries.tier_key_state(e.state, 1, k) is K.HELD for k in read)  # the oldest, but read
    check(e.state)


# Jobs


def job_scenarios() -> dict:
    """For each (stage, action) of `JOB_MOVES`, a run that moves store job 1 that way: (engine, act)."""
    def running(world_size: int = 1) -> Engine:
        e = Engine(make_config(groups=(FULL,), num_tier_slots=8, world_size=world_size))
        e.add("a", 64)
        e.alloc("a", (1, 2))
        return e

    def flushed(world_size: int = 1) -> Engine:
        e = running(world_size)
        e.step(("a", 0, 64))
        e.finish("a")
        e.add("b", 64, tag="b")
        assert admits("b", e.alloc("b", (1, 20))) == (fx.FlushStores(job_ids=(1,)),)
        return e

    def started(world_size: int = 1) -> Engine:
        e = running(world_size)
        e.step(("a", 0, 64))
        return e

    def reset(e: Engine) -> tuple:
        return e.apply(ev.CacheReset(epoch=1))

    return {
        (None, "started"): (running(), lambda e: e.step(("a", 0, 64))),
        (J.IN_FLIGHT, "worker_reported"): (started(2), lambda e: e.store_done(1, worker=0)),
        (J.IN_FLIGHT, "last_worker_reported"): (started(), lambda e: e.store_done(1)),
        (J.IN_FLIGHT, "flushed"): (
            (lambda e: (e.finish("a"), e.add("b", 64, tag="b")) and e)(started()),
            lambda e: e.alloc("b", (1, 20))),
        (J.FLUSHED, "worker_reported"): (flushed(2), lambda e: e.store_done(1, worker=1)),
        (J.FLUSHED, "last_worker_reported"): (flushed(), lambda e: e.store_done(1)),
        (J.IN_FLIGHT, "reset"): (started(), reset),
        (J.FLUSHED, "reset"): (flushed(), reset),
    }


def test_every_job_move_has_a_scenario():
    assert set(JOB_MOVES) == set(job_scenarios())


@pytest.mark.parametrize("pair", list(JOB_MOVES), ids=lambda p: f"{p[0].value if p[0] else 'new'}-{p[1]}")
def test_every_job_move(pair):
    stage, action = pair
    e, act = job_scenarios()[pair]
    assert queries.job_stage(e.state, 1) is stage
    act(e)
    assert queries.job_stage(e.state, 1) is job_move(stage, action) is JOB_MOVES[pair]
    if action == "reset":
        assert e.core.jobs[1].stale
    check(e.state)


@pytest.mark.parametrize("stage", [None, J.IN_FLIGHT], ids=["ended", "reported"])
def test_a_report_without_a_row_is_a_violation(stage):
    """No job, or a worker that already reported: not in the table, so refused."""
    e = Engine(make_config(groups=(FULL,), num_tier_slots=8, world_size=2))
    e.add("a", 64)
    e.alloc("a", (1, 2))
    e.step(("a", 0, 64))
    e.store_done(1, worker=0)
    if stage is None:
        e.store_done(1, worker=1)
    assert queries.job_stage(e.state, 1) is stage
    with pytest.raises(reducer.ProtocolViolation):  # worker 0 again
        reducer.reduce(e.state, ev.StoreCompleted(job_id=1, worker_index=0), strict=True)


# The rendered doc

DOC = Path(__file__).resolve().parents[2] / "docs" / "transitions.md"


def test_render_is_deterministic_and_covers_every_cell():
    text = render()
    assert text == render()
    rows = {line.split(" | ")[0][3:-1]: line.split(" | ")[1:] for line in text.splitlines()
            if line.startswith("| `") and line.count("|") == len(STATUSES) + 2}
    assert set(rows) == set(KINDS)
    for kind in KINDS:
        for status, cell in zip(STATUSES, rows[kind]):
            cell = cell.rstrip(" |")
            if (status, kind) in REQUEST_MOVES:
                target = REQUEST_MOVES[(status, kind)]
                assert cell == f"→ `{target.value if target else 'gone'}`", (status, kind)
            else:
                assert cell == "·", (status, kind)
    for _, action in SLOT_MOVES:
        assert f"| `{action}` |" in text


def test_committed_doc_matches_the_tables():
    expected = render()
    if os.environ.get("KVLEDGER_UPDATE_GOLDEN") == "1":
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(expected, encoding="utf-8")
    assert DOC.exists(), f"{DOC} is missing: run with KVLEDGER_UPDATE_GOLDEN=1"
    assert DOC.read_text(encoding="utf-8") == expected, (
        "docs/transitions.md is out of date: rerun with KVLEDGER_UPDATE_GOLDEN=1")


# The tables are the mechanism: each lower-tier key move and job move takes its target from
# its row, read once when the module is imported (as the slots' are). The modules are imported
# again with a table that notes each row read: every row must be.


class _NotingMoves(dict):
    """A move table that notes each row looked up."""

    def __getitem__(self, pair):
        self.noted.add(pair)
        return dict.__getitem__(self, pair)


def _rows_read_at_import(monkeypatch, name: str, table: dict, module) -> set:
    noting = _NotingMoves(table)
    noting.noted = set()
    monkeypatch.setattr(transitions, name, noting)
    try:
        importlib.reload(module)
    finally:
        monkeypatch.undo()
        importlib.reload(module)
    return noting.noted


@pytest.mark.pure
def test_the_lower_tiers_read_every_key_row() -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        noted = _rows_read_at_import(monkeypatch, "TIER_KEY_MOVES", TIER_KEY_MOVES, lower)
    assert set(TIER_KEY_MOVES) <= noted, sorted(f"{s.value}-{a}" for s, a in set(TIER_KEY_MOVES) - noted)


def _source_row(stage, action: str, target) -> str:
    def name(value):
        return "None" if value is None else f"J.{value.name}"
    return f'({name(stage)}, "{action}"): {"GONE" if target is None else name(target)},'


@pytest.mark.parametrize("pair", list(JOB_MOVES), ids=lambda p: f"{p[0].value if p[0] else 'new'}-{p[1]}")
def test_the_job_moves_read_every_job_row(pair) -> None:
    """Each row, given another target, changes what the module does when imported: its
    import-time check fails, or the move's constant takes the new target."""
    stage, action = pair
    path = Path(__file__).resolve().parents[2] / "engine" / "transitions.py"  # the source, compiled or not
    source = path.read_text()
    row = _source_row(stage, action, JOB_MOVES[pair])
    assert source.count(row) == 1, row
    other = next(s for s in (*J, None) if s is not JOB_MOVES[pair] and not (stage is None and s is None))
    namespace: dict = {"__name__": "kvledger.engine.transitions_probe", "__package__": "kvledger.engine"}
    exec(compile(source, str(path), "exec"), dict(namespace))  # as it stands, the module imports
    try:
        exec(compile(source.replace(row, _source_row(stage, action, other)), str(path), "exec"), namespace)
    except AssertionError:
        return
    assert (namespace["_STARTED"], namespace["_FLUSHED"]) != (transitions._STARTED, transitions._FLUSHED), row
