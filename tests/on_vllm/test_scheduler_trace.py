"""kvledger under vLLM's real scheduler at scale: 256 requests on shared
documents, vLLM's prefix cache on, a pool that preempts (no model runs; the
trace samples the tokens). Admissions that hit vLLM's prefix cache on blocks
a running request allocated in the same step must not confuse the engine.

Under async scheduling (vLLM's default on GPU) vLLM's `AsyncScheduler`
schedules each step before it has processed the last one's output, so
requests carry placeholder tokens, and a kv_both connector's finished
requests give their blocks back only once the step in flight has ended
(`defer_block_free`). vLLM sees a `max_tokens` finish coming and schedules
no step past it, so that case runs long enough for requests to end on stop
tokens, which it learns of only from a step's output."""

from __future__ import annotations

import json

import pytest

from .conftest import REPO, replay_summary, zygote

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("scheduling", [
    pytest.param(["--steps", "150"], id="sync"),
    pytest.param(["--steps", "400", "--async-scheduling", "--early-stops"], id="async"),
])
def test_the_engine_follows_vllms_scheduler_with_no_violation(tmp_path, scheduling):
    log, out = tmp_path / "events.log", tmp_path / "run.json"
    # Forked from the zygote, which has imported vLLM already (a fresh interpreter spends 12 s on it).
    status, stdout, stderr = zygote().run(
        {"path": str(REPO / "bench" / "scheduler_overhead.py"),
         "argv": ["--connectors", "kvledger-logged", *scheduling, "--event-log", str(log), "--out", str(out)]},
        timeout=600)
    assert status == 0, stdout[-2000:] + stderr[-2000:]
    run = json.loads(out.read_text())["connectors"]["kvledger-logged"]
    assert run["protocol_violations"] == 0, run["violation_codes"]
    assert run["hit_tokens"] > 0 and run["local_hit_tokens"] > 0  # both caches served prefixes
    if "--early-stops" in scheduling:
        assert run["requests_finished"] > 0  # finished with a step in flight: vLLM deferred their frees
    summary = replay_summary(log)  # written on the log thread, complete once the run has exited
    assert summary["digests_checked"] > 0
    assert summary["violations"] == 0
    assert summary["stats"]["hit_tokens"] == run["hit_tokens"]
