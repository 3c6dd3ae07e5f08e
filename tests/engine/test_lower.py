"""Tiers below host memory, event by event: write-through, promotion, the
races of one step's admissions, failures, capacity, discovery and reset."""

from __future__ import annotations

import pytest

from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.invariants import check
from kvledger.engine.lookup import lookup
from kvledger.events import types as ev
from kvledger.events.config import StoreJobs
from tests.engine.builders import FULL, Engine, chain, key, make_config, only

pytestmark = pytest.mark.fast


def tiered(slots: int = 8, disk: int = 16) -> Engine:
    return Engine(make_config(groups=(FULL,), num_tier_slots=slots,
                              lower_tiers=({"name": "1:fs", "num_blocks": disk},)))


def stored_and_spilled(e: Engine, rid: str = "a", tokens: int = 96, blocks=(1, 2, 3), tag: str = "a") -> None:
    e.run_and_store(rid, tokens, blocks, tag=tag)
    e.apply(ev.RequestFinished(request_id=rid, block_ids=(blocks,)))


def disk(e: Engine) -> list[bytes]:
    return list(e.core.lower[0].held)


def test_a_stored_block_is_written_through_and_the_host_keeps_it() -> None:
    e = tiered()
    e.add("a", 96)
    e.alloc("a", (1, 2, 3))
    e.step(("a", 0, 96))
    (store,) = [j for j in e.core.jobs.values()]
    effects = e.store_done(store.job_id)
    (spill,) = only(effects, fx.StartSpill)
    keys = tuple(key(h, 0) for h in chain(3))
    assert spill.tier == 1 and spill.keys == (keys,)
    assert spill.source_slot_ids == (tuple(e.core.slot_of_key[k] for k in keys),)
    assert e.core.lower[0].writing == dict.fromkeys(keys, spill.job_id)
    # The host copy is loadable while it is being written, and stays after.
    assert all(queries.is_loadable(e.state, k) for k in keys)
    e.store_done(spill.job_id)
    assert disk(e) == list(keys) and not e.core.lower[0].writing
    assert all(queries.is_loadable(e.state, k) for k in keys)
    check(e.state)


def test_a_failed_write_keeps_the_host_copy_and_removes_any_partial_file() -> None:
    e = tiered()
    e.add("a", 64)
    e.alloc("a", (1, 2))
    e.step(("a", 0, 64))
    (store,) = list(e.core.jobs.values())
    (spill,) = only(e.store_done(store.job_id), fx.StartSpill)
    bad = spill.keys[0][0]
    effects = e.apply(ev.StoreFailed(job_id=spill.job_id, keys=(bad,)))
    assert only(effects, fx.DropTierKeys) == [fx.DropTierKeys(tier=1, keys=(bad,), reason=fx.Reason.FAILED)]
    assert disk(e) == [spill.keys[0][1]]
    assert queries.is_loadable(e.state, bad)  # still in host memory
    assert e.core.lower[0].counts["write_failures"] == 1
    check(e.state)


def spilled_by_two_ranks(e: Engine) -> fx.StartSpill:
    e.add("a", 64)
    e.alloc("a", (1, 2))
    (store,) = e.step(("a", 0, 64))
    e.store_done(store.job_id, worker=0)
    (spill,) = only(e.store_done(store.job_id, worker=1), fx.StartSpill)
    return spill


