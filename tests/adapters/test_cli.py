"""The kvledger command on real log files, including broken ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvledger
from kvledger.adapters.cli.main import main
from kvledger.events.config import RULES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hybrid_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("logs") / "hybrid.log"
    assert main(["simulate", "--scenario", "hybrid", "--steps", "120", "--seed", "3", "--out", str(path)]) == 0
    return path


def test_replay_check_passes_and_summarizes(hybrid_log: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["replay", str(hybrid_log), "--check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["first_problem"] is None
    assert data["events_by_kind"]["step_scheduled"] == data["steps"] == 120
    assert data["digests_checked"] > 0
    assert data["stats"]["keys_stored"] > 0


def test_the_evictions_line_says_when_a_reset_dropped_blocks_too(hybrid_log: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """The engine's eviction total includes a reset's drops: the summary says so where the log has one."""
    assert main(["replay", str(hybrid_log)]) == 0
    plain = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("evictions"))
    assert "cache reset" not in plain
    golden = ROOT / "tests" / "golden" / "hybrid_failures_reset.jsonl"
    assert main(["replay", str(golden)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("evictions"))
    assert ", to make room or in 3 cache resets;" in line, line


def test_replay_until_stops_there(hybrid_log: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["replay", str(hybrid_log), "--until", "99", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["last_seq"] == 99 and data["events"] == 100


def test_request_timeline(hybrid_log: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["replay", str(hybrid_log), "--request", "req-0"]) == 0
    out = capsys.readouterr().out
    assert "request_added" in out and "step_scheduled" in out


def test_inspect_shows_state(hybrid_log: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(hybrid_log), "--at", "40", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["at_seq"] == 40 and view["requests"]


def _small_log(path: Path, events: list) -> Path:
    """A JSONL log of `events` on an 8-block engine, written as a live host writes it."""
    from kvledger.adapters.engine_host import EngineHost
    from kvledger.events.config import EngineConfig, GroupSpec

    config = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),), hash_block_size=16,
                          num_device_blocks=8, num_tier_slots=8)
    with EngineHost(config, log_path=path, fmt="jsonl") as host:
        for event in events:
            host.apply(event)
    return path


def test_violation_names_its_seq(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kvledger.events import types as ev

    path = _small_log(tmp_path / "bad.jsonl", [
        ev.RequestAdded(request_id="a", num_prompt_tokens=32, block_hashes=[b"x" * 16] * 2),
        ev.BlocksAllocated(request_id="a", block_ids=((1, 2),)),
        ev.BlocksAllocated(request_id="b", block_ids=((3,),)),  # unknown request
        ev.StepScheduled(step_index=0, request_ids=["a"], num_computed_tokens=[0], num_scheduled_tokens=[32])])
    assert main(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FIRST PROBLEM at seq 2 (violation)" in out and "illegal_request_event" in out


def test_replay_check_names_a_block_outside_the_pool(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--check` once crashed with IndexError here, where plain replay names the violation."""
    from kvledger.events import types as ev

    path = _small_log(tmp_path / "outside.jsonl", [
        ev.RequestAdded(request_id="a", num_prompt_tokens=32, block_hashes=[b"x" * 16] * 2),
        ev.BlocksAllocated(request_id="a", block_ids=((1, 99),))])
    assert main(["replay", str(path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "FIRST PROBLEM at seq 1 (violation)" in out and "block_out_of_range" in out


def test_the_footprint_check_names_blocks_outside_the_pool() -> None:
    from kvledger.engine import invariants
    from kvledger.engine.state import initial_state
    from kvledger.events.config import EngineConfig, GroupSpec

    config = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),), hash_block_size=16,
                          num_device_blocks=8, num_tier_slots=8)
    core = initial_state(config).core
    problems: list[str] = []
    assert not invariants._blocks_look_fine(core, [1, 8], False)
    invariants._block_problems(core, [1, 8, -1], False, "a", problems)
    assert problems == ["block 8: outside the device pool [0, 8)", "block -1: outside the device pool [0, 8)"]


@pytest.mark.parametrize("damage", ["missing", "empty", "truncated", "garbage"])
def test_bad_files_exit_2_with_a_message(tmp_path: Path, hybrid_log: Path, damage: str,
                                         capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "damaged.log"
    data = hybrid_log.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xffnot a log\n" * 4)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: ") and str(path) in err and "Traceback" not in err


