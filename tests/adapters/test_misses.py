"""`kvledger explain`'s account of each admission against what the simulator,
which played vLLM, knows of it: which prompt blocks were restorable when the
request was admitted, which keys it named first, which stores it failed and
which resets it made. Every generated workload; every cause reached."""

from __future__ import annotations

import json
import os
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvledger.adapters.cli.main import main
from kvledger.adapters.log_files import open_log
from kvledger.adapters.log_tools.misses import CAUSES, MissLedger, totals
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.replay import replay
from kvledger.events.config import EngineConfig, GroupSpec
from tests.engine.builders import SIMULATED_CONFIGS

# Said of a block that was not restorable when its request was admitted.
# A key's removal from a tier, by the reason the engine gave it.
GONE = {"evicted": fx.Reason.EVICTED, "reset": fx.Reason.RESET, "transfer_failed": fx.Reason.FAILED}
# A shared tier's unanswered lookup, by the reason the simulator chose (`ev.LOOKUP_FAILURES`).
LOOKUP = {"tier_down": "down", "lookup_timed_out": "timed_out", "lookup_dropped": "dropped"}
NOT_RESTORABLE = {"first_seen", "evicted", "spill_dropped", "reset", "transfer_failed", "store_failed", "not_admitted",
                  "below_store_threshold", "decode_not_offloaded", "stored_too_late", "not_computed_yet",
                  "request_ended", "lazy_not_offloaded", *LOOKUP}
# Said of a block that was.
RESTORABLE = {"after_gap", "bounded_by_group", "no_host_slot", "load_slower_than_compute"}
LATER = {"load_failed", "promotion_failed", "partial_block"}  # decided after the admission, or by the prompt's length
WHATIF = {"log_table"}  # `kvledger whatif`'s own (tests/adapters/test_whatif.py)
assert NOT_RESTORABLE | RESTORABLE | LATER | WHATIF == set(CAUSES) - {"unexplained"}


def _run(config: EngineConfig, seed: int, *, prefix_caching: bool, **rates: float) -> tuple[Simulator, MissLedger]:
    ledger = MissLedger(config)
    sim = Simulator(config, prefix_caching=prefix_caching, observe=ledger.observe, record_truth=True)
    run_random(sim, random.Random(seed), steps=120, arrivals=0.8, max_tokens=12, **rates)
    return sim, ledger


REKEYED = "reset, under an earlier key generation"  # `_check`'s name for a cause it checked apart


