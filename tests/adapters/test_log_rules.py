"""Logs of kvledger 0.1.0 name no rules: their own records show which (adapters/log_rules.py),
and a log no kept rules reproduce is refused in one line, never replayed into a violation."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from kvledger.adapters.engine_host import EngineHost
from kvledger.adapters.log_files import open_log
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine.replay import replay
from kvledger.engine.state import initial_state
from kvledger.events.config import RULES, RULES_UNRESOLVED, EngineConfig
from kvledger.events.log_records import LogError

pytestmark = pytest.mark.fast
REPO = Path(__file__).resolve().parents[2]
SMALL_HOST_OVER_DISK = dict(groups=[{"group_id": 0, "kind": "full", "block_size": 16}], hash_block_size=16,
                            num_device_blocks=40, num_tier_slots=8, store_jobs="step",
                            lower_tiers=[{"name": "1:fs", "num_blocks": 64}])


def record(path: Path, rules: int, seed: int = 0, digest_interval: int = 4, **changes: object) -> EngineConfig:
    """A simulated run under `rules`, its log written as 0.1.0 wrote it: no rules, no commit."""
    config = EngineConfig.from_dict({**SMALL_HOST_OVER_DISK, **changes, "rules": rules})
    with EngineHost(config, log_path=path, fmt="jsonl", digest_interval=digest_interval, strict=True) as host:
        run_random(Simulator(config, host=host), random.Random(seed), steps=200, arrivals=0.9, max_tokens=30,
                   completion_rate=0.3, fail_rate=0.05, check_every=1)
    lines = path.read_bytes().splitlines(True)
    head = json.loads(lines[0])
    del head["config"]["rules"], head["commit"]
    head["engine_version"] = "0.1.0"
    path.write_bytes(json.dumps(head).encode() + b"\n" + b"".join(lines[1:]))
    return config


@pytest.mark.parametrize("digest_interval", [4, 0])
@pytest.mark.parametrize("rules", [1, 2])
def test_a_legacy_log_replays_under_the_rules_it_was_decided_under(tmp_path: Path, rules: int,
                                                                   digest_interval: int) -> None:
    path = tmp_path / "legacy.jsonl"
    config = record(path, rules, digest_interval=digest_interval)
    header, records = open_log(path)
    assert header.config.rules == rules and header.commit == ""
    assert replay(header.config, records, check_invariants=True).ok
    # The other rules break it: the inference had something to tell apart.
    assert not replay(attrs.evolve(config, rules=3 - rules), open_log(path)[1]).ok


def test_without_lower_tiers_every_rules_decide_alike_and_a_legacy_log_reads_as_this_builds(tmp_path: Path) -> None:
    path = tmp_path / "legacy.jsonl"
    record(path, 1, lower_tiers=[])
    header, records = open_log(path, resolve=False)
    assert header.config.rules == RULES
    assert replay(header.config, records, check_invariants=True).ok


def test_an_unresolved_header_runs_no_engine(tmp_path: Path) -> None:
    path = tmp_path / "legacy.jsonl"
    record(path, 1)
    header, _ = open_log(path, resolve=False)
    assert header.config.rules == RULES_UNRESOLVED
    with pytest.raises(ValueError, match="rules are not resolved"):
        initial_state(header.config)


def test_a_legacy_log_no_kept_rules_reproduce_is_refused_naming_the_builds(tmp_path: Path) -> None:
    """A late completion naming a job the run never started: under rules 1 the replay breaks
    there, under rules 2 far earlier. No rules reproduce the run, so nothing is replayed."""
    path = tmp_path / "legacy.jsonl"
    record(path, 1)
    lines = path.read_bytes().splitlines(True)
    last = max(i for i, line in enumerate(lines) if b'"kind":"store_completed"' in line)
    record_ = json.loads(lines[last])
    record_["job_id"] = 99999
    lines[last] = json.dumps(record_, separators=(",", ":")).encode() + b"\n"
    path.write_bytes(b"".join(lines))
    with pytest.raises(LogError) as refused:
        open_log(path)
    text = str(refused.value)
    assert "written by kvledger 0.1.0, which did not record its build's commit or rules" in text
    assert "its records disagree with rules 2 from seq" in text and ", rules 1 from seq" in text
    assert "9d5f430 and earlier decided under rules 1" in text and "\n" not in text
    done = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "replay", str(path), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and done.stdout == "" and "violation" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("command", ["replay", "explain", "inspect"])
@pytest.mark.parametrize("what", ["fifo", "/dev/zero"])
def test_a_log_path_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, what: str, command: str) -> None:
    if what == "fifo":
        path = tmp_path / "events.log"
        os.mkfifo(path)
    else:
        path = Path(what)
    argv = [command, str(path), *(["--at", "0"] if command == "inspect" else [])]
    done = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", *argv],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert ("a FIFO" if what == "fifo" else "a device") + ", not a log file" in done.stderr
    assert "Traceback" not in done.stderr
