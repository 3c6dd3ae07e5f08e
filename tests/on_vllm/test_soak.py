"""The soak's short form: a minute of vLLM's OpenAI server under concurrent
clients with every tier, while Valkey is killed, paused and filled, the cache
is reset through the API, clients drop their streams and (as root) the disk
tier's and the log's file systems fill. `bench/soak.py` runs the long form."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_a_minute_of_serving_under_faults_fails_nothing_outside_them_and_serves_nothing_wrong(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, "bench/soak.py", "--minutes", "1", "--clients", "2", "--fault-every-s", "6",
         "--hold-s", "3", "--sample-every-s", "2", "--check-sample", "8", "--compare-by", "reset", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    assert proc.returncode == 0, tail
    summary = json.loads((out / "summary.json").read_text())
    assert summary["served"] > 20, tail
    assert summary["failed_outside_faults"] == 0, summary["failures_outside_faults"]
    kinds = {fault["kind"] for fault in summary["faults"]}
    assert {"valkey_killed", "valkey_paused", "valkey_filled", "reset"} <= kinds, kinds
    assert all("true" in fault["note"] for fault in summary["faults"] if fault["kind"] == "reset")
    # Outputs: a sample recomputed from empty caches gives the text served, restored or not.
    assert summary["compared"]["compared"] == 8 and summary["compared"]["wrong"] == 0, summary["compared"]
    # The log replays with every invariant checked (it stops, whole, where its disk filled).
    assert summary["replay_check"]["exit"] == 0, summary["replay_check"]
    # Every fault left serving going: requests were served after the last one.
    last = max(fault["end"] for fault in summary["faults"])
    requests = json.loads((out / "requests.json").read_text())
    first = min(r["at"] for r in requests)
    assert any(r["ok"] and r["at"] - first > last for r in requests)
    # Descriptors and threads of the server's processes stay bounded through the faults.
    for kind, entry in summary["processes_after_warmup"].items():
        if kind in ("api_server", "VLLM::EngineCore", "VLLM::Worker"):
            assert entry["fds_range"][1] - entry["fds_range"][0] < 64, (kind, entry)
            assert entry["threads_range"][1] - entry["threads_range"][0] < 32, (kind, entry)
