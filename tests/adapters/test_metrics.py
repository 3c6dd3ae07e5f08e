"""Connector stats: how the halves merge, and what Prometheus ends up holding."""

from __future__ import annotations

import functools
import pickle
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvledger.adapters.vllm import metrics as m
from kvledger.adapters.vllm.connector import KVLedgerConnector
from kvledger.engine import queries

pytestmark = pytest.mark.vllm  # imports vLLM's types: not in the fast subset, which runs without vLLM

LABELS = {"model_name": "tiny", "engine": "0"}


def worker_stats(load_bytes: int, store_bytes: int) -> m.KVLedgerStats:
    stats = m.KVLedgerStats()
    stats.add(m.LOAD_BYTES, load_bytes)
    stats.add(m.LOAD_TIME, 0.002)
    stats.add(m.LOAD_SIZE, load_bytes)
    stats.add(m.STORE_BYTES, store_bytes)
    stats.add(m.STORE_TIME, 0.001)
    stats.add(m.STORE_SIZE, store_bytes)
    return stats


def scheduler_stats(hits: int, used: int) -> m.KVLedgerStats:
    stats = m.KVLedgerStats()
    stats.add(m.HIT_TOKENS, hits)
    stats.add(m.EVICTIONS, 0)  # a zero change adds nothing
    stats.add(m.TIER_USED, used)
    stats.add(m.TIER_CAPACITY, 100)
    stats.add(m.LOOKUP_DELAY, 1e-4)
    return stats


def test_stats_from_workers_and_scheduler_merge_as_vllm_merges_them():
    merged = worker_stats(4096, 8192).aggregate(worker_stats(4096, 0)).aggregate(scheduler_stats(64, 7))
    merged = merged.aggregate(scheduler_stats(32, 9))
    # vLLM ships stats between processes as the data dict and rebuilds them with the class method.
    rebuilt = KVLedgerConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(merged.to_dict())))
    reduced = rebuilt.reduce()
    assert reduced[m.LOAD_BYTES.name] == 8192 and reduced[m.STORE_BYTES.name] == 8192
    assert reduced[m.HIT_TOKENS.name] == 96
    assert reduced[m.TIER_USED.name] == 9  # a gauge keeps the latest value
    assert reduced[f"{m.LOAD_SIZE.name}_count"] == 2 and reduced[f"{m.STORE_SIZE.name}_sum"] == 8192
    assert m.EVICTIONS.name not in reduced
    assert m.KVLedgerStats().is_empty() and not rebuilt.is_empty()
    with pytest.raises(TypeError, match="cannot aggregate"):
        rebuilt.aggregate(SimpleNamespace())  # type: ignore[arg-type]


def test_prometheus_metrics_use_vllm_names_where_the_meaning_matches():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = KVLedgerConnector.build_prom_metrics(config, types, list(LABELS), {0: list(LABELS.values())})
    prom.observe(worker_stats(4096, 8192).aggregate(scheduler_stats(64, 7)).to_dict())
    prom.observe(scheduler_stats(32, 9).to_dict())

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, LABELS)

    assert value("vllm:kv_offload_load_bytes_total") == 4096
    assert value("vllm:kv_offload_store_bytes_total") == 8192
    assert value("vllm:kv_offload_load_time_total") == pytest.approx(0.002)
    assert value("vllm:kv_offload_store_size_count") == 1
    assert value("vllm:kv_offload_lookup_sync_delay_seconds_count") == 2
    assert value("vllm:kvledger_hit_tokens_total") == 96
    assert value("vllm:kvledger_tier_used_blocks") == 9
    assert value("vllm:kvledger_tier_capacity_blocks") == 100
    # Every metric is registered up front, so dashboards see zeros rather than gaps.
    assert value("vllm:kvledger_evictions_total") == 0
    assert value("vllm:kv_offload_allocation_failure_total") == 0
    with pytest.raises(KeyError, match="unknown metric"):
        prom.observe({m.COUNTER: {"vllm:something_else": 1}})


