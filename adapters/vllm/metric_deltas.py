"""What the scheduler reports each step: the engine's totals and the tiers'
counts as their change since the last report, the gauges when one moved,
and what the scheduler itself saw (keys dropped, by reason; violations;
lookup delays). vLLM asks every step and most steps move nothing: then
`take` answers None and vLLM sends nothing on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.adapters.vllm import metrics as m
from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.state import STATS_FIELDS, State

if TYPE_CHECKING:
    from kvledger.adapters.vllm.lower_tiers import SchedulerTiers

# Engine totals reported as counters: the stats carry their change since the last report.
_COUNTED = tuple((STATS_FIELDS.index(field), metric) for field, metric in (
    ("hit_tokens", m.HIT_TOKENS), ("loads", m.LOADS), ("stores", m.STORES),
    ("store_rejections", m.ALLOCATION_FAILURE), ("load_failures", m.LOAD_FAILURES),
    ("store_failures", m.STORE_FAILURES), ("keys_failed", m.FAILED_BLOCKS),
    ("flushes", m.FLUSHES), ("jobs_flushed", m.FLUSHED_JOBS)))

_TIER_COUNTED = (("keys_read", m.TIER_KEYS_READ), ("keys_written", m.TIER_KEYS_WRITTEN),
                 ("keys_found", m.TIER_FOUND))

# Keys leaving a tier, counted from the engine's notifications by their reason: its totals
# (`evictions`) count an eviction and a reset's drop alike. Failed keys have counters of their own.
_HOST_DROPS = {fx.Reason.EVICTED: m.EVICTIONS, fx.Reason.RESET: m.RESET_DROPPED}
_TIER_DROPS = {fx.Reason.EVICTED: m.TIER_EVICTIONS, fx.Reason.RESET: m.TIER_RESET_DROPPED}


class MetricDeltas:
    """The scheduler's side of the stats: what was last reported, and what it
    saw since. `tier_names` are the lower tiers' ("1:fs"), in order."""

    def __init__(self, tier_names: tuple[str, ...]) -> None:
        self.tier_names = tier_names
        self._reported = (0,) * len(STATS_FIELDS)  # engine totals at the last report
        self._gauges: tuple[int, ...] = ()  # the host tier's gauges as last reported
        self._tier_reported: dict[tuple[str, str], int] = {}  # each lower tier's counts, likewise
        self._dropped: dict[tuple[m.Metric, str], int] = {}  # keys evicted or reset away since the last report
        self._violations = 0
        self._log_failure_reported = False
        self._lookup_seconds: list[float] = []

    def keys_unloadable(self, effect: fx.KeysUnloadable) -> None:
        if effect.tier:
            self._count_drop(_TIER_DROPS.get(effect.reason), self.tier_names[effect.tier - 1], effect.keys)
        else:
            self._count_drop(_HOST_DROPS.get(effect.reason), "", effect.keys)

    def _count_drop(self, metric: m.Metric | None, tier: str, keys: tuple[bytes, ...]) -> None:
        self._count_up(metric, tier, len(keys))

    def _count_up(self, metric: m.Metric | None, tier: str, count: int) -> None:
        if metric is not None and count:
            mark = (metric, tier)
            self._dropped[mark] = self._dropped.get(mark, 0) + count

    def stores_skipped(self, keys: tuple[bytes, ...]) -> None:
        self._count_drop(m.STORES_SKIPPED, "", keys)

    def spill_dropped(self, tier: str, keys: tuple[bytes, ...]) -> None:
        self._count_drop(m.BACKPRESSURE_BLOCKS_DROPPED, tier, keys)
        self._count_up(m.BACKPRESSURE_STORES_DROPPED, tier, 1)  # one store (spill) a notification

    def violation(self) -> None:
        self._violations += 1

    def lookup_delay(self, seconds: float) -> None:
        self._lookup_seconds.append(seconds)

    def take(self, state: State, *, log_failed: bool, tiers: SchedulerTiers | None,
             misses: dict[str, int] | None = None,
             restores: list[tuple[str, float]] | None = None,
             pressure: dict[str, float] | None = None) -> m.KVLedgerStats | None:
        """What moved since the last report, or None when nothing did.
        `misses`: missed tokens by cause since then (`MissCounter.take`);
        `restores`: the stages of restores completed since then (`RestoreTimes.take`);
        `pressure`: each backpressured tier's write latency average, seconds a MiB."""
        totals = queries.totals(state)
        tier = queries.tier_usage(state)
        # Slots a transfer holds (vLLM 0.33's "pinned"): every used one but the evictable,
        # of them those being read; the rest are being stored into.
        gauges = (tier.used_slots, tier.capacity_slots, queries.num_jobs_in_flight(state),
                  tier.used_slots - tier.evictable_keys, tier.loading_slots)
        counted = totals != self._reported
        gauged = gauges != self._gauges
        log_failed = log_failed and not self._log_failure_reported
        if not (counted or gauged or log_failed or self._violations or self._lookup_seconds or self._dropped
                or misses or restores or tiers is not None or self.tier_names):
            return None
        stats = m.KVLedgerStats()
        if counted:
            for index, metric in _COUNTED:
                change = totals[index] - self._reported[index]
                if change:
                    stats.add(metric, change)
            self._reported = totals
        for cause, tokens in (misses or {}).items():
            stats.add(m.MISSED_TOKENS, tokens, cause)
        for stage, seconds in restores or ():
            stats.add(m.RESTORE_STAGE, seconds, stage)
        for (metric, tier_label), count in self._dropped.items():
            stats.add(metric, count, tier_label)
        self._dropped.clear()
        if self._violations:
            stats.add(m.VIOLATIONS, self._violations)
        if log_failed:
            stats.add(m.LOG_FAILURES, 1)
            self._log_failure_reported = True
        self._violations = 0
        for seconds in self._lookup_seconds:
            stats.add(m.LOOKUP_DELAY, seconds)
        self._lookup_seconds.clear()
        if gauged:
            used, capacity, jobs, pinned, reading = gauges
            for metric, value in ((m.TIER_USED, used), (m.TIER_CAPACITY, capacity), (m.JOBS_IN_FLIGHT, jobs),
                                  (m.CPU_USAGE, pinned / capacity), (m.CPU_WRITE_USAGE, (pinned - reading) / capacity),
                                  (m.CPU_READ_USAGE, reading / capacity)):
                stats.add(metric, value)
            self._gauges = gauges
        for usage in queries.lower_tier_usage(state):
            stats.add(m.TIER_HELD, usage.held_keys, usage.name)
            stats.add(m.TIER_BLOCKS_CAPACITY, usage.capacity_blocks, usage.name)
            for field, metric in _TIER_COUNTED:
                self._count(stats, metric, usage.name, field, usage.counts[field])
        for name, seconds in (pressure or {}).items():
            stats.add(m.BACKPRESSURE_LATENCY_EMA, seconds, name)
        if tiers is not None:
            self._lookups(stats, tiers)
        return stats

    def _count(self, stats: m.KVLedgerStats, metric: m.Metric, tier: str, field: str, total: int) -> None:
        mark = (tier, field)
        stats.add(metric, total - self._tier_reported.get(mark, 0), tier)
        self._tier_reported[mark] = total

    def _lookups(self, stats: m.KVLedgerStats, tiers: SchedulerTiers) -> None:
        for index, counts in tiers.counts.items():
            name = self.tier_names[index - 1]
            for field, metric in (("lookup_keys", m.TIER_LOOKUP_KEYS), ("lookup_timeouts", m.TIER_LOOKUP_TIMEOUTS)):
                self._count(stats, metric, name, field, counts[field])
        for index, (asked, found) in tiers.answered().items():
            name = self.tier_names[index - 1]
            self._count(stats, m.TIER_CHUNK_QUERIES, name, "chunk_queries", asked)
            self._count(stats, m.TIER_CHUNK_HITS, name, "chunk_hits", found)
        for index, health in tiers.health.items():
            stats.add(m.TIER_UP, 1 if health.up else 0, self.tier_names[index - 1])
