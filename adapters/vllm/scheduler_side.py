"""The scheduler half of the connector: vLLM's calls in, engine events out.

`on_new_request`, `update_connector_output`, `request_finished` and
`reset_cache` become events at once. Admissions are noted as vLLM makes
them; at the end of `schedule()`, `build_connector_meta` hands what vLLM
exposes to the pure step planner (`engine.planner.plan_step`), applies the
events it returns in one `reduce_step`, carries out the scheduler's own
effects (block-pool references), and sends the workers theirs as the step's
metadata, by phase (`engine.effects.route`).

`get_num_new_matched_tokens` is a query of the engine state, with what it
remembers between vLLM's calls in `hit_lookup.HitLookups` (which first asks
a shared tier below host memory about keys no tier is known to hold). The
engine's notifications are translated where they land: block-pool
references here, logs, metrics (`MetricDeltas`), KV events (`TierEvents`)
and the lower tiers' lookups (`SchedulerTiers.removed`); nothing reads the
state around a step.

With tiers below host memory, block keys are kvledger's own (`ChainKeys`,
equal in every process), not vLLM's per-process block hashes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from kvledger.adapters.backpressure import Backpressure
from kvledger.adapters.engine_host import EngineHost
from kvledger.adapters.miss_counter import MissCounter
from kvledger.adapters.restore_costs import CostMeter
from kvledger.adapters.settings import ConnectorSettings
from kvledger.adapters.vllm import metrics as m
from kvledger.adapters.vllm.block_pool import BlockPoolView
from kvledger.adapters.vllm.chain_keys import ChainKeys, generation_root
from kvledger.adapters.vllm.hit_lookup import HitLookups
from kvledger.adapters.vllm.kv_events import TierEvents
from kvledger.adapters.vllm.lower_tiers import SchedulerTiers
from kvledger.adapters.vllm.metadata import KVLedgerMetadata, KVLedgerWorkerMetadata
from kvledger.adapters.vllm.metric_deltas import MetricDeltas
from kvledger.adapters.vllm.restore_timing import RestoreTimes
from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.planner import new_hashes, plan_step
from kvledger.engine.state import RequestStatus
from kvledger.events import types as ev
from kvledger.events.config import ConfigError, EngineConfig, RestoreBudget, StoreMode
from kvledger.events.keys import hex_keys

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_log = structlog.get_logger("kvledger.adapters.vllm.scheduler")


class LedgerScheduler:
    """`tier_events` is given when vLLM publishes KV cache events."""

    def __init__(self, config: EngineConfig, settings: ConnectorSettings, *,
                 tier_events: TierEvents | None = None, tiers: SchedulerTiers | None = None) -> None:
        self.config = config
        self.settings = settings
        try:
            self.host = EngineHost(
                config, log_path=settings.event_log, fmt=settings.event_log_format,
                digest_interval=settings.digest_interval, background=True, next_free=True,
                snapshot_interval_events=settings.snapshot_interval_events,
                keep_serving=settings.event_log_on_error == "continue")
        except OSError as exc:  # a missing or read-only directory: name the setting
            raise ConfigError(f"event_log {settings.event_log!r} cannot be created: "
                              f"{exc.strerror or exc} (errno {exc.errno})") from None
        self.log_path = str(self.host.writer.path) if self.host.writer is not None else None
        if self.log_path is not None:
            _log.info("event_log_opened", path=self.log_path)
        self._tables: tuple = ()  # each group's `req_to_blocks`, which vLLM's managers keep for their life
        self._scheduled: Mapping[str, int] = {}  # the current step's requests (vLLM's num_scheduled_tokens)
        self._pool: BlockPoolView | None = None
        self._requests: dict[str, Request] = {}
        # Streaming sessions (vLLM's resumable requests): the planner compares their
        # hashes in every step, as a turn's next input can rewind them.
        self._sessions: set[str] = set()
        self.tier_events = tier_events
        self._tier_names = tuple(tier.name for tier in config.lower_tiers)
        self._metrics = MetricDeltas(self._tier_names)
        self.restores = RestoreTimes()
        self._carried: list[fx.Effect] = []  # worker effects of calls outside a step, for the next step
        self._tiers = tiers
        self._misses = (MissCounter(config, max_keys=settings.miss_memory_keys, background=True)
                        if settings.miss_metrics else None)
        # restore_budget "auto": what loads and prefills cost here, measured (`restore_costs.py`)
        self._costs = CostMeter(len(config.lower_tiers)) if config.restore_budget is RestoreBudget.AUTO else None
        # vLLM's backpressure: each lower tier's writes measured, the share of spills dropped (`backpressure.py`)
        pressured = {index: s for index, s in enumerate(settings.backpressure, start=1) if s is not None}
        self._pressure = Backpressure(pressured, config.slot_bytes) if pressured else None
        self._lookups = HitLookups(lambda: self.host.state, self._apply, tiers)
        self._chain = self._chain_keys(tiers.key_root) if tiers is not None else None
        self._keys_of = self._chain.keys if self._chain is not None else None
        # After a reset that began a new key generation: generation 0's keys, told beside the new
        # ones (`ev.FirstGenerationHashes`), so `explain` can say which blocks the reset lost.
        self._first_chain: ChainKeys | None = None
        if tiers is not None:
            self._apply(list(tiers.startup_events()))

    # Applying events and carrying out their effects.

    def _apply(self, events: list[ev.Event]) -> tuple[fx.Effect, ...]:
        """Apply one step's (or one call's) events; carry out what is the scheduler's."""
        if self._first_chain is not None:
            events = self._with_first_generation(events)
        if self._misses is None:
            effects = self.host.apply_step(events)
        else:
            ends: list[int] = []
            effects = self.host.apply_step(events, ends)
            self._misses.feed(events, effects, ends)
        if effects:
            self._carry_out(effects)
        return effects

    def _with_first_generation(self, events: list[ev.Event]) -> list[ev.Event]:
        """Each hash a request names, followed by the same blocks' generation-0 hashes."""
        first_chain = self._first_chain
        assert first_chain is not None
        told: list[ev.Event] = []
        for event in events:
            told.append(event)
            if type(event) is ev.RequestAdded or type(event) is ev.BlockHashesAppended:
                request = self._requests.get(event.request_id)
                if request is None or not event.block_hashes:
                    continue
                first = first_chain.keys(request)
                start = len(first) - len(event.block_hashes)
                told.append(ev.FirstGenerationHashes(request_id=event.request_id, first=start,
                                                     block_hashes=tuple(first[start:])))
        return told

    def _carry_out(self, effects: tuple[fx.Effect, ...]) -> None:
        """The scheduler's own effects, and the notifications translated for logs,
        metrics, KV events and lookups; the workers' effects wait for the step's
        metadata (those of calls between steps ride on the next one)."""
        routed = fx.route(effects)
        for phase in fx.WORKER_PHASES:
            self._carried.extend(routed[phase])
        fx.dispatch(_CARRY, self, effects)
        if self._pressure is not None:
            now = time.monotonic()
            for effect in routed[fx.Phase.AFTER_FORWARD]:
                if type(effect) is fx.StartSpill:
                    self._pressure.spill_started(effect, now)
        events = self.tier_events
        if events is not None and events.self_describing and routed[fx.Phase.AFTER_FORWARD]:
            stores = [e for e in routed[fx.Phase.AFTER_FORWARD] if type(e) is fx.StartStore]
            events.describe_stores(stores, self._requests, self._tables, self._scheduled)
        notifications = routed[fx.Phase.NOTIFICATION]
        if notifications and events is not None:
            events.observe(notifications)

    def _load_started(self, load: fx.StartLoad) -> None:
        self.restores.load_started(load.job_id, load.request_id, any(t for g in load.promote_tiers for t in g))
        if self._costs is not None:
            self._costs.load_started(load, time.monotonic())

    def _pin(self, effect: fx.PinDeviceBlocks) -> None:
        self._block_pool.touch(effect.block_ids)

    def _unpin(self, effect: fx.UnpinDeviceBlocks) -> None:
        self._block_pool.free_blocks(effect.block_ids)

    def _unloadable(self, effect: fx.KeysUnloadable) -> None:
        self._metrics.keys_unloadable(effect)
        if effect.tier and self._tiers is not None:
            self._tiers.removed(effect.tier, effect.keys)

    def _job_ended(self, effect: fx.JobEnded) -> None:
        if effect.kind == "spill" and self._pressure is not None:
            self._pressure.spill_ended(effect, time.monotonic())
        if effect.kind == "load":  # a failed load is recomputed: its time is not a restore's
            self.restores.load_ended(effect.job_id, ok=not effect.failed_keys)
            if self._costs is not None:
                self._costs.load_ended(effect.job_id, not effect.failed_keys, time.monotonic())

    def _failed(self, effect: fx.TransferFailed) -> None:
        if effect.tier and self._tiers is not None:  # a copy that failed to write may be partly there
            self._tiers.removed(effect.tier, effect.keys)
        if effect.kind == "store" and self.tier_events is not None:
            self.tier_events.forget_unstored(effect.keys)
        _log.warning(f"{effect.kind}_failed", request_id=effect.request_id or None, job_id=effect.job_id,
                     worker_index=effect.worker_index, keys=hex_keys(effect.keys), step=self._position.step_index)

    def _below_threshold(self, effect: fx.KeysBelowThreshold) -> None:
        self._metrics.stores_skipped(effect.keys)

    def _spill_dropped(self, effect: fx.SpillDropped) -> None:
        self._metrics.spill_dropped(self._tier_names[effect.tier - 1], effect.keys)

    def _violation(self, effect: fx.ReportViolation) -> None:
        self._metrics.violation()
        _log.error("protocol_violation", code=effect.code, message=effect.message, event_kind=effect.event_kind,
                   request_id=effect.request_id, job_id=effect.job_id, keys=hex_keys(effect.keys),
                   step=self._position.step_index)

    @property
    def _position(self) -> queries.Position:
        """The engine's step and epoch: the last step and reset it took."""
        return queries.position(self.host.state)

    # vLLM's scheduler-side calls.

    def bind(self, manager: KVCacheManager) -> None:
        self._tables = tuple(group.req_to_blocks for group in manager.coordinator.single_type_managers)
        self._pool = BlockPoolView(manager.block_pool)

    @property
    def _block_pool(self) -> BlockPoolView:
        assert self._pool is not None, "bind_kv_cache_manager was not called"
        return self._pool

    def on_new_request(self, request: Request) -> None:
        rid = request.request_id
        self._requests[rid] = request
        if getattr(request, "resumable", False):
            self._sessions.add(rid)
        hashes = request.block_hashes if self._keys_of is None else self._keys_of(request)
        self._apply([ev.RequestAdded(request_id=rid, num_prompt_tokens=request.num_prompt_tokens,
                                     block_hashes=tuple(hashes))])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        started = time.perf_counter()
        rid = request.request_id
        changed = new_hashes(self.host.state, rid, request, self._keys_of, rewinds=rid in self._sessions)
        if changed:
            if type(changed[0]) is ev.BlockHashesRewound:
                self._lookups.rewound(rid)
            self._apply(list(changed))
        self.restores.asked(rid)
        answer = self._lookups.hit(rid, num_computed_tokens)
        self.restores.answered(rid, answer[0])
        self._metrics.lookup_delay(time.perf_counter() - started)
        return answer

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        self._lookups.admitted(request.request_id, num_external_tokens)
        self.restores.admitted(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVLedgerMetadata:
        assert self._tables, "bind_kv_cache_manager was not called"
        scheduled = scheduler_output.num_scheduled_tokens
        self.restores.scheduled(scheduled)
        self._scheduled = scheduled  # the step's requests, for self-describing KV events
        if self._pressure is not None:  # a tier's pressure rose or eased: the engine drops spills by it
            moved = self._pressure.tick(time.monotonic())
            if moved:
                self._apply(list(moved))
        if self._costs is not None:  # the last step's time is a sample; the next lookups weigh the news
            measured = self._costs.step(time.monotonic(), scheduler_output.total_num_scheduled_tokens)
            if measured is not None:
                self._apply([measured])
        events = plan_step(
            self.host.state, step_index=self._position.step_index + 1, preempted=scheduler_output.preempted_req_ids or (),
            scheduled=scheduled, admissions=self._lookups.take_admissions(), requests=self._requests, tables=self._tables,
            near_eviction=self._near_eviction() if self.config.store_mode is StoreMode.LAZY else (),
            keys_of=self._keys_of, cached=scheduler_output.scheduled_cached_reqs, sessions=self._sessions,
            wall_time_us=time.time_ns() // 1000)
        self._apply(events)
        if self._tiers is not None:  # the next step's lookups may wait their budget again
            self._tiers.new_step()
        carried, self._carried = self._carried, []  # this step's, after those of calls since the last
        return KVLedgerMetadata.from_effects(carried, idle=not scheduler_output.total_num_scheduled_tokens)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVLedgerWorkerMetadata) and meta.events:
            self._apply(list(meta.events))

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        rid = request.request_id
        status = queries.request_status(self.host.state, rid)
        if status is RequestStatus.RUNNING:
            self._apply([ev.RequestFinished(request_id=rid, block_ids=block_ids)])
        elif status is not None:  # never ran, preempted, or still loading: vLLM frees a loading one when its load ends
            self._apply([ev.RequestAborted(request_id=rid)])
        self._requests.pop(rid, None)
        self._sessions.discard(rid)
        self._lookups.forget(rid)
        self.restores.forget(rid)
        if self._chain is not None:
            self._chain.forget(rid)
        if self._first_chain is not None:
            self._first_chain.forget(rid)
        if self._tiers is not None:
            self._tiers.forget(rid)
        return False, None  # blocks are freed now; the engine flushes stores that still read them

    def take_stats(self) -> m.KVLedgerStats | None:
        """What moved since the last report (`MetricDeltas`); None when nothing did."""
        return self._metrics.take(self.host.state, log_failed=self.host.log_failure is not None, tiers=self._tiers,
                                  misses=self._misses.take() if self._misses is not None else None,
                                  restores=self.restores.take(),
                                  pressure=None if self._pressure is None else
                                  {self._tier_names[t - 1]: d.ema for t, d in self._pressure.detectors.items()})

    def take_events(self) -> list:
        return [] if self.tier_events is None else self.tier_events.take()

    def has_pending_work(self) -> bool:
        """Keep vLLM stepping while transfers run, or their completions never arrive, and
        while the miss counter's last counts are not yet reported."""
        return (queries.has_jobs_in_flight(self.host.state) or bool(self._carried)
                or (self._misses is not None and self._misses.unpublished()))

    def has_pending_block_frees(self) -> bool:
        """Blocks kvledger holds for stores come back when those end: vLLM
        should wait for them rather than preempt a request."""
        return self._pool is not None and self._pool.pinned > 0

    def reset_cache(self) -> bool:
        """vLLM resets the connector before a sleep discards the KV cache, when
        generation pauses with its cache cleared (new weights), and on request.

        What host memory holds is dropped, and what the device blocks hold is
        forgotten. With tiers below host memory, a new key generation begins:
        blocks written before the reset, by this process or by any other sharing
        the tier, are never found again under the keys used after it; or, with
        `key_generations` "kept", those tiers keep their blocks under the same keys."""
        epoch = self._position.epoch + 1
        tiers = self._tiers
        kept = self.settings.key_generations == "kept"
        rekeyed = tiers is not None and not kept
        if tiers is not None and not kept:
            # Private generations are salted at random: another replica's reset, whatever weights it
            # loaded, never lands on these keys (adapters may draw randomness; the keys enter the log).
            salt = os.urandom(16) if self.settings.key_generations == "private" else b""
            if self._first_chain is None:  # the chain being replaced is generation 0's
                self._first_chain = self._chain
            self._chain = self._chain_keys(generation_root(tiers.key_root, epoch, salt))
            self._keys_of = self._chain.keys
            tiers.new_generation()
        self._apply([ev.CacheReset(epoch=epoch, rekeyed=rekeyed, keep_lower=tiers is not None and kept)])
        return True

    def _chain_keys(self, root: bytes) -> ChainKeys:
        tiers = self._tiers
        assert tiers is not None
        return ChainKeys(root, self.config.hash_block_size, tiers.block_keys, tiers.chain_secret)

    def shutdown(self) -> None:
        if self._tiers is not None:
            self._tiers.close()
        if self._misses is not None:
            self._misses.close()
        self.host.close()

    def _near_eviction(self) -> tuple[int, ...]:
        """The first free blocks vLLM will hand out, in the order it will."""
        near = []
        for block in self._block_pool.iter_free_blocks():
            if len(near) >= self.settings.lazy_target_blocks:
                break
            if not block.is_null:
                near.append(block.block_id)
        return tuple(near)


# What the scheduler half does with each effect kind at once. Ignored: what the workers carry out
# (from the step's metadata) and what only the KV events read.
_CARRY = fx.dispatch_table("scheduler side", {
    fx.PinDeviceBlocks: LedgerScheduler._pin,
    fx.UnpinDeviceBlocks: LedgerScheduler._unpin,
    fx.StartLoad: LedgerScheduler._load_started,  # timed from here (restore_timing)
    fx.KeysUnloadable: LedgerScheduler._unloadable,
    fx.TransferFailed: LedgerScheduler._failed,
    fx.JobEnded: LedgerScheduler._job_ended,  # restore_timing's last mark
    fx.ReportViolation: LedgerScheduler._violation,
    fx.KeysBelowThreshold: LedgerScheduler._below_threshold,  # vllm:kv_offload_stores_skipped
    fx.SpillDropped: LedgerScheduler._spill_dropped,  # vllm:kv_offload_tiering_backpressure_*_dropped
}, ignored=(fx.StartStore, fx.StartSpill, fx.DropTierKeys, fx.FlushStores, fx.KeysLoadable, fx.KeysNotAdmitted, fx.RequestAdmitted, fx.RequestRequeued))