def test_tier_metrics_carry_vllm_033_names_and_a_tier_label():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = KVLedgerConnector.build_prom_metrics(config, types, list(LABELS), {0: list(LABELS.values())})
    worker, scheduler = m.KVLedgerStats(), m.KVLedgerStats()
    worker.add(m.TIER_READ_BYTES, 2 << 20, "1:fs")
    worker.add(m.TIER_PROMOTION_LATENCY, 0.004, "1:fs")
    worker.add(m.TIER_CASCADE_FAILURES, 1, "1:fs")
    scheduler.add(m.TIER_HELD, 12, "1:fs")
    # Across processes as vLLM sends it (pickled), then merged and observed.
    rebuilt = KVLedgerConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(worker.aggregate(scheduler).to_dict())))
    prom.observe(rebuilt.to_dict())
    tier = {**LABELS, "tier": "1:fs"}
    assert registry.get_sample_value("vllm:kv_offload_tiering_read_bytes_total", tier) == 2 << 20
    assert registry.get_sample_value("vllm:kv_offload_tiering_promotion_latency_seconds_count", tier) == 1
    assert registry.get_sample_value("vllm:kv_offload_tiering_cascade_job_failures_total", tier) == 1
    assert registry.get_sample_value("vllm:kvledger_tiering_held_blocks", tier) == 12
    with pytest.raises(AssertionError):
        worker.add(m.TIER_READ_BYTES, 1)  # a tier metric needs its tier
    with pytest.raises(KeyError, match="unknown metric"):
        prom.observe({m.COUNTER: {"vllm:kv_offload_load_bytes|1:fs": 1}})  # not a tier metric


def test_the_scheduler_reports_each_tier_count_once():
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from kvledger.events import types as ev
    from tests.engine.builders import FULL, chain, make_config

    config = make_config(groups=(FULL,), lower_tiers=({"name": "1:fs", "num_blocks": 8},))
    scheduler = LedgerScheduler(config, parse_settings({"capacity_bytes": 1 << 20}))
    try:
        scheduler.host.apply(ev.TierKeysFound(tier=1, keys=chain(3)))
        first = _settled_stats(scheduler).data
        assert first[m.COUNTER]["vllm:kvledger_tiering_found_blocks|1:fs"] == 3
        assert first[m.GAUGE]["vllm:kvledger_tiering_held_blocks|1:fs"] == 3
        scheduler.host.apply(ev.TierKeysFound(tier=1, keys=chain(2, "b")))
        second = _settled_stats(scheduler).data
        assert second[m.COUNTER]["vllm:kvledger_tiering_found_blocks|1:fs"] == 2  # the change, not the total
        assert "vllm:kvledger_tiering_found_blocks|1:fs" not in _settled_stats(scheduler).data[m.COUNTER]
    finally:
        scheduler.shutdown()


def test_a_step_that_changed_nothing_reports_nothing_and_the_next_change_reports_again():
    """vLLM asks for the scheduler's stats every step: unchanged totals and gauges
    stay out of them (Prometheus keeps a gauge's last value)."""
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from kvledger.events import types as ev
    from tests.engine.builders import FULL, chain, make_config

    config = make_config(groups=(FULL,))
    scheduler = LedgerScheduler(config, parse_settings({"capacity_bytes": 1 << 20}))
    try:
        first = _settled_stats(scheduler).data
        assert first[m.GAUGE] == {m.TIER_USED.name: 0, m.TIER_CAPACITY.name: config.num_tier_slots,
                                  m.JOBS_IN_FLIGHT.name: 0, m.CPU_USAGE.name: 0.0, m.CPU_WRITE_USAGE.name: 0.0,
                                  m.CPU_READ_USAGE.name: 0.0}
        assert _settled_stats(scheduler) is None
        block = config.groups[0].block_size
        scheduler.host.apply(ev.RequestAdded(request_id="r", num_prompt_tokens=2 * block, block_hashes=chain(2)))
        scheduler.host.apply(ev.BlocksAllocated(request_id="r", block_ids=((1, 2),)))
        scheduler.host.apply(ev.StepScheduled(step_index=1, request_ids=("r",), num_computed_tokens=(0,),
                                              num_scheduled_tokens=(2 * block,)))
        moved = _settled_stats(scheduler).data
        assert moved[m.COUNTER] == {m.STORES.name: 1}
        storing = 2 / config.num_tier_slots  # both slots are being stored into
        assert moved[m.GAUGE] == {m.TIER_USED.name: 2, m.TIER_CAPACITY.name: config.num_tier_slots,
                                  m.JOBS_IN_FLIGHT.name: 1, m.CPU_USAGE.name: storing,
                                  m.CPU_WRITE_USAGE.name: storing, m.CPU_READ_USAGE.name: 0.0}
        assert _settled_stats(scheduler) is None
    finally:
        scheduler.shutdown()


