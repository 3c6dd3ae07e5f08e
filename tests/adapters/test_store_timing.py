"""When the worker submits stores, and what orders them before a reused block is written.

vLLM's V2 model runner queues the zeroing (and copy-on-write copies) of the
blocks a step hands out before the connector's first hook of that step; the
V1 runner after it. These tests replay both call orders on host memory with
real copies on the CPU backend's copy threads, and the device half (which
stream waits for which event) on the CUDA backend's stand-in.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
import torch

from kvledger.adapters.settings import ConnectorSettings
from kvledger.adapters.vllm.store_timing import StoreQueue, StoreTiming, store_timing, uses_v2_model_runner
from kvledger.adapters.vllm.worker_side import LedgerWorker
from kvledger.engine.effects import FlushStores
from kvledger.events.config import Protection
from kvledger.events.types import LoadCompleted, StoreCompleted
from tests.transfers import layouts
from tests.transfers.cuda_standin import FakeEvent, HostStandIn, install_fake_cuda
from tests.transfers.harness import GatedBackend, load, make_rig, store

pytestmark = pytest.mark.vllm  # imports the vLLM adapter: not in the fast subset, which runs without vLLM


@pytest.mark.parametrize(("device", "v2", "protection", "timing"), [
    ("cpu", False, Protection.FLUSH, StoreTiming.NOW),
    ("cpu", True, Protection.FLUSH, StoreTiming.NOW),
    ("cuda", False, Protection.FLUSH, StoreTiming.DEFERRED),
    ("cuda", False, Protection.PIN, StoreTiming.DEFERRED),
    ("cuda", True, Protection.FLUSH, StoreTiming.ORDERED),
    ("cuda", True, Protection.PIN, StoreTiming.NOW),
])
def test_the_timing_follows_device_runner_and_protection(device, v2, protection, timing) -> None:
    assert store_timing(device, v2_runner=v2, protection=protection) is timing


def test_the_runner_kind_is_read_where_vllm_decides_it() -> None:
    from vllm.config import VllmConfig

    assert isinstance(VllmConfig.__dict__.get("use_v2_model_runner"), property)

    class V2:
        use_v2_model_runner = True

    assert uses_v2_model_runner(V2()) and not uses_v2_model_runner(object()) and not uses_v2_model_runner(None)


def _slot_bytes_equal_block(rig, slot: int, block: int, original: list[torch.Tensor]) -> bool:
    """Load the slot into a spare block and compare with what `block` held."""
    rig.runner.submit([load(99, [[slot]], [[7]])])
    rig.runner.wait([99])
    assert LoadCompleted(job_id=99, worker_index=3) in rig.runner.poll()
    (spare,), (source,) = rig.block_mask({0: [7]}), rig.block_mask({0: [block]})
    return torch.equal(rig.case.raws[0][spare], original[0][source])


def _zero_block(rig, block: int) -> None:
    """What vLLM's runner does to a block it hands out when zeroing is on."""
    (mask,) = rig.block_mask({0: [block]})
    rig.case.raws[0][mask] = 0


def test_deferred_stores_start_before_the_next_steps_flush_and_zeroing() -> None:
    rig = make_rig(layouts.cpu_attention(num_blocks=8))
    original = rig.snapshot()
    queue = StoreQueue(StoreTiming.DEFERRED)
    queue.after_forward(rig.runner, [store(1, [[2]], [[0]])])  # step N's wait_for_save
    assert rig.runner.in_flight == frozenset() and queue.deferred == 1
    # Step N+1 under the V1 runner: handle_preemptions (deferred stores, then the
    # flush of the reused block 2), then the runner zeroes block 2.
    queue.before_step(rig.runner)
    rig.runner.submit([FlushStores(job_ids=(1,))])
    _zero_block(rig, 2)
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    assert _slot_bytes_equal_block(rig, 0, 2, original)
    rig.runner.shutdown()


def test_ordered_stores_end_before_the_next_step_can_write_their_blocks() -> None:
    """V2 order: the zeroing comes before any hook of the next step, so the
    ordering must already hold when `wait_for_save` returns. On host memory
    that is a wait; the store runs on a copy thread that starts late."""
    gate = threading.Event()
    rig = make_rig(layouts.cpu_attention(num_blocks=8), backend_cls=GatedBackend, gates={1: gate})
    original = rig.snapshot()
    queue = StoreQueue(StoreTiming.ORDERED)
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    queue.after_forward(rig.runner, [store(1, [[2]], [[0]])])
    opener.join()
    _zero_block(rig, 2)  # step N+1's update_requests
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    assert _slot_bytes_equal_block(rig, 0, 2, original)
    rig.runner.shutdown()


@pytest.mark.parametrize("timing", [StoreTiming.ORDERED, StoreTiming.NOW])
def test_on_cuda_the_compute_stream_waits_for_ordered_stores_only(monkeypatch, timing) -> None:
    compute = install_fake_cuda(monkeypatch)
    pending: list[FakeEvent] = []

    class Pending(FakeEvent):  # copies still running: waits would block, ordering must not
        def __init__(self, enable_timing: bool = False) -> None:
            super().__init__(enable_timing)
            self.complete = False
            pending.append(self)

    monkeypatch.setattr(torch.cuda, "Event", Pending)
    rig = make_rig(layouts.cpu_attention(num_blocks=8), backend_cls=HostStandIn)
    queue = StoreQueue(timing)
    queue.after_forward(rig.runner, [store(1, [[2, 3]], [[0, 1]])])
    done = pending[-1]
    assert rig.runner.in_flight == {1}, "the host did not wait for the copy"
    assert (done in compute.waits) is (timing is StoreTiming.ORDERED)
    done.complete = True
    assert rig.runner.poll() == [StoreCompleted(job_id=1, worker_index=3)]
    rig.runner.shutdown()


def test_a_worker_on_host_memory_submits_stores_at_once() -> None:
    case = layouts.cpu_attention(num_blocks=8)
    worker = LedgerWorker(case.config, ConnectorSettings(capacity_bytes=1 << 20), worker_index=0)
    worker.register_kv_caches(case.kv_caches)
    assert worker._store_queue.timing is StoreTiming.NOW
    worker.shutdown()


def test_a_worker_holding_stores_starts_them_first_in_the_next_step_and_before_a_drain() -> None:
    """The worker's hooks with the timing a CUDA worker under vLLM's V1 runner
    gets (set by hand: here the copies run on host memory)."""
    from kvledger.adapters.vllm.metadata import KVLedgerMetadata

    case = layouts.cpu_attention(num_blocks=8)
    worker = LedgerWorker(case.config, ConnectorSettings(capacity_bytes=1 << 20), worker_index=0)
    worker.register_kv_caches(case.kv_caches)
    worker._stores = StoreQueue(StoreTiming.DEFERRED)
    runner = worker.transfers.runner
    worker.start_stores(KVLedgerMetadata(after_forward=(store(1, [[2]], [[0]]),)))
    assert runner.in_flight == frozenset()
    worker.handle_preemptions(KVLedgerMetadata(before_step=(FlushStores(job_ids=(1,)),)))
    worker.transfer_results()
    assert worker.take_worker_meta().events == (StoreCompleted(job_id=1, worker_index=0),)
    worker.start_stores(KVLedgerMetadata(after_forward=(store(2, [[3]], [[1]]),)))
    worker.submit_deferred_stores()  # what a drain (sleep, shutdown) calls first
    assert worker._store_queue.deferred == 0
    runner.wait([2])
    worker.transfer_results()
    assert worker.take_worker_meta().events == (StoreCompleted(job_id=2, worker_index=0),)
    worker.shutdown()
