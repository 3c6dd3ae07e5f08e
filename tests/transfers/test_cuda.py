"""The CUDA backend: streams ordered after compute, events polled, DMA to a pinned tier.

Skipped without a CUDA device; written to run unchanged on one.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvledger.engine.effects import FlushStores
from kvledger.events.types import LoadCompleted, StoreCompleted
from kvledger.transfers.assemble import make_runner, open_transfers
from kvledger.transfers.copies.backend import Direction, TransferTimeout
from kvledger.transfers.copies.batch_copies import moves_in_words, own_batch_copy
from kvledger.transfers.copies.cuda_backend import CudaBackend, slot_runs
from kvledger.transfers.copies.driver_copy import driver_batch_copy
from kvledger.transfers.copies.faults import FaultPlan
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import canonicalize
from kvledger.transfers.copies.triton_copy import triton_batch_copy
from tests.transfers import layouts
from tests.transfers.cuda_standin import FakeEvent, FakeStream, HostStandIn, install_fake_cuda
from tests.transfers.harness import load, make_rig, store
from tests.transfers.test_copy_descriptors import memmove_batch


def needs_cuda(test):
    """Marked cuda, and skipped where no CUDA device is present."""
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test)
    return pytest.mark.cuda(test)

SLEEP_CYCLES = 2_000_000_000  # about a second of GPU time: keeps the compute stream busy


def cuda_rig(build, plan: FaultPlan | None = None, timeout_s: float = 30.0, batch_copy=None):
    cpu_case = build()
    masks_of = make_rig(cpu_case).block_mask  # byte positions depend on geometry only
    case = layouts.on_device(cpu_case, "cuda")
    layout = canonicalize(case.kv_caches, case.config)
    tier = HostTier(capacity_bytes=16 * -(-layout.slot_bytes // 64) * 64, slot_bytes=layout.slot_bytes, pin=True)
    assert tier.pinned
    backend = CudaBackend(layout, tier, batch_copy=batch_copy)
    runner = make_runner(layout, tier, backend, faults=plan, worker_index=1, timeout_s=timeout_s)
    return case, runner, masks_of


BUILDERS = [
    lambda: layouts.cpu_attention(num_blocks=8),
    lambda: layouts.flash_attention(num_blocks=8, kv_outer=True, hnd=True),
    lambda: layouts.flash_attention(num_blocks=8, kv_outer=False, kernel=2),
    lambda: layouts.mamba(num_blocks=8),
    lambda: layouts.hybrid_sliding(num_blocks=8),
    lambda: layouts.hybrid_mamba(num_blocks=8),
]


@needs_cuda
@pytest.mark.parametrize("build", BUILDERS)
def test_round_trip_through_the_pinned_tier_is_byte_exact(build, batch_copy=None) -> None:
    """On kvledger's torch path; `tests/adapters/test_batch_copy.py` runs it on vLLM's batch copy."""
    case, runner, masks_of = cuda_rig(build, batch_copy=batch_copy)
    groups = len(case.config.kv_cache_groups)
    blocks = [[1, 3, 2], [5, 4]][:groups] if groups == 2 else [[1, 3, 2, 6]]
    slots = [[7, 0, 1], [3, 12]][:groups] if groups == 2 else [[7, 0, 1, 9]]
    original = [raw.cpu() for raw in case.raws]
    runner.submit([store(1, blocks, slots), FlushStores(job_ids=(1,))])
    assert runner.poll() == [StoreCompleted(job_id=1, worker_index=1)]
    for raw in case.raws:
        raw.random_(-128, 128)
    scrambled = [raw.cpu() for raw in case.raws]
    runner.submit([load(2, slots, blocks)])
    runner.wait([2])
    torch.cuda.synchronize()
    assert runner.poll() == [LoadCompleted(job_id=2, worker_index=1)]
    for raw, mask, before, after in zip(case.raws, masks_of(dict(enumerate(blocks))), original, scrambled):
        got = raw.cpu()
        assert torch.equal(got[mask], before[mask])
        assert torch.equal(got[~mask], after[~mask])
    runner.shutdown()


def driver_copy():
    copy = driver_batch_copy()
    assert copy is not None, "a CUDA 12.8 driver or newer has cuMemcpyBatchAsync"
    return copy


def triton_copy():
    copy = triton_batch_copy(programs=4)
    assert copy is not None, "PyTorch's CUDA builds ship Triton"
    return copy


COPY_PATHS = {"torch": lambda: None, "driver": driver_copy, "triton": triton_copy}


@needs_cuda
@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("path", ["driver", "triton"])
def test_round_trip_on_kvledgers_batch_copies_is_byte_exact(build, path) -> None:
    test_round_trip_through_the_pinned_tier_is_byte_exact(build, batch_copy=COPY_PATHS[path]())


@needs_cuda
def test_a_cuda_worker_without_vllms_batch_copy_takes_the_triton_kernel_on_a_pinned_tier() -> None:
    case = layouts.on_device(layouts.cpu_attention(num_blocks=8), "cuda")
    transfers = open_transfers(case.kv_caches, case.config, capacity_bytes=1 << 20)
    assert transfers.tier.pinned
    assert transfers.runner.backend.copy_path == "triton_copy"
    transfers.runner.shutdown()


def on_unpinned_tier(case):
    layout = canonicalize(case.kv_caches, case.config)
    return layout, HostTier(capacity_bytes=16 * -(-layout.slot_bytes // 64) * 64, slot_bytes=layout.slot_bytes,
                            pin=False)


def test_the_triton_copy_is_offered_only_layouts_that_move_in_8_byte_words() -> None:
    assert moves_in_words(*on_unpinned_tier(layouts.hybrid_mamba()))
    assert moves_in_words(*on_unpinned_tier(layouts.cpu_attention()))
    assert not moves_in_words(*on_unpinned_tier(layouts.mla(block_size=2, latent=3)))  # 12-byte pages


def test_an_unpinned_tier_gets_no_batch_copy_of_kvledgers_own() -> None:
    """The kernel reaches the tier through its device mapping, which pageable memory lacks."""
    assert own_batch_copy(*on_unpinned_tier(layouts.cpu_attention())) is None


@needs_cuda
@pytest.mark.parametrize("path", COPY_PATHS)
def test_a_store_reads_what_the_compute_stream_wrote_before_it(path) -> None:
    case, runner, masks_of = cuda_rig(lambda: layouts.cpu_attention(num_blocks=8), batch_copy=COPY_PATHS[path]())
    torch.cuda._sleep(SLEEP_CYCLES)
    for raw in case.raws:
        raw.fill_(7)  # queued behind the sleep on the compute stream
    runner.submit([store(1, [[2, 3]], [[0, 1]])])
    runner.submit([FlushStores(job_ids=(1,))])
    for raw in case.raws:
        raw.fill_(0)
    runner.submit([load(2, [[0, 1]], [[4, 5]])])
    runner.wait([2])
    for raw, mask in zip(case.raws, masks_of({0: [4, 5]})):
        assert bool((raw.cpu()[mask] == 7).all())
    runner.shutdown()


@needs_cuda
@pytest.mark.parametrize("path", COPY_PATHS)
def test_a_load_lands_after_the_compute_stream_zeroed_its_blocks(path) -> None:
    case, runner, masks_of = cuda_rig(lambda: layouts.cpu_attention(num_blocks=8), batch_copy=COPY_PATHS[path]())
    for raw in case.raws:
        raw.fill_(5)
    runner.submit([store(1, [[2]], [[0]]), FlushStores(job_ids=(1,))])
    torch.cuda._sleep(SLEEP_CYCLES)
    for raw in case.raws:
        raw.zero_()  # vLLM zeroing new blocks, queued behind the sleep
    runner.submit([load(2, [[0]], [[6]])])
    runner.wait([2])
    (mask,) = masks_of({0: [6]})
    assert bool((case.raws[0].cpu()[mask] == 5).all())
    runner.shutdown()


@needs_cuda
@pytest.mark.parametrize("path", COPY_PATHS)
def test_compute_work_queued_after_order_after_waits_for_the_store(path) -> None:
    """vLLM's V2 runner zeroes reused blocks on the compute stream before any
    connector hook of the step: the store must already be ordered before it."""
    case, runner, masks_of = cuda_rig(lambda: layouts.cpu_attention(num_blocks=8), batch_copy=COPY_PATHS[path]())
    for raw in case.raws:
        raw.fill_(7)
    torch.cuda._sleep(SLEEP_CYCLES)  # the store's stream starts after this
    runner.submit([store(1, [[2]], [[0]])])
    runner.order_after([1])
    assert runner.in_flight == {1}, "ordering does not wait on the host"
    for raw in case.raws:
        raw.zero_()  # the next step's zeroing, on the compute stream
    runner.submit([load(2, [[0]], [[4]])])
    runner.wait([2])
    (mask,) = masks_of({0: [4]})
    assert bool((case.raws[0].cpu()[mask] == 7).all())
    runner.shutdown()


@needs_cuda
def test_poll_never_blocks_and_flush_waits_for_named_jobs_only() -> None:
    case, runner, _ = cuda_rig(lambda: layouts.cpu_attention(num_blocks=8), timeout_s=0.2)
    runner.submit([store(1, [[1]], [[0]])])
    runner.submit([FlushStores(job_ids=(1,))])
    torch.cuda._sleep(SLEEP_CYCLES)
    runner.submit([store(2, [[2]], [[1]])])  # waits for the sleeping compute stream
    started = time.monotonic()
    events = runner.poll()
    assert time.monotonic() - started < 0.05
    assert events == [StoreCompleted(job_id=1, worker_index=1)]
    runner.submit([FlushStores(job_ids=(1,))])  # already done: returns at once
    assert runner.in_flight == {2}
    with pytest.raises(TransferTimeout):
        runner.submit([FlushStores(job_ids=(2,))])
    torch.cuda.synchronize()
    assert runner.poll() == [StoreCompleted(job_id=2, worker_index=1)]
    runner.shutdown()


@needs_cuda
def test_corrupt_mode_flips_device_bytes() -> None:
    plan = FaultPlan(block_ids={4}, corrupt=True, directions={"load"})
    case, runner, masks_of = cuda_rig(lambda: layouts.cpu_attention(num_blocks=8), plan)
    original = [raw.cpu() for raw in case.raws]
    runner.submit([store(1, [[2]], [[0]]), FlushStores(job_ids=(1,))])
    runner.submit([load(2, [[0]], [[4]])])
    runner.wait([2])
    (block_4,), (block_2,) = masks_of({0: [4]}), masks_of({0: [2]})
    assert torch.equal(case.raws[0].cpu()[block_4], original[0][block_2].bitwise_not())
    assert runner.poll() == [StoreCompleted(job_id=1, worker_index=1), LoadCompleted(job_id=2, worker_index=1)]
    runner.shutdown()


def test_a_cpu_layout_is_refused() -> None:
    case = layouts.cpu_attention()
    layout = canonicalize(case.kv_caches, case.config)
    with pytest.raises(ValueError, match="needs KV caches on a CUDA device"):
        CudaBackend(layout, HostTier(capacity_bytes=1 << 16, slot_bytes=layout.slot_bytes, pin=False))


def test_slot_runs() -> None:
    """Runs of consecutive slots, one DMA each (planning needs no device)."""
    assert slot_runs([0, 1, 2, 5, 7, 8]) == [(0, 3, 0), (3, 4, 5), (4, 6, 7)]
    assert slot_runs([]) == []


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    return install_fake_cuda(monkeypatch)


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize(("staging_bytes", "batch_copy"), [(1 << 20, None), (1, None), (0, memmove_batch)])
def test_the_cuda_data_path_round_trips_on_host_tensors(fake_cuda, monkeypatch, build, staging_bytes,
                                                        batch_copy) -> None:
    """Torch path (1: one slot per staging chunk) and batch path (a memcpy per descriptor)."""
    from kvledger.transfers.copies import cuda_backend

    monkeypatch.setattr(cuda_backend, "STAGING_BYTES", staging_bytes)
    rig = make_rig(build(), backend_cls=HostStandIn, batch_copy=batch_copy)
    assert rig.backend.copy_path == ("torch" if batch_copy is None else "memmove_batch")
    assert bool(rig.backend._staging) is (batch_copy is None), "the batch path takes no device memory"
    groups = len(rig.case.config.kv_cache_groups)
    blocks = [[1, 3, 2], [5, 4]][:groups] if groups == 2 else [[1, 3, 2, 6]]
    slots = [[7, 0, 1], [3, 12]][:groups] if groups == 2 else [[8, 0, 1, 9]]
    original = rig.snapshot()
    rig.runner.submit([store(1, blocks, slots), FlushStores(job_ids=(1,))])
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    scrambled = rig.scramble(seed=3)
    rig.runner.submit([load(2, slots, blocks)])
    rig.runner.wait([2])
    assert rig.runner.poll() == [LoadCompleted(job_id=2, worker_index=3)]
    # Copy time comes from the timing events around each job (1.5 ms in the stand-in).
    stats = rig.runner.take_stats()
    assert [(s.direction.value, s.seconds, s.ok) for s in stats] == [("store", 0.0015, True), ("load", 0.0015, True)]
    assert [sum(s.blocks_per_group) for s in stats] == [sum(map(len, blocks))] * 2
    for raw, mask, before, after in zip(rig.case.raws, rig.block_mask(dict(enumerate(blocks))), original, scrambled):
        assert torch.equal(raw[mask], before[mask])
        assert torch.equal(raw[~mask], after[~mask])
    streams = rig.backend._streams
    assert all(fake_cuda in s.waits for s in streams.values()), "copy streams must follow the compute stream"
    assert sum(isinstance(w, FakeEvent) for w in fake_cuda.waits) >= 2, "waits order the caller's stream"


def test_a_launch_error_is_a_failure_once_the_stream_passes_it(fake_cuda) -> None:
    class Exploding(HostStandIn):
        def _load(self, job, keep):
            raise RuntimeError("CUDA out of memory")

    rig = make_rig(layouts.cpu_attention(), backend_cls=Exploding)
    rig.runner.submit([load(1, [[0, 1]], [[2, 3]])])
    rig.runner.wait([1])
    events = rig.runner.poll()
    assert [type(e).__name__ for e in events] == ["LoadFailed"]
    assert events[0].block_ids == (2, 3)


def test_staging_is_one_bounded_buffer_per_direction_taken_at_start(fake_cuda) -> None:
    """vLLM budgets device memory before kvledger starts: nothing is allocated per job."""
    rig = make_rig(layouts.hybrid_sliding(num_blocks=8), backend_cls=HostStandIn, staging_bytes=3 * 1024)
    slot_bytes = rig.tier.slot_bytes
    staging = dict(rig.backend._staging)
    assert {d.value: tuple(t.shape) for d, t in staging.items()} == {
        "store": (max(1, 3 * 1024 // slot_bytes), slot_bytes), "load": (max(1, 3 * 1024 // slot_bytes), slot_bytes)}
    original = rig.snapshot()
    blocks, slots = [[1, 3, 2, 6], [5, 4, 7]], [[8, 0, 1, 9], [3, 12, 13]]
    rig.runner.submit([store(1, blocks, slots), FlushStores(job_ids=(1,))])
    rig.scramble(seed=5)
    rig.runner.submit([load(2, slots, blocks)])
    rig.runner.wait([2])
    assert [type(e).__name__ for e in rig.runner.poll()] == ["StoreCompleted", "LoadCompleted"]
    for raw, mask, before in zip(rig.case.raws, rig.block_mask(dict(enumerate(blocks))), original):
        assert torch.equal(raw[mask], before[mask])
    assert all(rig.backend._staging[d] is staging[d] for d in staging), "the same buffers, reused"


def test_staging_that_does_not_fit_stops_the_start_with_the_setting_to_change(fake_cuda, monkeypatch) -> None:
    """A CUDA allocation failure cannot happen on the host: torch.empty raises as it would on a full GPU."""
    from kvledger.transfers.copies import cuda_backend

    real_empty = torch.empty

    def full_gpu(*shape, **kwargs):
        if kwargs.get("device") is not None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")
        return real_empty(*shape, **kwargs)

    case = layouts.cpu_attention()
    layout = canonicalize(case.kv_caches, case.config)
    tier = HostTier(capacity_bytes=1 << 16, slot_bytes=layout.slot_bytes, pin=False)
    monkeypatch.setattr(torch, "empty", full_gpu)
    with pytest.raises(cuda_backend.DeviceMemoryError, match="gpu_memory_utilization"):
        HostStandIn(layout, tier)


def test_an_outcome_survives_a_timing_failure(fake_cuda, monkeypatch) -> None:
    class Untimed(FakeEvent):
        def elapsed_time(self, end) -> float:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "Event", Untimed)
    rig = make_rig(layouts.cpu_attention(num_blocks=8), backend_cls=HostStandIn)
    rig.runner.submit([store(1, [[2]], [[0]]), store(2, [[3]], [[1]])])
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3), StoreCompleted(job_id=2, worker_index=3)]
    assert rig.runner.in_flight == frozenset()
    assert [s.seconds for s in rig.runner.take_stats()] == [0.0, 0.0]


def test_a_job_whose_end_event_cannot_be_recorded_is_rejected_only_once_its_stream_drained(
        fake_cuda, monkeypatch) -> None:
    created: list[FakeEvent] = []

    class EndUnrecordable(FakeEvent):
        """Each job makes a start event, queues its copies, then makes its end event."""

        def __init__(self, enable_timing: bool = False) -> None:
            super().__init__(enable_timing)
            created.append(self)

        def record(self, stream) -> None:
            if len(created) % 2 == 0:
                raise RuntimeError("CUDA error: out of resources")
            super().record(stream)

    monkeypatch.setattr(torch.cuda, "Event", EndUnrecordable)
    rig = make_rig(layouts.cpu_attention(num_blocks=8), backend_cls=HostStandIn)
    rig.runner.submit([load(1, [[0]], [[4]])])
    assert [type(e).__name__ for e in rig.runner.poll()] == ["LoadFailed"]
    assert rig.backend._streams[Direction.LOAD].synchronized == 1, "its copies ended before it was rejected"


def test_a_timed_out_load_orders_the_compute_stream_after_its_copy(fake_cuda, monkeypatch) -> None:
    from kvledger.transfers.runner import TransferRunner

    class Pending(FakeEvent):
        def query(self) -> bool:
            return False

    monkeypatch.setattr(torch.cuda, "Event", Pending)
    rig = make_rig(layouts.cpu_attention(num_blocks=8), backend_cls=HostStandIn)
    now = [0.0]
    runner = TransferRunner(rig.backend, num_groups=1, num_device_blocks=8, num_slots=rig.tier.num_slots,
                            worker_index=3, load_timeout_s=5.0, clock=lambda: now[0])
    runner.submit([load(1, [[0]], [[4]])])
    done = rig.backend._launched[1].done
    now[0] = 6.0
    assert [type(e).__name__ for e in runner.poll()] == ["LoadFailed"]
    assert done in fake_cuda.waits, "recompute's writes on the compute stream come after the late copy"