def test_a_lookup_alone_is_reported_though_no_count_moved():
    """The quiet-step shortcut must not swallow what moves no total: a lookup's delay."""
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from tests.engine.builders import FULL, chain, make_config

    config = make_config(groups=(FULL,))
    scheduler = LedgerScheduler(config, parse_settings({"capacity_bytes": 1 << 20}))
    try:
        assert _settled_stats(scheduler) is not None  # the gauges' first values
        block = config.groups[0].block_size
        request = SimpleNamespace(request_id="r", block_hashes=list(chain(2)), num_prompt_tokens=2 * block,
                                  num_tokens=2 * block)
        scheduler.on_new_request(request)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # a miss: nothing stored
        reported = _settled_stats(scheduler)
        assert reported is not None
        assert len(reported.data[m.HISTOGRAM][m.LOOKUP_DELAY.name]) == 1
        assert not reported.data[m.COUNTER] and not reported.data[m.GAUGE]
        assert _settled_stats(scheduler) is None
    finally:
        scheduler.shutdown()


def _stored_request(scheduler, rid: str, blocks: tuple[int, ...], step: int) -> None:
    """Request `rid` computes one block per id in `blocks` and stores them all."""
    from kvledger.events import types as ev
    from tests.engine.builders import chain

    block = scheduler.config.groups[0].block_size
    tokens = len(blocks) * block
    scheduler._apply([ev.RequestAdded(request_id=rid, num_prompt_tokens=tokens, block_hashes=chain(len(blocks), rid)),
                      ev.BlocksAllocated(request_id=rid, block_ids=(blocks,)),
                      ev.StepScheduled(step_index=step, request_ids=(rid,), num_computed_tokens=(0,),
                                       num_scheduled_tokens=(tokens,))])
    (job_id,) = queries.job_ids(scheduler.host.state)  # the step's one store job
    scheduler._apply([ev.StoreCompleted(job_id=job_id), ev.RequestFinished(request_id=rid, block_ids=(blocks,))])


def _settled_stats(scheduler):
    """The stats once the miss counter's thread (on by default) folded what was fed so far, as a
    server's forward gives it the time: a take never races the thread."""
    assert scheduler._misses is None or scheduler._misses.settle()
    return scheduler.take_stats()


def _registry_and_prom():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = KVLedgerConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, list(LABELS),
                                                {0: list(LABELS.values())})
    return registry, prom


