"""The scheduler half of the connector: vLLM's calls in, engine events out.

vLLM tells a connector about a step piecemeal: lookups and admissions while
`schedule()` runs, then `build_connector_meta` once at its end. Block frees
(preemption, sliding-window blocks leaving the window) happen inside
`schedule()` without any call. So admissions are held until
`build_connector_meta`, where the step's events are emitted in one order
that is always legal: preemptions, frees, growth, admissions, the step
(vLLM's own order: running requests are scheduled before waiting ones).
Frees and growth come from diffing vLLM's block tables against the engine's
own, so nothing is inferred.

`get_num_new_matched_tokens` is a pure query of the engine state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from kvledger.adapters.engine_host import EngineHost
from kvledger.adapters.log_files import unused_path
from kvledger.adapters.settings import ConnectorSettings
from kvledger.adapters.vllm import metrics as m
from kvledger.adapters.vllm.block_pool import BlockPoolView
from kvledger.adapters.vllm.kv_events import TierEvents
from kvledger.adapters.vllm.metadata import KVLedgerMetadata, KVLedgerWorkerMetadata
from kvledger.engine import effects as fx
from kvledger.engine.lookup import lookup
from kvledger.engine.state import RequestState, RequestStatus
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupKind, StoreMode
from kvledger.events.keys import hex_keys
from kvledger.events.types import NULL_BLOCK_ID

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_log = structlog.get_logger("kvledger.adapters.vllm.scheduler")

_ADMITTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

# Engine totals reported as counters: the stats carry their change since the last report.
_COUNTED = (("hit_tokens", m.HIT_TOKENS), ("loads", m.LOADS), ("stores", m.STORES),
            ("store_rejections", m.ALLOCATION_FAILURE), ("load_failures", m.LOAD_FAILURES),
            ("store_failures", m.STORE_FAILURES), ("keys_failed", m.FAILED_BLOCKS),
            ("evictions", m.EVICTIONS), ("flushes", m.FLUSHES), ("jobs_flushed", m.FLUSHED_JOBS))


def _job_keys(job) -> list[bytes]:
    return [] if job is None else [k for group in job.keys for k in group]


class LedgerScheduler:
    """`tier_events` is given when vLLM publishes KV cache events."""

    def __init__(self, config: EngineConfig, settings: ConnectorSettings, *,
                 tier_events: TierEvents | None = None) -> None:
        self.config = config
        self.settings = settings
        self.log_path = unused_path(settings.event_log) if settings.event_log else None
        self.recorder = EngineHost(
            config, log_path=self.log_path, fmt=settings.event_log_format,
            digest_interval=settings.digest_interval, background=True)
        if self.log_path is not None:
            _log.info("event_log_opened", path=self.log_path)
        self._manager: KVCacheManager | None = None
        self._managers: tuple = ()  # vLLM's per-group managers, in group order
        self._window_groups = tuple(i for i, g in enumerate(config.groups) if g.kind is not GroupKind.FULL)
        self._pool: BlockPoolView | None = None
        self._requests: dict[str, Request] = {}
        self._local_hit: dict[str, int] = {}  # the local hit vLLM passed to the last lookup
        self._admitted: list[tuple[str, int, int]] = []  # (request, local tokens, external tokens)
        self._step = 0
        self._epoch = 0
        self.tier_events = tier_events
        self._violations = 0
        self._reported: dict[str, int] = {}  # engine totals at the last stats report
        self._lookup_seconds: list[float] = []

    # Engine access.

    def _engine_request(self, rid: str) -> RequestState | None:
        return self.recorder.state.core.requests.get(rid)

    def _apply(self, event: ev.Event, effects: list[fx.Effect]) -> None:
        job_id = getattr(event, "job_id", None)
        job = None if job_id is None else self.recorder.state.core.jobs.get(job_id)  # gone once it ends
        produced = self.recorder.apply(event)
        for effect in produced:
            if isinstance(effect, fx.PinDeviceBlocks):
                self._block_pool.touch(effect.block_ids)
            elif isinstance(effect, fx.UnpinDeviceBlocks):
                self._block_pool.free_blocks(effect.block_ids)
            elif isinstance(effect, fx.ReportViolation):
                self._violations += 1
                keys = getattr(event, "keys", ()) or _job_keys(job)
                _log.error("protocol_violation", code=effect.code, message=effect.message,
                           event_kind=effect.event_kind, request_id=effect.request_id,
                           job_id=effect.job_id, keys=hex_keys(keys), step=self._step)
        if isinstance(event, (ev.StoreFailed, ev.LoadFailed)):
            _log.warning(event.kind, request_id=None if job is None else job.request_id, job_id=event.job_id,
                         worker_index=event.worker_index, keys=hex_keys(event.keys), step=self._step)
        if self.tier_events is not None:
            self.tier_events.observe(event, _job_keys(job), produced, self.recorder.state.core)
        effects.extend(produced)

    # vLLM's scheduler-side calls.

    def bind(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self._managers = tuple(manager.coordinator.single_type_managers)
        self._pool = BlockPoolView(manager.block_pool)

    @property
    def _block_pool(self) -> BlockPoolView:
        assert self._pool is not None, "bind_kv_cache_manager was not called"
        return self._pool

    def on_new_request(self, request: Request) -> None:
        rid = request.request_id
        self._requests[rid] = request
        effects: list[fx.Effect] = []
        self._apply(ev.RequestAdded(request_id=rid, num_prompt_tokens=request.num_prompt_tokens,
                                    block_hashes=tuple(request.block_hashes)), effects)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        started = time.perf_counter()
        rid = request.request_id
        self._local_hit[rid] = num_computed_tokens
        self._sync_hashes(request, [])
        result = lookup(self.recorder.state, rid, num_computed_tokens)
        self._lookup_seconds.append(time.perf_counter() - started)
        if not result.ready:
            return None, False  # a needed key is still being stored or loaded: ask next step
        hit = result.num_hit_tokens
        return hit, hit > 0  # loads are asynchronous: the request waits for them in WAITING_FOR_REMOTE_KVS

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        rid = request.request_id
        engine_request = self._engine_request(rid)
        if engine_request is not None and engine_request.status in _ADMITTABLE:
            self._admitted.append((rid, self._local_hit.pop(rid, 0), num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVLedgerMetadata:
        effects: list[fx.Effect] = []
        admitted = {rid for rid, _, _ in self._admitted}
        for rid in sorted(scheduler_output.preempted_req_ids or ()):
            engine_request = self._engine_request(rid)
            if engine_request is not None and engine_request.status is RequestStatus.RUNNING:
                self._apply(ev.RequestPreempted(request_id=rid), effects)

        scheduled = scheduler_output.num_scheduled_tokens
        # Every free before any growth: a block one request's window released
        # may be the block another request grew into.
        growing = []
        for rid in scheduled:
            if rid not in admitted:
                blocks = self._follow(rid, effects)
                if blocks is not None:
                    growing.append((rid, blocks))
        # Growth before admissions, as vLLM schedules them: an admission may
        # hit vLLM's prefix cache on blocks a running request allocated this step.
        for rid, blocks in growing:
            self._grow(rid, blocks, effects)
        for rid in admitted:
            self._sync_hashes(self._requests[rid], effects)
        for rid, local, external in self._admitted:
            self._admit(rid, local, external, effects)
        self._admitted.clear()

        if self.config.store_mode is StoreMode.LAZY:
            near = self._near_eviction()
            if near:
                self._apply(ev.BlocksNearEviction(block_ids=near), effects)

        if scheduled:
            self._step += 1
            rids = tuple(scheduled)
            self._apply(ev.StepScheduled(
                step_index=self._step, request_ids=rids,
                num_computed_tokens=tuple(self._requests[r].num_computed_tokens for r in rids),
                num_scheduled_tokens=tuple(scheduled[r] for r in rids)), effects)
        return KVLedgerMetadata.from_effects(effects)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVLedgerWorkerMetadata):
            return
        effects: list[fx.Effect] = []
        for event in meta.events:
            self._apply(event, effects)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        rid = request.request_id
        engine_request = self._engine_request(rid)
        effects: list[fx.Effect] = []
        if engine_request is not None:
            if engine_request.status is RequestStatus.RUNNING:
                self._apply(ev.RequestFinished(request_id=rid, block_ids=block_ids), effects)
            else:  # never ran, preempted, or still loading: vLLM frees a loading one when its load ends
                self._apply(ev.RequestAborted(request_id=rid), effects)
        self._requests.pop(rid, None)
        self._local_hit.pop(rid, None)
        return False, None  # blocks are freed now; the engine flushes stores that still read them

    def take_stats(self) -> m.KVLedgerStats:
        """What the engine counted since the last report, and the tier now."""
        stats = m.KVLedgerStats()
        core = self.recorder.state.core
        totals = core.stats.as_dict()
        for field, metric in _COUNTED:
            stats.add(metric, totals[field] - self._reported.get(field, 0))
        self._reported = totals
        stats.add(m.VIOLATIONS, self._violations)
        self._violations = 0
        for seconds in self._lookup_seconds:
            stats.add(m.LOOKUP_DELAY, seconds)
        self._lookup_seconds.clear()
        stats.add(m.TIER_USED, core.num_used_slots())
        stats.add(m.TIER_CAPACITY, self.config.num_tier_slots)
        stats.add(m.JOBS_IN_FLIGHT, len(core.jobs))
        return stats

    def take_events(self) -> list:
        return [] if self.tier_events is None else self.tier_events.take()

    def has_pending_work(self) -> bool:
        """Keep vLLM stepping while transfers run, or their completions never arrive."""
        return bool(self.recorder.state.core.jobs)

    def has_pending_block_frees(self) -> bool:
        """Blocks kvledger holds for stores come back when those end: vLLM
        should wait for them rather than preempt a request."""
        return self._pool is not None and self._pool.pinned > 0

    def reset_cache(self) -> bool:
        self._epoch += 1
        self._apply(ev.CacheReset(epoch=self._epoch), [])
        return True

    def shutdown(self) -> None:
        self.recorder.close()

    # Table diffs.

    def _near_eviction(self) -> tuple[int, ...]:
        """The first free blocks vLLM will hand out, in the order it will."""
        near = []
        for block in self._block_pool.iter_free_blocks():
            if len(near) >= self.settings.lazy_target_blocks:
                break
            if not block.is_null:
                near.append(block.block_id)
        return tuple(near)

    def _blocks(self, rid: str) -> tuple[list, ...]:
        """vLLM's own per-group block lists for the request (read, never copied)."""
        assert self._manager is not None, "bind_kv_cache_manager was not called"
        return tuple(m.req_to_blocks.get(rid, ()) for m in self._managers)

    def _table(self, rid: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(b.block_id for b in blocks) for blocks in self._blocks(rid))

    def _sync_hashes(self, request: Request, effects: list[fx.Effect]) -> None:
        engine_request = self._engine_request(request.request_id)
        if engine_request is None:
            return
        known = len(engine_request.hashes)
        hashes = request.block_hashes
        if len(hashes) > known:
            self._apply(ev.BlockHashesAppended(request_id=request.request_id, num_tokens=request.num_tokens,
                                               block_hashes=tuple(hashes[known:])), effects)

    def _follow(self, rid: str, effects: list[fx.Effect]) -> tuple[list, ...] | None:
        """Catch the engine up with one running request's new hashes and its
        window frees; vLLM's block lists when they grew, for `_grow`.

        Frees are blocks vLLM has replaced by the null block. Only window
        groups lose blocks mid-request, always from the front, so the scan
        starts at the engine's free floor and stops at the first block vLLM
        still holds: at most a comparison per window group in most steps.
        """
        mine = self._engine_request(rid)
        if mine is None:
            return None
        request = self._requests[rid]
        if len(request.block_hashes) > len(mine.hashes):
            self._sync_hashes(request, effects)
            mine = self._engine_request(rid)
        blocks = self._blocks(rid)
        freed: list[list[int]] | None = None
        for g in self._window_groups:
            known, now = mine.table[g], blocks[g]
            for position in range(mine.free_floor[g], min(len(known), len(now))):
                if not now[position].is_null:
                    break
                if known[position] != NULL_BLOCK_ID:
                    if freed is None:
                        freed = [[] for _ in blocks]
                    freed[g].append(known[position])
        if freed is not None:
            self._apply(ev.BlocksFreed(request_id=rid, block_ids=tuple(tuple(f) for f in freed)), effects)
            mine = self._engine_request(rid)
        if all(len(now) == len(known) for known, now in zip(mine.table, blocks)):
            return None
        return blocks

    def _grow(self, rid: str, blocks: tuple[list, ...], effects: list[fx.Effect]) -> None:
        mine = self._engine_request(rid)
        if mine is None:
            return
        grown = tuple(tuple(b.block_id for b in now[len(known):]) for known, now in zip(mine.table, blocks))
        if any(grown):
            self._apply(ev.BlocksAllocated(request_id=rid, block_ids=grown), effects)

    def _admit(self, rid: str, local: int, external: int, effects: list[fx.Effect]) -> None:
        mine = self._engine_request(rid)
        if mine is None:
            return
        if mine.status is RequestStatus.PREEMPTED:
            self._apply(ev.RequestResumed(request_id=rid), effects)
        table = self._table(rid)
        if local:
            touched = tuple(tuple(ids[: local // g.block_size]) for ids, g in zip(table, self.config.groups))
            self._apply(ev.BlocksTouched(request_id=rid, block_ids=touched), effects)
        fresh = tuple(tuple(ids[local // g.block_size:]) for ids, g in zip(table, self.config.groups))
        self._apply(ev.BlocksAllocated(request_id=rid, block_ids=fresh, num_external_tokens=external), effects)