def _check(sim: Simulator, ledger: MissLedger) -> set[str]:
    """Every admission explained consistently with the simulator's truth; the causes seen."""
    assert sim.truth is not None
    admissions = ledger.admissions
    assert [(a.request_id, a.seq) for a in admissions] == [(t["request_id"], t["seq"]) for t in sim.truth]
    size = ledger.block_size
    seen: set[str] = set()
    for admission, truth in zip(admissions, sim.truth):
        where = f"{admission.request_id} admitted at seq {admission.seq}"
        runs = admission.runs
        # The runs tile the tokens, in order: vLLM's cache, then kvledger's hit, then the computed rest.
        assert runs[0].first_token == 0 and runs[-1].end_token == truth["num_tokens"], where
        assert all(a.end_token == b.first_token for a, b in zip(runs, runs[1:])), where
        assert admission.tokens("device") == truth["local"], where
        alignment = sim.config.alignment_tokens
        first_missed = (truth["local"] + truth["ext"]) // size  # the first block the hit did not reach
        assert (admission.tokens("restored") + admission.tokens("missed", "load_failed")
                + admission.tokens("missed", "promotion_failed")) == truth["ext"], where
        for run in runs:
            if run.outcome != "missed":
                continue
            seen.add(run.cause)
            assert run.cause != "unexplained", (where, run)
            blocks = range(run.first_block, run.last_block + 1)
            if run.cause in NOT_RESTORABLE:
                assert not any(truth["loadable"][p] for p in blocks), (where, run)
            elif run.cause in RESTORABLE:
                assert all(truth["loadable"][p] for p in blocks), (where, run)
            if run.cause == "first_seen":
                assert all(truth["named_first"][p] for p in blocks), (where, run)
                assert truth["unanswered"] is None, (where, run)  # else the lookup's failure is the cause
                assert not any(truth["reset_lost"][p] for p in blocks), (where, run)  # else the reset is
            elif run.cause == "reset" and "key generation" in run.detail:  # held under an earlier generation
                seen.add(REKEYED)
                assert all(truth["named_first"][p] for p in blocks), (where, run)
                for p in blocks:  # dropped by that reset, from that tier, stored under that generation
                    seq, tier, generation = truth["reset_lost"][p]
                    assert (seq, tier) == (run.seq, run.tier) and seq in sim.reset_seqs, (where, run)
                    assert run.detail == f"stored under key generation {generation}", (where, run)
            elif run.cause in LOOKUP:
                assert all(truth["named_first"][p] for p in blocks), (where, run)
                reason, seq = truth["unanswered"]
                assert (LOOKUP[run.cause], run.tier, run.seq) == (reason, 1, seq) and seq < admission.seq, (where, run)
            elif run.cause in ("not_computed_yet", "request_ended"):  # another named it first: which, and its end
                assert run.other_request != admission.request_id, (where, run)
                assert all(truth["named_by"][p] == run.other_request for p in blocks), (where, run)
                ended = truth["ended_at"].get(run.other_request)
                if run.cause == "request_ended":
                    assert ended == run.seq, (where, run)
                else:
                    assert ended is None, (where, run)
            elif run.cause == "stored_too_late":  # the last store on it still in flight: that job, its start
                assert all(truth["storing"][p] == (run.job_id, run.seq) for p in blocks), (where, run)
            elif run.cause == "store_failed":
                # (the seq of its last failing report before this admission: each worker's names the store failed)
                assert run.job_id in sim.failed_jobs and run.seq < admission.seq, (where, run)
                assert run.seq == max(seq for seq in sim.failed_reports[run.job_id] if seq < admission.seq), (where, run)
                assert run.detail.startswith("copy_failed ("), (where, run)  # the simulated worker's reason
            elif run.cause in GONE:  # the key's last removal, at that seq, from that tier, for that reason
                assert all(truth["gone"][p] == (run.seq, GONE[run.cause], run.tier) for p in blocks), (where, run)
                assert run.seq < admission.seq and (run.cause != "reset" or run.seq in sim.reset_seqs), (where, run)
            elif run.cause == "not_admitted":
                assert all(truth["refused"][p] == run.seq for p in blocks) and run.seq < admission.seq, (where, run)
            elif run.cause == "spill_dropped":  # evicted from host after its write below was dropped for pressure
                assert all(truth["spill_dropped"][p] == (run.seq, run.tier) for p in blocks), (where, run)
                assert all(truth["gone"][p][0] > run.seq and truth["gone"][p][2] == 0 for p in blocks), (where, run)
            elif run.cause == "below_store_threshold":  # its last offer, fewer requests than the threshold
                assert sim.config.store_threshold >= 2 and run.seq < admission.seq, (where, run)
                assert all(truth["below"][p] == run.seq for p in blocks), (where, run)
            elif run.cause == "decode_not_offloaded":  # first named past its request's prompt, never stored
                assert sim.config.offload_prompt_only and all(truth["decode_named"][p] for p in blocks), (where, run)
                assert all(truth["gone"][p] is None and truth["storing"][p] is None for p in blocks), (where, run)
            elif run.cause == "load_slower_than_compute":  # the budget's cut: the event, within what was offered
                assert truth["budgeted"] is not None, (where, run)
                offered, seq = truth["budgeted"]
                assert run.seq == seq < admission.seq and sim.config.restore_budget.value == "auto", (where, run)
                assert run.last_block < (truth["local"] + offered) // size and "against compute" in run.detail
            elif run.cause == "load_failed":
                assert run.job_id == admission.load_job and run.job_id in sim.failed_jobs, (where, run)
            elif run.cause == "promotion_failed":  # restored from a lower tier, whose read failed
                assert run.job_id == admission.load_job and run.job_id in sim.failed_jobs and run.tier >= 1, (where, run)
                assert run.detail.split(": ", 1)[1].split(" ")[0] in ("missing", "corrupt", "rejected"), (where, run)
            elif run.cause == "partial_block":  # from the last aligned token (or the hit's end) to the prompt's end
                most = (truth["num_tokens"] - 1) // alignment * alignment
                assert (run.first_token, run.end_token) == (max(most, truth["local"] + truth["ext"]),
                                                            truth["num_tokens"]), (where, run)
            elif run.cause == "lazy_not_offloaded":  # another request had it; lazy mode never stored it
                assert sim.config.store_mode.value == "lazy", (where, run)
                assert all(truth["named_by"][p] not in (None, admission.request_id) and truth["gone"][p] is None
                           and truth["refused"][p] == -1 and truth["storing"][p] is None for p in blocks), (where, run)
            elif run.cause == "after_gap":  # after the first block the hit did not reach
                assert run.first_block > first_missed, (where, run)
            elif run.cause == "bounded_by_group":  # the first block past the hit: a group lacked a block, or
                assert run.first_block == run.last_block == first_missed, (where, run)  # the end is unaligned
                if truth["bounded_by"] is not None:
                    group, position = truth["bounded_by"]
                    assert f"group {group} (" in run.detail and f" block {position}: " in run.detail, (where, run)
                else:
                    assert (first_missed + 1) * size % alignment and "a multiple of" in run.detail, (where, run)
            elif run.cause == "no_host_slot":  # nothing else lacking: the promotion's host slots
                assert run.first_block == first_missed and truth["bounded_by"] is None, (where, run)
                assert (first_missed + 1) * size % alignment == 0 and sim.config.lower_tiers, (where, run)
            if run.cause != "partial_block":
                assert run.first_token == run.first_block * size and run.end_token == (run.last_block + 1) * size
    # Restored tokens add up to what the engine counts as hits (a failed load's included).
    counted = totals(admissions)
    assert counted["hit_tokens"] == queries.stats(sim.state)["hit_tokens"]
    assert counted["prompt_tokens"] == counted["device_tokens"] + counted["restored_tokens"] + counted["missed_tokens"]
    return seen


