"""Injected faults yield exactly the events they name, and corruption really lands."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvledger.engine.effects import FlushStores
from kvledger.events.types import LoadCompleted, LoadFailed, StoreCompleted, StoreFailed
from kvledger.transfers.copies.backend import Direction
from kvledger.transfers.copies.cpu_backend import CpuBackend
from kvledger.transfers.copies.faults import FaultInjectingBackend, FaultPlan
from tests.transfers import layouts
from tests.transfers.harness import load, make_rig, store

BLOCKS = [[1, 2, 3, 4, 5]]
SLOTS = [[9, 3, 0, 12, 6]]


def stored_rig(plan: FaultPlan):
    """A rig whose five blocks are already in the tier (stores are never faulted here)."""
    rig = make_rig(layouts.cpu_attention(num_blocks=8), faults=attrs.evolve(plan, directions={Direction.LOAD}))
    original = rig.snapshot()
    rig.runner.submit([store(1, BLOCKS, SLOTS), FlushStores(job_ids=(1,))])
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    return rig, original


def test_chosen_jobs_fail_whole() -> None:
    rig = make_rig(layouts.hybrid_sliding(), faults=FaultPlan(job_ids={2, 4}))
    rig.runner.submit(
        [store(1, [[1], [2]], [[0], [1]]), store(2, [[3], [4, 5]], [[2], [3, 4]]), FlushStores(job_ids=(1, 2))]
    )
    rig.runner.submit([load(3, [[0], [1]], [[6], [7]]), load(4, [[0], []], [[3], []])])
    rig.runner.wait([3, 4])
    events = sorted(rig.runner.poll(), key=lambda e: e.job_id)
    assert events == [
        StoreCompleted(job_id=1, worker_index=3),
        StoreFailed(job_id=2, worker_index=3, keys=(b"k2-0-0", b"k2-1-0", b"k2-1-1"), reason="copy_failed"),
        LoadCompleted(job_id=3, worker_index=3),
        LoadFailed(job_id=4, worker_index=3, block_ids=(3,), keys=(b"k4-0-0",), reason="copy_failed"),
    ]


def test_chosen_blocks_fail_alone_and_the_rest_load_exactly() -> None:
    rig, original = stored_rig(FaultPlan(block_ids={2, 5}))
    scrambled = rig.scramble(seed=5)
    rig.runner.submit([load(2, SLOTS, BLOCKS)])
    rig.runner.wait([2])
    assert rig.runner.poll() == [
        LoadFailed(job_id=2, worker_index=3, block_ids=(2, 5), keys=(b"k2-0-1", b"k2-0-4"), reason="copy_failed")
    ]
    restored = rig.block_mask({0: [1, 3, 4]})
    untouched = [~m for m in restored]
    for raw, keep, old in zip(rig.case.raws, restored, original):
        assert torch.equal(raw[keep], old[keep])
    for raw, mask, new in zip(rig.case.raws, untouched, scrambled):
        assert torch.equal(raw[mask], new[mask]), "a failed block must keep its old bytes"


def test_failed_store_blocks_name_their_keys_and_the_rest_are_stored() -> None:
    rig = make_rig(layouts.cpu_attention(num_blocks=8), faults=FaultPlan(block_ids={3}, directions={"store"}))
    original = rig.snapshot()
    rig.runner.submit([store(1, [[2, 3, 4]], [[0, 1, 2]]), FlushStores(job_ids=(1,))])
    assert rig.runner.poll() == [StoreFailed(job_id=1, worker_index=3, keys=(b"k1-0-1",), reason="copy_failed")]
    rig.scramble(seed=1)
    rig.runner.submit([load(2, [[0, 2]], [[2, 4]])])
    rig.runner.wait([2])
    assert rig.runner.poll() == [LoadCompleted(job_id=2, worker_index=3)]
    for raw, mask, old in zip(rig.case.raws, rig.block_mask({0: [2, 4]}), original):
        assert torch.equal(raw[mask], old[mask])


def _random_run(seed: int) -> list:
    rig = make_rig(layouts.cpu_attention(num_blocks=8), faults=FaultPlan(block_rate=0.3, job_rate=0.1, seed=seed))
    events = []
    for job in range(1, 13):
        blocks = [[1 + (job + i) % 7 for i in range(4)]]
        slots = [[(job * 4 + i) % 16 for i in range(4)]]
        rig.runner.submit([store(job, blocks, slots), FlushStores(job_ids=(job,))])
        events += rig.runner.poll()
    rig.runner.shutdown()
    return events


def test_random_faults_replay_exactly_from_their_seed() -> None:
    first, again, other = _random_run(7), _random_run(7), _random_run(8)
    assert first == again
    assert first != other
    failed = [e for e in first if isinstance(e, StoreFailed)]
    assert 0 < len(failed) < len(first)


def test_rates_of_zero_and_one() -> None:
    assert all(isinstance(e, StoreCompleted) for e in _events_with(FaultPlan(block_rate=0.0)))
    assert all(isinstance(e, StoreFailed) and len(e.keys) == 2 for e in _events_with(FaultPlan(job_rate=1.0)))


def _events_with(plan: FaultPlan) -> list:
    rig = make_rig(layouts.cpu_attention(num_blocks=8), faults=plan)
    rig.runner.submit([store(j, [[j, j + 1]], [[2 * j, 2 * j + 1]]) for j in range(1, 5)])
    rig.runner.submit([FlushStores(job_ids=(1, 2, 3, 4))])
    return rig.runner.poll()


def test_corrupt_mode_flips_loaded_bytes_before_the_forward_and_reports_success() -> None:
    rig, original = stored_rig(FaultPlan(block_ids={3}, corrupt=True))
    rig.scramble(seed=2)
    rig.runner.submit([load(2, SLOTS, BLOCKS)])
    rig.runner.wait([2])
    corrupted = rig.block_mask({0: [3]})
    exact = rig.block_mask({0: [1, 2, 4, 5]})
    for raw, bad, good, old in zip(rig.case.raws, corrupted, exact, original):
        assert torch.equal(raw[bad], old[bad].bitwise_not())
        assert torch.equal(raw[good], old[good])
    assert rig.runner.poll() == [LoadCompleted(job_id=2, worker_index=3)]
    for raw, bad, old in zip(rig.case.raws, corrupted, original):
        assert torch.equal(raw[bad], old[bad].bitwise_not()), "flipped twice"


def test_corrupt_mode_without_a_wait_flips_at_poll() -> None:
    rig, original = stored_rig(FaultPlan(job_rate=1.0, corrupt=True))
    rig.runner.submit([load(2, [[9]], [[6]])])
    rig.backend._inner.wait([2], 5)
    assert rig.runner.poll() == [LoadCompleted(job_id=2, worker_index=3)]
    (raw,), (old,) = rig.case.raws, original
    (block_6,), (block_1,) = rig.block_mask({0: [6]}), rig.block_mask({0: [1]})
    assert torch.equal(raw[block_6], old[block_1].bitwise_not())


def test_plans_are_validated() -> None:
    with pytest.raises(ValueError, match="block_rate"):
        FaultPlan(block_rate=1.5)
    case = layouts.cpu_attention()
    rig = make_rig(case)
    with pytest.raises(ValueError, match="corrupt mode needs"):
        FaultInjectingBackend(CpuBackend(rig.layout, rig.tier), FaultPlan(corrupt=True))
