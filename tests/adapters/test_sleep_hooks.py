"""The worker through vLLM 0.33's sleep, its hooks called in vLLM's order.

`Worker.sleep`: the device synchronized, `unregister_kv_caches`, the KV cache
unmapped; `wake_up`: mapped back, `restore_kv_caches`. (The scheduler's reset
comes before both: `tests/on_vllm/test_sleep.py`.) Copies run on host memory
here, with the store timing a CUDA worker under vLLM's V1 runner gets, so a
store may still be held for the next step when the sleep comes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
import torch

from kvledger.adapters.settings import ConnectorSettings
from kvledger.adapters.vllm.metadata import KVLedgerMetadata
from kvledger.adapters.vllm.store_timing import StoreQueue, StoreTiming
from kvledger.adapters.vllm.worker_side import LedgerWorker
from kvledger.events.types import LoadCompleted, LoadFailed, StoreCompleted, StoreFailed
from tests.transfers import layouts
from tests.transfers.harness import load, store

pytestmark = pytest.mark.vllm  # imports the vLLM adapter: not in the fast subset, which runs without vLLM


def _worker() -> tuple[LedgerWorker, object]:
    case = layouts.cpu_attention(num_blocks=8)
    worker = LedgerWorker(case.config, ConnectorSettings(capacity_bytes=1 << 20), worker_index=0)
    worker.register_kv_caches(case.kv_caches)
    worker._stores = StoreQueue(StoreTiming.DEFERRED)
    return worker, case


def _block_bytes(worker: LedgerWorker, block: int) -> list[torch.Tensor]:
    layout = worker.transfers.layout
    return [layout.span_view(span)[block].clone() for span in layout.group_spans[0]]


def _outcomes(worker: LedgerWorker) -> list:
    worker.transfer_results()
    meta = worker.take_worker_meta()
    return [] if meta is None else sorted(meta.events, key=lambda e: e.job_id)


def test_a_sleep_runs_the_held_store_then_refuses_copies_until_the_wake_up() -> None:
    worker, case = _worker()
    for raw in case.raws:
        raw.copy_(torch.arange(raw.numel(), dtype=torch.int64).to(torch.int8))
    stored = _block_bytes(worker, 2)
    worker.start_stores(KVLedgerMetadata(after_forward=(store(1, [[2]], [[0]]),)))  # held for the next step
    worker.unregister_kv_caches()  # returns once the held store has copied its block
    assert _outcomes(worker) == [StoreCompleted(job_id=1, worker_index=0)]
    worker.unregister_kv_caches()  # idempotent
    for raw in case.raws:
        raw.fill_(0)  # what vLLM maps back holds nothing of what was there
    # A call vLLM never makes while asleep: it fails, and the device is not written.
    worker.handle_preemptions(KVLedgerMetadata())
    worker.start_loads(KVLedgerMetadata(loads=(load(2, [[0]], [[5]]),)))
    worker.start_stores(KVLedgerMetadata(after_forward=(store(3, [[4]], [[1]]),)))
    worker.submit_deferred_stores()
    assert [type(e) for e in _outcomes(worker)] == [LoadFailed, StoreFailed]
    assert all(not raw.any() for raw in case.raws)
    worker.restore_kv_caches()
    worker.restore_kv_caches()  # idempotent
    worker.start_loads(KVLedgerMetadata(loads=(load(4, [[0]], [[5]]),)))
    worker.transfers.runner.wait([4])
    assert _outcomes(worker) == [LoadCompleted(job_id=4, worker_index=0)]
    assert all(torch.equal(a, b) for a, b in zip(_block_bytes(worker, 5), stored))  # what block 2 held
    worker.shutdown()


def test_hooks_before_register_kv_caches_do_nothing() -> None:
    case = layouts.cpu_attention(num_blocks=8)
    worker = LedgerWorker(case.config, ConnectorSettings(capacity_bytes=1 << 20), worker_index=0)
    worker.unregister_kv_caches()
    worker.restore_kv_caches()
    worker.register_kv_caches(case.kv_caches)
    assert not worker.transfers.runner.suspended
    worker.shutdown()
