"""The worker half of the connector: runs the step's transfers.

Per step, in vLLM's order: `handle_preemptions` waits for exactly the stores
whose source blocks this step reuses; `start_load_kv` starts loads (their
requests wait outside the batch); `wait_for_save` starts stores of the
blocks the forward just wrote (on CUDA under vLLM's V1 model runner, at the
next step's first hook instead; see `store_timing`); `get_transfer_results`
polls, and the outcomes travel back as worker metadata for the engine.

A failed load is reported the way vLLM 0.32 can take it: with one KV group,
the exact failed block ids (vLLM recomputes from the first); with several,
the request in `failed_recving` (vLLM recomputes all of it), since vLLM
cannot map flat block ids back to groups. A failure is logged once here, by
the runner that saw it, and once by the scheduler, with the step, as the
engine applies it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
import torch

from kvledger.adapters.settings import ConnectorSettings
from kvledger.adapters.vllm import metrics as m
from kvledger.adapters.vllm.metadata import KVLedgerMetadata, KVLedgerWorkerMetadata
from kvledger.engine.effects import StartLoad
from kvledger.events.config import ConfigError
from kvledger.events.types import LoadCompleted, LoadFailed, TransferEvent
from kvledger.transfers.assemble import Transfers, open_transfers
from kvledger.transfers.copies.backend import Direction
from kvledger.transfers.copies.faults import FaultPlan
from kvledger.transfers.copies.kv_spec import KVCacheConfig

from .batch_copy import vllm_batch_copy
from .kv_cache_config import slot_bytes
from .lower_tiers import open_worker_tiers, tier_name
from .store_timing import StoreQueue, store_timing, uses_v2_model_runner

_log = structlog.get_logger("kvledger.adapters.vllm.worker")

IDLE_WAIT_S = 0.02
"""How long a step with nothing to compute waits for the loads in flight (it
ends as soon as they do). vLLM steps again at once while a load is under way;
without the wait those empty steps spin, and take the interpreter from the
I/O threads reading a lower tier. A request arriving meanwhile waits at most
this long to be scheduled."""


def fault_plans(settings: ConnectorSettings, worker_index: int = 0) -> tuple[FaultPlan, ...]:
    """This worker's injected faults: none where `ranks` leaves it out."""
    faults = settings.faults
    if not faults.applies_to(worker_index):
        return ()
    plans = []
    if faults.load_rate or faults.load_block_rate:
        plans.append(FaultPlan(job_rate=faults.load_rate, block_rate=faults.load_block_rate, seed=faults.seed,
                               corrupt=faults.corrupt, directions=(Direction.LOAD,)))
    if faults.store_rate:
        plans.append(FaultPlan(job_rate=faults.store_rate, seed=faults.seed + 1, directions=(Direction.STORE,)))
    return tuple(plans)


def _store_hold_steps(settings: ConnectorSettings, worker_index: int) -> int:
    faults = settings.faults
    return faults.store_hold_steps if faults.applies_to(worker_index) else 0


