"""Every reducer handler: the happy path (exact effects, exact state after)
and each protocol violation it can raise (state unchanged, one
ReportViolation, strict mode raises)."""

from __future__ import annotations

import pytest

from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.digest import digest
from kvledger.engine.invariants import check
from kvledger.engine.lookup import MISS, LookupResult, lookup
from kvledger.engine.reducer import ProtocolViolation, reduce, reduce_step
from kvledger.engine.state import JobKind, RequestStatus, SlotState, StaleStateError
from kvledger.events import types as ev
from tests.engine.builders import Engine, admits, chain, full_only_config, key, make_config, only, violations

A = chain(4, "a")
KA0 = tuple(key(h, 0) for h in A)  # full-attention keys of prefix "a"
KA1 = tuple(key(h, 1) for h in A)  # sliding keys of prefix "a"
A_BLOCKS = ((1, 2, 3, 4), (5, 6, 7, 8))


def running_with_store() -> Engine:
    """Request "a" (128 tokens) computed in step 0; store job 1 in flight."""
    e = Engine()
    e.add("a", 128)
    e.alloc("a", *A_BLOCKS)
    e.step(("a", 0, 128))
    return e


def donor_stored(config=None) -> Engine:
    """Prefix "a" (4 blocks in each group) stored and indexed; its request finished."""
    e = Engine(config)
    e.run_and_store("d", 128, *A_BLOCKS[:e.groups])
    e.finish("d")
    return e


def loading_b(e: Engine) -> tuple:
    """Request "b" (129 tokens, prefix "a") admits a 128-token hit: job 2."""
    e.add("b", 129, A)
    return admits("b", e.alloc("b", (9, 10, 11, 12, 13), (0, 0, 14, 15, 16), ext=128))


def store_failed(request_id: str, *keys: bytes, job_id: int = 1) -> fx.TransferFailed:
    """A step's store job serves no one request: its `request_id` is ""."""
    return fx.TransferFailed(job_id=job_id, kind="store", request_id=request_id, tier=0, worker_index=0,
                             keys=tuple(sorted(keys)))


def load_failed(request_id: str, *keys: bytes, job_id: int = 2, worker: int = 0) -> fx.TransferFailed:
    return fx.TransferFailed(job_id=job_id, kind="load", request_id=request_id, tier=0, worker_index=worker,
                             keys=tuple(sorted(keys)))


def ends(job_id: int, effects: tuple[fx.Effect, ...]) -> tuple[fx.Effect, ...]:
    """The effects of a job's last report, less its one `JobEnded`, checked to name that job."""
    ended = [e for e in effects if type(e) is fx.JobEnded]
    assert [e.job_id for e in ended] == [job_id], f"expected job {job_id}'s end announced once: {ended}"
    return tuple(e for e in effects if type(e) is not fx.JobEnded)


def tier_keys(e: Engine) -> dict[bytes, int]:
    return dict(e.core.slot_of_key)


def policy_order(e: Engine) -> tuple:
    return e.core.policy.canonical()[1]


# request_added


def test_request_added_creates_a_waiting_request_with_group_keys():
    e = Engine()
    assert e.add("a", 130, A) == ()
    r = e.core.requests["a"]
    assert r.status is RequestStatus.WAITING
    assert (r.num_prompt_tokens, r.num_tokens, r.num_computed_tokens) == (130, 130, 0)
    assert r.hashes == list(A)
    assert r.keys == [list(KA0), list(KA1)]
    assert r.table == [[], []]
    assert r.load_job_id == -1
    check(e.state)


@pytest.mark.parametrize("event, code", [
    (ev.RequestAdded(request_id="a", num_prompt_tokens=64, block_hashes=()), "illegal_request_event"),
    (ev.RequestAdded(request_id="z", num_prompt_tokens=0, block_hashes=()), "bad_prompt"),
    (ev.RequestAdded(request_id="z", num_prompt_tokens=127, block_hashes=A), "too_many_hashes"),
])
def test_request_added_violations(event, code):
    e = Engine()
    e.add("a", 128)
    assert e.reject(event) == code


# block_hashes_appended


def test_block_hashes_appended_extends_hashes_and_keys():
    e = Engine()
    e.add("a", 100, A[:3])
    assert e.apply(ev.BlockHashesAppended(request_id="a", num_tokens=130, block_hashes=A[3:])) == ()
    r = e.core.requests["a"]
    assert (r.num_prompt_tokens, r.num_tokens) == (100, 130)
    assert r.keys == [list(KA0), list(KA1)]
    check(e.state)


@pytest.mark.parametrize("event, code", [
    (ev.BlockHashesAppended(request_id="nobody", num_tokens=200, block_hashes=()), "illegal_request_event"),
    (ev.BlockHashesAppended(request_id="a", num_tokens=99, block_hashes=()), "tokens_shrank"),
    (ev.BlockHashesAppended(request_id="a", num_tokens=127, block_hashes=A[3:]), "too_many_hashes"),
])
def test_block_hashes_appended_violations(event, code):
    e = Engine()
    e.add("a", 100, A[:3])
    assert e.reject(event) == code


# blocks_touched


def test_blocks_touched_takes_refs_and_marks_the_prefix_computed():
    e = donor_stored()
    e.add("b", 129, A)
    assert e.touch("b", (1, 2), (5, 6)) == ()
    r = e.core.requests["b"]
    assert r.status is RequestStatus.WAITING
    assert r.table == [[1, 2], [5, 6]]
    assert r.num_computed_tokens == 64
    assert [e.core.block_refs[b] for b in (1, 2, 5, 6, 3)] == [1, 1, 1, 1, 0]
    assert [e.core.block_key[b] for b in (1, 2, 5, 6)] == [KA0[0], KA0[1], KA1[0], KA1[1]]
    check(e.state)


def test_a_touched_block_gives_the_request_its_key_object():
    # Equal keys, one object: the tier's dicts then compare by identity in the
    # request's later steps. Keys of blocks with no known content stay the request's.
    e = donor_stored()
    e.add("b", 129, A)
    own = list(e.core.requests["b"].keys[0])
    e.core.block_key[2] = None  # block 2's content unknown to the engine
    e.touch("b", (1, 2), (5, 6))
    keys = e.core.requests["b"].keys
    assert keys[0][:2] == list(KA0[:2]) and keys[1][:2] == list(KA1[:2])
    assert keys[0][0] is e.core.block_key[1] and keys[0][0] is not own[0]
    assert keys[1][0] is e.core.block_key[5] and keys[1][1] is e.core.block_key[6]
    assert keys[0][1] is own[1] and e.core.block_key[2] is own[1]
    check(e.state)


def test_blocks_touched_skips_null_sliding_positions():
    e = donor_stored()
    e.add("b", 129, A)
    e.touch("b", (1, 2, 3), (0, 6, 7))
    assert e.core.block_refs[0] == 0
    assert e.core.requests["b"].table == [[1, 2, 3], [0, 6, 7]]
    assert e.core.requests["b"].num_computed_tokens == 96
    check(e.state)


