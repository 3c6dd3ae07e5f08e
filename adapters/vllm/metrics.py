"""Connector metrics through vLLM's hooks: stats per step, Prometheus at the end.

Workers report what they measured while copying (bytes, copy time, job
sizes); the scheduler reports what only the engine knows (hits, lookups,
evictions, flushes, failures, tier usage). vLLM merges both halves with
`aggregate()` and hands the result to `KVLedgerPromMetrics.observe`.

Where a meaning matches vLLM's own offloading connector, the name is its
`vllm:kv_offload_*` name, so dashboards built for it keep working; the rest
are `vllm:kvledger_*`. Tiers below host memory report under vLLM 0.33's
`vllm:kv_offload_tiering_*` names, labelled `tier` ("1:fs"); missed prompt
tokens are labelled by `cause` (`misses.CAUSES`), restore stages by `stage`.
In the stats such a value travels as `name|tier`, `name|cause` or `name|stage`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
_LOOKUP_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)


@attrs.frozen
class Metric:
    name: str
    kind: str
    documentation: str
    buckets: tuple[float, ...] = ()
    label: str = ""  # the label of its own, if any: "tier" ("1:fs"), "cause" (a miss's) or "stage" (a restore's)


LOAD_BYTES = Metric("vllm:kv_offload_load_bytes", COUNTER, "Total bytes loaded from offload storage to GPU.")
LOAD_TIME = Metric("vllm:kv_offload_load_time", COUNTER,
                   "Total load time from offload storage to GPU, in seconds.")
LOAD_SIZE = Metric("vllm:kv_offload_load_size", HISTOGRAM,
                   "Histogram of KV offload load operation size, in bytes.", _SIZE_BUCKETS)
STORE_BYTES = Metric("vllm:kv_offload_store_bytes", COUNTER, "Total bytes stored from GPU to offload storage.")
STORE_TIME = Metric("vllm:kv_offload_store_time", COUNTER,
                    "Total store time from GPU to offload storage, in seconds.")
STORE_SIZE = Metric("vllm:kv_offload_store_size", HISTOGRAM,
                    "Histogram of KV offload store operation size, in bytes.", _SIZE_BUCKETS)
ALLOCATION_FAILURE = Metric("vllm:kv_offload_allocation_failure", COUNTER,
                            "Number of KV offload store allocation attempts that failed.")
LOOKUP_DELAY = Metric("vllm:kv_offload_lookup_sync_delay_seconds", HISTOGRAM,
                      "Histogram of the time spent in a single offload lookup call, in seconds.", _LOOKUP_BUCKETS)
STORES_SKIPPED = Metric("vllm:kv_offload_stores_skipped", COUNTER,
                        "Blocks offered for storing and not stored: fewer than store_threshold requests had "
                        "offered them.")
HIT_TOKENS = Metric("vllm:kvledger_hit_tokens", COUNTER, "Tokens restored from the tier instead of computed.")
RESTORE_STAGE = Metric("vllm:kvledger_restore_stage_seconds", HISTOGRAM,
                       "Time a restore waited at each stage, on the scheduler's clock: lookup, admission, "
                       "load_host or load_promoted (the load, with promotions from a lower tier or not), "
                       "first_step (from the load's end to the step that computes the rest).",
                       (1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0), label="stage")
MISSED_TOKENS = Metric("vllm:kvledger_missed_tokens", COUNTER,
                       "Prompt tokens computed because neither vLLM's prefix cache nor a tier held them, by why "
                       "(kvledger explain's causes).", label="cause")
LOADS = Metric("vllm:kvledger_loads", COUNTER, "Load jobs started.")
STORES = Metric("vllm:kvledger_stores", COUNTER, "Store jobs started.")
LOAD_FAILURES = Metric("vllm:kvledger_load_failures", COUNTER, "Load jobs that failed, in whole or in part.")
STORE_FAILURES = Metric("vllm:kvledger_store_failures", COUNTER, "Store jobs that failed, in whole or in part.")
FAILED_BLOCKS = Metric("vllm:kvledger_failed_blocks", COUNTER,
                       "Blocks dropped from the tier because a transfer of theirs failed.")
EVICTIONS = Metric("vllm:kvledger_evictions", COUNTER,
                   "Blocks evicted from host memory to make room (not those a cache reset dropped: "
                   "vllm:kvledger_reset_dropped_blocks).")
RESET_DROPPED = Metric("vllm:kvledger_reset_dropped_blocks", COUNTER,
                       "Blocks host memory held that a cache reset dropped (reset_prefix_cache, the reset "
                       "before a sleep, or one for new weights).")
FLUSHES = Metric("vllm:kvledger_flushes", COUNTER,
                 "Steps that waited for stores before reusing their source blocks.")
FLUSHED_JOBS = Metric("vllm:kvledger_flushed_jobs", COUNTER, "Store jobs a step waited for.")
VIOLATIONS = Metric("vllm:kvledger_protocol_violations", COUNTER,
                    "Connector calls the engine refused as protocol violations (see the logs).")
LOG_FAILURES = Metric("vllm:kvledger_event_log_failures", COUNTER,
                     "Event logs stopped because they could not be written (vLLM served on).")
TIER_USED = Metric("vllm:kvledger_tier_used_blocks", GAUGE, "Tier slots holding or receiving a block.")
TIER_CAPACITY = Metric("vllm:kvledger_tier_capacity_blocks", GAUGE, "Tier slots in all.")
JOBS_IN_FLIGHT = Metric("vllm:kvledger_jobs_in_flight", GAUGE, "Store and load jobs not yet completed.")
# vLLM 0.33's CPU tier gauges (vllm/v1/kv_offload/cpu/spec.py): the share of host slots a transfer
# holds, not of slots holding blocks (vllm:kvledger_tier_used_blocks counts those).
CPU_USAGE = Metric("vllm:kv_offload_cpu_cache_usage_perc", GAUGE,
                   "Fraction of CPU KV-cache space currently pinned by active transfers (0.0 = idle, "
                   "1.0 = saturated): host slots being stored into or read from.")
CPU_WRITE_USAGE = Metric("vllm:kv_offload_cpu_cache_write_usage_perc", GAUGE,
                         "Fraction of CPU KV-cache space currently pinned by in-flight stores that have not "
                         "yet completed (0.0 = idle, 1.0 = saturated); promotions from a lower tier included.")
CPU_READ_USAGE = Metric("vllm:kv_offload_cpu_cache_read_usage_perc", GAUGE,
                        "Fraction of CPU KV-cache space currently pinned by in-flight loads that have not "
                        "yet completed (0.0 = idle, 1.0 = saturated); reads for writes to a lower tier included.")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TIER_READ_BYTES = Metric("vllm:kv_offload_tiering_read_bytes", COUNTER,
                         "Bytes promoted from a secondary tier into host memory.", label="tier")
TIER_READ_TIME = Metric("vllm:kv_offload_tiering_read_time", COUNTER,
                        "Time the tier's I/O threads spent on promotions, in seconds.", label="tier")
TIER_WRITE_BYTES = Metric("vllm:kv_offload_tiering_write_bytes", COUNTER,
                          "Bytes written from host memory to a secondary tier.", label="tier")
TIER_WRITE_TIME = Metric("vllm:kv_offload_tiering_write_time", COUNTER,
                         "Time the tier's I/O threads spent on writes, in seconds.", label="tier")
TIER_PROMOTION_FAILURES = Metric("vllm:kv_offload_tiering_promotion_job_failures", COUNTER,
                                 "Promotions (reads) from a secondary tier that failed in whole or part.", label="tier")
TIER_CASCADE_FAILURES = Metric("vllm:kv_offload_tiering_cascade_job_failures", COUNTER,
                               "Writes to a secondary tier that failed in whole or part.", label="tier")
TIER_PROMOTION_LATENCY = Metric("vllm:kv_offload_tiering_promotion_latency_seconds", HISTOGRAM,
                                "I/O time of a promotion from a secondary tier, in seconds.", _LATENCY_BUCKETS,
                                label="tier")
TIER_HELD = Metric("vllm:kvledger_tiering_held_blocks", GAUGE, "Blocks a secondary tier holds.", label="tier")
TIER_BLOCKS_CAPACITY = Metric("vllm:kvledger_tiering_capacity_blocks", GAUGE,
                              "Blocks a secondary tier can hold.", label="tier")
TIER_KEYS_READ = Metric("vllm:kvledger_tiering_promoted_blocks", COUNTER,
                        "Blocks promoted from a secondary tier towards the device.", label="tier")
TIER_KEYS_WRITTEN = Metric("vllm:kvledger_tiering_written_blocks", COUNTER,
                           "Blocks written to a secondary tier.", label="tier")
BACKPRESSURE_LATENCY_EMA = Metric("vllm:kv_offload_tiering_backpressure_store_latency_ema", GAUGE,
                                  "Exponential moving average of store latency for back-pressure detection, in s/MiB.",
                                  label="tier")
BACKPRESSURE_STORES_DROPPED = Metric("vllm:kv_offload_tiering_backpressure_stores_dropped", COUNTER,
                                     "Number of store operations dropped due to back-pressure on a secondary tier.",
                                     label="tier")
BACKPRESSURE_BLOCKS_DROPPED = Metric("vllm:kv_offload_tiering_backpressure_blocks_dropped", COUNTER,
                                     "Number of blocks dropped due to back-pressure on a secondary tier.", label="tier")
TIER_EVICTIONS = Metric("vllm:kvledger_tiering_evictions", COUNTER,
                        "Blocks removed from a secondary tier to make room (not those a cache reset dropped: "
                        "vllm:kvledger_tiering_reset_dropped_blocks).", label="tier")
TIER_RESET_DROPPED = Metric("vllm:kvledger_tiering_reset_dropped_blocks", COUNTER,
                            "Blocks a cache reset removed from a secondary tier: those it held, and those a "
                            "write in flight at the reset put there.", label="tier")
TIER_FOUND = Metric("vllm:kvledger_tiering_found_blocks", COUNTER,
                    "Blocks found in a secondary tier at start or by a lookup (written by another process).",
                    label="tier")
TIER_UNREACHABLE = Metric("vllm:kvledger_tiering_unreachable_blocks", COUNTER,
                          "Blocks a tier job failed because the tier's server was down or slower than its timeout.",
                          label="tier")
TIER_FORGED = Metric("vllm:kvledger_tiering_forged_blocks", COUNTER,
                     "Blocks a tier with a secret refused to load: not sealed with its secret (written by someone "
                     "without it). Recomputed, never served.", label="tier")
TIER_LOOKUP_KEYS = Metric("vllm:kvledger_tiering_lookup_blocks", COUNTER,
                          "Blocks looked up in a shared tier (found ones: vllm:kvledger_tiering_found_blocks).",
                          label="tier")
TIER_LOOKUP_TIMEOUTS = Metric("vllm:kvledger_tiering_lookup_timeouts", COUNTER,
                              "Lookups in a shared tier not answered in time (the request computed).", label="tier")
TIER_UP = Metric("vllm:kvledger_tiering_up", GAUGE,
                 "1 while a shared tier's server answers the scheduler's lookups, 0 while it is down.", label="tier")
# vLLM 0.33's (vllm/v1/kv_offload/tiering/spec.py). kvledger sends lookups only to shared tiers, and only
# for blocks no tier is known to hold: it knows what host memory and its own writes hold.
TIER_CHUNK_QUERIES = Metric("vllm:kv_offload_tiering_chunk_queries", COUNTER,
                            "Number of chunk lookup queries sent to a tier, labeled by tier: blocks a shared "
                            "tier answered a lookup about (asks it could not answer are not counted).",
                            label="tier")
TIER_CHUNK_HITS = Metric("vllm:kv_offload_tiering_chunk_hits", COUNTER,
                         "Number of chunk lookup hits in a tier, labeled by tier: blocks a shared tier's "
                         "answer said it holds.", label="tier")

METRICS = (LOAD_BYTES, LOAD_TIME, LOAD_SIZE, STORE_BYTES, STORE_TIME, STORE_SIZE, ALLOCATION_FAILURE,
           LOOKUP_DELAY, STORES_SKIPPED, BACKPRESSURE_LATENCY_EMA, BACKPRESSURE_STORES_DROPPED, BACKPRESSURE_BLOCKS_DROPPED, HIT_TOKENS, MISSED_TOKENS, RESTORE_STAGE, LOADS, STORES, LOAD_FAILURES, STORE_FAILURES, FAILED_BLOCKS,
           EVICTIONS, RESET_DROPPED, FLUSHES, FLUSHED_JOBS, VIOLATIONS, LOG_FAILURES, TIER_USED, TIER_CAPACITY,
           JOBS_IN_FLIGHT, CPU_USAGE, CPU_WRITE_USAGE, CPU_READ_USAGE,
           TIER_READ_BYTES, TIER_READ_TIME, TIER_WRITE_BYTES, TIER_WRITE_TIME, TIER_PROMOTION_FAILURES,
           TIER_CASCADE_FAILURES, TIER_PROMOTION_LATENCY, TIER_HELD, TIER_BLOCKS_CAPACITY, TIER_KEYS_READ,
           TIER_KEYS_WRITTEN, TIER_EVICTIONS, TIER_RESET_DROPPED, TIER_FOUND, TIER_UNREACHABLE, TIER_FORGED,
           TIER_LOOKUP_KEYS, TIER_LOOKUP_TIMEOUTS, TIER_UP, TIER_CHUNK_QUERIES, TIER_CHUNK_HITS)
_BY_NAME = {m.name: m for m in METRICS}


@dataclass
class KVLedgerStats(KVConnectorStats):
    """`data` is `{"counter": {name: n}, "gauge": {name: v}, "histogram": {name: [v]}}`:
    plain containers, so it crosses processes as vLLM sends it."""

    def __post_init__(self) -> None:
        for kind in (COUNTER, GAUGE, HISTOGRAM):
            self.data.setdefault(kind, {})

    def reset(self) -> None:
        self.data = {COUNTER: {}, GAUGE: {}, HISTOGRAM: {}}

    def add(self, metric: Metric, value: float, label: str = "") -> None:
        assert bool(label) == bool(metric.label), f"{metric.name}: {metric.label or 'label'} {label!r}"
        name = f"{metric.name}|{label}" if label else metric.name
        if metric.kind == COUNTER:
            if value:
                self.data[COUNTER][name] = self.data[COUNTER].get(name, 0) + value
        elif metric.kind == GAUGE:
            self.data[GAUGE][name] = value
        else:
            self.data[HISTOGRAM].setdefault(name, []).append(value)

    def aggregate(self, other: KVConnectorStats) -> KVLedgerStats:
        if not isinstance(other, KVLedgerStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVLedgerStats")
        for name, value in other.data[COUNTER].items():
            self.data[COUNTER][name] = self.data[COUNTER].get(name, 0) + value
        self.data[GAUGE].update(other.data[GAUGE])
        for name, values in other.data[HISTOGRAM].items():
            self.data[HISTOGRAM].setdefault(name, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line's worth for vLLM's periodic log."""
        out: dict[str, int | float] = {**self.data[COUNTER], **self.data[GAUGE]}
        for name, values in self.data[HISTOGRAM].items():
            out[f"{name}_count"] = len(values)
            out[f"{name}_sum"] = sum(values)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[kind] for kind in (COUNTER, GAUGE, HISTOGRAM))