class LedgerWorker:
    def __init__(self, config: KVCacheConfig, settings: ConnectorSettings, *, worker_index: int,
                 vllm_config: Any = None, vllm_kv_cache_config: Any = None, world_size: int = 1) -> None:
        """`vllm_config` and vLLM's own KV cache config name the tiers' namespace
        (needed only with tiers below host memory)."""
        self.config = config
        self.settings = settings
        self.worker_index = worker_index
        self._vllm_configs = (vllm_config, vllm_kv_cache_config)
        self._world_size = world_size
        self.transfers: Transfers | None = None
        self._load_requests: dict[int, str] = {}  # load job -> request
        self._events: list[TransferEvent] = []  # outcomes not yet sent to the scheduler
        self._invalid_blocks: set[int] = set()
        self._stores: StoreQueue | None = None

    def _open_lower_tiers(self, tier, layout):
        vllm_config, kv_cache_config = self._vllm_configs
        return open_worker_tiers(
            self.settings, vllm_config, kv_cache_config, rank=self.worker_index, world_size=self._world_size,
            rows=tier.rows, payload_bytes=tuple(layout.payload_bytes(g) for g in range(layout.num_groups)))

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.transfers = open_transfers(
            kv_caches, self.config, capacity_bytes=self.settings.capacity_bytes,
            worker_index=self.worker_index, faults=fault_plans(self.settings, self.worker_index),
            store_hold_polls=_store_hold_steps(self.settings, self.worker_index),
            # On vLLM-CPU the "device" is host memory and the forward uses every
            # core: copying in the step's own thread measured faster than a copy thread.
            inline_cpu_copies=True, load_timeout_s=self.settings.load_timeout_s,
            batch_copy=vllm_batch_copy(kv_caches),
            lower_tiers=self._open_lower_tiers if self.settings.secondary_tiers else None)
        expected = slot_bytes(self.config)
        if self.transfers.layout.slot_bytes != expected:
            raise ConfigError(
                f"the registered KV caches give {self.transfers.layout.slot_bytes} bytes per block, the KV "
                f"cache config {expected}: the scheduler would size the tier differently")
        self._stores = StoreQueue(store_timing(
            self.transfers.layout.device.type, v2_runner=uses_v2_model_runner(self._vllm_configs[0]),
            protection=self.settings.protection))
        _log.info("worker_ready", worker_index=self.worker_index, num_slots=self.transfers.tier.num_slots,
                  slot_bytes=self.transfers.tier.slot_bytes, groups=self.transfers.layout.num_groups,
                  store_timing=self._stores.timing.value)

    @property
    def _runner(self):
        if self.transfers is None:
            raise RuntimeError("register_kv_caches was not called before the first step")
        return self.transfers.runner

    def unregister_kv_caches(self) -> None:
        """Before vLLM's sleep unmaps the KV cache: every copy from or to it ends
        here, and none starts until `restore_kv_caches`. The scheduler was reset
        first (vLLM resets the connector before it sleeps), so nothing stored
        afterwards is taken from what the blocks held."""
        if self.transfers is not None:
            self.submit_deferred_stores()  # they read the blocks too: they run, then the drain covers them
            self._runner.suspend()
            _log.info("kv_caches_unregistered", worker_index=self.worker_index)

    def restore_kv_caches(self) -> None:
        """vLLM maps the KV cache back at the same addresses, so the views the
        copies use stay valid; their content is gone, and the scheduler knows."""
        if self.transfers is not None and self._runner.suspended:
            self._runner.resume()
            _log.info("kv_caches_restored", worker_index=self.worker_index)

    def handle_preemptions(self, meta: KVLedgerMetadata) -> None:
        self._store_queue.before_step(self._runner)
        if meta.before_step:
            self._runner.submit(meta.before_step)
            _log.debug("stores_flushed", effects=meta.before_step)

    def start_loads(self, meta: KVLedgerMetadata) -> None:
        runner = self._runner
        self._store_queue.before_step(runner)  # a step whose runner skipped handle_preemptions
        if meta.loads:
            for load in meta.loads:
                assert isinstance(load, StartLoad), load
                self._load_requests[load.job_id] = load.request_id
            runner.submit(meta.loads)

    def start_stores(self, meta: KVLedgerMetadata) -> None:
        self._store_queue.after_forward(self._runner, meta.after_forward)

    @property
    def _store_queue(self) -> StoreQueue:
        if self._stores is None:
            raise RuntimeError("register_kv_caches was not called before the first step")
        return self._stores

    def transfer_results(self, *, idle: bool = False) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call. In an `idle`
        step (nothing to compute: vLLM steps only to hear of transfers) it
        first waits up to `IDLE_WAIT_S` for the loads in flight to end."""
        finished: set[str] = set()
        failed: set[str] = set()
        multi_group = len(self.config.kv_cache_groups) > 1
        if idle and IDLE_WAIT_S > 0 and self._load_requests:
            self._runner.wait_loads(IDLE_WAIT_S)
        for event in self._runner.poll():
            self._events.append(event)
            if not isinstance(event, (LoadCompleted, LoadFailed)):
                continue
            rid = self._load_requests.pop(event.job_id, None)
            if rid is None:
                continue
            finished.add(rid)  # a failed load ends too: vLLM releases the request with both sets
            if isinstance(event, LoadFailed):
                if multi_group:
                    failed.add(rid)
                else:
                    self._invalid_blocks.update(event.block_ids)
        return finished, failed

    def take_invalid_blocks(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def take_stats(self) -> m.KVLedgerStats | None:
        """Bytes, copy time and sizes of the jobs finished since the last call."""
        if self.transfers is None:
            return None
        jobs = self.transfers.runner.take_stats()
        tier_jobs = self.transfers.runner.take_tier_stats()
        if not jobs and not tier_jobs:  # vLLM asks every step; most steps finish no job
            return None
        stats = m.KVLedgerStats()
        layout = self.transfers.layout
        for job in jobs:
            nbytes = sum(n * layout.payload_bytes(g) for g, n in enumerate(job.blocks_per_group))
            if job.direction is Direction.LOAD:
                stats.add(m.LOAD_BYTES, nbytes)
                stats.add(m.LOAD_TIME, job.seconds)
                stats.add(m.LOAD_SIZE, nbytes)
            else:
                stats.add(m.STORE_BYTES, nbytes)
                stats.add(m.STORE_TIME, job.seconds)
                stats.add(m.STORE_SIZE, nbytes)
        for job in tier_jobs:
            tier = tier_name(job.tier, self.settings.secondary_tiers[job.tier - 1])
            if job.kind == "read":
                stats.add(m.TIER_READ_BYTES, job.nbytes, tier)
                stats.add(m.TIER_READ_TIME, job.seconds, tier)
                stats.add(m.TIER_PROMOTION_LATENCY, job.seconds, tier)
                stats.add(m.TIER_PROMOTION_FAILURES, 0 if job.ok else 1, tier)
                stats.add(m.TIER_UNREACHABLE, job.unreachable, tier)
                stats.add(m.TIER_FORGED, job.forged, tier)
            else:
                stats.add(m.TIER_WRITE_BYTES, job.nbytes, tier)
                stats.add(m.TIER_WRITE_TIME, job.seconds, tier)
                stats.add(m.TIER_CASCADE_FAILURES, 0 if job.ok else 1, tier)
                stats.add(m.TIER_UNREACHABLE, job.unreachable, tier)
        return None if stats.is_empty() else stats

    def take_worker_meta(self) -> KVLedgerWorkerMetadata | None:
        if not self._events:
            return None
        events, self._events = tuple(self._events), []
        return KVLedgerWorkerMetadata(events=events)

    def submit_deferred_stores(self) -> None:
        """Start the stores held for the next step now (V1 runner on CUDA), so a
        drain that follows covers them: before shutdown, or before vLLM discards
        the device memory they read."""
        if self.transfers is not None and self._stores is not None:
            self._stores.before_step(self.transfers.runner)

    def shutdown(self) -> None:
        if self.transfers is not None:
            self.submit_deferred_stores()  # they run and report too
            self.transfers.runner.shutdown(drain=True)
            self.transfers.tier.close()