def test_touch_violations():
    e = donor_stored()
    e.add("b", 129, A)
    e.add("x", 64, tag="x")  # another prefix: its first key differs from block 1's
    assert e.reject(ev.BlocksTouched(request_id="b", block_ids=((1,),))) == "bad_group_count"
    assert e.reject(ev.BlocksTouched(request_id="b", block_ids=((1,), (64,)))) == "block_out_of_range"
    assert e.reject(ev.BlocksTouched(request_id="b", block_ids=((1, 2), (5,)))) == "unaligned_touch"
    assert e.reject(ev.BlocksTouched(request_id="x", block_ids=((1,), (5,)))) == "touch_wrong_content"
    assert e.reject(ev.BlocksTouched(request_id="nobody", block_ids=((1,), (5,)))) == "illegal_request_event"
    e.touch("b", (1,), (5,))
    assert e.reject(ev.BlocksTouched(request_id="b", block_ids=((2,), (6,)))) == "touch_after_alloc"


def test_touch_of_a_block_being_loaded_is_a_violation():
    e = donor_stored()
    loading_b(e)
    e.add("c", 129, A)
    assert e.reject(ev.BlocksTouched(request_id="c", block_ids=((9,), (20,)))) == "touch_loading_block"


def test_touch_of_a_running_request_is_a_violation():
    e = running_with_store()
    assert e.reject(ev.BlocksTouched(request_id="a", block_ids=((9,), (10,)))) == "illegal_request_event"


# blocks_allocated


def test_blocks_allocated_without_a_hit_starts_running():
    e = Engine()
    e.add("a", 128)
    gen_before = list(e.core.block_generation)
    assert admits("a", e.alloc("a", *A_BLOCKS)) == ()
    r = e.core.requests["a"]
    assert r.status is RequestStatus.RUNNING
    assert r.table == [[1, 2, 3, 4], [5, 6, 7, 8]]
    for b in range(1, 9):
        assert e.core.block_refs[b] == 1
        assert e.core.block_generation[b] == gen_before[b] + 1
        assert e.core.block_group[b] == (0 if b <= 4 else 1)
        assert e.core.block_key[b] is None
    assert e.core.block_refs[9] == 0 and e.core.block_group[9] == -1
    assert e.core.jobs == {}
    check(e.state)


def test_blocks_allocated_with_a_hit_starts_the_load_of_exactly_the_needed_blocks():
    e = donor_stored()
    slot = tier_keys(e)
    effects = loading_b(e)
    # Full attention loads every block of the hit; the 64-token window only the last two.
    assert effects == (fx.StartLoad(
        job_id=2, request_id="b", keys=(KA0, KA1[2:]),
        source_slot_ids=(tuple(slot[k] for k in KA0), tuple(slot[k] for k in KA1[2:])),
        target_block_ids=((9, 10, 11, 12), (14, 15))),)
    r = e.core.requests["b"]
    assert r.status is RequestStatus.LOADING
    assert r.load_job_id == 2
    assert r.num_computed_tokens == 128
    assert r.table == [[9, 10, 11, 12, 13], [0, 0, 14, 15, 16]]
    job = e.core.jobs[2]
    assert job.kind is JobKind.LOAD and job.num_tokens == 128 and job.pending_workers == 1
    assert e.core.block_writer == {9: 2, 10: 2, 11: 2, 12: 2, 14: 2, 15: 2}
    assert [e.core.block_key[b] for b in (9, 10, 11, 12, 14, 15)] == [*KA0, *KA1[2:]]
    assert e.core.block_key[13] is None and e.core.block_key[16] is None
    loaded = (*KA0, *KA1[2:])
    assert e.core.slot_loads == {slot[k]: 1 for k in loaded}
    # Loading keys leave the policy: they cannot be evicted under the load.
    assert policy_order(e) == KA1[:2]
    s = e.core.stats
    assert (s.loads, s.hit_tokens, s.keys_loaded) == (1, 128, 6)
    check(e.state)


def test_a_load_gives_the_request_the_tiers_key_objects():
    e = donor_stored()
    loading_b(e)
    core = e.core
    job = core.jobs[core.requests["b"].load_job_id]
    for group_keys, group_slots in zip(job.keys, job.slot_ids):
        assert all(k is core.slot_key[s] for k, s in zip(group_keys, group_slots))
    keys = core.requests["b"].keys
    assert keys[0][:4] == list(KA0) and all(a is b for a, b in zip(keys[0], job.keys[0]))
    assert all(a is b for a, b in zip(keys[1][2:4], job.keys[1]))
    check(e.state)


def test_blocks_allocated_after_a_touched_prefix_loads_from_its_end():
    e = donor_stored()
    e.add("b", 129, A)
    e.touch("b", (1,), (5,))
    effects = admits("b", e.alloc("b", (9, 10, 11, 12), (0, 14, 15, 16), ext=96))
    (load,) = effects
    assert load.keys == (KA0[1:], KA1[2:])
    assert load.target_block_ids == ((9, 10, 11), (14, 15))
    assert e.core.requests["b"].num_computed_tokens == 128
    check(e.state)


def test_an_admission_is_announced_first_with_what_explains_it_and_a_growth_is_not():
    e = donor_stored()
    e.add("b", 129, A)
    e.touch("b", (1,), (5,))
    effects = e.alloc("b", (9, 10, 11, 12), (0, 14, 15, 16), ext=96)
    assert effects[0] == fx.RequestAdmitted(request_id="b", step_index=e.core.step_index, num_tokens=129,
                                            local_tokens=32, hit_tokens=96, keys=(KA0, KA1))
    e.load_done(effects[1].job_id)
    e.step(("b", 128, 1))
    assert not only(e.alloc("b", (17,), (18,)), fx.RequestAdmitted)  # a running request's growth


def test_reallocating_a_finished_requests_block_flushes_exactly_its_store():
    e = Engine()
    e.add("a", 128)
    e.alloc("a", *A_BLOCKS)
    e.step(("a", 0, 128))  # store job 1 reads blocks 1-8
    e.add("c", 128, tag="c")
    e.alloc("c", (9, 10, 11, 12), (13, 14, 15, 16))
    e.step(("c", 0, 128))  # store job 2 reads blocks 9-16
    assert sorted(e.core.jobs) == [1, 2]
    e.finish("a")
    assert e.core.block_refs[3] == 0 and e.core.block_readers[3] == 1
    e.add("b", 64, tag="b")
    effects = admits("b", e.alloc("b", (3, 20), (21, 22)))
    assert effects == (fx.FlushStores(job_ids=(1,)),)
    assert e.core.jobs[1].flushed and not e.core.jobs[2].flushed
    assert sorted(e.core.block_readers) == list(range(9, 17))  # job 1 released every source
    assert (e.core.stats.flushes, e.core.stats.jobs_flushed) == (1, 1)
    check(e.state)
    # A second reuse of job 1's sources flushes nothing more.
    e.add("f", 64, tag="f")
    assert admits("f", e.alloc("f", (4, 23), (5, 24))) == ()
    # The flushed store still completes and indexes its keys.
    assert ends(1, e.store_done(1)) == (fx.KeysLoadable(tier=0, keys=KA0 + KA1),)
    assert all(e.core.slot_state[tier_keys(e)[k]] == SlotState.STORED for k in KA0 + KA1)
    check(e.state)