def test_blocks_a_reset_drops_are_not_counted_as_evictions():
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from tests.engine.builders import FULL, make_config

    config = make_config(groups=(FULL,), num_tier_slots=4)
    scheduler = LedgerScheduler(config, parse_settings({"capacity_bytes": 1 << 20, "miss_metrics": True}))
    registry, prom = _registry_and_prom()
    try:
        _stored_request(scheduler, "a", (1, 2, 3, 4), step=1)  # the tier is full
        first = _settled_stats(scheduler)
        assert m.EVICTIONS.name not in first.data[m.COUNTER] and m.RESET_DROPPED.name not in first.data[m.COUNTER]
        prom.observe(first.data)
        _stored_request(scheduler, "b", (5, 6), step=2)  # two of a's blocks make room
        second = _settled_stats(scheduler)
        assert second.data[m.COUNTER][m.EVICTIONS.name] == 2
        assert m.RESET_DROPPED.name not in second.data[m.COUNTER]
        prom.observe(second.data)
        assert scheduler.reset_cache()  # drops the four blocks stored now
        third = _settled_stats(scheduler)
        assert third.data[m.COUNTER][m.RESET_DROPPED.name] == 4
        assert m.EVICTIONS.name not in third.data[m.COUNTER]
        prom.observe(third.data)
        # The engine's own total counts both; the counters split it by reason.
        assert queries.stats(scheduler.host.state)["evictions"] == 6
        assert registry.get_sample_value("vllm:kvledger_evictions_total", LABELS) == 2
        assert registry.get_sample_value("vllm:kvledger_reset_dropped_blocks_total", LABELS) == 4
        assert _settled_stats(scheduler) is None  # reported once
        # The requests' prompts were new: 4 + 2 blocks missed for want of an earlier request, by cause
        # (each prompt's last block holds its last token, which vLLM always computes), counted by the
        # counter's thread once it folded the step that admitted them (here before each take, where a
        # server's forward gives it the time).
        block = scheduler.config.groups[0].block_size
        missed = {cause: registry.get_sample_value("vllm:kvledger_missed_tokens_total", {**LABELS, "cause": cause})
                  for cause in ("first_seen", "partial_block")}
        assert missed == {"first_seen": 4 * block, "partial_block": 2 * block}
    finally:
        scheduler.shutdown()


def test_blocks_a_reset_drops_from_a_lower_tier_are_not_counted_as_its_evictions():
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from kvledger.events import types as ev
    from tests.engine.builders import FULL, chain, make_config

    config = make_config(groups=(FULL,), lower_tiers=({"name": "1:fs", "num_blocks": 2},))
    scheduler = LedgerScheduler(config, parse_settings({"capacity_bytes": 1 << 20}))
    registry, prom = _registry_and_prom()
    try:
        scheduler._apply([ev.TierKeysFound(tier=1, keys=chain(3))])  # one more than fits: the oldest goes
        found = _settled_stats(scheduler).data[m.COUNTER]
        assert found[f"{m.TIER_EVICTIONS.name}|1:fs"] == 1
        assert f"{m.TIER_RESET_DROPPED.name}|1:fs" not in found
        prom.observe({m.COUNTER: found})
        scheduler.reset_cache()
        reset = _settled_stats(scheduler).data[m.COUNTER]
        assert reset[f"{m.TIER_RESET_DROPPED.name}|1:fs"] == 2
        assert f"{m.TIER_EVICTIONS.name}|1:fs" not in reset
        prom.observe({m.COUNTER: reset})
        tier = {**LABELS, "tier": "1:fs"}
        assert registry.get_sample_value("vllm:kvledger_tiering_evictions_total", tier) == 1
        assert registry.get_sample_value("vllm:kvledger_tiering_reset_dropped_blocks_total", tier) == 2
    finally:
        scheduler.shutdown()


def test_host_usage_gauges_count_slots_held_by_transfers_as_vllm_does():
    """vLLM 0.33's cpu_cache_usage_perc is the share of slots a transfer pins, not of slots
    holding blocks: a stored, idle block is not counted; one being read is."""
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from kvledger.events import types as ev
    from tests.engine.builders import FULL, chain, make_config

    config = make_config(groups=(FULL,), num_tier_slots=8)
    scheduler = LedgerScheduler(config, parse_settings({"capacity_bytes": 1 << 20}))
    try:
        _stored_request(scheduler, "a", (1, 2, 3, 4), step=1)
        idle = _settled_stats(scheduler).data[m.GAUGE]
        assert idle[m.TIER_USED.name] == 4
        assert (idle[m.CPU_USAGE.name], idle[m.CPU_WRITE_USAGE.name], idle[m.CPU_READ_USAGE.name]) == (0, 0, 0)
        block = config.groups[0].block_size
        # b hits a's first three blocks (its last block is computed) and loads them.
        scheduler._apply([ev.RequestAdded(request_id="b", num_prompt_tokens=4 * block, block_hashes=chain(4, "a")),
                          ev.BlocksAllocated(request_id="b", block_ids=((9, 10, 11, 12),),
                                             num_external_tokens=3 * block)])
        loading = _settled_stats(scheduler).data[m.GAUGE]
        assert loading[m.CPU_READ_USAGE.name] == loading[m.CPU_USAGE.name] == 3 / 8
        assert loading[m.CPU_WRITE_USAGE.name] == 0
    finally:
        scheduler.shutdown()