@pytest.mark.slow
@settings(deadline=None)
@given(config=st.sampled_from(SIMULATED_CONFIGS), seed=st.integers(0, 2**16), prefix_caching=st.booleans(),
       fail_rate=st.sampled_from([0.0, 0.1]), reset_rate=st.sampled_from([0.0, 0.03]),
       turn_rate=st.sampled_from([0.0, 0.2]), pressure_rate=st.sampled_from([0.0, 0.05]),
       keep_rate=st.sampled_from([0.0, 0.0, 0.5]))
# A promotion planned before a rekeying reset reads, after it, a block another process wrote under the
# earlier keys: the simulator took it for other content than the one its own copies were renamed to.
@example(config=SIMULATED_CONFIGS[7], seed=431, prefix_caching=False, fail_rate=0.0, reset_rate=0.03, turn_rate=0.0,
         pressure_rate=0.05, keep_rate=0.0)
def test_every_admission_is_explained_as_the_simulator_saw_it(config, seed, prefix_caching, fail_rate, reset_rate,
                                                              turn_rate, pressure_rate, keep_rate):
    """`keep_rate`: some resets keep the lower tiers' blocks (`key_generations` "kept")."""
    sim, ledger = _run(config, seed, prefix_caching=prefix_caching, fail_rate=fail_rate, reset_rate=reset_rate,
                       damage_rate=0.05, foreign_rate=0.05, lookup_fail_rate=0.05, turn_rate=turn_rate,
                       pressure_rate=pressure_rate, keep_rate=keep_rate)
    _check(sim, ledger)


# Workloads chosen to reach every cause: a tier too small to keep the documents
# (evictions, refusals), failures, resets, lazy stores, window and Mamba groups,
# a disk below a small host tier.
SMALL = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),), hash_block_size=16,
                     num_device_blocks=24, num_tier_slots=6, protection="pin")


def test_every_cause_is_reached_and_checked():
    seen: set[str] = set()
    for config in (*SIMULATED_CONFIGS, SMALL):
        for seed in range(6):
            sim, ledger = _run(config, seed, prefix_caching=seed % 2 == 0, fail_rate=0.1, reset_rate=0.03,
                               damage_rate=0.05, foreign_rate=0.05, lookup_fail_rate=0.1, turn_rate=0.2,
                               pressure_rate=0.05)
            seen |= _check(sim, ledger)
    assert REKEYED in seen  # a block stored under an earlier key generation, asked for under a later one
    seen.discard(REKEYED)
    assert seen == set(CAUSES) - {"unexplained"} - WHATIF, f"never reached: {set(CAUSES) - seen - {'unexplained'}}"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])  # 1 and 3 end with a load in flight
