"""The `kvledger` command never surprises: a bad value or path is one line and
exit 2, never a traceback; `--report` never replaces the log, a device or an
existing file without `--force`; keys are found by the prefixes timelines
print; requests are listed; `--from` and `--check` say what they did; and
"result ok" is never printed beside a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.adapters.cli.main import build_parser, main
from kvledger.adapters.log_files import open_log
from kvledger.engine import effects as fx
from kvledger.engine.replay import replay

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "events.log"
    assert main(["simulate", "--scenario", "hybrid", "--steps", "300", "--seed", "5",
                 "--snapshot-interval-events", "400", "--out", str(path)]) == 0
    return path


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", *argv], capture_output=True,
                          text=True, timeout=120)


BAD = {  # subcommand -> flag -> a bad value
    "replay": {"--until": "-5", "--from": "x", "--key": "zz", "--jobs": "0"},
    "requests": {"--until": "-1"},
    "explain": {"--until": "-1", "--window": "0", "--window-seconds": "-2"},
    "whatif": {"--jobs": "0", "--capacity-bytes": "0", "--capacity-blocks": "-4", "--policy": "mru", "--secondary-tiers": "[{",
               "--shared-tier": "{", "--store-threshold": "0", "--max-tracker-size": "-1", "--sweep": "policy"},
    "inspect": {"--at": "-3"},
    "bisect": {"--jobs": "0"},
    "simulate": {"--steps": "0", "--fail-rate": "2", "--digest-interval": "-1",
                 "--snapshot-interval-events": "-1", "--seed": "one", "--scenario": "other", "--format": "text", "--protection": "none"},
    "demo": {"--model": "bogus", "--docs": "0", "--doc-words": "-1"},
}


def test_every_subcommand_s_flags_are_walked() -> None:
    """A new subcommand or flag that takes a value must be added to BAD above."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        valued = {a.option_strings[0] for a in sub._actions
                  if a.option_strings and (a.type is not None or a.choices)}
        assert name in BAD and valued <= set(BAD[name]), (name, valued - set(BAD[name]))


@pytest.mark.parametrize("command, flag, value", [(c, f, v) for c, flags in BAD.items() for f, v in flags.items()])
def test_a_bad_flag_value_is_one_line_and_exit_2(log: Path, tmp_path: Path, command: str, flag: str,
                                                 value: str) -> None:
    positional = [] if command in ("simulate", "demo") else [str(log)]
    more = ["--out", str(tmp_path / "x.log")] if command == "simulate" else []
    if command == "inspect" and flag != "--at":
        more = ["--at", "1"]
    done = run(command, *positional, *more, flag, value)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("argv, words", [
    (["simulate", "--out", "/missing/folder/x.log"], "cannot use /missing/folder/x.log: No such file"),
    (["simulate", "--out", "{tmp}", "--force"], "Is a directory"),
    (["replay", "/missing.log"], "no such log"),
    (["replay", "{log}", "--from", "900", "--until", "100"], "--from 900 is after --until 100"),
])
def test_a_bad_path_or_range_is_one_line_and_exit_2(log: Path, tmp_path: Path, argv, words) -> None:
    done = run(*(a.format(tmp=tmp_path, log=log) for a in argv))
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_report_never_replaces_the_log_a_device_or_a_file_without_force(log: Path, tmp_path: Path,
                                                                            capsys) -> None:
    before = log.read_bytes()
    assert main(["replay", str(log), "--report", str(log)]) == 2
    assert log.read_bytes() == before and "is the log being replayed" in capsys.readouterr().err
    link = tmp_path / "link.html"
    link.symlink_to(log)
    assert main(["replay", str(log), "--report", str(link), "--force"]) == 2
    assert log.read_bytes() == before
    assert main(["replay", str(log), "--report", os.devnull, "--force"]) == 2
    assert os.path.exists(os.devnull) and not Path(os.devnull).is_file()  # still the device
    assert "not a regular file" in capsys.readouterr().err
    os.mkfifo(tmp_path / "fifo")
    assert main(["replay", str(log), "--report", str(tmp_path / "fifo"), "--force"]) == 2
    page = tmp_path / "page.html"
    page.write_text("mine")
    assert main(["replay", str(log), "--report", str(page)]) == 2 and page.read_text() == "mine"
    assert main(["replay", str(log), "--report", str(page), "--force"]) == 0
    assert page.read_text().startswith("<!DOCTYPE html>")


