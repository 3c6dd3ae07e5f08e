"""kvledger under vLLM's real scheduler at scale: 256 requests on shared
documents, vLLM's prefix cache on, a pool that preempts (no model runs; the
trace samples the tokens). Admissions that hit vLLM's prefix cache on blocks
a running request allocated in the same step must not confuse the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO, replay_summary

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_engine_follows_vllms_scheduler_with_no_violation(tmp_path):
    log, out = tmp_path / "events.log", tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "bench/scheduler_overhead.py", "--connectors", "kvledger-logged", "--steps", "150",
         "--event-log", str(log), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())["connectors"]["kvledger-logged"]
    assert run["protocol_violations"] == 0, run["violation_codes"]
    assert run["hit_tokens"] > 0 and run["local_hit_tokens"] > 0  # both caches served prefixes
    summary = replay_summary(log)  # written on the log thread, complete once the run has exited
    assert summary["digests_checked"] > 0
    assert summary["violations"] == 0
    assert summary["stats"]["hit_tokens"] == run["hit_tokens"]
