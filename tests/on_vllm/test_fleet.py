"""The fleet soak's short form: two vLLM OpenAI servers with kvledger sharing a disk
directory and a Valkey cluster (three masters, a replica each) under one tier
secret, each conversation's turns sent to either server, while a master is killed
and its replica promoted. `bench/fleet_soak.py` runs the long form; here each
server is forked from a vLLM zygote of its own (two `PYTHONHASHSEED`s: the
replicas hash differently, and kvledger's keys must not)."""

from __future__ import annotations

import pytest

from tests.support.zygotes import OTHER_SEED

from .bench_servers import ForkedServer, bench_module

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_two_replicas_share_their_tiers_through_a_failover_and_serve_nothing_wrong(tmp_path, monkeypatch):
    fleet = bench_module("fleet_soak")
    for name, value in fleet.soak.SERVER_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(fleet.SECRET_ENV, "fleet-suite-secret-0123456789abcdef")
    summary = fleet.main(
        ["--minutes", "1", "--clients", "3", "--fault-every-s", "20", "--hold-s", "5", "--faults", "master_killed",
         "--sample-every-s", "5", "--check-sample", "8", "--compare-by", "reset", "--out", str(tmp_path / "fleet")],
        start=lambda args, log: ForkedServer(fleet.soak.SERVER_MODULE, args, log,
                                             OTHER_SEED if log.name == "server-b.out" else None))
    assert all(summary["served_by_replica"][name] > 5 for name in fleet.REPLICAS), summary["served_by_replica"]
    assert summary["failed_outside_faults"] == 0, summary["failures_outside_faults"]
    killed = [fault for fault in summary["faults"] if fault["kind"] == "master_killed"]
    assert killed and all("rejoined as a replica" in fault["note"] for fault in killed), summary["faults"]
    assert summary["cluster"]["epoch_last"] > summary["cluster"]["epoch_first"], summary["cluster"]  # a failover
    assert summary["served_after_last_fault"] > 0, summary["faults"]
    # Prefixes crossed replicas: each read blocks from a shared tier that the other wrote there.
    for name in fleet.REPLICAS:
        blocks = summary["promoted"][name]["blocks"]
        assert any(count > 0 for tier, count in blocks.items() if tier.endswith("other")), (name, blocks)
    # A sample recomputed from empty caches gives the text served; every log replays whole.
    assert summary["compared"]["compared"] == 8 and summary["compared"]["wrong"] == 0, summary["compared"]
    assert all(check["exit"] == 0 for check in summary["replay_check"].values()), summary["replay_check"]
