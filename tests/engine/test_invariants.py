"""Invariants pass on legal states and fail on each kind of corruption.

Every check family has one test, parametrized over corruptions of a state
built by legal events; each corruption must be reported with its own message,
so a check that cannot fail shows up here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvledger.engine import reducer
from kvledger.engine.digest import digest
from kvledger.engine.invariants import InvariantViolation, check, check_event, find_problems
from kvledger.engine.replay import breaks_invariants, replay
from kvledger.engine.state import RequestStatus, SlotState, reader_ids
from kvledger.events import types as ev
from kvledger.events.log_records import DigestRecord
from tests.engine.builders import Engine, chain, key, make_config

A = chain(4, "a")
KA0 = [key(h, 0) for h in A]
KA1 = [key(h, 1) for h in A]
LOAD, STORE = 2, 4  # job ids in the rich state


def rich(**config) -> Engine:
    """A state with a bit of everything, reached by legal events:
    "d" stored prefix "a" and finished; "b" loads 128 tokens of it (job 2);
    "f" and "g" failed their stores (slots on the free list); "s" has store
    job 4 in flight; "w" waits; "p" was preempted."""
    e = Engine(make_config(**config))
    e.run_and_store("d", 128, (1, 2, 3, 4), (5, 6, 7, 8))
    e.finish("d")
    e.add("b", 129, A)
    e.alloc("b", (9, 10, 11, 12, 13), (0, 0, 14, 15, 16), ext=128)
    e.add("f", 64, tag="f")
    e.alloc("f", (17, 18), (19, 20))
    e.step(("f", 0, 64))
    for worker in range(e.config.world_size):
        e.apply(ev.StoreFailed(job_id=3, worker_index=worker))
    e.add("s", 64, tag="s")
    e.alloc("s", (21, 22), (23, 24))
    e.step(("s", 0, 64))
    e.add("g", 64, tag="g")
    e.alloc("g", (29, 30), (31, 32))
    e.step(("g", 0, 64))
    for worker in range(e.config.world_size):
        e.apply(ev.StoreFailed(job_id=5, worker_index=worker))
    e.add("w", 64, tag="w")
    e.add("p", 64, tag="p")
    e.alloc("p", (25, 26), (27, 28))
    e.preempt("p")
    assert sorted(e.core.jobs) == [LOAD, STORE]
    assert e.core.free_slots and len(e.core.policy) == 2
    return e


RICH = rich()


def corrupted(mutate) -> list[str]:
    state = RICH.state.clone()
    mutate(state.core)
    with pytest.raises(InvariantViolation) as raised:
        check(state)
    return raised.value.problems


def store_slot(c) -> int:
    return c.jobs[STORE].slot_ids[0][0]


def load_slot(c) -> int:
    return c.jobs[LOAD].slot_ids[0][0]


def idle_slot(c) -> int:
    """A stored, indexed slot no job uses: sliding key 0 of prefix "a"."""
    return c.slot_of_key[KA1[0]]


def test_the_rich_state_passes_and_is_not_changed_by_checking():
    check(RICH.state)
    assert find_problems(RICH.state.core) == []
    assert not breaks_invariants(RICH.state)


def test_states_across_a_whole_lifecycle_pass():
    e = rich(protection="pin", world_size=2)
    check(e.state)
    for job_id in sorted(e.core.jobs):
        kind = e.core.jobs[job_id].kind.value
        for worker in (1, 0):
            e.apply(ev.StoreCompleted(job_id=job_id, worker_index=worker) if kind == "store"
                    else ev.LoadCompleted(job_id=job_id, worker_index=worker))
            check(e.state)
    e.step(("b", 128, 1), ("s", 0, 64))
    check(e.state)
    e.apply(ev.CacheReset(epoch=1))
    check(e.state)
    e.finish_all_jobs()
    for rid in ("b", "s"):
        e.finish(rid)
    e.abort("w")
    check(e.state)


# One test per family of checks.


def _set_status(rid, status):
    def mutate(c):
        c.requests[rid].status = status
    return mutate


REQUEST_CORRUPTIONS = {
    "running with a load job": (_set_status("b", RequestStatus.RUNNING), "status running with load job 2"),
    "loading without a load job": (_set_status("s", RequestStatus.LOADING), "status loading with load job -1"),
    "someone else's load": (lambda c: setattr(c.requests["b"], "load_job_id", STORE),
                            "load job 4 is not its open load"),
    "preempted holding blocks": (lambda c: c.requests["p"].table.__setitem__(0, [40]),
                                 "preempted but still holds blocks"),
    "keys out of step with hashes": (lambda c: c.requests["w"].keys[1].append(b"x"),
                                     "group 1 keys do not match its hashes"),
    "holds a free block": (lambda c: c.requests["s"].table[0].append(40), "holds block 40 whose ref count is 0"),
    "stale step limit": (lambda c: setattr(c.requests["s"], "step_limit", 5), "request s: derived counts"),
    "stale capacity": (lambda c: setattr(c.requests["b"], "capacity_tokens", 0), "request b: derived counts"),
    "free floor above a held block": (lambda c: c.requests["s"].free_floor.__setitem__(0, 1),
                                      "request s: group 0 has a held block below its free floor 1"),
    "stale free point": (lambda c: setattr(c.requests["s"], "next_free_tokens", 10**6),
                         "request s: next_free_tokens 1000000, not its free point"),
}


@pytest.mark.parametrize("case", list(REQUEST_CORRUPTIONS))
def test_request_checks(case):
    mutate, message = REQUEST_CORRUPTIONS[case]
    assert any(message in p for p in corrupted(mutate)), corrupted(mutate)


def _job_attr(job_id, name, value):
    def mutate(c):
        setattr(c.jobs[job_id], name, value(c.jobs[job_id]) if callable(value) else value)
    return mutate


def _reallocate_store_source(c):
    c.block_generation[c.jobs[STORE].block_ids[0][0]] += 1


def _drop_reader(c):
    left = [job for job in reader_ids(c.block_readers[21]) if job != STORE]
    if left:
        c.block_readers[21] = left
    else:
        del c.block_readers[21]


JOB_CORRUPTIONS = {
    "no pending worker": (_job_attr(STORE, "pending_workers", 0), "job 4: pending workers 0 out of range"),
    "unknown worker": (_job_attr(STORE, "pending_workers", 0b10), "job 4: pending workers 10 out of range"),
    "id from the future": (_job_attr(STORE, "job_id", 99), "job 99: id not yet issued"),
    "misaligned": (_job_attr(STORE, "slot_ids", lambda j: (j.slot_ids[0][:1], j.slot_ids[1])),
                   "job 4: keys, blocks and slots are not aligned"),
    "null block": (_job_attr(STORE, "block_ids", lambda j: ((0, *j.block_ids[0][1:]), j.block_ids[1])),
                   "job 4: moves the null block"),
    "free slot": (lambda c: c.slot_state.__setitem__(store_slot(c), SlotState.FREE), "job 4: uses free slot"),
    "slot with another key": (lambda c: c.slot_key.__setitem__(store_slot(c), b"other"),
                              "holds another key"),
    "store into a stored slot": (lambda c: c.slot_state.__setitem__(store_slot(c), SlotState.STORED),
                                 "store target slot"),
    "load from an unpinned slot": (lambda c: c.slot_loads.pop(load_slot(c)), "is not stored and pinned"),
    "load target not marked": (lambda c: c.block_writer.pop(9), "target block 9 is not marked as being loaded"),
    "store source reallocated": (_reallocate_store_source,
                                 "source block 21 was reallocated while the store reads it"),
    "store reader not recorded": (_drop_reader, "source block 21 does not record its reader"),
    "load target released": (lambda c: c.requests["b"].table[0].__setitem__(0, 0),
                             "job 2: target block 9 is no longer held by b"),
}


@pytest.mark.parametrize("case", list(JOB_CORRUPTIONS))
def test_job_checks(case):
    mutate, message = JOB_CORRUPTIONS[case]
    problems = corrupted(mutate)
    assert any(message in p for p in problems), problems


BLOCK_CORRUPTIONS = {
    "ref bumped": (lambda c: c.block_refs.__setitem__(21, 2), "block 21: ref count 2, held 1 times"),
    "ref dropped": (lambda c: c.block_refs.__setitem__(9, 0), "block 9: ref count 0, held 1 times"),
    "null block held": (lambda c: c.block_refs.__setitem__(0, 1), "the null block is held or pinned"),
    "phantom reader": (lambda c: c.block_readers.__setitem__(40, [STORE]),
                       "block readers do not match the unflushed stores"),
    "phantom writer": (lambda c: c.block_writer.__setitem__(40, LOAD), "block writers do not match the open loads"),
    "phantom pin": (lambda c: c.block_pins.__setitem__(21, 1), "block 21: 1 pins, 0 pinning stores"),
}


@pytest.mark.parametrize("case", list(BLOCK_CORRUPTIONS))
def test_block_count_checks(case):
    mutate, message = BLOCK_CORRUPTIONS[case]
    problems = corrupted(mutate)
    assert any(message in p for p in problems), problems


def _desync_index(c):
    c.slot_of_key[KA1[0]] = c.slot_of_key[KA1[1]]


def _orphan(c):
    c.policy.remove(KA1[0])
    del c.slot_of_key[KA1[0]]


def _storing_without_job(c):
    c.policy.remove(KA1[0])
    c.slot_state[idle_slot(c)] = SlotState.STORING


def _free_without_list(c):
    slot = idle_slot(c)
    c.policy.remove(KA1[0])
    del c.slot_of_key[KA1[0]]
    c.slot_key[slot] = None
    c.slot_state[slot] = SlotState.FREE


TIER_CORRUPTIONS = {
    "index desynced": (_desync_index, "index points at a slot holding another key or none"),
    "load count without a load": (lambda c: c.slot_loads.__setitem__(idle_slot(c), 1),
                                  "slot load counts do not match the open loads"),
    "free listed twice": (lambda c: c.free_slots.append(c.free_slots[0]), "a slot is on the free list twice"),
    "used beyond the fresh mark": (lambda c: c.slot_state.__setitem__(c.next_fresh_slot, SlotState.STORED),
                                   "a slot beyond the fresh mark is in use"),
    "free list holds a used slot": (lambda c: c.slot_state.__setitem__(c.free_slots[0], SlotState.STORED),
                                    "on the free list but STORED"),
    "free slot lost": (_free_without_list, "FREE but neither fresh nor on the free list"),
    "free slot with a key": (lambda c: c.slot_key.__setitem__(c.free_slots[0], b"x"), "state FREE with key"),
    "dropped and never freed": (_orphan, "dropped from the index but no job will free it"),
    "storing without a store": (_storing_without_job, "storing without exactly one store job"),
    "policy lost a key": (lambda c: c.policy.remove(KA1[0]), "policy holds 1 keys, 2 are evictable"),
    "policy holds a loading key": (lambda c: c.policy.insert(KA0[0], False),
                                   "evictable=False but policy membership disagrees"),
    "load from a storing slot": (lambda c: c.slot_state.__setitem__(load_slot(c), SlotState.STORING),
                                 "loads from a slot that is not stored"),
}


@pytest.mark.parametrize("case", list(TIER_CORRUPTIONS))
def test_tier_checks(case):
    mutate, message = TIER_CORRUPTIONS[case]
    problems = corrupted(mutate)
    assert any(message in p for p in problems), problems


ARC_RICH = rich(policy="arc", num_tier_slots=16)


def _arc_corrupted(mutate) -> list[str]:
    state = ARC_RICH.state.clone()
    mutate(state.core.policy)
    with pytest.raises(InvariantViolation) as raised:
        check(state)
    return raised.value.problems


ARC_CORRUPTIONS = {
    "ghosts overflow": (lambda arc: arc.b1.update(dict.fromkeys(bytes([i]) for i in range(17))),
                        "arc: a list pair exceeds capacity"),
    "target above capacity": (lambda arc: setattr(arc, "p", 17), "arc: target 17 out of [0, 16]"),
    "target below zero": (lambda arc: setattr(arc, "p", -1), "arc: target -1 out of [0, 16]"),
}


@pytest.mark.parametrize("case", list(ARC_CORRUPTIONS))
def test_arc_checks(case):
    check(ARC_RICH.state)
    mutate, message = ARC_CORRUPTIONS[case]
    problems = _arc_corrupted(mutate)
    assert any(message in p for p in problems), problems


# The per-event footprint check


def _footprint(mutate, event: ev.Event) -> list[str]:
    state = RICH.state.clone()
    mutate(state.core)
    with pytest.raises(InvariantViolation) as raised:
        check_event(state, event, state.core.next_job_id)
    return raised.value.problems


def test_event_footprint_passes_on_the_rich_state():
    state = RICH.state
    for event in (
        ev.BlocksFreed(request_id="s", block_ids=((21,), (23,))),
        ev.StoreCompleted(job_id=STORE),
        ev.LoadFailed(job_id=LOAD, block_ids=(9, 14), keys=()),
        ev.RequestAdded(request_id="b", num_prompt_tokens=1, block_hashes=()),
    ):
        check_event(state, event, state.core.next_job_id)


FOOTPRINT_CORRUPTIONS = {
    "negative refs": (lambda c: c.block_refs.__setitem__(40, -1),
                      ev.BlocksFreed(request_id="w", block_ids=((40,), ())), "block 40: negative count"),
    "stale reader": (lambda c: c.block_readers.__setitem__(40, [99]),
                     ev.BlocksFreed(request_id="w", block_ids=((40,), ())), "block 40: stale reader job 99"),
    "writer on a free block": (lambda c: c.block_writer.__setitem__(40, LOAD),
                               ev.LoadFailed(job_id=LOAD, block_ids=(40,), keys=()),
                               "block 40: load 2 writes a block nobody holds"),
    "null block transferred": (lambda c: c.block_readers.__setitem__(0, [STORE]),
                               ev.BlocksFreed(request_id="w", block_ids=((0,), ())),
                               "the null block is held, pinned or transferred"),
    "request": (_set_status("s", RequestStatus.LOADING), ev.RequestPreempted(request_id="s"),
                "status loading with load job -1"),
    "job and its slots": (lambda c: c.slot_state.__setitem__(store_slot(c), SlotState.STORED),
                          ev.StoreCompleted(job_id=STORE), "store target slot"),
    "a job's slot freed under it": (lambda c: c.slot_state.__setitem__(store_slot(c), SlotState.FREE),
                                    ev.StoreCompleted(job_id=STORE), "state FREE with key"),
    "a held block without a count": (lambda c: c.block_refs.__setitem__(22, 0),
                                     ev.BlocksAllocated(request_id="s", block_ids=((21, 22), (23, 24))),
                                     "request s: holds block 22 whose ref count is 0"),
    "a stale step limit": (lambda c: setattr(c.requests["s"], "step_limit", -1), ev.RequestResumed(request_id="s"),
                           "request s: derived counts"),
    "a pinned count gone negative": (lambda c: c.block_pins.__setitem__(40, -1),
                                     ev.BlocksFreed(request_id="w", block_ids=((40,), ())), None),
    # The load job's fast pass must hand each of these to the item-by-item check.
    "a load's slot unpinned": (lambda c: c.slot_loads.pop(load_slot(c)), ev.LoadCompleted(job_id=LOAD),
                               "is not stored and pinned"),
    "a load's slot rekeyed": (lambda c: c.slot_key.__setitem__(load_slot(c), b"\x01" * 36),
                              ev.LoadCompleted(job_id=LOAD), "holds another key"),
    "a load target unmarked": (lambda c: c.block_writer.pop(c.jobs[LOAD].block_ids[0][0]),
                               ev.LoadCompleted(job_id=LOAD), "is not marked as being loaded"),
    "a load target dropped": (lambda c: c.requests["b"].table[0].__setitem__(0, 0), ev.LoadCompleted(job_id=LOAD),
                              "is no longer held by b"),
    "a pinned slot evictable": (lambda c: c.policy.insert(c.slot_key[load_slot(c)], False),
                                ev.LoadCompleted(job_id=LOAD), "policy membership disagrees"),
}


@pytest.mark.parametrize("case", list(FOOTPRINT_CORRUPTIONS))
def test_event_footprint_checks(case):
    mutate, event, message = FOOTPRINT_CORRUPTIONS[case]
    if message is None:  # outside the footprint: left to the full check
        state = RICH.state.clone()
        mutate(state.core)
        check_event(state, event, state.core.next_job_id)
        with pytest.raises(InvariantViolation):
            check(state)
        return
    problems = _footprint(mutate, event)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("corrupt, message", [
    (lambda c, job: c.slot_state.__setitem__(job.slot_ids[1][0], SlotState.STORED), "store target slot"),
    (lambda c, job: c.block_generation.__setitem__(job.block_ids[0][1], 99), "was reallocated"),
    (lambda c, job: c.block_readers.pop(job.block_ids[1][1]), "does not record its reader"),
    (lambda c, job: c.policy.insert(job.keys[0][0], False), "policy membership disagrees"),
], ids=["slot state", "generation", "reader", "evictable"])
@pytest.mark.parametrize("store_jobs, jobs", [("step", 1), ("request", 2)])
def test_a_steps_new_stores_are_checked_together_and_each_problem_named(corrupt, message, store_jobs, jobs):
    e = Engine(make_config(store_jobs=store_jobs))
    for rid, blocks in (("x", ((1, 2), (3, 4))), ("y", ((5, 6), (7, 8)))):
        e.add(rid, 64, tag=rid)
        e.alloc(rid, *blocks)
    first = e.core.next_job_id
    e.step(("x", 0, 64), ("y", 0, 64))
    step = e.log[-1]
    assert len(range(first, e.core.next_job_id)) == jobs
    check_event(e.state, step, first)
    state = e.state.clone()
    corrupt(state.core, state.core.jobs[e.core.next_job_id - 1])
    with pytest.raises(InvariantViolation) as raised:
        check_event(state, step, first)
    assert any(message in p for p in raised.value.problems), raised.value.problems


def test_the_footprint_of_a_rejected_event_is_not_taken_as_held():
    """A refused allocation names blocks the request does not hold (ref count 0): no problem."""
    event = ev.BlocksAllocated(request_id="s", block_ids=((40, 40), (41,)))
    state, effects = reducer.reduce(RICH.state.clone(), event)
    assert [x.code for x in effects] == ["duplicate_block"]
    check_event(state, event, state.core.next_job_id)


def test_invariant_violation_message_names_the_first_problems():
    broken = InvariantViolation([f"p{i}" for i in range(7)])
    assert str(broken) == "p0; p1; p2; p3; p4 (+2 more)"
    assert broken.problems[6] == "p6"


# Replay and bisect


def records(events, digests: dict[int, str] | None = None):
    """Log-like records: events at seq 0.., and digest records after given seqs."""
    out = []
    for index, event in enumerate(events):
        out.append(SimpleNamespace(seq=len(out), event=event))
        if digests and index in digests:
            out.append(DigestRecord(seq=len(out), step_index=0, digest=digests[index]))
    return out


def test_replay_reproduces_the_state_and_names_the_first_violation():
    e = rich()
    log = list(e.log)
    bad = ev.RequestResumed(request_id="w")  # w is waiting: illegal
    log.insert(7, bad)
    log.insert(9, ev.RequestResumed(request_id="nobody"))
    result = replay(e.config, records(log), check_invariants=True)
    assert result.first_problem is not None
    assert (result.first_problem.seq, result.first_problem.kind) == (7, "violation")
    assert result.first_problem.detail.startswith("illegal_request_event")
    assert [seq for seq, _ in result.violations] == [7, 9]
    assert result.events == len(log)
    assert digest(result.state) == digest(e.state)


def test_replay_names_the_first_digest_mismatch_and_where_it_last_matched():
    e = Engine()
    e.run_and_store("d", 128, (1, 2, 3, 4), (5, 6, 7, 8))
    truth = Engine()
    marks = {}
    for index, event in enumerate(e.log):
        truth.apply(event)
        marks[index] = digest(truth.state)
    assert len(marks) == 4
    log = records(e.log, {0: marks[0], 2: "0" * 32, 3: marks[3]})
    # seq: 0 ev, 1 digest ok, 2 ev, 3 ev, 4 digest wrong, 5 ev, 6 digest ok
    result = replay(e.config, log)
    assert result.digests_checked == 3
    finding = result.first_problem
    assert (finding.kind, finding.seq) == ("digest", 4)
    assert "last matched at seq 1" in finding.detail
    assert replay(e.config, records(e.log, {0: marks[0], 2: marks[2], 3: marks[3]})).ok


def _break_on_preempt(monkeypatch):
    """Make request_preempted keep a block it freed: an engine bug on purpose."""
    original = reducer._HANDLERS[ev.RequestPreempted]

    def sticky(core, event, out):
        original(core, event, out)
        core.requests[event.request_id].table[0].append(40)

    monkeypatch.setitem(reducer._HANDLERS, ev.RequestPreempted, sticky)


def test_replay_stops_at_the_first_invariant_break(monkeypatch):
    e = Engine()
    e.run_and_store("d", 128, (1, 2, 3, 4), (5, 6, 7, 8))
    log = [*e.log, ev.RequestPreempted(request_id="d"), ev.RequestAdded(request_id="x", num_prompt_tokens=1,
                                                                        block_hashes=())]
    _break_on_preempt(monkeypatch)
    result = replay(e.config, records(log), check_invariants=True)
    assert (result.first_problem.kind, result.first_problem.seq) == ("invariant", 4)
    assert "preempted but still holds blocks" in result.first_problem.detail
    assert result.events == 5  # it stopped there: the state is no longer trusted
    unchecked = replay(e.config, records(log), check_invariants=False)
    assert unchecked.ok and unchecked.events == len(log)


def test_replay_finds_a_break_outside_the_footprint_at_the_next_full_check(monkeypatch):
    e = Engine()
    e.run_and_store("d", 128, (1, 2, 3, 4), (5, 6, 7, 8))
    e.add("w", 64, tag="w")
    truth = Engine()
    for event in e.log:
        truth.apply(event)
    log = [*e.log, ev.RequestAborted(request_id="w"), ev.RequestAdded(request_id="x", num_prompt_tokens=1,
                                                                      block_hashes=())]
    _break_on_abort(monkeypatch)
    # seq 0-4 events, 5 digest, 6 the leaky abort, 7 an add, 8 digest: the full check there names it.
    result = replay(e.config, records(log, {4: digest(truth.state), 6: "0" * 32}), check_invariants=True)
    assert (result.first_problem.kind, result.first_problem.seq) == ("invariant", 8)
    assert "block 40: ref count 1, held 0 times" in result.first_problem.detail


def test_replay_until_seq():
    e = rich()
    result = replay(e.config, records(e.log), until_seq=4)
    assert result.events == 5 and result.last_seq == 4


def _break_on_abort(monkeypatch):
    """Make request_aborted leak a block reference: an engine bug on purpose."""
    original = reducer._HANDLERS[ev.RequestAborted]

    def leaky(core, event, out):
        original(core, event, out)
        core.block_refs[40] += 1

    monkeypatch.setitem(reducer._HANDLERS, ev.RequestAborted, leaky)

