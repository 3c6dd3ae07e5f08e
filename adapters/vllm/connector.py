"""`KVLedgerConnector`: the class vLLM instantiates, once per role.

A thin facade. vLLM builds it in the scheduler process (role SCHEDULER,
which runs the engine) and in every worker (role WORKER, which moves
bytes); each call is forwarded to the half that owns it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvledger.adapters.settings import parse_settings
from kvledger.adapters.structlog_setup import configure_logging
from kvledger.adapters.vllm.kv_cache_config import engine_config, slot_bytes, transfer_config
from kvledger.adapters.vllm.kv_events import TierEvents, group_event_specs
from kvledger.adapters.vllm.lower_tiers import SchedulerTiers, engine_tiers, tier_copies
from kvledger.adapters.vllm.metadata import KVLedgerMetadata
from kvledger.adapters.vllm.metrics import KVLedgerPromMetrics, KVLedgerStats
from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
from kvledger.adapters.vllm.worker_side import LedgerWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A tier's locality in self-describing KV events, relative to this replica (vLLM 0.33's words).
_LOCALITY = {"fs": "LOCAL", "valkey": "REMOTE"}


def _worker_index() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group  # set up only in a worker, after import

        return get_world_group().rank_in_group
    except (AssertionError, ImportError):  # no distributed group: a single in-process worker
        return 0


class KVLedgerConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = parse_settings(self._kv_transfer_config.kv_connector_extra_config)
        configure_logging(settings.log_level, json=settings.log_json)
        self._scheduler: LedgerScheduler | None = None
        self._worker: LedgerWorker | None = None
        world_size = vllm_config.parallel_config.world_size
        if role == KVConnectorRole.SCHEDULER:
            copies = tier_copies(vllm_config, kv_cache_config, world_size)
            config = engine_config(
                kv_cache_config, capacity_bytes=settings.capacity_bytes, policy=settings.eviction_policy,
                protection=settings.protection, store_mode=settings.store_mode,
                world_size=world_size, block_size=vllm_config.cache_config.block_size,
                lower_tiers=engine_tiers(settings, slot_bytes(transfer_config(kv_cache_config)), copies),
                tier_copies=copies, store_threshold=settings.store_threshold,
                max_tracker_size=settings.max_tracker_size, offload_prompt_only=settings.offload_prompt_only,
                restore_budget=settings.restore_budget)
            events = vllm_config.kv_events_config
            tier_events = (TierEvents(group_event_specs(kv_cache_config), len(settings.secondary_tiers),
                                      self_describing=settings.self_describing_kv_events,
                                      localities=[_LOCALITY[tier.kind] for tier in settings.secondary_tiers],
                                      hash_block_size=config.hash_block_size)
                           if events is not None and events.enable_kv_cache_events else None)
            tiers = (SchedulerTiers(settings, vllm_config, kv_cache_config, world_size=world_size)
                     if settings.secondary_tiers else None)
            self._scheduler = LedgerScheduler(config, settings, tier_events=tier_events, tiers=tiers)
        else:
            self._worker = LedgerWorker(transfer_config(kv_cache_config), settings, worker_index=_worker_index(),
                                        vllm_config=vllm_config, vllm_kv_cache_config=kv_cache_config,
                                        world_size=world_size)

    @property
    def scheduler(self) -> LedgerScheduler:
        assert self._scheduler is not None, "a scheduler-side call reached the worker connector"
        return self._scheduler

    @property
    def worker(self) -> LedgerWorker:
        assert self._worker is not None, "a worker-side call reached the scheduler connector"
        return self._worker

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Yes: the hooks below end every transfer before vLLM unmaps the KV cache,
        and the reset vLLM makes first drops what the tiers hold (`reset_cache`)."""
        return True

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.worker.restore_kv_caches()

    def finish_forward(self) -> None:
        return  # stores start in wait_for_save (or the next step's first hook: store_timing); loads ended before the forward

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVLedgerMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def _step_meta(self) -> KVLedgerMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVLedgerMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_loads(self._step_meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before their request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores copy whole blocks after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.start_stores(self._step_meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        finished, failed = self.worker.transfer_results(idle=isinstance(meta, KVLedgerMetadata) and meta.idle)
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid_blocks()

    def build_connector_worker_meta(self):
        return self.worker.take_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Both roles report: workers what they copied, the scheduler what the engine counted."""
        if self._worker is not None:
            return self._worker.take_stats()
        return self.scheduler.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVLedgerStats(data=data) if data is not None else KVLedgerStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVLedgerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # Scheduler side.

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache()