def test_reallocating_a_block_freed_from_the_window_flushes_its_store():
    e = running_with_store()
    e.free("a", (), (5,))
    e.add("b", 64, tag="b")
    assert admits("b", e.alloc("b", (20, 21), (5, 22))) == (fx.FlushStores(job_ids=(1,)),)
    check(e.state)


def test_blocks_allocated_violations():
    e = donor_stored()
    loading_b(e)  # holds 9-16 (load into 9-12, 14, 15)
    e.add("a", 128, tag="x")
    e.alloc("a", (20, 21, 22, 23), (24, 25, 26, 27))
    e.add("c", 129, A)
    e.add("h", 129, A[:2])
    allocate = ev.BlocksAllocated
    assert e.reject(allocate(request_id="c", block_ids=((30,),))) == "bad_group_count"
    assert e.reject(allocate(request_id="c", block_ids=((30,), (64,)))) == "block_out_of_range"
    assert e.reject(allocate(request_id="c", block_ids=((30, 31), (31,)))) == "duplicate_block"
    assert e.reject(allocate(request_id="c", block_ids=((20,), (30,)))) == "block_in_use"
    assert e.reject(allocate(request_id="c", block_ids=((9,), (30,)))) == "block_in_use"
    table = ((30, 31, 32, 33, 34), (0, 0, 35, 36, 37))
    assert e.reject(allocate(request_id="c", block_ids=table, num_external_tokens=100)) == "bad_hit"
    assert e.reject(allocate(request_id="c", block_ids=table, num_external_tokens=160)) == "bad_hit"
    assert e.reject(allocate(request_id="c", block_ids=table, num_external_tokens=-32)) == "bad_hit"
    short = ((30, 31, 32), (0, 0, 35))
    assert e.reject(allocate(request_id="c", block_ids=short, num_external_tokens=128)) == "load_target_missing"
    nulls = ((30, 31, 32, 33, 34), (0, 0, 0, 36, 37))
    assert e.reject(allocate(request_id="c", block_ids=nulls, num_external_tokens=128)) == "load_target_missing"
    assert e.reject(allocate(request_id="h", block_ids=table, num_external_tokens=96)) == "load_key_unknown"
    # Request "a" (prefix "x") is running, not stored: nothing of it can be loaded.
    e.add("y", 129, tag="x")
    assert e.reject(allocate(request_id="y", block_ids=table, num_external_tokens=32)) == "load_not_stored"
    e.step(("a", 0, 128))  # store of prefix "x" in flight: STORING keys cannot be loaded either
    assert e.reject(allocate(request_id="y", block_ids=table, num_external_tokens=32)) == "load_not_stored"
    e.preempt("a")
    assert e.reject(allocate(request_id="a", block_ids=((40,), (41,)))) == "illegal_request_event"


# blocks_freed


def test_blocks_freed_nulls_the_positions_and_drops_the_refs():
    e = running_with_store()
    assert e.free("a", (), (5, 6)) == ()
    assert e.core.requests["a"].table == [[1, 2, 3, 4], [0, 0, 7, 8]]
    assert [e.core.block_refs[b] for b in (5, 6, 7)] == [0, 0, 1]
    assert e.core.block_readers[5] == 1  # the store still reads it: reuse would flush
    check(e.state)


def test_blocks_freed_in_any_order_with_nulls_among_them():
    e = running_with_store()
    assert e.free("a", (), (7, 0, 5, 0)) == ()
    assert e.core.requests["a"].table == [[1, 2, 3, 4], [0, 6, 0, 8]]
    assert e.free("a", (), (6,)) == ()
    assert e.free("a", (2, 1), (8,)) == ()
    assert e.core.requests["a"].table == [[0, 0, 3, 4], [0, 0, 0, 0]]
    assert [e.core.block_refs[b] for b in range(1, 9)] == [0, 0, 1, 1, 0, 0, 0, 0]
    check(e.state)


def test_blocks_freed_violations():
    e = running_with_store()
    e.add("w", 64, tag="w")
    free = ev.BlocksFreed
    assert e.reject(free(request_id="a", block_ids=((5,),))) == "bad_group_count"
    assert e.reject(free(request_id="a", block_ids=((), (64,)))) == "block_out_of_range"
    assert e.reject(free(request_id="a", block_ids=((), (1,)))) == "free_unheld_block"
    assert e.reject(free(request_id="a", block_ids=((), (5, 5)))) == "duplicate_block"
    assert e.reject(free(request_id="a", block_ids=((), (6, 0, 5, 6)))) == "duplicate_block"
    assert e.reject(free(request_id="a", block_ids=((99,), (64,)))) == "block_out_of_range"  # range first
    assert e.reject(free(request_id="a", block_ids=((1, 1), (9,)))) == "free_unheld_block"  # then held
    assert e.reject(free(request_id="w", block_ids=((), ()))) == "illegal_request_event"
    e.free("a", (), (5,))
    assert e.reject(free(request_id="a", block_ids=((), (5,)))) == "free_unheld_block"


# request_preempted / request_resumed


def test_request_preempted_frees_everything_and_restarts_stores():
    e = running_with_store()
    assert e.preempt("a") == ()
    r = e.core.requests["a"]
    assert r.status is RequestStatus.PREEMPTED
    assert r.table == [[], []]
    assert r.num_computed_tokens == 0 and r.num_preemptions == 1
    assert r.next_store == [0, 0] and r.next_store_tokens == 0
    assert all(e.core.block_refs[b] == 0 for b in range(1, 9))
    assert e.core.stats.preemptions == 1
    assert 1 in e.core.jobs  # the store keeps going; its sources are protected by flush
    check(e.state)


def test_request_resumed_returns_to_waiting():
    e = running_with_store()
    e.preempt("a")
    assert e.resume("a") == ()
    assert e.core.requests["a"].status is RequestStatus.WAITING
    check(e.state)


def test_preempt_and_resume_violations():
    e = running_with_store()
    e.add("w", 64, tag="w")
    assert e.reject(ev.RequestPreempted(request_id="w")) == "illegal_request_event"
    assert e.reject(ev.RequestResumed(request_id="a")) == "illegal_request_event"
    assert e.reject(ev.RequestPreempted(request_id="nobody")) == "illegal_request_event"


# request_finished / request_aborted


def test_request_finished_frees_the_table_and_forgets_the_request():
    e = running_with_store()
    e.free("a", (), (5,))
    # vLLM may report a freed window position either as null or as the old id.
    assert e.apply(ev.RequestFinished(request_id="a", block_ids=((1, 2, 3, 4), (0, 0, 7, 8)))) == ()
    assert "a" not in e.core.requests
    assert all(e.core.block_refs[b] == 0 for b in range(1, 9))
    assert e.core.stats.finished == 1
    check(e.state)


def test_request_finished_violations():
    e = running_with_store()
    e.add("w", 64, tag="w")
    fin = ev.RequestFinished
    assert e.reject(fin(request_id="a", block_ids=((1, 2, 3, 4),))) == "bad_group_count"
    assert e.reject(fin(request_id="a", block_ids=((1, 2, 3), (5, 6, 7, 8)))) == "final_table_mismatch"
    assert e.reject(fin(request_id="a", block_ids=((1, 2, 3, 9), (5, 6, 7, 8)))) == "final_table_mismatch"
    assert e.reject(fin(request_id="w", block_ids=((), ()))) == "illegal_request_event"


