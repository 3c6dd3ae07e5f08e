"""Each check's fast path agrees with the path that names its problem.

The reducer's protocol checks (`engine/checks.py`) and the per-event invariant
checks (`engine/invariants.py`) come in pairs: a fast path built from C-level
passes and an item-by-item path that names what is wrong. A handler trusts the
fast path when it says fine, and raises `AssertionError` when it fails but the
naming path finds nothing; the invariants trust it likewise. So for each pair,
on states the engine reaches (simulated runs, snapshotted along the way) and
inputs drawn around them: the fast path says fine iff the naming path finds
no problem.
"""

from __future__ import annotations

import random
from collections import Counter
from functools import cache

from hypothesis import assume, given
from hypothesis import strategies as st

from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine import checks, invariants
from kvledger.engine.checks import ProtocolViolation
from kvledger.engine.state import Core, JobKind, RequestState, RequestStatus, SlotState, State, reader_ids
from kvledger.engine.transitions import REQUEST_MOVES
from kvledger.events import types as ev
from kvledger.events.types import NULL_BLOCK_ID
from tests.engine.builders import SIMULATED_CONFIGS

CONFIGS = SIMULATED_CONFIGS
SNAPSHOTS = (2, 5, 9, 14, 20, 28, 40)


@cache
def pool() -> tuple[State, ...]:
    """States simulated runs pass through: loads and stores in flight, failed
    and stale jobs, requests in every status, windows with freed blocks."""
    states = []
    for config in CONFIGS:
        for seed, max_tokens in enumerate((8, 40, 12, 24)):  # long outputs preempt, short ones hit the tier
            sim = Simulator(config, prefix_caching=seed != 2)
            rng = random.Random(seed)
            done = 0
            for mark in SNAPSHOTS:
                run_random(sim, rng, steps=mark - done, arrivals=0.9, max_tokens=max_tokens, completion_rate=0.3,
                           fail_rate=0.2, reset_rate=0.03, abort_rate=0.08, damage_rate=0.1, foreign_rate=0.1)
                done = mark
                states.append(sim.state.clone())
    return tuple(states)


def agree(fast: bool, naming) -> None:
    """`fast` says fine iff `naming()` raises no `ProtocolViolation`."""
    try:
        naming()
    except ProtocolViolation:
        assert not fast, "the fast path passed what the naming path rejects"
    else:
        assert fast, "the fast path failed what the naming path accepts"


@st.composite
def core_and_blocks(draw, *, in_range: bool = False):
    """A reachable state, and a vocabulary of block ids that matter in it:
    held, free, being loaded or read, keyed, null, and (unless `in_range`) out of range."""
    core = draw(st.sampled_from(pool())).core
    n = core.config.num_device_blocks
    held = {b for r in core.requests.values() for t in r.table for b in t if b}
    vocabulary = sorted(held | set(core.block_writer) | set(core.block_readers)
                        | {b for b in range(n) if core.block_key[b] is not None} | {0, 1, n - 1})
    vocabulary += [b for b in range(1, n) if not core.block_refs[b]][:4]
    if not in_range:
        vocabulary += [-1, n, n + 3]
    return core, vocabulary


def block_lists(draw, vocabulary: list[int], groups: int, *, max_size: int = 6):
    count = draw(st.sampled_from([groups, groups, groups, groups - 1, groups + 1]))
    return tuple(tuple(draw(st.lists(st.sampled_from(vocabulary), max_size=max_size))) for _ in range(max(count, 0)))


def a_request(draw, core: Core) -> RequestState:
    assume(core.requests)
    return core.requests[draw(st.sampled_from(sorted(core.requests)))]


# The reducer's protocol checks.


@given(status=st.sampled_from([None, *RequestStatus]), kind=st.sampled_from(sorted({k for _, k in REQUEST_MOVES})))
def test_legality(status, kind):
    request = None
    if status is not None:
        request = RequestState("r", 16, CONFIGS[0].groups)
        request.status = status
    fast = request is not None and request.status in checks.LEGAL_FROM[kind]
    if request is None and kind == "request_added":  # the fast path vouches for known requests only
        assert not fast
        checks.request_problem(request, "r", kind)
        return
    agree(fast, lambda: checks.request_problem(request, "r", kind))


@given(data=st.data())
def test_touch(data):
    core, vocabulary = data.draw(core_and_blocks(in_range=True))
    request = a_request(data.draw, core)
    block_ids = tuple(tuple(data.draw(st.lists(st.sampled_from(vocabulary), max_size=len(keys) + 2)))
                      for keys in request.keys)
    agree(checks.touch_ok(core, request, block_ids), lambda: checks.touch_problem(core, request, block_ids))


@given(data=st.data())
def test_allocation(data):
    core, vocabulary = data.draw(core_and_blocks())
    block_ids = block_lists(data.draw, vocabulary, len(core.groups), max_size=10)
    agree(checks.allocation_ok(core, block_ids), lambda: checks.allocation_problem(core, block_ids, "r"))


