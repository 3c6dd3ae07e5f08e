"""Connector stats: how the halves merge, and what Prometheus ends up holding."""

from __future__ import annotations

import functools
import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvledger.adapters.vllm import metrics as m
from kvledger.adapters.vllm.connector import KVLedgerConnector

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
        first = scheduler.take_stats().data
        assert first[m.COUNTER]["vllm:kvledger_tiering_found_blocks|1:fs"] == 3
        assert first[m.GAUGE]["vllm:kvledger_tiering_held_blocks|1:fs"] == 3
        scheduler.host.apply(ev.TierKeysFound(tier=1, keys=chain(2, "b")))
        second = scheduler.take_stats().data
        assert second[m.COUNTER]["vllm:kvledger_tiering_found_blocks|1:fs"] == 2  # the change, not the total
        assert "vllm:kvledger_tiering_found_blocks|1:fs" not in scheduler.take_stats().data[m.COUNTER]
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
        first = scheduler.take_stats().data
        assert first[m.GAUGE] == {m.TIER_USED.name: 0, m.TIER_CAPACITY.name: config.num_tier_slots,
                                  m.JOBS_IN_FLIGHT.name: 0}
        assert scheduler.take_stats() is None
        block = config.groups[0].block_size
        scheduler.host.apply(ev.RequestAdded(request_id="r", num_prompt_tokens=2 * block, block_hashes=chain(2)))
        scheduler.host.apply(ev.BlocksAllocated(request_id="r", block_ids=((1, 2),)))
        scheduler.host.apply(ev.StepScheduled(step_index=1, request_ids=("r",), num_computed_tokens=(0,),
                                              num_scheduled_tokens=(2 * block,)))
        moved = scheduler.take_stats().data
        assert moved[m.COUNTER] == {m.STORES.name: 1}
        assert moved[m.GAUGE] == {m.TIER_USED.name: 2, m.TIER_CAPACITY.name: config.num_tier_slots,
                                  m.JOBS_IN_FLIGHT.name: 1}
        assert scheduler.take_stats() is None
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
        assert scheduler.take_stats() is not None  # the gauges' first values
        block = config.groups[0].block_size
        request = SimpleNamespace(request_id="r", block_hashes=list(chain(2)), num_prompt_tokens=2 * block,
                                  num_tokens=2 * block)
        scheduler.on_new_request(request)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # a miss: nothing stored
        reported = scheduler.take_stats()
        assert reported is not None
        assert len(reported.data[m.HISTOGRAM][m.LOOKUP_DELAY.name]) == 1
        assert not reported.data[m.COUNTER] and not reported.data[m.GAUGE]
        assert scheduler.take_stats() is None
    finally:
        scheduler.shutdown()