@pytest.mark.parametrize("writer_ok", [True, False])
def test_ranks_sharing_one_copy_a_block_is_held_by_the_writers_report(writer_ok: bool) -> None:
    # Ranks with identical KV (MLA) keep one file per block: rank 1 writes
    # nothing and reports at once. Its report must not make the block held;
    # rank 0's decides, a failure included.
    e = Engine(make_config(groups=(FULL,), num_tier_slots=8, world_size=2,
                           lower_tiers=({"name": "1:fs", "num_blocks": 16},)))
    spill = spilled_by_two_ranks(e)
    keys = spill.keys[0]
    assert e.store_done(spill.job_id, worker=1) == ()
    assert not any(queries.tier_holds(e.state, 1, k) for k in keys)
    if writer_ok:
        e.store_done(spill.job_id, worker=0)
        assert all(queries.tier_holds(e.state, 1, k) for k in keys)
    else:
        effects = e.apply(ev.StoreFailed(job_id=spill.job_id, worker_index=0, keys=(keys[0],)))
        assert only(effects, fx.DropTierKeys) == [fx.DropTierKeys(tier=1, keys=(keys[0],), reason=fx.Reason.FAILED)]
        assert [queries.tier_holds(e.state, 1, k) for k in keys] == [False, True]
    assert all(queries.is_loadable(e.state, k) for k in keys)  # each rank's host copy either way
    check(e.state)


def evict_host(e: Engine, tag: str = "z", blocks=(10, 11, 12, 13, 14, 15, 16, 17)) -> None:
    """Fill host memory with another document, so the first one is on disk only."""
    stored_and_spilled(e, "filler", 32 * len(blocks), blocks, tag=tag)


def test_a_hit_on_disk_only_is_promoted_through_a_host_slot() -> None:
    e = tiered()
    stored_and_spilled(e)
    evict_host(e)
    keys = [key(h, 0) for h in chain(3)]
    assert not any(k in e.core.slot_of_key for k in keys) and set(keys) <= set(disk(e))
    e.add("b", 100)
    assert lookup(e.state, "b", 0).num_hit_tokens == 96
    effects = e.alloc("b", (20, 21, 22, 23), ext=96)
    (load,) = only(effects, fx.StartLoad)
    assert load.promote_tiers == ((1, 1, 1),)
    assert all(s >= 0 for s in load.source_slot_ids[0])
    assert e.core.lower[0].reading == dict.fromkeys(keys, 1)
    check(e.state)
    e.load_done(load.job_id)
    assert all(queries.is_loadable(e.state, k) for k in keys)  # promoted: host memory holds them again
    assert e.core.lower[0].counts["keys_read"] == 3 and not e.core.lower[0].reading
    assert disk(e)[-3:] == keys  # most recently used now
    check(e.state)


def test_a_damaged_promotion_fails_drops_the_key_and_removes_the_file() -> None:
    e = tiered()
    stored_and_spilled(e)
    evict_host(e)
    e.add("b", 100)
    (load,) = only(e.alloc("b", (20, 21, 22, 23), ext=96), fx.StartLoad)
    bad = load.keys[0][1]
    effects = e.apply(ev.LoadFailed(job_id=load.job_id, block_ids=(21,), keys=(bad,)))
    assert fx.DropTierKeys(tier=1, keys=(bad,), reason=fx.Reason.FAILED) in effects
    assert bad not in e.core.lower[0].held and bad not in e.core.slot_of_key
    assert queries.is_loadable(e.state, load.keys[0][0])  # the first block was read fine
    assert e.core.lower[0].counts["read_failures"] == 1
    check(e.state)


def test_two_admissions_in_one_step_promoting_the_same_keys() -> None:
    """vLLM looks both up before either allocation is applied: both saw the keys on disk only."""
    e = tiered()
    stored_and_spilled(e)
    evict_host(e)
    e.add("b", 100)
    e.add("c", 100)
    assert lookup(e.state, "b", 0).num_hit_tokens == lookup(e.state, "c", 0).num_hit_tokens == 96
    (first,) = only(e.alloc("b", (20, 21, 22, 23), ext=96), fx.StartLoad)
    (second,) = only(e.alloc("c", (24, 25, 26, 27), ext=96), fx.StartLoad)
    assert second.promote_tiers == ((1, 1, 1),)
    assert set(first.source_slot_ids[0]).isdisjoint(second.source_slot_ids[0])
    check(e.state)
    e.load_done(second.job_id)  # the unindexed copies are freed
    e.load_done(first.job_id)
    assert all(queries.is_loadable(e.state, k) for k in first.keys[0])
    check(e.state)