def test_chunk_queries_and_hits_count_the_blocks_a_shared_tier_answered_for(tmp_path):
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.lower_tiers import SchedulerTiers
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from tests.adapters.test_lower_tiers import _ask_until_answered, _store
    from tests.adapters.test_tier_namespace import kv_cache_config, vllm_config
    from tests.engine.builders import FULL, make_config

    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
        {"type": "fs", "path": str(tmp_path), "capacity_bytes": 1 << 20, "shared": True}]})
    tiers = SchedulerTiers(settings, vllm_config(), kv_cache_config(), world_size=1)
    config = make_config(groups=(FULL,), lower_tiers=({"name": "1:fs", "num_blocks": 8},))
    scheduler = LedgerScheduler(config, settings, tiers=tiers)
    registry, prom = _registry_and_prom()
    try:
        prom.observe(_settled_stats(scheduler).data)
        _store(tiers, tmp_path, b"b" * 20)  # another process wrote it
        assert len(_ask_until_answered(tiers, "r1", [b"a" * 20, b"b" * 20, b"c" * 20])) == 1
        counted = _settled_stats(scheduler).data[m.COUNTER]
        assert counted[f"{m.TIER_CHUNK_QUERIES.name}|1:fs"] == 3
        assert counted[f"{m.TIER_CHUNK_HITS.name}|1:fs"] == 1
        prom.observe({m.COUNTER: counted})
        assert not _settled_stats(scheduler).data[m.COUNTER]  # the change, once
        tier = {**LABELS, "tier": "1:fs"}
        assert registry.get_sample_value("vllm:kv_offload_tiering_chunk_queries_total", tier) == 3
        assert registry.get_sample_value("vllm:kv_offload_tiering_chunk_hits_total", tier) == 1
    finally:
        scheduler.shutdown()