class KVLedgerPromMetrics(KVConnectorPromMetrics):
    """One Prometheus metric per entry of `METRICS`, with vLLM's engine labels."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[tuple[int, str], Any] = {}
        self._families: dict[str, Any] = {}
        self._engine_labels = per_engine_labelvalues
        for metric in METRICS:
            names = [*labelnames, metric.label] if metric.label else labelnames
            if metric.kind == COUNTER:
                family = self._counter_cls(name=metric.name, documentation=metric.documentation,
                                           labelnames=names)
            elif metric.kind == GAUGE:
                family = self._gauge_cls(name=metric.name, documentation=metric.documentation,
                                         labelnames=names, multiprocess_mode="mostrecent")
            else:
                family = self._histogram_cls(name=metric.name, documentation=metric.documentation,
                                             labelnames=names, buckets=list(metric.buckets))
            self._families[metric.name] = family
            if not metric.label:  # a tier's or a cause's children appear with its first value
                for engine, values in per_engine_labelvalues.items():
                    self._children[(engine, metric.name)] = family.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get(COUNTER, {}).items():
            self._child(engine_idx, name).inc(value)
        for name, value in transfer_stats_data.get(GAUGE, {}).items():
            self._child(engine_idx, name).set(value)
        for name, values in transfer_stats_data.get(HISTOGRAM, {}).items():
            child = self._child(engine_idx, name)
            for value in values:
                child.observe(value)

    def _child(self, engine_idx: int, name: str) -> Any:
        child = self._children.get((engine_idx, name))
        if child is not None:
            return child
        base, _, label = name.partition("|")
        metric = _BY_NAME.get(base)
        if metric is None or bool(metric.label) != bool(label):
            raise KeyError(f"kvledger stats carry an unknown metric {name!r}")
        child = self._children[(engine_idx, name)] = self._families[base].labels(
            *self._engine_labels[engine_idx], label)
        return child