def test_a_key_lost_to_an_earlier_admission_fails_its_block() -> None:
    """Host-only keys an earlier admission of the step evicted: that block fails, nothing raises."""
    e = Engine(make_config(groups=(FULL,), num_tier_slots=4, lower_tiers=({"name": "1:fs", "num_blocks": 2},)))
    e.run_and_store("a", 96, (1, 2, 3))  # 3 host slots; the disk holds only 2 of them
    e.apply(ev.RequestFinished(request_id="a", block_ids=((1, 2, 3),)))
    on_disk = disk(e)
    assert len(on_disk) == 2
    host_only = next(k for k in (key(h, 0) for h in chain(3)) if k not in on_disk)
    e.add("b", 100)
    assert lookup(e.state, "b", 0).num_hit_tokens == 96
    # An earlier admission of the same step evicted it to make room for its promotions
    # (done here by hand: the slot module's eviction, for this one key).
    slot = e.core.slot_of_key.pop(host_only)
    e.core.policy.remove(host_only)
    e.core.slot_key[slot] = None
    e.core.slot_state[slot] = 0
    e.core.free_slots.append(slot)
    (load,) = only(e.alloc("b", (20, 21, 22, 23), ext=96), fx.StartLoad)
    position = load.keys[0].index(host_only)
    assert load.source_slot_ids[0][position] == -1 and load.promote_tiers[0][position] == 1
    check(e.state)


def test_capacity_evicts_least_recently_used_files() -> None:
    e = tiered(slots=16, disk=4)
    stored_and_spilled(e, "a", 96, (1, 2, 3), tag="a")
    first = disk(e)
    stored_and_spilled(e, "b", 64, (4, 5), tag="b")
    assert len(disk(e)) == 4 and first[0] not in disk(e)
    assert e.core.lower[0].counts["evictions"] == 1
    check(e.state)


def test_keys_found_join_the_tier_and_a_reset_removes_everything() -> None:
    e = tiered(disk=3)
    found = tuple(key(h, 0) for h in chain(4, "other"))
    effects = e.apply(ev.TierKeysFound(tier=1, keys=found))
    assert disk(e) == list(found[1:])  # oldest first: over capacity, the oldest goes
    assert effects == (fx.KeysLoadable(tier=1, keys=found),  # found, then the oldest evicted
                       fx.DropTierKeys(tier=1, keys=(found[0],), reason=fx.Reason.EVICTED),
                       fx.KeysUnloadable(tier=1, keys=(found[0],), reason=fx.Reason.EVICTED))
    e.add("b", 100, hashes=chain(3, "other"))
    assert lookup(e.state, "b", 0).num_hit_tokens == 0  # the first block is gone: no prefix
    effects = e.apply(ev.CacheReset(epoch=1))
    assert fx.DropTierKeys(tier=1, keys=found[1:], reason=fx.Reason.RESET) in effects and not disk(e)
    with pytest.raises(Exception, match="unknown_tier"):
        e.apply(ev.TierKeysFound(tier=2, keys=found))
    check(e.state)