# vLLM 0.33.0's definitions of the `vllm:kv_offload_*` names kvledger exports: kind, and the labels
# after vLLM's own per-engine ones (model_name, engine). Paths are under vllm/ in vLLM 0.33.0:
# C = distributed/kv_transfer/kv_connector/v1/offloading/metrics.py (get_connector_metric_definitions),
# P = v1/kv_offload/cpu/spec.py (CPUOffloadingSpec.build_metric_definitions; names in cpu/common.py:13-17),
# T = v1/kv_offload/tiering/spec.py (TieringOffloadingSpec.build_metric_definitions; names in
# tiering/base.py:46-68, the "tier" label at tiering/base.py:40).
VLLM_033 = {
    "vllm:kv_offload_load_bytes": (m.COUNTER, ()),  # C:82
    "vllm:kv_offload_load_time": (m.COUNTER, ()),  # C:85
    "vllm:kv_offload_load_size": (m.HISTOGRAM, ()),  # C:88
    "vllm:kv_offload_store_bytes": (m.COUNTER, ()),  # C:92
    "vllm:kv_offload_store_time": (m.COUNTER, ()),  # C:95
    "vllm:kv_offload_store_size": (m.HISTOGRAM, ()),  # C:98
    "vllm:kv_offload_lookup_sync_delay_seconds": (m.HISTOGRAM, ()),  # C:102
    "vllm:kv_offload_allocation_failure": (m.COUNTER, ()),  # C:141
    "vllm:kv_offload_stores_skipped": (m.COUNTER, ()),  # S:87 (registered with store_threshold >= 2)
    "vllm:kv_offload_cpu_cache_usage_perc": (m.GAUGE, ()),  # P:55
    "vllm:kv_offload_cpu_cache_write_usage_perc": (m.GAUGE, ()),  # P:63
    "vllm:kv_offload_cpu_cache_read_usage_perc": (m.GAUGE, ()),  # P:70
    "vllm:kv_offload_tiering_read_bytes": (m.COUNTER, ("tier",)),  # T:152
    "vllm:kv_offload_tiering_read_time": (m.COUNTER, ("tier",)),  # T:159
    "vllm:kv_offload_tiering_write_bytes": (m.COUNTER, ("tier",)),  # T:169
    "vllm:kv_offload_tiering_write_time": (m.COUNTER, ("tier",)),  # T:176
    "vllm:kv_offload_tiering_promotion_job_failures": (m.COUNTER, ("tier",)),  # T:184
    "vllm:kv_offload_tiering_cascade_job_failures": (m.COUNTER, ("tier",)),  # T:192
    "vllm:kv_offload_tiering_chunk_queries": (m.COUNTER, ("tier",)),  # T:200
    "vllm:kv_offload_tiering_chunk_hits": (m.COUNTER, ("tier",)),  # T:206
    "vllm:kv_offload_tiering_backpressure_store_latency_ema": (m.GAUGE, ("tier",)),  # T:281
    "vllm:kv_offload_tiering_backpressure_stores_dropped": (m.COUNTER, ("tier",)),  # T:290
    "vllm:kv_offload_tiering_backpressure_blocks_dropped": (m.COUNTER, ("tier",)),  # T:299
    "vllm:kv_offload_tiering_promotion_latency_seconds": (m.HISTOGRAM, ("tier", "result")),  # T:250
}

# Exported under vLLM's name with a label set of its own (kvledger observes I/O time per tier, with no
# "result" label); kept so dashboards that sum over the labels still see it.
DIVERGENT_LABELS = {"vllm:kv_offload_tiering_promotion_latency_seconds": ("tier",)}

# Run here, or by another Python with vLLM: the definitions vLLM's offloading connector registers.
_READ_DEFINITIONS = """
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import get_connector_metric_definitions
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


def definitions():
    found = {**get_connector_metric_definitions(),
             **CPUOffloadingSpec.build_metric_definitions({"store_threshold": 2}),
             **TieringOffloadingSpec.build_metric_definitions({})}
    return {name: ("counter" if isinstance(d, OffloadingCounterMetadata) else
                   "gauge" if isinstance(d, OffloadingGaugeMetadata) else "histogram", tuple(d.labelnames))
            for name, d in found.items()}
"""


def test_each_vllm_name_is_registered_with_the_kind_and_labels_vllm_033_gives_it():
    registry, prom = _registry_and_prom()
    families = {name: family for name, family in prom._families.items() if name.startswith("vllm:kv_offload_")}
    assert {m.CPU_USAGE.name, m.CPU_WRITE_USAGE.name, m.CPU_READ_USAGE.name, m.TIER_CHUNK_QUERIES.name,
            m.TIER_CHUNK_HITS.name} <= set(families)
    # Blocks held back by the reuse threshold (store_threshold >= 2): kvledger's engine decides it too.
    assert m.STORES_SKIPPED.name == "vllm:kv_offload_stores_skipped" and m.STORES_SKIPPED.name in families
    for name, family in families.items():
        kind, labels = VLLM_033[name]
        assert family._type == kind, name
        assert family._labelnames == (*LABELS, *DIVERGENT_LABELS.get(name, labels)), name
    for name, labels in DIVERGENT_LABELS.items():
        assert VLLM_033[name][1] != labels  # still divergent: if not, drop it from DIVERGENT_LABELS