def _keys(log: Path) -> list[bytes]:
    header, records = open_log(log)
    keys: list[bytes] = []
    replay(header.config, records, observe=lambda seq, event, state, effects: keys.extend(
        k for e in effects if isinstance(e, fx.StartStore) for group in e.keys for k in group))
    return keys


def test_a_key_is_found_by_the_prefix_a_timeline_prints(log: Path, capsys) -> None:
    keys = _keys(log)
    whole = keys[0]
    assert main(["replay", str(log), "--key", whole.hex()]) == 0
    by_whole = capsys.readouterr().out
    # 12 digits, as timelines print keys: the block's keys in every KV group.
    assert main(["replay", str(log), "--key", whole.hex()[:12].upper()]) == 0
    by_prefix = capsys.readouterr().out
    assert by_prefix.count("\n") >= by_whole.count("\n") > 3
    assert main(["replay", str(log), "--key", "ffffffffffff"]) == 2
    assert "no key in" in capsys.readouterr().err


def test_a_prefix_two_blocks_share_is_named_ambiguous(tmp_path: Path, capsys) -> None:
    from kvledger.events import types as ev
    from tests.adapters.test_cli import _small_log

    twins = [b"\xab\xcd" + bytes([n]) * 14 for n in (1, 2)]  # two blocks whose keys share "abcd"
    path = _small_log(tmp_path / "twins.jsonl", [
        ev.RequestAdded(request_id="a", num_prompt_tokens=33, block_hashes=twins),
        ev.BlocksAllocated(request_id="a", block_ids=((1, 2, 3),)),
        ev.StepScheduled(step_index=0, request_ids=["a"], num_computed_tokens=[0], num_scheduled_tokens=[33])])
    assert main(["replay", str(path), "--key", "abcd"]) == 2
    assert "is ambiguous: 2 blocks" in capsys.readouterr().err
    assert main(["replay", str(path), "--key", "abcd01"]) == 0
    assert "StartStore" in capsys.readouterr().out


def test_requests_are_listed_and_an_unknown_one_is_refused(log: Path, capsys) -> None:
    assert main(["requests", str(log), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and rows[0]["request_id"] == "req-0" and rows[0]["prompt_tokens"] > 0
    assert main(["replay", str(log), "--request", rows[-1]["request_id"]]) == 0
    capsys.readouterr()
    assert main(["replay", str(log), "--request", "nobody"]) == 2
    assert "kvledger requests" in capsys.readouterr().err


def test_from_names_its_snapshot_and_scopes_every_count_there(log: Path, capsys) -> None:
    assert main(["replay", str(log), "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["replay", str(log), "--from", str(whole["last_seq"] - 10), "--json"]) == 0
    part = json.loads(capsys.readouterr().out)
    assert part["from_snapshot"] and part["replayed_from_seq"] > 0
    assert 0 < part["events"] < whole["events"]
    assert part["stats"]["stores"] < whole["stats"]["stores"]  # counted from the snapshot, like the events
    assert main(["replay", str(log), "--from", str(whole["last_seq"] - 10)]) == 0
    assert f"the snapshot at seq {part['replayed_from_seq']}" in capsys.readouterr().out


def test_check_says_what_it_checked(log: Path, capsys) -> None:
    assert main(["replay", str(log), "--check"]) == 0
    out = capsys.readouterr().out
    assert "checks      every invariant after each of" in out
    assert main(["replay", str(log)]) == 0
    assert "checks " not in capsys.readouterr().out


def test_a_torn_log_never_says_ok(log: Path, tmp_path: Path, capsys) -> None:
    torn = tmp_path / "torn.log"
    torn.write_bytes(log.read_bytes()[: log.stat().st_size // 2])
    assert main(["replay", str(torn)]) == 2
    assert "result      TORN after seq" in capsys.readouterr().out
    assert main(["bisect", str(torn)]) == 2
    out = capsys.readouterr().out
    assert "result      ok" not in out and "TORN" in out