def test_a_streamed_ledger_tallies_what_a_kept_one_holds(seed: int) -> None:
    """`explain` keeps no admission: each is tallied once it can no longer change, and
    `flush` sends those whose load the log never ends. The tally equals the totals of
    the admissions a ledger keeps, with failures, resets and loads cut off by the end."""
    from kvledger.adapters.log_tools.misses import Tally

    config = SIMULATED_CONFIGS[seed % len(SIMULATED_CONFIGS)]
    tally = Tally()
    streamed = MissLedger(config, on_admission=tally.add)
    kept = MissLedger(config)

    def both(seq, event, state, effects) -> None:
        kept.observe(seq, event, state, effects)
        streamed.observe(seq, event, state, effects)

    sim = Simulator(config, prefix_caching=seed % 2 == 0, observe=both)
    run_random(sim, random.Random(seed), steps=90, arrivals=0.8, max_tokens=12, fail_rate=0.1, reset_rate=0.03,
               lookup_fail_rate=0.05)
    in_flight = len(streamed._loads)
    streamed.flush()
    assert tally.as_dict() == totals(kept.admissions)
    assert tally.admissions + tally.superseded == len(kept.admissions) > 0
    assert not streamed.admissions
    assert in_flight == (seed in (1, 3))


# The command, on a simulated log written as vLLM's would be.

@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("explain") / "events.log"
    assert main(["simulate", "--scenario", "hybrid", "--steps", "300", "--seed", "3", "--out", str(path)]) == 0
    return path


@pytest.mark.fast
def test_the_command_counts_what_the_replay_counts(log, capsys) -> None:
    assert main(["explain", str(log), "--json", "--window", "100"]) == 0
    data = json.loads(capsys.readouterr().out)
    header, records = open_log(log)
    stats = queries.stats(replay(header.config, records).state)
    assert data["hit_tokens"] == stats["hit_tokens"]
    assert data["prompt_tokens"] == data["device_tokens"] + data["restored_tokens"] + data["missed_tokens"]
    assert sum(entry["tokens"] for entry in data["missed_by_cause"].values()) == data["missed_tokens"]
    assert {"first_seen", "evicted", "partial_block"} <= set(data["missed_by_cause"])
    assert sum(row["missed_tokens"] for row in data["windows"]) == data["missed_tokens"]
    assert [row["steps"][0] for row in data["windows"]] == [0, 100, 200]


@pytest.mark.fast
def test_one_request_block_by_block(log, capsys) -> None:
    assert main(["explain", str(log), "--json"]) == 0
    assert main(["explain", str(log), "--request", "req-20"]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line.startswith("  block")]
    assert text.count("request req-20, admission 1 at seq") == 1 and lines
    assert "partial_block" in lines[-1]
    assert main(["explain", str(log), "--request", "nobody"]) == 2
    assert "admits no request 'nobody'" in capsys.readouterr().err


@pytest.mark.fast
def test_the_readme_names_every_cause():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = text.split("## Why did it miss, and what if", 1)[1].split("\n| cause", 1)[1].split("\n\n", 1)[0]
    named = {row.split("`")[1] for row in table.splitlines() if row.startswith("| `")}
    assert named == set(CAUSES) - {"unexplained"} - WHATIF


@pytest.mark.fast
def test_the_page_of_one_example_per_cause_is_current():
    """docs/causes.md shows every cause explain can name from a log, rendered from seeded runs."""
    from pathlib import Path

    from tests.support.causes_doc import SHOWN, render

    page = Path(__file__).resolve().parents[2] / "docs" / "causes.md"
    text = render()
    if os.environ.get("KVLEDGER_UPDATE_GOLDEN") == "1":
        page.write_text(text + "\n")
    assert page.read_text() == text + "\n", "docs/causes.md is stale: KVLEDGER_UPDATE_GOLDEN=1 rewrites it"
    assert "(no seeded run reaches it)" not in text and all(f"## `{cause}`" in text for cause in SHOWN)
