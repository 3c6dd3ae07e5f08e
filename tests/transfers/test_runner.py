"""The runner on the CPU backend: exact bytes, exact events, bounded waits."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvledger.engine.effects import FlushStores, KeysUnloadable, Reason, StartLoad
from kvledger.events.types import LoadCompleted, LoadFailed, StoreCompleted, StoreFailed
from kvledger.transfers.copies.backend import CopyJob, Direction, TransferTimeout
from tests.transfers import layouts
from tests.transfers.harness import GatedBackend, RaisingBackend, keys_for, load, make_rig, store

BUILDERS = [
    lambda: layouts.cpu_attention(packing="layer"),
    lambda: layouts.cpu_attention(packing="block", num_layers=3),
    lambda: layouts.cpu_attention(kernel=2),
    lambda: layouts.flash_attention(kv_outer=True, hnd=True),
    lambda: layouts.flash_attention(kv_outer=False, hnd=False, kernel=2),
    lambda: layouts.mla(padded_bytes=256),
    lambda: layouts.mamba(),
    lambda: layouts.hybrid_sliding(packing="layer"),
    lambda: layouts.hybrid_sliding(packing="block"),
    lambda: layouts.hybrid_mamba(),
    lambda: layouts.packed_uniform(),
]


@st.composite
def round_trips(draw):
    case = draw(st.sampled_from(BUILDERS))()
    groups = len(case.config.kv_cache_groups)
    usable = list(range(1, case.num_blocks))
    order = draw(st.permutations(usable))
    slots = draw(st.permutations(range(16)))
    blocks_by_group, slots_by_group, taken = [], [], 0
    for _ in range(groups):
        n = draw(st.integers(0, (len(usable) // groups)))
        blocks_by_group.append(order[taken : taken + n])
        slots_by_group.append(slots[taken : taken + n])
        taken += n
    return case, blocks_by_group, slots_by_group


@settings(max_examples=40, deadline=None)
@given(round_trips())
def test_device_host_device_round_trip_is_byte_exact(example) -> None:
    case, blocks, slots = example
    rig = make_rig(case)
    original = rig.snapshot()
    rig.runner.submit([store(1, blocks, slots), FlushStores(job_ids=(1,))])
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    scrambled = rig.scramble(seed=99)
    rig.runner.submit([load(2, slots, blocks)])
    rig.runner.wait([2])
    assert rig.runner.poll() == [LoadCompleted(job_id=2, worker_index=3)]
    masks = rig.block_mask(dict(enumerate(blocks)))
    for raw, mask, before, after in zip(case.raws, masks, original, scrambled):
        assert torch.equal(raw[mask], before[mask]), "restored bytes differ"
        assert torch.equal(raw[~mask], after[~mask]), "bytes outside the loaded blocks changed"
    rig.runner.shutdown()


def test_flush_waits_for_the_named_jobs_only() -> None:
    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(), backend_cls=GatedBackend, gates={2: gate}, timeout_s=0.3)
    runner = rig.runner
    runner.submit([store(1, [[1, 2]], [[0, 1]]), store(2, [[3]], [[2]]), FlushStores(job_ids=(1,))])
    assert runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    assert runner.in_flight == {2}
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"flush of stores \[2\]"):
        runner.submit([FlushStores(job_ids=(2,))])
    assert time.monotonic() - started < 3
    assert runner.poll() == []
    gate.set()
    runner.submit([FlushStores(job_ids=(2, 1, 77))])  # finished and unknown ids are fine
    assert runner.poll() == [StoreCompleted(job_id=2, worker_index=3)]
    runner.shutdown()


def test_a_slow_store_does_not_hold_back_a_load() -> None:
    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(), backend_cls=GatedBackend, gates={5: gate}, timeout_s=5)
    rig.runner.submit([store(5, [[1]], [[0]]), load(6, [[3]], [[2]])])
    rig.runner.wait([6], timeout_s=5)
    assert rig.runner.poll() == [LoadCompleted(job_id=6, worker_index=3)]
    gate.set()
    rig.runner.submit([FlushStores(job_ids=(5,))])
    assert rig.runner.poll() == [StoreCompleted(job_id=5, worker_index=3)]
    rig.runner.shutdown()


def test_an_exception_in_a_copy_is_a_failure_event_and_the_thread_lives_on() -> None:
    rig = make_rig(layouts.hybrid_sliding(), backend_cls=RaisingBackend, failing={1, 3})
    runner = rig.runner
    with capture_logs() as logs:
        runner.submit([store(1, [[1], [2, 3]], [[0], [1, 2]]), store(2, [[4], []], [[3], []]), FlushStores(job_ids=(1, 2))])
        runner.submit([load(3, [[0], [1]], [[5], [6]]), load(4, [[3], []], [[7], []])])
        runner.wait([3, 4])
        events = runner.poll()
    assert sorted(events, key=lambda e: e.job_id) == [
        StoreFailed(job_id=1, worker_index=3, keys=keys_for(1, [[1], [2, 3]])[0] + keys_for(1, [[1], [2, 3]])[1],
                    reason="copy_failed"),
        StoreCompleted(job_id=2, worker_index=3),
        LoadFailed(job_id=3, worker_index=3, block_ids=(5, 6), keys=(b"k3-0-0", b"k3-1-0"), reason="copy_failed"),
        LoadCompleted(job_id=4, worker_index=3),
    ]
    assert any(log["event"] == "copy_failed" and "disk on fire" in log["error"] for log in logs)
    assert any(log["event"] == "transfer_failed" and log["job_id"] == 3 for log in logs)
    runner.shutdown()


BAD_EFFECTS = {
    "too few groups": store(10, [], []),
    "misaligned": store(10, [[1, 2]], [[0]]),
    "null block": store(10, [[0, 1]], [[0, 1]]),
    "block past the pool": store(10, [[6]], [[0]]),
    "slot past the tier": store(10, [[1]], [[16]]),
    "negative slot": load(10, [[-1]], [[1]]),
    "duplicate target slot": store(10, [[1, 2]], [[4, 4]]),
    "duplicate target block": load(10, [[1, 2]], [[3, 3]]),
}


@pytest.mark.parametrize("name", list(BAD_EFFECTS))
def test_a_failed_precondition_is_a_failure_event_and_moves_nothing(name: str) -> None:
    rig = make_rig(layouts.cpu_attention())
    tier_before, device_before = rig.tier.rows.clone(), rig.snapshot()
    effect = BAD_EFFECTS[name]
    with capture_logs() as logs:
        rig.runner.submit([effect])
    keys = tuple(k for group in effect.keys for k in group)
    if isinstance(effect, StartLoad):
        blocks = tuple(b for group in effect.target_block_ids for b in group)
        expected = [LoadFailed(job_id=10, worker_index=3, block_ids=blocks, keys=keys, reason="rejected")]
    else:
        expected = [StoreFailed(job_id=10, worker_index=3, keys=keys, reason="rejected")]
    assert rig.runner.poll() == expected
    assert [log["event"] for log in logs] == ["transfer_rejected"]
    assert logs[0]["log_level"] == "warning" and logs[0]["job_id"] == 10
    assert torch.equal(rig.tier.rows, tier_before)
    assert all(torch.equal(a, b) for a, b in zip(rig.case.raws, device_before))
    assert rig.runner.in_flight == frozenset()
    rig.runner.shutdown()


def test_a_job_id_already_in_flight_is_rejected() -> None:
    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(), backend_cls=GatedBackend, gates={1: gate})
    rig.runner.submit([store(1, [[1]], [[0]]), store(1, [[2]], [[1]])])
    assert rig.runner.poll() == [StoreFailed(job_id=1, worker_index=3, keys=(b"k1-0-0",), reason="rejected")]
    gate.set()
    rig.runner.submit([FlushStores(job_ids=(1,))])
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    rig.runner.shutdown()


def test_a_non_worker_effect_is_refused_by_name_and_empty_jobs_complete() -> None:
    rig = make_rig(layouts.cpu_attention())
    with pytest.raises(TypeError, match="KeysUnloadable is not a worker effect"):
        rig.runner.submit([KeysUnloadable(tier=0, keys=(b"x",), reason=Reason.EVICTED)])
    rig.runner.submit([store(1, [[]], [[]]), FlushStores(job_ids=(1,))])
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    rig.runner.shutdown()


def test_shutdown_drains_queued_jobs() -> None:
    rig = make_rig(layouts.cpu_attention())
    rig.runner.submit([store(i, [[i]], [[i]]) for i in range(1, 5)])
    rig.runner.shutdown(drain=True)
    assert sorted(e.job_id for e in rig.runner.poll()) == [1, 2, 3, 4]
    rig.runner.submit([store(9, [[1]], [[0]])])
    assert rig.runner.poll() == [StoreFailed(job_id=9, worker_index=3, keys=(b"k9-0-0",), reason="rejected")]


def test_shutdown_without_drain_cancels_queued_jobs_within_its_timeout() -> None:
    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(), backend_cls=GatedBackend, gates={1: gate})
    rig.runner.submit([store(1, [[1]], [[0]]), store(2, [[2]], [[1]]), store(3, [[3]], [[2]])])
    time.sleep(0.05)  # job 1 is now running and blocked on its gate
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="did not stop"):
        rig.runner.shutdown(drain=False, timeout_s=0.2)
    assert time.monotonic() - started < 3
    gate.set()
    rig.backend.wait([1], timeout_s=5)
    events = sorted(rig.runner.poll(), key=lambda e: e.job_id)
    assert events == [
        StoreCompleted(job_id=1, worker_index=3),
        StoreFailed(job_id=2, worker_index=3, keys=(b"k2-0-0",), reason="rejected"),  # cancelled by the shutdown
        StoreFailed(job_id=3, worker_index=3, keys=(b"k3-0-0",), reason="rejected"),
    ]


def test_waits_are_bounded() -> None:
    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(), backend_cls=GatedBackend, gates={4: gate})
    rig.runner.submit([load(4, [[0]], [[1]])])
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"jobs \[4\]"):
        rig.runner.wait([4], timeout_s=0.1)
    assert time.monotonic() - started < 3
    gate.set()
    rig.runner.wait([4])
    assert rig.runner.poll() == [LoadCompleted(job_id=4, worker_index=3)]
    rig.runner.shutdown()


def test_open_transfers_builds_a_working_runner_from_what_vllm_registers() -> None:
    from kvledger.transfers.assemble import open_transfers
    from kvledger.transfers.copies.faults import FaultPlan

    case = layouts.hybrid_sliding()
    transfers = open_transfers(
        case.kv_caches, case.config, capacity_bytes=8 * 1024, worker_index=2, faults=FaultPlan(job_ids={2})
    )
    assert (transfers.tier.num_slots, transfers.layout.num_groups) == (8, 2)
    runner = transfers.runner
    runner.submit([store(1, [[1], [2]], [[0], [1]]), store(2, [[3], []], [[2], []]), FlushStores(job_ids=(1, 2))])
    assert sorted(runner.poll(), key=lambda e: e.job_id) == [
        StoreCompleted(job_id=1, worker_index=2),
        StoreFailed(job_id=2, worker_index=2, keys=(b"k2-0-0",), reason="copy_failed"),
    ]
    runner.shutdown()


def test_jobs_queued_together_copy_as_one_batch_and_each_reports() -> None:
    # vLLM queues a store per request per step; the CPU thread merges what is
    # queued, and a merged copy that fails falls back to one job at a time.
    rig = make_rig(layouts.cpu_attention())
    original = rig.snapshot()
    backend = rig.backend
    jobs = [1, 2, 3]
    batch = [CopyJob(job_id=i, direction=Direction.STORE, block_ids=((i,),), slot_ids=((i,),)) for i in jobs]
    backend._run_batch(Direction.STORE, batch)
    outcomes = sorted(backend.poll(), key=lambda o: o.job_id)
    assert [(o.job_id, o.ok) for o in outcomes] == [(1, True), (2, True), (3, True)]
    rig.scramble(seed=5)
    backend._run_batch(Direction.LOAD, [CopyJob(job_id=10 + i, direction=Direction.LOAD, block_ids=((i,),),
                                                slot_ids=((i,),)) for i in jobs])
    assert all(o.ok for o in backend.poll())
    masks = rig.block_mask({0: jobs})
    for raw, mask, before in zip(rig.case.raws, masks, original):
        assert torch.equal(raw.flatten()[mask], before.flatten()[mask])

    bad = CopyJob(job_id=20, direction=Direction.STORE, block_ids=((10**6,),), slot_ids=((2,),))
    good = CopyJob(job_id=21, direction=Direction.STORE, block_ids=((3,),), slot_ids=((3,),))
    backend._run_batch(Direction.STORE, [bad, good])
    outcomes = {o.job_id: o.ok for o in backend.poll()}
    assert outcomes == {20: False, 21: True}


def test_a_held_store_starts_after_its_polls_or_at_once_when_flushed() -> None:
    from kvledger.transfers.copies.faults import DelayingBackend

    rig = make_rig(layouts.cpu_attention())
    runner = rig.runner
    runner._backend = DelayingBackend(rig.backend, Direction.STORE, polls=3)
    runner.submit([store(1, [[1]], [[0]]), store(2, [[2]], [[1]])])
    assert runner.poll() == [] and runner.poll() == []  # held: two polls, nothing started
    runner.submit([FlushStores(job_ids=(2,))])  # a flush starts it and waits for it
    events = runner.poll()  # the third poll also releases job 1
    assert StoreCompleted(job_id=2, worker_index=3) in events
    rig.backend.wait([1], timeout_s=5)
    events += runner.poll()
    assert sorted(e.job_id for e in events) == [1, 2]


def test_an_inline_cpu_backend_has_copied_by_the_time_submit_returns() -> None:
    from kvledger.transfers.copies.cpu_backend import CpuBackend

    rig = make_rig(layouts.cpu_attention(), backend_cls=CpuBackend, inline=True)
    original = rig.snapshot()
    rig.runner.submit([store(1, [[1, 2]], [[0, 1]])])
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]  # no wait needed
    rig.scramble(seed=3)
    rig.runner.submit([load(2, [[0, 1]], [[1, 2]])])
    assert rig.runner.poll() == [LoadCompleted(job_id=2, worker_index=3)]
    for raw, mask, before in zip(rig.case.raws, rig.block_mask({0: [1, 2]}), original):
        assert torch.equal(raw.flatten()[mask], before.flatten()[mask])


def test_an_inline_cpu_backend_starts_no_copy_thread_and_shuts_down_clean() -> None:
    from kvledger.transfers.copies.cpu_backend import CpuBackend

    before = set(threading.enumerate())
    rig = make_rig(layouts.cpu_attention(), backend_cls=CpuBackend, inline=True)
    assert not set(threading.enumerate()) - before
    rig.runner.submit([store(1, [[1]], [[0]])])
    rig.runner.shutdown(drain=True, timeout_s=1)
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]


# vLLM's sleep: unregister_kv_caches suspends the runner, restore_kv_caches resumes it.


def test_suspend_waits_for_every_device_copy_and_then_refuses_new_ones() -> None:
    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(), backend_cls=GatedBackend, gates={1: gate}, timeout_s=5)
    runner = rig.runner
    runner.submit([store(1, [[1, 2]], [[0, 1]])])
    opened = threading.Timer(0.2, gate.set)
    opened.start()
    runner.suspend()  # returns only once store 1 has copied its blocks
    assert gate.is_set() and runner.suspended
    before = rig.snapshot()
    with capture_logs() as logs:
        runner.submit([load(2, [[0]], [[5]]), store(3, [[4]], [[2]])])
    assert sorted(runner.poll(), key=lambda e: e.job_id) == [
        StoreCompleted(job_id=1, worker_index=3),  # outcomes still travel
        LoadFailed(job_id=2, worker_index=3, block_ids=(5,), keys=keys_for(2, [[5]])[0], reason="rejected"),
        StoreFailed(job_id=3, worker_index=3, keys=keys_for(3, [[4]])[0], reason="rejected")]
    assert all(torch.equal(a, b) for a, b in zip(before, rig.snapshot())), "a refused job touched the device"
    assert [log["problem"] for log in logs if log["event"] == "transfer_rejected"] == [
        "vLLM's KV cache is unmapped (asleep): unregister_kv_caches came before this job"] * 2
    runner.suspend()  # idempotent
    runner.resume()
    runner.resume()
    runner.submit([load(4, [[0]], [[5]])])
    runner.wait([4])
    assert runner.poll() == [LoadCompleted(job_id=4, worker_index=3)]
    runner.shutdown()


def test_suspend_gives_up_after_its_timeout_and_names_what_it_waited_for() -> None:
    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(), backend_cls=GatedBackend, gates={7: gate}, timeout_s=0.2)
    rig.runner.submit([store(7, [[1]], [[0]])])
    with pytest.raises(TransferTimeout, match=r"device copies before the KV cache is unmapped \[7\]"):
        rig.runner.suspend()
    gate.set()
    rig.runner.shutdown()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed_runner(load_timeout_s: float):
    """A runner whose clock the test moves, over a backend where job 2 waits for its gate."""
    from kvledger.transfers.runner import TransferRunner

    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(num_blocks=8), backend_cls=GatedBackend, gates={2: gate})
    clock = _Clock()
    runner = TransferRunner(rig.backend, num_groups=1, num_device_blocks=8, num_slots=rig.tier.num_slots,
                            worker_index=3, load_timeout_s=load_timeout_s, clock=clock)
    return rig, runner, clock, gate


def test_a_polled_load_that_outlives_its_timeout_fails_and_its_late_end_is_dropped() -> None:
    rig, runner, clock, gate = _timed_runner(30.0)
    runner.submit([store(1, [[2]], [[0]]), FlushStores(job_ids=(1,))])
    runner.submit([load(2, [[0]], [[5, ]])])
    clock.now = 30.0
    assert runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]  # not late yet
    clock.now = 30.5
    with capture_logs() as logs:
        events = runner.poll()
    assert events == [LoadFailed(job_id=2, worker_index=3, block_ids=(5,), keys=keys_for(2, [[5]])[0], reason="timed_out")]
    assert runner.in_flight == frozenset()
    names = [entry["event"] for entry in logs]
    assert "load_timed_out" in names and "timed_out_load_still_running" in names  # host memory cannot order it
    gate.set()
    rig.backend.wait([2], 10)
    with capture_logs() as logs:
        assert runner.poll() == []
    assert [entry["event"] for entry in logs] == ["timed_out_load_ended"]
    assert [(s.direction, s.ok) for s in runner.take_stats()] == [(Direction.STORE, True), (Direction.LOAD, False)]
    runner.shutdown()


def test_suspend_waits_for_a_timed_out_load_whose_copy_may_still_write() -> None:
    rig, runner, clock, gate = _timed_runner(30.0)
    runner.submit([load(2, [[0]], [[5]])])
    clock.now = 31.0
    assert [type(e) for e in runner.poll()] == [LoadFailed]
    with pytest.raises(TransferTimeout, match=r"device copies before the KV cache is unmapped \[2\]"):
        runner.suspend(timeout_s=0.2)
    gate.set()
    runner.suspend()
    runner.shutdown()


def test_no_load_timeout_when_it_is_zero() -> None:
    _rig, runner, clock, gate = _timed_runner(0)
    runner.submit([load(2, [[0]], [[5]])])
    clock.now = 1e9
    assert runner.poll() == [] and runner.in_flight == {2}
    gate.set()
    runner.wait([2])
    assert runner.poll() == [LoadCompleted(job_id=2, worker_index=3)]
    runner.shutdown()
