"""Streaming sessions (vLLM's resumable requests) through vLLM's real scheduler.

Turn 1 ends on a sampled token that fills a hash block; turn 2's input replaces
that token, and vLLM hashes the block again. The engine must key the session's
blocks by the hashes vLLM ends with, and never store one under the dropped hash.
vLLM 0.32 and 0.33 hand a session's hashes to a connector only once they are
final, so no `block_hashes_rewound` is expected here; the engine's handling of
one is tested without vLLM (tests/engine/test_rewind.py, test_planner.py).
"""

from __future__ import annotations

import json

import pytest

from kvledger.adapters.testing.tiny_models import build_model

from .conftest import HERE, REPO, zygote

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("scheduling", [[], ["--async-scheduling"]], ids=["sync", "async"])
def test_a_sessions_blocks_are_stored_under_vllms_final_hashes_never_the_dropped_one(scheduling):
    model = build_model("tiny-gemma3", REPO / "bench" / "out" / "models")  # where bench/scheduler_overhead.py keeps it
    # Forked from the zygote, which has imported vLLM already (a fresh interpreter spends 12 s on it).
    status, stdout, stderr = zygote().run({"path": str(HERE / "session_run.py"), "argv": [str(model), *scheduling]},
                                          timeout=300)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert status == 0 and lines, stdout[-2000:] + stderr[-2000:]
    run = json.loads(lines[0][len("RESULT "):])
    assert run["turn_1_hashes"] == 3 and run["dropped"] not in run["vllm"]  # vLLM replaced block 2's hash
    assert run["engine"] == run["vllm"]
    assert run["tier_keys_from_dropped"] == []
    assert run["tier_keys_of_the_session"] == [len(run["vllm"])] * 2  # every full block, in both groups
    assert "block_hashes_rewound" not in run["events"]