@pytest.mark.parametrize("status", ["waiting", "running", "preempted"])
def test_request_aborted_frees_and_forgets(status):
    e = donor_stored()
    e.add("b", 129, A)
    e.touch("b", (1, 2), (5, 6))
    if status != "waiting":
        e.alloc("b", (9, 10, 11), (12, 13, 14))
    if status == "preempted":
        e.preempt("b")
    assert e.abort("b") == ()
    assert "b" not in e.core.requests
    assert all(e.core.block_refs[b] == 0 for b in range(64))
    assert e.core.stats.aborted == 1
    check(e.state)


def test_request_aborted_violation():
    e = Engine()
    assert e.reject(ev.RequestAborted(request_id="nobody")) == "illegal_request_event"


def test_abort_during_load_holds_the_blocks_until_the_load_ends():
    e = donor_stored()
    loading_b(e)
    held = [9, 10, 11, 12, 13, 14, 15, 16]
    assert e.abort("b") == ()
    r = e.core.requests["b"]
    assert r.status is RequestStatus.ABORTING and r.load_job_id == 2
    assert all(e.core.block_refs[b] == 1 for b in held)
    assert e.core.stats.aborted == 1
    e.add("c", 64, tag="c")
    assert e.reject(ev.BlocksAllocated(request_id="c", block_ids=((9, 30), (31, 32)))) == "block_in_use"
    assert e.reject(ev.BlocksAllocated(request_id="c", block_ids=((13, 30), (31, 32)))) == "block_in_use"
    check(e.state)
    assert ends(2, e.load_done(2)) == ()
    assert "b" not in e.core.requests
    assert all(e.core.block_refs[b] == 0 for b in held)
    assert e.core.block_writer == {} and e.core.slot_loads == {}
    assert len(e.core.policy) == 8  # the source keys are evictable again
    assert admits("c", e.alloc("c", (9, 13), (14, 15))) == ()
    check(e.state)


def test_abort_during_a_failing_load_also_ends_the_request():
    e = donor_stored()
    loading_b(e)
    e.abort("b")
    effects = e.apply(ev.LoadFailed(job_id=2, block_ids=(10,), keys=()))
    assert ends(2, effects) == (load_failed("b", KA0[1]), fx.KeysUnloadable(tier=0, keys=(KA0[1],), reason=fx.Reason.FAILED))
    assert "b" not in e.core.requests
    assert all(e.core.block_refs[b] == 0 for b in range(64))
    check(e.state)


# step_scheduled


def test_step_scheduled_stores_every_full_new_block():
    e = Engine()
    e.add("a", 128)
    e.alloc("a", *A_BLOCKS)
    effects = e.step(("a", 0, 128))
    assert effects == (fx.StartStore(
        job_id=1, request_id="", keys=(KA0, KA1), source_block_ids=A_BLOCKS,
        target_slot_ids=((0, 1, 2, 3), (4, 5, 6, 7))),)
    c = e.core
    assert c.step_index == 0
    job = c.jobs[1]
    assert job.kind is JobKind.STORE and job.pending_workers == 1 and not job.flushed
    assert job.generations == ((1, 1, 1, 1), (1, 1, 1, 1))
    assert c.slot_of_key == {k: s for s, k in enumerate(KA0 + KA1)}
    assert [c.slot_state[s] for s in range(9)] == [SlotState.STORING] * 8 + [SlotState.FREE]
    assert c.block_readers == {b: 1 for b in range(1, 9)}
    assert [c.block_key[b] for b in range(1, 9)] == list(KA0 + KA1)
    assert len(c.policy) == 0  # storing keys are not evictable
    assert c.stats.stores == 1 and c.stats.keys_stored == 0
    r = c.requests["a"]
    assert r.next_store == [4, 4] and r.next_store_tokens == 160
    assert r.num_computed_tokens == 0
    check(e.state)


def test_step_scheduled_stores_only_blocks_filled_since_the_last_store():
    e = Engine()
    e.add("a", 80, A[:2])
    e.alloc("a", (1, 2, 3), (5, 6, 7))
    (store,) = e.step(("a", 0, 80))
    assert store.source_block_ids == ((1, 2), (5, 6))
    e.store_done(1)
    assert e.step(("a", 80, 1)) == ()  # 81 tokens: block 2 is not full yet
    e.apply(ev.BlockHashesAppended(request_id="a", num_tokens=96, block_hashes=A[2:3]))
    assert e.step(("a", 81, 15)) == (fx.StartStore(
        job_id=2, request_id="", keys=((KA0[2],), (KA1[2],)), source_block_ids=((3,), (7,)),
        target_slot_ids=((4,), (5,))),)
    assert e.core.requests["a"].num_computed_tokens == 81
    check(e.state)


def test_step_scheduled_skips_keys_already_in_the_tier_and_null_blocks():
    e = donor_stored()
    e.add("b", 160, chain(5, "a"))
    e.alloc("b", (9, 10, 11, 12, 13), (0, 0, 14, 15, 16))
    k4 = chain(5, "a")[4]
    assert e.step(("b", 0, 160)) == (fx.StartStore(
        job_id=2, request_id="", keys=((key(k4, 0),), (key(k4, 1),)), source_block_ids=((13,), (16,)),
        target_slot_ids=((8,), (9,))),)
    check(e.state)


@pytest.mark.parametrize("store_jobs", ["step", "request"])
def test_a_steps_stores_are_one_job_in_group_order_and_a_shared_block_is_stored_once(store_jobs):
    """Request "y" shares the blocks "x" computes in the same step (vLLM caches a
    full block when it allocates it). One job per step holds both requests'
    blocks, by group, and the shared ones once; one job per request stores the
    shared blocks with the first request, as each job is admitted in turn."""
    e = Engine(make_config(store_jobs=store_jobs))
    e.add("x", 64, tag="x")
    e.alloc("x", (1, 2), (3, 4))
    e.add("y", 96, chain(3, "x"))
    e.touch("y", (1, 2), (3, 4))
    e.alloc("y", (5,), (6,))
    effects = e.step(("x", 0, 64), ("y", 64, 32))
    kx = chain(3, "x")
    k0, k1 = tuple(key(h, 0) for h in kx), tuple(key(h, 1) for h in kx)
    if store_jobs == "step":
        assert effects == (fx.StartStore(
            job_id=1, request_id="", keys=(k0, k1), source_block_ids=((1, 2, 5), (3, 4, 6)),
            target_slot_ids=((0, 1, 4), (2, 3, 5))),)  # slots taken request by request
    else:
        assert effects == (
            fx.StartStore(job_id=1, request_id="x", keys=(k0[:2], k1[:2]), source_block_ids=((1, 2), (3, 4)),
                          target_slot_ids=((0, 1), (2, 3))),
            fx.StartStore(job_id=2, request_id="y", keys=(k0[2:], k1[2:]), source_block_ids=((5,), (6,)),
                          target_slot_ids=((4,), (5,))))
    assert e.core.block_readers == {b: e.core.next_job_id - 1 if b in (5, 6) else 1 for b in range(1, 7)}
    check(e.state)
    e.finish_all_jobs()
    assert sorted(e.core.slot_of_key) == sorted(k0 + k1) and len(e.core.policy) == 6
    check(e.state)


