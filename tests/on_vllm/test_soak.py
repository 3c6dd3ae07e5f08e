"""The soak's short form: a minute of vLLM's OpenAI server under concurrent
clients with every tier, while Valkey is killed, paused and filled, the cache
is reset through the API, clients drop their streams and (as root) the disk
tier's and the log's file systems fill. `bench/soak.py` runs the long form; here
its server is forked from the suite's vLLM zygote (its engine core and worker
from the zygote's forkserver), which spares three imports of vLLM."""

from __future__ import annotations

import pytest

from .bench_servers import ForkedServer, bench_module

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_minute_of_serving_under_faults_fails_nothing_outside_them_and_serves_nothing_wrong(tmp_path, monkeypatch):
    soak = bench_module("soak")
    for name, value in soak.SERVER_ENV.items():  # a forked run takes the environment as it is at its start
        monkeypatch.setenv(name, value)
    summary = soak.main(
        ["--minutes", "1", "--clients", "2", "--fault-every-s", "6", "--hold-s", "3", "--sample-every-s", "2",
         "--check-sample", "8", "--compare-by", "reset", "--out", str(tmp_path / "soak")],
        start=lambda args, log: ForkedServer(soak.SERVER_MODULE, args, log))
    assert summary["served"] > 20, summary
    assert summary["failed_outside_faults"] == 0, summary["failures_outside_faults"]
    kinds = {fault["kind"] for fault in summary["faults"]}
    assert {"valkey_killed", "valkey_paused", "valkey_filled", "reset"} <= kinds, kinds
    assert all("true" in fault["note"] for fault in summary["faults"] if fault["kind"] == "reset")
    filled = [fault["note"] for fault in summary["faults"] if fault["kind"] == "valkey_filled"]
    assert all(note.startswith("filled:") and int(note.split()[1]) >= 32 for note in filled), filled
    # Outputs: a sample recomputed from empty caches gives the text served, restored or not.
    assert summary["compared"]["compared"] == 8 and summary["compared"]["wrong"] == 0, summary["compared"]
    # The log replays with every invariant checked (it stops, whole, where its disk filled).
    assert summary["replay_check"]["exit"] == 0, summary["replay_check"]
    # Every fault left serving going: requests sent after the last one ended were served.
    assert summary["served_after_last_fault"] > 0, summary["faults"]
    # Descriptors and threads of the server's processes stay bounded through the faults;
    # the engine core and its worker are sampled too.
    processes = summary["processes_after_warmup"]
    assert {"api_server", "VLLM::EngineCore", "VLLM::Worker"} <= processes.keys(), processes.keys()
    for kind, entry in processes.items():
        if kind in ("api_server", "VLLM::EngineCore", "VLLM::Worker"):
            assert entry["fds_range"][1] - entry["fds_range"][0] < 64, (kind, entry)
            assert entry["threads_range"][1] - entry["threads_range"][0] < 32, (kind, entry)