@given(data=st.data())
def test_free(data):
    core, vocabulary = data.draw(core_and_blocks())
    request = a_request(data.draw, core)
    own = sorted({b for t in request.table for b in t}) or [0]
    mixed = st.one_of(st.sampled_from(own), st.sampled_from(own), st.sampled_from(vocabulary))
    count = data.draw(st.sampled_from([len(core.groups)] * 4 + [len(core.groups) + 1]))
    block_ids = tuple(tuple(data.draw(st.lists(mixed, max_size=4))) for _ in range(count))
    search = checks.free_positions(core, request, block_ids)
    agree(search is not None, lambda: checks.free_problem(core, request, block_ids))
    if search is not None:  # where each block is found: where `index` from the floor finds it
        for positions, ids, table, floor in zip(search[0], block_ids, request.table, request.free_floor):
            assert positions == [table.index(b, floor) for b in ids if b != NULL_BLOCK_ID]


@given(data=st.data())
def test_step(data):
    core = data.draw(st.sampled_from(pool())).core
    rids = sorted(core.requests) + ["ghost"]
    chosen = data.draw(st.lists(st.sampled_from(rids), max_size=6))
    scheduled = []
    for rid in chosen:
        request = core.requests.get(rid)
        top = (request.capacity_tokens if request else 4) + 2
        scheduled.append((rid, data.draw(st.integers(-1, top)), data.draw(st.integers(-1, top))))
    event = ev.StepScheduled(
        step_index=core.step_index + data.draw(st.sampled_from([1, 1, 1, 0, -1])),
        request_ids=tuple(s[0] for s in scheduled), num_computed_tokens=tuple(s[1] for s in scheduled),
        num_scheduled_tokens=tuple(s[2] for s in scheduled))
    search = checks.step_crossings(core, event)
    agree(search is not None, lambda: checks.step_problem(core, event))
    if search is not None:  # the crossings are the requests that reached their next storable block
        expected = [(core.requests[rid], done + count) for rid, done, count in scheduled
                    if done + count >= core.requests[rid].next_store_tokens]
        assert search[1] == expected


@given(data=st.data())
def test_final_table(data):
    core, vocabulary = data.draw(core_and_blocks())
    request = a_request(data.draw, core)
    final = [list(t) for t in request.table]
    for _ in range(data.draw(st.integers(0, 3))):
        change = data.draw(st.sampled_from(["null", "other", "drop", "extend", "groups"]))
        group = data.draw(st.integers(0, len(final) - 1)) if final else 0
        if change == "groups":
            final = final[:-1] if data.draw(st.booleans()) else [*final, []]
        elif not final:
            continue
        elif change in ("null", "other") and final[group]:
            position = data.draw(st.integers(0, len(final[group]) - 1))
            final[group][position] = NULL_BLOCK_ID if change == "null" else data.draw(st.sampled_from(vocabulary))
        elif change == "drop" and final[group]:
            final[group].pop()
        elif change == "extend":
            final[group].append(data.draw(st.sampled_from(vocabulary)))
    final_ids = tuple(tuple(t) for t in final)
    agree(checks.final_table_ok(core, request, final_ids),
          lambda: checks.final_table_problem(core, request, final_ids))


@given(data=st.data())
def test_report(data):
    core = data.draw(st.sampled_from(pool())).core
    job_id = data.draw(st.sampled_from([*sorted(core.jobs), core.next_job_id, 0]))
    kind = data.draw(st.sampled_from(list(JobKind)))
    worker = data.draw(st.integers(-1, core.config.world_size))
    fast = checks.report_ok(core.jobs.get(job_id), kind, worker, core.config.world_size)
    agree(fast, lambda: checks.report_problem(core, job_id, kind, worker))


# The per-event invariant checks, on reachable states with one thing broken.