@pytest.mark.parametrize("store_jobs", ["step", "request"])
def test_when_the_tier_is_short_a_steps_first_requests_are_stored_whole(store_jobs):
    """Four slots, two requests of two blocks in each of two groups: the first
    request's blocks are stored in every group (a hit needs them all), the
    second's are not admitted."""
    e = Engine(make_config(num_tier_slots=4, store_jobs=store_jobs))
    for rid, blocks in (("x", ((1, 2), (3, 4))), ("y", ((5, 6), (7, 8)))):
        e.add(rid, 64, tag=rid)
        e.alloc(rid, *blocks)
    effects = e.step(("x", 0, 64), ("y", 0, 64))
    (store,) = [x for x in effects if isinstance(x, fx.StartStore)]
    assert store.source_block_ids == ((1, 2), (3, 4))
    assert e.core.stats.store_rejections == 4
    (refused,) = [x for x in effects if isinstance(x, fx.KeysNotAdmitted)]  # each refused key named
    assert sorted(refused.keys) == sorted(k for group in queries.request_keys(e.state, "y") for k in group)
    assert len(effects) == 2
    check(e.state)


def test_step_scheduled_violations():
    e = running_with_store()  # step 0 done
    e.add("w", 64, tag="w")
    step = ev.StepScheduled
    assert e.reject(step(step_index=0, request_ids=(), num_computed_tokens=(), num_scheduled_tokens=())) \
        == "step_not_increasing"
    assert e.reject(step(step_index=1, request_ids=("a", "a"), num_computed_tokens=(0, 0),
                         num_scheduled_tokens=(1, 1))) == "duplicate_request"
    assert e.reject(step(step_index=1, request_ids=("a", "w"), num_computed_tokens=(128, 0),
                         num_scheduled_tokens=(0, 64))) == "illegal_request_event"
    assert e.reject(step(step_index=1, request_ids=("nobody",), num_computed_tokens=(0,),
                         num_scheduled_tokens=(1,))) == "illegal_request_event"
    assert e.reject(step(step_index=1, request_ids=("a",), num_computed_tokens=(-1,),
                         num_scheduled_tokens=(1,))) == "bad_token_count"
    assert e.reject(step(step_index=1, request_ids=("a",), num_computed_tokens=(128,),
                         num_scheduled_tokens=(1,))) == "unallocated_tokens"


# store_completed / store_failed


def test_store_completed_indexes_the_keys_in_store_order():
    e = running_with_store()
    assert ends(1, e.store_done(1)) == (fx.KeysLoadable(tier=0, keys=KA0 + KA1),)
    c = e.core
    assert 1 not in c.jobs
    assert [c.slot_state[s] for s in range(8)] == [SlotState.STORED] * 8
    assert policy_order(e) == KA0 + KA1
    assert c.block_readers == {}
    assert c.stats.keys_stored == 8 and c.stats.store_failures == 0
    e.add("b", 129, A)
    assert lookup(e.state, "b", 0) == LookupResult(128)
    check(e.state)


def test_store_and_load_completion_violations():
    e = running_with_store()
    assert e.reject(ev.StoreCompleted(job_id=7)) == "unknown_job"
    assert e.reject(ev.LoadCompleted(job_id=1)) == "unknown_job"  # job 1 is a store
    assert e.reject(ev.StoreCompleted(job_id=1, worker_index=1)) == "bad_worker"
    assert e.reject(ev.StoreFailed(job_id=1, worker_index=-1)) == "bad_worker"
    assert e.reject(ev.StoreFailed(job_id=7)) == "unknown_job"
    assert e.reject(ev.StoreFailed(job_id=1, keys=(key(A[0], 2),))) == "foreign_keys"
    e.store_done(1)
    assert e.reject(ev.StoreCompleted(job_id=1)) == "unknown_job"  # each job completes exactly once


def test_store_failed_for_every_key_indexes_nothing_and_frees_the_slots():
    e = running_with_store()
    assert ends(1, e.apply(ev.StoreFailed(job_id=1))) == (store_failed("", *KA0, *KA1),)  # no keys named: all failed
    c = e.core
    assert c.slot_of_key == {} and len(c.policy) == 0
    assert all(c.slot_state[s] == SlotState.FREE for s in range(8))
    assert sorted(c.free_slots) == list(range(8)) and c.num_used_slots() == 0
    assert c.block_readers == {} and c.jobs == {}
    s = c.stats
    assert (s.store_failures, s.keys_failed, s.keys_stored) == (1, 8, 0)
    e.add("b", 129, A)
    assert lookup(e.state, "b", 0) == MISS
    check(e.state)


def test_store_failed_for_some_keys_indexes_the_rest():
    e = running_with_store()
    assert ends(1, e.apply(ev.StoreFailed(job_id=1, keys=(KA0[2],)))) == (
        store_failed("", KA0[2]), fx.KeysLoadable(tier=0, keys=(*KA0[:2], KA0[3], *KA1)))
    c = e.core
    assert KA0[2] not in c.slot_of_key
    assert c.slot_state[2] == SlotState.FREE and c.free_slots == [2]
    assert policy_order(e) == (*KA0[:2], KA0[3], *KA1)
    assert (c.stats.store_failures, c.stats.keys_failed, c.stats.keys_stored) == (1, 1, 7)
    e.add("b", 129, A)
    assert lookup(e.state, "b", 0) == LookupResult(64)  # full attention stops at the hole
    check(e.state)


# load_completed / load_failed


def test_load_completed_runs_the_request_and_makes_the_keys_evictable_again():
    e = donor_stored()
    loading_b(e)
    assert ends(2, e.load_done(2)) == ()
    c = e.core
    r = c.requests["b"]
    assert r.status is RequestStatus.RUNNING and r.load_job_id == -1
    assert c.block_writer == {} and c.slot_loads == {} and c.jobs == {}
    # Reused keys move to the back of the LRU order, in the load's order.
    assert policy_order(e) == (*KA1[:2], *KA0, *KA1[2:])
    assert all(c.block_refs[b] == 1 for b in (9, 10, 11, 12, 13, 14, 15, 16))
    # The loaded blocks are already in the tier: computing the rest stores nothing.
    assert e.step(("b", 128, 1)) == ()
    check(e.state)


def test_load_failed_with_several_groups_drops_the_keys_and_starts_the_request_over():
    e = donor_stored()
    slot = tier_keys(e)
    loading_b(e)
    effects = e.apply(ev.LoadFailed(job_id=2, block_ids=(), keys=(KA0[1],)))
    assert ends(2, effects) == (load_failed("b", KA0[1]), fx.KeysUnloadable(tier=0, keys=(KA0[1],), reason=fx.Reason.FAILED),
                                fx.RequestRequeued(request_id="b", job_id=2))
    c = e.core
    assert KA0[1] not in c.slot_of_key
    assert c.slot_state[slot[KA0[1]]] == SlotState.FREE
    assert c.block_key[10] is None
    assert c.jobs == {} and c.block_writer == {} and c.slot_loads == {}
    # vLLM 0.32 fails the whole request with several groups: it is admitted again from scratch.
    r = c.requests["b"]
    assert r.status is RequestStatus.WAITING and r.load_job_id == -1
    assert r.table == [[], []] and r.num_computed_tokens == 0
    assert r.next_store == [0, 0]
    assert all(c.block_refs[b] == 0 for b in range(64))
    assert (c.stats.load_failures, c.stats.keys_failed) == (1, 1)
    assert lookup(e.state, "b", 0) == LookupResult(32)  # the hit stops before the dropped key
    check(e.state)
    (load,) = admits("b", e.alloc("b", (9, 10), (14, 15), ext=32))
    assert load.keys == ((KA0[0],), (KA1[0],))
    check(e.state)