def test_the_vllm_033_table_agrees_with_the_installed_vllm():
    """The installed vLLM defines each name of the table it has as the table says: on
    the CPU test machine that is 0.32, which defines all but the promotion latency."""
    import vllm

    scope: dict = {}
    try:
        exec(_READ_DEFINITIONS, scope)
    except ImportError as exc:
        pytest.skip(f"this vLLM has no offloading metric definitions: {exc}")
    found = scope["definitions"]()
    missing = {name for name in VLLM_033 if name not in found}
    if vllm.__version__.startswith("0.33"):
        assert not missing
    assert not missing & {m.CPU_USAGE.name, m.CPU_WRITE_USAGE.name, m.CPU_READ_USAGE.name,
                          m.TIER_CHUNK_QUERIES.name, m.TIER_CHUNK_HITS.name}
    for name, definition in VLLM_033.items():
        if name not in missing:
            assert found[name] == definition, name


def test_the_miss_counts_keep_vllm_stepping_until_they_are_taken():
    """On by default, the counter folds on its own thread: an idle server must still
    step (vLLM's `has_pending_push_work`) until the last request's counts are reported."""
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from tests.engine.builders import FULL, make_config

    config = make_config(groups=(FULL,), num_tier_slots=4)
    scheduler = LedgerScheduler(config, parse_settings({"capacity_bytes": 1 << 20}))
    try:
        assert scheduler._misses is not None and scheduler._misses._thread is not None  # the default
        assert not scheduler.has_pending_work()
        _stored_request(scheduler, "a", (1, 2, 3), step=1)  # its store done: no job in flight
        scheduler._carried.clear()  # the workers' effects, as the next step's metadata takes them
        assert scheduler.has_pending_work()  # its admission's counts not yet taken
        stats = _settled_stats(scheduler)
        block = config.groups[0].block_size
        assert stats.data[m.COUNTER][f"{m.MISSED_TOKENS.name}|first_seen"] == 2 * block
        assert not scheduler.has_pending_work()
    finally:
        scheduler.shutdown()
    assert not any(t.name == "kvledger-misses" for t in threading.enumerate())  # shutdown ends the thread


def test_a_tier_under_backpressure_has_its_spills_dropped_counted_and_its_latency_gauged(tmp_path):
    """The scheduler times each spill (vLLM's detector: here any time a MiB is too slow), tells
    the engine the share to drop, and reports the drops and the latency under vLLM's names."""
    import time

    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from kvledger.events import types as ev
    from tests.engine.builders import FULL, make_config

    settings = parse_settings({"capacity_bytes": 1 << 20, "backpressure": {
        "backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy", "high_water_s": 0,
        "low_water_s": 0, "warmup_completions": 1}, "secondary_tiers": [
        {"type": "fs", "path": str(tmp_path), "capacity_bytes": 1 << 20}]})
    config = make_config(groups=(FULL,), num_tier_slots=16, lower_tiers=({"name": "1:fs", "num_blocks": 16},),
                         slot_bytes=1 << 16)
    scheduler = LedgerScheduler(config, settings)
    try:
        for rid, blocks in (("a", (1,)), ("b", (2,))):  # two spills written: the warm-up, then a slow one
            _stored_request(scheduler, rid, blocks, step=len(rid) + blocks[0])
            (spill,) = queries.job_ids(scheduler.host.state)
            scheduler._apply([ev.StoreCompleted(job_id=spill)])
        moved = scheduler._pressure.tick(time.monotonic())  # as build_connector_meta does each step
        assert [(e.tier, e.drop_ppm) for e in moved] == [(1, 1_000_000)]
        scheduler._apply(moved)
        _stored_request(scheduler, "c", (3,), step=9)
        assert not queries.job_ids(scheduler.host.state)  # its spill dropped: no job
        data = _settled_stats(scheduler).data
        assert data[m.COUNTER][f"{m.BACKPRESSURE_STORES_DROPPED.name}|1:fs"] == 1
        assert data[m.COUNTER][f"{m.BACKPRESSURE_BLOCKS_DROPPED.name}|1:fs"] == 1
        assert data[m.GAUGE][f"{m.BACKPRESSURE_LATENCY_EMA.name}|1:fs"] > 0
    finally:
        scheduler.shutdown()