@pytest.mark.slow
def test_replay_digest_is_independent_of_hash_seed(hybrid_log: Path) -> None:
    """Contract 7: the same log gives the same digests under any PYTHONHASHSEED."""
    digests = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "replay", str(hybrid_log), "--json"],
                             env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert data["digests_checked"] > 0  # recorded in this process, matched in that one
        digests.add(data["final_digest"])
    assert len(digests) == 1


@pytest.mark.slow
def test_recording_is_independent_of_hash_seed(tmp_path: Path) -> None:
    logs = []
    for seed in ("1", "2"):
        out_path = tmp_path / f"sim-{seed}.log"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "simulate", "--scenario", "mamba",
                               "--steps", "80", "--out", str(out_path)], env=env, capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        logs.append(out_path.read_bytes())
    assert logs[0] == logs[1]


def test_a_reader_that_stops_early_is_no_error(hybrid_log: Path) -> None:
    """`kvledger replay LOG | head` once ended in a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "replay", str(hybrid_log)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[2])
    finally:
        os.close(write_end)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("fmt", ["binary", "jsonl"])
def test_a_torn_log_replays_up_to_the_tear(tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture) -> None:
    """A log cut by a crash or a full disk: the reader once read the whole file first, so even
    `--until 10` failed on damage at the end."""
    path = tmp_path / f"whole.{fmt}"
    assert main(["simulate", "--scenario", "hybrid", "--steps", "120", "--seed", "3", "--format", fmt,
                 "--out", str(path)]) == 0
    data = path.read_bytes()
    cut = tmp_path / f"cut.{fmt}"
    cut.write_bytes(data[: len(data) * 2 // 3 - 5])  # inside a frame or a line (2/3 itself once fell between two)
    capsys.readouterr()
    assert main(["replay", str(cut), "--until", "10"]) == 0  # the damage lies beyond
    assert main(["inspect", str(cut), "--at", "10"]) == 0
    capsys.readouterr()
    assert main(["replay", str(cut), "--json"]) == 2
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert "truncated" in data["tear"]["error"] and "were replayed" in err
    last = data["tear"]["last_good_seq"]
    assert data["last_seq"] == last > 10 and data["events"] > 10
    assert main(["inspect", str(cut), "--at", str(last + 1)]) == 2
    assert f"torn after seq {last}" in capsys.readouterr().err


def test_a_log_says_whether_its_process_closed_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A killed engine's log once replayed as plain `ok`, indistinguishable from a closed one."""
    path = tmp_path / "whole.jsonl"
    assert main(["simulate", "--scenario", "hybrid", "--steps", "60", "--seed", "3", "--format", "jsonl",
                 "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["replay", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["closed"] is True
    # Killed between two steps: every line whole, but no end mark.
    lines = path.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "killed.jsonl"
    cut.write_bytes(b"".join(lines[: len(lines) // 2]))
    assert main(["replay", str(cut), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["closed"] is False and data["ok"]
    assert main(["replay", str(cut)]) == 0
    out = capsys.readouterr().out
    assert "NOT CLOSED" in out and f"{data['requests_live']} requests were live" in out


def test_a_log_from_another_kvledger_version_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "old.jsonl"
    assert main(["simulate", "--scenario", "full", "--steps", "20", "--seed", "1", "--format", "jsonl",
                 "--out", str(path)]) == 0
    lines = path.read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["engine_version"] = "0.0.1"
    header["commit"] = "0123456789abcdef"
    path.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0
    assert (f"recorded by kvledger 0.0.1 (commit 0123456789ab) under engine rules {RULES} (named in its header), "
            f"replayed by kvledger {kvledger.__version__} under them") in capsys.readouterr().out


def test_version_names_the_build_and_the_installed_vllm(capsys: pytest.CaptureFixture) -> None:
    from kvledger._identity import commit
    from kvledger.adapters.vllm_version import installed_vllm

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"kvledger {kvledger.__version__}"
    assert lines[1] == f"commit: {commit()}"  # a checkout asks git; a wheel reads the commit it was built from
    assert lines[2].startswith("engine: compiled" if kvledger.BUILD.compiled else "engine: pure Python")
    assert lines[3] == (f"event log: writes binary format 3 (reads 1-3), schema 2 (reads 1-2); engine rules "
                        f"{RULES} (replays 1-{RULES}, and logs of 0.1.0, which name none)")
    assert lines[4] == "tiers: writes and reads block format 1, pack format 1"
    found = installed_vllm()
    if found is None:
        assert lines[5] == "vLLM: not installed (supported: 0.32.x or 0.33.x)"
    else:
        assert lines[5] == f"vLLM: {found[0]} {found[1]}, supported (0.32.x or 0.33.x)"