def test_load_failed_with_one_group_runs_the_request_and_stores_the_block_again():
    e = donor_stored(full_only_config())
    e.add("b", 129, A)
    e.alloc("b", (9, 10, 11, 12, 13), ext=128)
    assert ends(2, e.apply(ev.LoadFailed(job_id=2, block_ids=(10,), keys=()))) == (
        load_failed("b", KA0[1]), fx.KeysUnloadable(tier=0, keys=(KA0[1],), reason=fx.Reason.FAILED))
    r = e.core.requests["b"]
    assert r.status is RequestStatus.RUNNING and r.load_job_id == -1
    assert r.table == [[9, 10, 11, 12, 13]] and r.next_store == [0]
    assert KA0[1] not in e.core.slot_of_key
    # vLLM recomputes from the failed block; the next step stores it again.
    (store,) = e.step(("b", 32, 97))
    assert store.keys == ((KA0[1],),)
    assert store.source_block_ids == ((10,),)
    check(e.state)


def test_load_failed_block_drops_its_key_too():
    e = donor_stored()
    loading_b(e)
    effects = e.apply(ev.LoadFailed(job_id=2, block_ids=(14,), keys=()))
    assert ends(2, effects) == (load_failed("b", KA1[2]), fx.KeysUnloadable(tier=0, keys=(KA1[2],), reason=fx.Reason.FAILED),
                                fx.RequestRequeued(request_id="b", job_id=2))
    assert KA1[2] not in e.core.slot_of_key
    assert e.core.jobs == {}
    e.add("c", 129, A)
    assert lookup(e.state, "c", 0) == LookupResult(64)  # the window ending at 96 lost a block
    check(e.state)


def test_load_failed_violations():
    e = donor_stored()
    loading_b(e)
    assert e.reject(ev.LoadFailed(job_id=2, block_ids=(13,), keys=())) == "foreign_blocks"
    assert e.reject(ev.LoadFailed(job_id=2, block_ids=(), keys=(KA1[0],))) == "foreign_keys"
    assert e.reject(ev.LoadFailed(job_id=2, block_ids=(), keys=())) == "empty_failure"
    assert e.reject(ev.LoadFailed(job_id=9, block_ids=(9,), keys=())) == "unknown_job"
    assert e.reject(ev.LoadCompleted(job_id=2, worker_index=3)) == "bad_worker"


# cache_reset


def test_cache_reset_evicts_everything_and_ignores_older_jobs():
    e = donor_stored()
    loading_b(e)  # load job 2 reads six of the eight keys
    e.add("s", 64, tag="s")
    e.alloc("s", (20, 21), (22, 23))
    e.step(("s", 0, 64))  # store job 3 in flight
    effects = e.apply(ev.CacheReset(epoch=1))
    assert effects == (fx.KeysUnloadable(tier=0, keys=KA0 + KA1, reason=fx.Reason.RESET),)
    c = e.core
    assert c.epoch == 1 and c.slot_of_key == {} and len(c.policy) == 0
    assert c.stats.evictions == 8
    assert c.jobs[2].stale and c.jobs[3].stale
    assert sorted(c.free_slots) == [4, 5]  # the unread keys; the others wait for their jobs
    check(e.state)
    e.add("c", 129, A)
    assert lookup(e.state, "c", 0) == MISS
    # Completions of pre-reset jobs are not violations and change nothing the tier offers.
    assert ends(3, e.store_done(3)) == ()
    assert e.core.slot_of_key == {} and e.core.stats.keys_stored == 8
    assert ends(2, e.load_done(2)) == ()
    assert e.core.requests["b"].status is RequestStatus.RUNNING
    assert e.core.num_used_slots() == 0 and len(e.core.policy) == 0
    check(e.state)
    # Stores restart: the next step stores the loaded prefix again.
    (store,) = e.step(("b", 128, 1))
    assert store.keys == (KA0, KA1[2:])  # window positions 0 and 1 hold no block
    check(e.state)


def test_cache_reset_stale_failures_are_not_violations():
    e = running_with_store()
    e.apply(ev.CacheReset(epoch=3))
    assert ends(1, e.apply(ev.StoreFailed(job_id=1))) == (store_failed("", *KA0, *KA1),)
    assert e.core.num_used_slots() == 0
    check(e.state)


def test_cache_reset_violation():
    e = Engine()
    assert e.reject(ev.CacheReset(epoch=0)) == "epoch_not_increasing"
    e.apply(ev.CacheReset(epoch=2))
    assert e.reject(ev.CacheReset(epoch=2)) == "epoch_not_increasing"


# Protection modes and workers


def test_pin_mode_pins_on_store_and_unpins_exactly_once():
    e = Engine(make_config(protection="pin"))
    e.add("a", 128)
    e.alloc("a", *A_BLOCKS)
    effects = e.step(("a", 0, 128))
    assert effects[0] == fx.PinDeviceBlocks(block_ids=(1, 2, 3, 4, 5, 6, 7, 8))
    assert isinstance(effects[1], fx.StartStore) and len(effects) == 2
    assert all(e.core.block_pins[b] == 1 for b in range(1, 9))
    e.finish("a")
    e.add("b", 64, tag="b")
    assert e.reject(ev.BlocksAllocated(request_id="b", block_ids=((1, 20), (21, 22)))) == "block_in_use"
    assert ends(1, e.store_done(1)) == (fx.UnpinDeviceBlocks(block_ids=(1, 2, 3, 4, 5, 6, 7, 8)),
                               fx.KeysLoadable(tier=0, keys=KA0 + KA1))
    assert all(e.core.block_pins[b] == 0 for b in range(64))
    assert e.reject(ev.StoreCompleted(job_id=1)) == "unknown_job"
    assert admits("b", e.alloc("b", (1, 20), (21, 22))) == ()  # no flush: pins kept the block safe
    check(e.state)


def test_pin_mode_unpins_a_failed_store_too():
    e = Engine(make_config(protection="pin"))
    e.add("a", 64, tag="p")
    e.alloc("a", (1, 2), (3, 4))
    e.step(("a", 0, 64))
    effects = e.apply(ev.StoreFailed(job_id=1))
    assert ends(1, effects)[1:] == (fx.UnpinDeviceBlocks(block_ids=(1, 2, 3, 4)),) and type(effects[0]) is fx.TransferFailed
    assert e.core.block_pins == [0] * 64
    check(e.state)