def test_a_reset_that_keeps_the_lower_tiers_leaves_their_blocks_loadable() -> None:
    """`keep_lower` (`key_generations` "kept"): host memory is emptied, the disk keeps every
    block it held and a later request promotes them; a spill in flight at the reset is stale,
    and what it wrote is removed at its end. Never with a new key generation."""
    e = tiered()
    stored_and_spilled(e)
    held = disk(e)
    e.add("c", 64, hashes=chain(2, "c"))
    e.alloc("c", (7, 8))
    (store,) = e.step(("c", 0, 64))
    (spill,) = only(e.store_done(store.job_id), fx.StartSpill)
    effects = e.apply(ev.CacheReset(epoch=1, keep_lower=True))
    assert only(effects, fx.DropTierKeys) == [] and disk(e) == held
    assert {effect.tier for effect in only(effects, fx.KeysUnloadable)} == {0}  # host memory alone
    dropped = only(e.store_done(spill.job_id), fx.DropTierKeys)
    assert dropped == [fx.DropTierKeys(tier=1, keys=spill.keys[0], reason=fx.Reason.RESET)] and disk(e) == held
    e.add("b", 100)
    assert lookup(e.state, "b", 0).num_hit_tokens == 96
    (load,) = only(e.alloc("b", (20, 21, 22, 23), ext=96), fx.StartLoad)
    assert load.promote_tiers == ((1, 1, 1),)
    check(e.state)
    with pytest.raises(Exception, match="bad_reset"):
        e.apply(ev.CacheReset(epoch=2, keep_lower=True, rekeyed=True))


def test_a_lookup_counts_the_slots_earlier_hits_of_the_step_will_take() -> None:
    e = tiered(slots=4)
    stored_and_spilled(e)
    evict_host(e, blocks=(10, 11, 12, 13))
    e.add("b", 100)
    alone = lookup(e.state, "b", 0)
    assert alone.num_hit_tokens == 96 and alone.slots_taken == 3  # three promotions
    # Earlier admissions of this step take two of the four slots: the hit fits in host
    # memory once their loads end, so the request waits for the slots, not cut short.
    for promised in (2, 3, 4):
        waits = lookup(e.state, "b", 0, slots_promised=promised)
        assert not waits.ready and waits.num_hit_tokens == 0


def test_a_hit_read_in_place_waits_while_earlier_promotions_of_the_step_would_evict_it() -> None:
    e = tiered(slots=4)
    stored_and_spilled(e)  # a's three blocks, on disk
    evict_host(e, blocks=(10, 11, 12, 13))  # host memory: the filler's four, idle (and on disk)
    e.add("b", 100)  # a's document: three promotions
    e.add("x", 140, tag="z")  # the filler's document: read where it is
    first = lookup(e.state, "b", 0)
    assert first.num_hit_tokens == 96 and first.slots_taken == first.promotions == 3
    alone = lookup(e.state, "x", 0)
    assert alone.num_hit_tokens == 128 and alone.slots_taken == 4 and alone.promotions == 0
    # b is admitted first in the step: its promotions will evict three of the keys x reads.
    assert not lookup(e.state, "x", 0, slots_promised=3, promotions_promised=3).ready
    # Hits that only read in place evict nothing: x need not wait for them.
    assert lookup(e.state, "x", 0, slots_promised=4).num_hit_tokens == 128
    # What the wait avoids: admitted after b anyway, x finds three of its keys evicted by
    # b's promotions, and no slot left to promote them back into (recomputed).
    e.alloc("b", (20, 21, 22, 23), ext=96)
    (load,) = only(e.alloc("x", (30, 31, 32, 33, 34), ext=128), fx.StartLoad)
    assert load.promote_tiers == ((1, 1, 1, 0),) and load.source_slot_ids[0][:3] == (-1, -1, -1)
    check(e.state)


def test_a_hit_larger_than_host_memory_takes_what_fits() -> None:
    e = tiered(slots=4)
    stored_and_spilled(e, "a", 160, (1, 2, 3, 4, 5))  # five blocks on disk, four host slots
    evict_host(e, blocks=(10, 11, 12, 13))
    e.add("b", 170)
    assert lookup(e.state, "b", 0).num_hit_tokens == 128  # four promotions: every slot
    assert not lookup(e.state, "b", 0, slots_promised=1).ready  # those four, once another hit's load ends


