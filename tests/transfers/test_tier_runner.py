"""The runner with a file-system tier below host memory, on a real directory:
spills write exactly the slots' bytes, a promoted load brings them back to
the device byte for byte, and a block that cannot be read fails alone."""

from __future__ import annotations

import time

import pytest
import torch

from kvledger.engine.effects import DropTierKeys, FlushStores, Reason, StartLoad, StartSpill
from kvledger.events.types import LoadCompleted, LoadFailed, StoreCompleted, StoreFailed
from kvledger.transfers.assemble import make_runner
from kvledger.transfers.copies.cpu_backend import CpuBackend
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import canonicalize
from kvledger.transfers.lower_tiers.fs.block_file import block_path
from kvledger.transfers.lower_tiers.fs.tier import FsTierIO
from tests.transfers import layouts
from tests.transfers.harness import keys_for, store

pytestmark = pytest.mark.fast
NAMESPACE = bytes(range(16))


def _rig(tmp_path, case):
    layout = canonicalize(case.kv_caches, case.config)
    tier = HostTier(capacity_bytes=16 * -(-layout.slot_bytes // 64) * 64, slot_bytes=layout.slot_bytes, pin=False)
    io = FsTierIO(root=str(tmp_path), namespace=NAMESPACE, rows=tier.rows,
                  payload_bytes=tuple(layout.payload_bytes(g) for g in range(layout.num_groups)), threads=2,
                  pack_bytes=0)  # a file per block: a test damages one
    runner = make_runner(layout, tier, CpuBackend(layout, tier), worker_index=1, lower_tiers={1: io})
    return layout, tier, runner


def _poll_until(runner, count: int, timeout_s: float = 10.0) -> list:
    events: list = []
    deadline = time.monotonic() + timeout_s
    while len(events) < count and time.monotonic() < deadline:
        events += runner.poll()
        time.sleep(0.005)
    return events


def _device_bytes(case, layout, blocks_by_group) -> list[torch.Tensor]:
    return [layout.span_view(span)[block].clone()
            for g, blocks in enumerate(blocks_by_group) for span in layout.group_spans[g] for block in blocks]


@pytest.mark.parametrize("build", [lambda: layouts.cpu_attention(packing="layer"), layouts.hybrid_sliding])
def test_spill_then_promote_restores_the_device_bytes(tmp_path, build) -> None:
    case = build()
    layout, tier, runner = _rig(tmp_path, case)
    groups = layout.num_groups
    blocks = tuple((1, 2) if g == 0 else (3,) for g in range(groups))
    slots = tuple((0, 1) if g == 0 else (2,) for g in range(groups))
    keys = keys_for(1, blocks)
    runner.submit([store(1, blocks, slots), FlushStores(job_ids=(1,))])
    assert runner.poll() == [StoreCompleted(job_id=1, worker_index=1)]
    original = _device_bytes(case, layout, blocks)

    runner.submit([StartSpill(job_id=2, tier=1, keys=keys, source_slot_ids=slots)])
    assert _poll_until(runner, 1) == [StoreCompleted(job_id=2, worker_index=1)]
    for group_keys in keys:
        for key in group_keys:
            assert block_path(tmp_path, NAMESPACE, key).exists()

    tier.rows.fill_(7)  # the host copy is gone: only the files hold the blocks
    for raw in case.raws:
        raw.fill_(-3)
    fresh_slots = tuple(tuple(s + 8 for s in group) for group in slots)
    promote = tuple(tuple(1 for _ in group) for group in keys)
    runner.submit([StartLoad(job_id=3, request_id="r", keys=keys, source_slot_ids=fresh_slots,
                             target_block_ids=blocks, promote_tiers=promote)])
    assert _poll_until(runner, 1) == [LoadCompleted(job_id=3, worker_index=1)]
    restored = _device_bytes(case, layout, blocks)
    assert all(torch.equal(a, b) for a, b in zip(original, restored))


def test_a_damaged_or_unplaced_block_fails_alone(tmp_path) -> None:
    case = layouts.cpu_attention(packing="layer")
    layout, tier, runner = _rig(tmp_path, case)
    blocks, slots = ((1, 2, 3),), ((0, 1, 2),)
    keys = keys_for(1, blocks)
    runner.submit([store(1, blocks, slots), FlushStores(job_ids=(1,))])
    runner.poll()
    runner.submit([StartSpill(job_id=2, tier=1, keys=keys, source_slot_ids=slots)])
    assert _poll_until(runner, 1) == [StoreCompleted(job_id=2, worker_index=1)]
    original = _device_bytes(case, layout, blocks)

    damaged = block_path(tmp_path, NAMESPACE, keys[0][1])
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # one payload byte
    damaged.write_bytes(bytes(data))
    for raw in case.raws:
        raw.fill_(-3)
    # Block 3's key got no host slot (-1): it fails without a read.
    runner.submit([StartLoad(job_id=3, request_id="r", keys=keys, source_slot_ids=((8, 9, -1),),
                             target_block_ids=blocks, promote_tiers=((1, 1, 1),))])
    events = _poll_until(runner, 1)
    assert events == [LoadFailed(job_id=3, worker_index=1, block_ids=(2, 3), keys=(keys[0][1], keys[0][2]),
                                 reason="corrupt")]  # the read's reason (block 3 was refused: no slot)
    restored = _device_bytes(case, layout, blocks)
    assert torch.equal(restored[0], original[0])  # block 1 was read and copied
    assert not torch.equal(restored[1], original[1])  # the damaged one was never copied


def _spilled(tmp_path, case):
    """Blocks 1, 2 stored in slots 0, 1 and spilled to the disk as job 2."""
    layout, tier, runner = _rig(tmp_path, case)
    blocks, slots = ((1, 2),), ((0, 1),)
    keys = keys_for(1, blocks)
    runner.submit([store(1, blocks, slots), FlushStores(job_ids=(1,))])
    runner.poll()
    runner.submit([StartSpill(job_id=2, tier=1, keys=keys, source_slot_ids=slots)])
    assert _poll_until(runner, 1) == [StoreCompleted(job_id=2, worker_index=1)]
    return runner, blocks, slots, keys


def test_drops_remove_files_and_a_spill_to_an_unknown_tier_fails(tmp_path) -> None:
    runner, blocks, slots, keys = _spilled(tmp_path, layouts.cpu_attention(packing="layer"))
    runner.submit([DropTierKeys(tier=1, keys=keys[0], reason=Reason.EVICTED)])
    deadline = time.monotonic() + 5
    while any(block_path(tmp_path, NAMESPACE, k).exists() for k in keys[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(block_path(tmp_path, NAMESPACE, k).exists() for k in keys[0])
    # A spill to a tier the worker does not have fails whole, at once.
    runner.submit([StartSpill(job_id=4, tier=2, keys=keys, source_slot_ids=slots)])
    assert runner.poll() == [StoreFailed(job_id=4, worker_index=1, keys=keys[0], reason="rejected")]


def test_a_promotion_that_ends_while_vllm_sleeps_fails_without_touching_the_device(tmp_path) -> None:
    # The tier read started before unregister_kv_caches and ends after it: the
    # host copy is there, but the device memory it would be copied into is not.
    case = layouts.cpu_attention(packing="layer")
    runner, blocks, slots, keys = _spilled(tmp_path, case)
    for raw in case.raws:
        raw.fill_(-3)
    runner.submit([StartLoad(job_id=3, request_id="r", keys=keys, source_slot_ids=((8, 9),),
                             target_block_ids=blocks, promote_tiers=((1, 1),))])
    runner.suspend()
    assert _poll_until(runner, 1) == [LoadFailed(job_id=3, worker_index=1, block_ids=(1, 2), keys=keys[0],
                                                 reason="rejected")]
    assert all(bool((raw == -3).all()) for raw in case.raws)
    runner.resume()
    runner.submit([StartLoad(job_id=4, request_id="r", keys=keys, source_slot_ids=((8, 9),),
                             target_block_ids=blocks, promote_tiers=((1, 1),))])
    assert _poll_until(runner, 1) == [LoadCompleted(job_id=4, worker_index=1)]
    assert not all(bool((raw == -3).all()) for raw in case.raws)
    runner.shutdown()


def test_a_tier_read_stuck_past_the_load_timeout_fails_and_its_slot_waits_until_it_ends(tmp_path) -> None:
    """A read stuck in the kernel (here: host memory that faults until released,
    as a hung network file system would hold it) fails its load at the timeout;
    until the read lets go, no job may use the host slot it may still write."""
    from kvledger.transfers.runner import TransferRunner
    from tests.transfers.test_fs_tier import StuckRows

    case = layouts.cpu_attention(packing="layer")
    layout = canonicalize(case.kv_caches, case.config)
    tier = HostTier(capacity_bytes=16 * -(-layout.slot_bytes // 64) * 64, slot_bytes=layout.slot_bytes, pin=False)
    stuck = StuckRows(num_slots=16, row_bytes=4096)  # a page per row: userfaultfd registers pages
    io = FsTierIO(root=str(tmp_path), namespace=NAMESPACE, rows=stuck.rows,
                  payload_bytes=tuple(layout.payload_bytes(g) for g in range(layout.num_groups)), threads=2,
                  pack_bytes=0)  # a file per block: a test damages one
    now = [0.0]
    runner = TransferRunner(CpuBackend(layout, tier), num_groups=layout.num_groups, num_device_blocks=layout.num_blocks,
                            num_slots=tier.num_slots, worker_index=1, load_timeout_s=5.0, lower_tiers={1: io},
                            clock=lambda: now[0])
    try:
        blocks = ((1, 2),)
        keys = keys_for(1, blocks)
        io.write(1, keys, ((1, 2),))  # both blocks on disk, written from readable slots
        io.wait([1], 10)
        assert [o.ok for o in io.poll()] == [True]
        runner.submit([StartLoad(job_id=3, request_id="r", keys=keys, source_slot_ids=((0, 3),),
                                 target_block_ids=blocks, promote_tiers=((1, 1),))])
        time.sleep(0.3)
        assert runner.poll() == []  # slot 0's read is stuck; the load waits
        now[0] = 6.0
        assert runner.poll() == [LoadFailed(job_id=3, worker_index=1, block_ids=(1, 2), keys=keys[0],
                                            reason="timed_out")]
        # Slot 0 (and 3, read by the same job) may still be written: a store into it fails at once.
        runner.submit([store(4, ((5,),), ((0,),))])
        assert runner.poll() == [StoreFailed(job_id=4, worker_index=1, keys=keys_for(4, ((5,),))[0],
                                             reason="rejected")]
        runner.submit([store(5, ((4,),), ((7,),))])  # another slot is fine
        assert _poll_until(runner, 1) == [StoreCompleted(job_id=5, worker_index=1)]
        stuck.release()
        deadline = time.monotonic() + 10
        while runner._lower.quarantined and time.monotonic() < deadline:
            runner.poll()
            time.sleep(0.01)
        assert not runner._lower.quarantined
        runner.submit([store(6, ((5,),), ((0,),))])
        assert _poll_until(runner, 1) == [StoreCompleted(job_id=6, worker_index=1)]
    finally:
        stuck.release()
        runner.shutdown(drain=False, timeout_s=10)


def test_an_idle_step_waits_for_a_promoted_load_and_the_next_poll_reports_it(tmp_path) -> None:
    """`wait_loads` blocks until the promotion's reads and then its device copy
    end, so one poll reports the load: no empty steps spinning in between."""
    runner, blocks, slots, keys = _spilled(tmp_path, layouts.cpu_attention(packing="layer"))
    runner.submit([StartLoad(job_id=3, request_id="r", keys=keys, source_slot_ids=((8, 9),),
                             target_block_ids=((4, 5),), promote_tiers=((1, 1),))])
    runner.wait_loads(10.0)
    assert runner.poll() == [LoadCompleted(job_id=3, worker_index=1)]
    runner.wait_loads(10.0)  # nothing in flight: returns at once
    assert runner.poll() == []


def test_an_idle_step_waits_no_longer_than_asked_for_a_read_that_hangs(tmp_path) -> None:
    from tests.transfers.test_fs_tier import StuckRows

    case = layouts.cpu_attention(packing="layer")
    layout = canonicalize(case.kv_caches, case.config)
    tier = HostTier(capacity_bytes=16 * -(-layout.slot_bytes // 64) * 64, slot_bytes=layout.slot_bytes, pin=False)
    stuck = StuckRows(num_slots=16, row_bytes=4096)
    io = FsTierIO(root=str(tmp_path), namespace=NAMESPACE, rows=stuck.rows,
                  payload_bytes=tuple(layout.payload_bytes(g) for g in range(layout.num_groups)), threads=2,
                  pack_bytes=0)  # a file per block: a test damages one
    runner = make_runner(layout, tier, CpuBackend(layout, tier), worker_index=1, lower_tiers={1: io})
    try:
        keys = keys_for(1, ((1, 2),))
        io.write(1, keys, ((1, 2),))
        io.wait([1], 10)
        io.poll()
        runner.submit([StartLoad(job_id=3, request_id="r", keys=keys, source_slot_ids=((0, 3),),
                                 target_block_ids=((1, 2),), promote_tiers=((1, 1),))])
        started = time.monotonic()
        runner.wait_loads(0.2)  # slot 0's read is stuck: the wait gives up, without raising
        assert 0.15 < time.monotonic() - started < 5
        assert runner.poll() == []
        stuck.release()
        assert _poll_until(runner, 1) == [LoadCompleted(job_id=3, worker_index=1)]
    finally:
        stuck.release()
        runner.shutdown(drain=False, timeout_s=10)