def test_two_workers_a_store_completes_after_both():
    e = Engine(make_config(world_size=2, protection="pin"))
    e.add("a", 128)
    e.alloc("a", *A_BLOCKS)
    e.step(("a", 0, 128))
    assert e.core.jobs[1].pending_workers == 0b11
    assert e.store_done(1, worker=1) == ()
    assert e.core.jobs[1].pending_workers == 0b01
    assert all(e.core.slot_state[s] == SlotState.STORING for s in range(8))
    e.add("b", 129, A)
    assert lookup(e.state, "b", 0).ready is False  # not stored on every worker yet
    assert e.reject(ev.StoreCompleted(job_id=1, worker_index=1)) == "duplicate_completion"
    assert e.reject(ev.StoreFailed(job_id=1, worker_index=1)) == "duplicate_completion"
    assert e.reject(ev.StoreCompleted(job_id=1, worker_index=2)) == "bad_worker"
    assert ends(1, e.store_done(1, worker=0)) == (fx.UnpinDeviceBlocks(block_ids=(1, 2, 3, 4, 5, 6, 7, 8)),
                                         fx.KeysLoadable(tier=0, keys=KA0 + KA1))
    assert e.core.stats.keys_stored == 8
    assert lookup(e.state, "b", 0) == LookupResult(128)
    check(e.state)


@pytest.mark.parametrize("first, last", [(0, 1), (1, 0)])
def test_two_workers_a_block_is_offered_and_counted_only_once_both_stored_it(first, last):
    # Each rank holds its own shard of a block: a hit needs every shard, so one
    # rank's report, whichever comes first, must neither offer nor count it.
    e = Engine(make_config(world_size=2))
    e.add("a", 128)
    e.alloc("a", *A_BLOCKS)
    (store,) = e.step(("a", 0, 128))
    keys = [k for group in store.keys for k in group]
    e.store_done(store.job_id, worker=first)
    assert not any(queries.is_loadable(e.state, k) for k in keys)
    assert queries.loadable_keys(e.state) == [] and e.core.stats.keys_stored == 0
    e.add("b", 129, A)
    assert lookup(e.state, "b", 0).ready is False
    e.store_done(store.job_id, worker=last)
    assert queries.loadable_keys(e.state) == sorted(keys) and e.core.stats.keys_stored == len(keys) == 8
    assert lookup(e.state, "b", 0) == LookupResult(128)
    check(e.state)


def test_two_workers_one_failing_store_drops_its_keys():
    e = Engine(make_config(world_size=2))
    e.add("a", 128)
    e.alloc("a", *A_BLOCKS)
    e.step(("a", 0, 128))
    e.apply(ev.StoreFailed(job_id=1, worker_index=0, keys=(KA1[3],)))
    e.store_done(1, worker=1)
    assert KA1[3] not in e.core.slot_of_key and len(e.core.slot_of_key) == 7
    check(e.state)


def test_two_workers_a_load_ends_after_both_and_keeps_either_failure():
    e = donor_stored(make_config(world_size=2))
    loading_b(e)
    assert e.apply(ev.LoadFailed(job_id=2, worker_index=1, block_ids=(11,), keys=())) == (
        load_failed("b", KA0[2], worker=1),)  # the outcome waits for the other worker
    assert e.core.requests["b"].status is RequestStatus.LOADING
    assert e.reject(ev.LoadCompleted(job_id=2, worker_index=1)) == "duplicate_completion"
    assert ends(2, e.load_done(2, worker=0)) == (fx.KeysUnloadable(tier=0, keys=(KA0[2],), reason=fx.Reason.FAILED),
                                                 fx.RequestRequeued(request_id="b", job_id=2))
    assert e.core.requests["b"].status is RequestStatus.WAITING
    assert KA0[2] not in e.core.slot_of_key
    check(e.state)


# Tier admission and eviction


def test_store_admission_rejects_what_does_not_fit_without_a_violation():
    e = Engine(full_only_config(num_tier_slots=6))
    e.add("a", 128)
    e.alloc("a", (1, 2, 3, 4))
    e.step(("a", 0, 128))  # 4 slots storing
    e.add("b", 128, tag="b")
    e.alloc("b", (5, 6, 7, 8))
    refused, store = e.step(("b", 0, 128))
    assert refused == fx.KeysNotAdmitted(keys=tuple(key(h, 0) for h in chain(4, "b")[2:]))
    assert store.keys == (tuple(key(h, 0) for h in chain(2, "b")),)
    assert store.target_slot_ids == ((4, 5),)
    assert e.core.stats.store_rejections == 2
    e.add("c", 64, tag="c")
    e.alloc("c", (9, 10))
    # Every slot is storing: nothing can be evicted, and nothing is stored.
    assert e.step(("c", 0, 64)) == (fx.KeysNotAdmitted(keys=tuple(key(h, 0) for h in chain(2, "c"))),)
    assert e.core.stats.store_rejections == 4
    assert e.core.next_job_id == 3
    check(e.state)


def test_store_admission_never_evicts_a_key_under_a_load():
    e = Engine(full_only_config(num_tier_slots=4))
    e.run_and_store("a", 128, (1, 2, 3, 4))
    e.finish("a")
    e.add("l", 97, A[:3])
    e.alloc("l", (5, 6, 7, 8), ext=96)  # loads keys 0-2
    e.add("b", 128, tag="b")
    e.alloc("b", (9, 10, 11, 12))
    effects = e.step(("b", 0, 128))
    kb0 = key(chain(1, "b")[0], 0)
    assert effects == (
        fx.KeysNotAdmitted(keys=tuple(key(h, 0) for h in chain(4, "b")[1:])),
        fx.KeysUnloadable(tier=0, keys=(KA0[3],), reason=fx.Reason.EVICTED),
        fx.StartStore(job_id=3, request_id="", keys=((kb0,),), source_block_ids=((9,),),
                      target_slot_ids=((3,),)),
    )
    assert e.core.stats.store_rejections == 3 and e.core.stats.evictions == 1
    check(e.state)


def test_eviction_is_least_recently_stored_or_loaded_first():
    e = Engine(full_only_config(num_tier_slots=4))
    e.run_and_store("a", 128, (1, 2, 3, 4))
    e.finish("a")
    e.add("l", 33, A[:1])
    e.alloc("l", (5, 6), ext=32)
    e.load_done(2)  # key 0 was just reused: it goes last
    assert policy_order(e) == (KA0[1], KA0[2], KA0[3], KA0[0])
    e.add("b", 64, tag="b")
    e.alloc("b", (9, 10))
    effects = e.step(("b", 0, 64))
    assert effects[0] == fx.KeysUnloadable(tier=0, keys=(KA0[1], KA0[2]), reason=fx.Reason.EVICTED)
    assert effects[1].target_slot_ids == ((2, 1),)  # freed slots are reused, last freed first
    assert e.core.stats.evictions == 2
    assert policy_order(e) == (KA0[3], KA0[0])
    check(e.state)


# The reducer's own contract


def test_a_consumed_state_handle_is_stale():
    e = Engine()
    old = e.state
    e.add("a", 64)
    with pytest.raises(StaleStateError):
        old.core  # noqa: B018


def test_strict_mode_raises_and_keeps_the_handle_usable():
    e = Engine()
    state = e.state
    with pytest.raises(ProtocolViolation) as raised:
        reduce(state, ev.RequestResumed(request_id="x"), strict=True)
    assert raised.value.code == "illegal_request_event" and raised.value.request_id == "x"
    assert state.core.requests == {}