def _corrupt(draw, core: Core, kind: JobKind | None) -> None:
    """Break one fact the footprint checks read, around a job of `kind` if given."""
    n = core.config.num_device_blocks
    jobs = sorted(core.jobs)
    mine = [j for j in jobs if kind is None or core.jobs[j].kind is kind]
    job = core.jobs[draw(st.sampled_from(mine))] if mine else None
    job_blocks = job.flat_blocks() if job else []
    job_slots = [s for ids in job.slot_ids for s in ids] if job else []
    block = draw(st.sampled_from(job_blocks or list(range(n))))
    change = draw(st.sampled_from([
        "refs", "pins", "stale reader", "reader gone", "writer", "writer gone", "slot state",
        "slot key", "slot loads", "policy", "generation", "table", "pending", "index", "stored elsewhere",
    ]))
    if change == "refs":
        core.block_refs[block] = draw(st.sampled_from([-1, 0, 1]))
    elif change == "pins":
        core.block_pins[block] = -1
    elif change == "stale reader":
        core.block_readers[block] = reader_ids(core.block_readers.get(block, [])) + [10**6]
    elif change == "reader gone":
        core.block_readers.pop(block, None)
    elif change == "writer":
        core.block_writer[block] = draw(st.sampled_from([*jobs, 10**6]))
    elif change == "writer gone":
        core.block_writer.pop(block, None)
    elif change == "slot state" and job_slots:
        core.slot_state[draw(st.sampled_from(job_slots))] = draw(st.sampled_from(list(SlotState)))
    elif change == "slot key" and job_slots:
        core.slot_key[draw(st.sampled_from(job_slots))] = draw(st.sampled_from([None, b"\x01" * 20]))
    elif change == "slot loads" and job_slots:
        slot = draw(st.sampled_from(job_slots))
        if draw(st.booleans()):
            core.slot_loads.pop(slot, None)
        else:
            core.slot_loads[slot] = draw(st.sampled_from([0, 1]))
    elif change == "policy" and job:
        key = draw(st.sampled_from([k for ids in job.keys for k in ids] or [b"\x02"]))
        if key not in core.policy:
            core.policy.insert(key, False)
    elif change == "generation":
        core.block_generation[block] += 1
    elif change == "table" and core.requests:
        request = core.requests[draw(st.sampled_from(sorted(core.requests)))]
        tables = [t for t in request.table if t]
        if tables:
            table = draw(st.sampled_from(tables))
            table[draw(st.integers(0, len(table) - 1))] = NULL_BLOCK_ID
    elif change == "pending" and job:
        job.pending_workers = draw(st.sampled_from([0, 1 << core.config.world_size, -1]))
    elif change in ("index", "stored elsewhere") and job:
        key = draw(st.sampled_from([k for ids in job.keys for k in ids] or [b"\x02"]))
        core.slot_of_key[key] = draw(st.integers(0, core.config.num_tier_slots - 1))
        if change == "stored elsewhere" and key not in core.policy:  # as after a reset and a new store
            core.policy.insert(key, False)


def a_broken_core(draw, kind: JobKind | None = None) -> Core:
    """A reachable state (with a job of `kind`, if given), with a thing or two broken."""
    states = [s for s in pool() if kind is None or any(j.kind is kind for j in s.core.jobs.values())]
    core = draw(st.sampled_from(states)).clone().core
    for _ in range(draw(st.integers(0, 2))):
        _corrupt(draw, core, kind)
    return core


@given(data=st.data())
def test_blocks_footprint(data):
    core = a_broken_core(data.draw)
    n = core.config.num_device_blocks
    busy = [b for b in range(n) if core.block_refs[b] or core.block_pins[b] or b in core.block_readers
            or b in core.block_writer]
    blocks = data.draw(st.lists(st.one_of(st.integers(0, n - 1), st.sampled_from(busy or [0])), max_size=8))
    held = data.draw(st.booleans())
    problems: list[str] = []
    invariants._block_problems(core, blocks, held, "r", problems)
    assert invariants._blocks_look_fine(core, blocks, held) == (not problems), problems


@given(data=st.data())
def test_stores_footprint(data):
    core = a_broken_core(data.draw, JobKind.STORE)
    stores = [job for _, job in sorted(core.jobs.items()) if job.kind is JobKind.STORE]
    chosen = data.draw(st.lists(st.sampled_from(stores), unique_by=id, max_size=3)) if stores else []
    problems: list[str] = []
    invariants._job_problems(core, chosen, problems)
    assert invariants._stores_look_fine(core, chosen) == (not problems), problems


@given(data=st.data())
def test_load_footprint(data):
    core = a_broken_core(data.draw, JobKind.LOAD)
    loads = [job for _, job in sorted(core.jobs.items()) if job.kind is JobKind.LOAD]
    job = data.draw(st.sampled_from(loads))
    problems: list[str] = []
    invariants._job_problems(core, [job], problems)
    assert invariants._load_looks_fine(core, job) == (not problems), problems


@given(data=st.data())
def test_slots_pass(data):
    """The full check's pass over the slots in use vouches for exactly the states in which
    the item-by-item check finds nothing."""
    core = a_broken_core(data.draw)
    if data.draw(st.booleans()) and core.slot_of_key:  # a slot's key dropped from the index, or moved
        key = data.draw(st.sampled_from(sorted(core.slot_of_key)))
        if data.draw(st.booleans()):
            del core.slot_of_key[key]
        else:
            core.slot_of_key[key] = data.draw(st.integers(0, core.config.num_tier_slots - 1))
    free = set(core.free_slots)
    used: Counter[int] = Counter(s for job in core.jobs.values() for slots in job.slot_ids for s in slots if s >= 0)
    problems: list[str] = []
    invariants._slot_problems(core, free, used, problems)
    assert invariants._slots_look_fine(core, free, used) == (not problems), problems


def test_the_pool_holds_what_the_checks_meet():
    """The states drawn from hold every request status, both job kinds, and free-listed slots."""
    cores = [state.core for state in pool()]
    assert {r.status for c in cores for r in c.requests.values()} >= {
        RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.LOADING, RequestStatus.PREEMPTED}
    assert {j.kind for c in cores for j in c.jobs.values()} == set(JobKind)
    assert any(c.free_slots for c in cores) and any(c.block_writer for c in cores)
    assert any(NULL_BLOCK_ID in t[:f] for c in cores for r in c.requests.values()
               for t, f in zip(r.table, r.free_floor))