@pytest.mark.parametrize("jobs", list(StoreJobs), ids=lambda j: j.value)
def test_stores_host_memory_cannot_take_wait_for_slots_when_a_lower_tier_has_room(jobs: StoreJobs) -> None:
    e = Engine(make_config(groups=(FULL,), num_tier_slots=2, store_jobs=jobs,
                           lower_tiers=({"name": "1:fs", "num_blocks": 16},)))
    e.add("a", 100)
    e.alloc("a", (1, 2, 3, 4))
    (store,) = only(e.step(("a", 0, 96)), fx.StartStore)  # three blocks full, two slots
    assert len(store.keys[0]) == 2 and e.core.stats.store_rejections == 0
    assert only(e.step(("a", 96, 1)), fx.StartStore) == []  # the slots are still being stored into
    e.finish_all_jobs()  # stored, and written through: the slots are evictable again
    (late,) = only(e.step(("a", 97, 1)), fx.StartStore)
    assert late.keys[0] == (key(chain(3)[2], 0),)
    e.finish_all_jobs()
    assert set(disk(e)) == {key(h, 0) for h in chain(3)}  # every block reached the disk
    assert e.core.stats.store_rejections == 0
    check(e.state)


@pytest.mark.parametrize("end", ["finished", "preempted", "aborted"])
def test_blocks_still_waiting_when_their_request_ends_are_counted_not_admitted(end: str) -> None:
    e = tiered(slots=2)
    e.add("a", 100)
    e.alloc("a", (1, 2, 3, 4))
    e.step(("a", 0, 96))
    e.step(("a", 96, 1))  # the slots are still being stored into: the third block waits again
    {"finished": e.finish, "preempted": e.preempt, "aborted": e.abort}[end]("a")
    assert e.core.stats.store_rejections == 1  # the third block, never stored
    e.finish_all_jobs()
    check(e.state)


def test_without_a_lower_tier_what_host_memory_cannot_take_is_not_stored() -> None:
    e = Engine(make_config(groups=(FULL,), num_tier_slots=2))
    e.add("a", 100)
    e.alloc("a", (1, 2, 3, 4))
    e.step(("a", 0, 96))
    assert e.core.stats.store_rejections == 1
    e.finish_all_jobs()
    assert only(e.step(("a", 96, 1)), fx.StartStore) == []  # not offered again
    check(e.state)


def test_a_jobs_end_is_announced_once_with_its_outcome() -> None:
    """`JobEnded` carries what a consumer would otherwise read from the state after a report
    (a step's store serves no one request: its request is "")."""
    e = tiered()
    e.add("a", 64)
    e.alloc("a", (1, 2))
    e.step(("a", 0, 64))
    (store,) = list(e.core.jobs.values())
    effects = e.store_done(store.job_id)
    (spill,) = only(effects, fx.StartSpill)
    assert only(effects, fx.JobEnded) == [fx.JobEnded(job_id=store.job_id, kind="store", request_id="", tier=0,
                                                      keys=store.keys, failed_keys=(), stale=False)]
    bad = spill.keys[0][0]
    effects = e.apply(ev.StoreFailed(job_id=spill.job_id, keys=(bad,)))
    assert only(effects, fx.JobEnded) == [fx.JobEnded(job_id=spill.job_id, kind="spill", request_id="", tier=1,
                                                      keys=spill.keys, failed_keys=(bad,), stale=False)]


def test_a_job_two_ranks_copy_ends_at_the_second_report_and_keeps_the_firsts_failure() -> None:
    e = Engine(make_config(groups=(FULL,), num_tier_slots=8, world_size=2))
    e.add("a", 64)
    e.alloc("a", (1, 2))
    e.step(("a", 0, 64))
    (store,) = list(e.core.jobs.values())
    failed = store.keys[0][1]
    assert only(e.apply(ev.StoreFailed(job_id=store.job_id, worker_index=1, keys=(failed,))), fx.JobEnded) == []
    e.apply(ev.CacheReset(epoch=1))
    (ended,) = only(e.store_done(store.job_id, worker=0), fx.JobEnded)
    assert ended.failed_keys == (failed,) and ended.stale