def test_reduce_step_strict_raises_as_the_fold_does():
    """The fold restores the handle it was given: the caller's when the first event
    fails, an intermediate one (never seen by the caller) after that."""
    e = Engine()
    state = e.state
    with pytest.raises(ProtocolViolation):
        reduce_step(state, [ev.RequestResumed(request_id="x")], strict=True)
    assert state.core.requests == {}
    with pytest.raises(ProtocolViolation):
        reduce_step(state, [ev.RequestAdded(request_id="a", num_prompt_tokens=128, block_hashes=A),
                            ev.RequestResumed(request_id="a")], strict=True)
    with pytest.raises(StaleStateError):
        state.core  # noqa: B018


def test_reduce_step_equals_folding_reduce():
    events = [
        ev.RequestAdded(request_id="a", num_prompt_tokens=128, block_hashes=A),
        ev.BlocksAllocated(request_id="a", block_ids=A_BLOCKS),
        ev.RequestResumed(request_id="a"),  # illegal: reported, skipped
        ev.StepScheduled(step_index=0, request_ids=("a",), num_computed_tokens=(0,), num_scheduled_tokens=(128,)),
    ]
    one = Engine(strict=False)
    folded = []
    for event in events:
        folded.extend(one.apply(event))
    state, effects = reduce_step(Engine().state, events)
    assert digest(state) == digest(one.state)
    assert effects == tuple(folded)
    assert [type(x) for x in effects] == [fx.RequestAdmitted, fx.ReportViolation, fx.StartStore]


def test_a_load_target_still_read_by_a_store_is_flushed_before_the_load():
    e = donor_stored()
    e.add("x", 64, tag="x")
    e.alloc("x", (20, 21), (22, 23))
    e.step(("x", 0, 64))  # store job 2 reads 20-23
    e.finish("x")
    e.add("b", 129, A)
    effects = admits("b", e.alloc("b", (20, 10, 11, 12, 13), (0, 0, 14, 15, 16), ext=128))
    assert [type(x) for x in effects] == [fx.FlushStores, fx.StartLoad]
    assert effects[0] == fx.FlushStores(job_ids=(2,))
    assert effects[1].target_block_ids == ((20, 10, 11, 12), (14, 15))
    check(e.state)


# KeysUnloadable names only keys that left the tier.


def test_a_failed_load_of_a_key_stored_again_since_does_not_report_it_evicted():
    e = donor_stored()
    loading_b(e)  # job 2 reads the pre-reset copies
    e.apply(ev.CacheReset(epoch=1))
    e.add("x", 129, A)
    e.alloc("x", (20, 21, 22, 23, 24), (25, 26, 27, 28, 29))
    e.step(("x", 0, 129))
    e.store_done(3)  # prefix "a" is stored again, in new slots
    e.add("y", 129, A)
    assert lookup(e.state, "y", 0) == LookupResult(128)
    effects = e.apply(ev.LoadFailed(job_id=2, block_ids=(), keys=(KA0[1],)))
    assert KA0[1] in e.core.slot_of_key  # the new copy is still offered...
    assert lookup(e.state, "y", 0) == LookupResult(128)
    assert only_evictions(effects) == []  # ...so it must not be reported as gone
    assert e.core.stats.load_failures == 1
    check(e.state)


def test_two_failed_loads_of_one_key_report_its_eviction_once():
    e = donor_stored(full_only_config())
    e.add("b", 129, A)
    e.alloc("b", (9, 10, 11, 12, 13), ext=128)  # job 2
    e.add("c", 129, A)
    e.alloc("c", (20, 21, 22, 23, 24), ext=128)  # job 3 reads the same slots
    assert ends(2, e.apply(ev.LoadFailed(job_id=2, block_ids=(10,), keys=()))) == (
        load_failed("b", KA0[1]), fx.KeysUnloadable(tier=0, keys=(KA0[1],), reason=fx.Reason.FAILED))
    (store,) = e.step(("b", 32, 97))  # b recomputes block 1 and stores it again
    e.store_done(store.job_id)
    assert KA0[1] in e.core.slot_of_key
    effects = e.apply(ev.LoadFailed(job_id=3, block_ids=(21,), keys=()))
    assert only_evictions(effects) == []
    assert KA0[1] in e.core.slot_of_key
    check(e.state)


def only_evictions(effects: tuple) -> list:
    return [x for x in effects if isinstance(x, fx.KeysUnloadable)]


def _lazy_block_known():
    """Lazy mode: request "a" ran 64 tokens on full blocks 1, 2 and finished,
    so the engine knows what the free blocks 1, 2 hold and has stored nothing."""
    e = Engine(full_only_config(store_mode="lazy"))
    e.add("a", 64)
    e.alloc("a", (1, 2))
    e.step(("a", 0, 64))
    e.finish("a")
    assert e.core.lazy_keys and not e.core.jobs
    return e


def test_a_reset_forgets_what_free_blocks_held():
    # vLLM resets before a sleep discards the KV cache and before new weights:
    # a block reused afterwards must not be stored as what it held before.
    e = _lazy_block_known()
    e.apply(ev.CacheReset(epoch=1))
    assert e.core.lazy_keys == {} and set(e.core.block_key) == {None}
    assert e.apply(ev.BlocksNearEviction(block_ids=(1, 2))) == ()
    check(e.state)


def test_a_version_1_reset_kept_what_free_blocks_held():
    # Old logs replay as they ran: their resets stored the old content afterwards.
    e = _lazy_block_known()
    e.apply(ev.CacheReset(epoch=1, forget_device=False))
    (store,) = only(e.apply(ev.BlocksNearEviction(block_ids=(1, 2))), fx.StartStore)
    assert store.source_block_ids == ((1, 2),)


def test_a_rekeyed_reset_forgets_every_live_requests_keys_until_told_again():
    e = Engine(full_only_config())
    e.add("a", 64)
    e.alloc("a", (1, 2, 3))
    (old,) = only(e.step(("a", 0, 64)), fx.StartStore)
    e.apply(ev.CacheReset(epoch=1, rekeyed=True))
    mine = e.core.requests["a"]
    assert mine.hashes == [] and mine.keys == [[]]
    assert e.step(("a", 64, 1)) == ()  # no keys: nothing can be stored under the old ones
    new = chain(2, "gen1")
    e.apply(ev.BlockHashesAppended(request_id="a", num_tokens=65, block_hashes=new))
    (store,) = only(e.step(("a", 65, 1)), fx.StartStore)
    assert store.keys == ((key(new[0], 0), key(new[1], 0)),) != old.keys
    check(e.state)


@pytest.mark.parametrize("forget_device", [True, False])
def test_after_a_rekeyed_reset_a_new_key_may_touch_a_block_that_held_an_old_one(forget_device):
    # vLLM's own prefix cache keeps its blocks when a reset leaves running requests
    # (its hashes do not change with kvledger's key generation).
    e = Engine(full_only_config())
    e.run_and_store("a", 64, (1, 2))
    e.finish("a")
    e.apply(ev.CacheReset(epoch=1, rekeyed=True, forget_device=forget_device))
    e.add("b", 64, chain(2, "gen1"))
    if forget_device:
        assert not violations(e.touch("b", (1, 2)))
        check(e.state)
    else:  # the old semantics: the block is taken for what it held
        assert e.reject(ev.BlocksTouched(request_id="b", block_ids=((1, 2),))) == "touch_wrong_content"
