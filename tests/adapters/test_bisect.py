"""`kvledger bisect` on real broken logs: an engine bug that fires late, a
tampered digest, a tampered event; each named where a checked replay from the
start names it, after replaying less than the whole log with checks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import attrs
import pytest

from kvledger.adapters.cli.main import main
from kvledger.adapters.engine_host import EngineHost
from kvledger.adapters.log_files import open_log
from kvledger.adapters.log_seek import find_snapshots
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine import reducer
from kvledger.engine.replay import replay
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig
from kvledger.events.log_records import EventRecord

pytestmark = pytest.mark.fast
CONFIG = EngineConfig.from_dict(dict(
    groups=[{"group_id": 0, "kind": "full", "block_size": 32},
            {"group_id": 1, "kind": "sliding", "block_size": 32, "window": 64}],
    hash_block_size=32, num_device_blocks=40, num_tier_slots=30))
STEPS = 600


def _record(path: Path, *, tamper_step: int | None = None, tamper_digest_step: int | None = None) -> Path:
    """A simulated log with a snapshot every 400 events; optionally the logged copy of
    one event of step `tamper_step`, or the digest of step `tamper_digest_step`, changed."""
    host = EngineHost(CONFIG, log_path=path, digest_interval=4, strict=True, snapshot_interval_events=400)
    add_step, digest_due = host.writer.add_step, host._digest_due  # type: ignore[union-attr]

    tampered: list[int] = []

    def tampering_add_step(step_index: int, events: list, digest: str | None = None, snapshot: object = None) -> None:
        if tamper_step is not None and step_index >= tamper_step and not tampered:
            # The first store completion from here on, as reported by a worker that does not exist.
            for i, e in enumerate(events):
                if isinstance(e, ev.StoreCompleted):
                    events = [*events[:i], attrs.evolve(e, worker_index=5), *events[i + 1:]]
                    tampered.append(step_index)
                    break
        add_step(step_index, events, digest, snapshot)

    def tampering_digest(step_index: int) -> str | None:
        recorded = digest_due(step_index)
        if step_index == tamper_digest_step and recorded is not None:
            return recorded[:-4] + ("0000" if not recorded.endswith("0000") else "1111")
        return recorded

    host.writer.add_step = tampering_add_step  # type: ignore[union-attr,method-assign]
    host._digest_due = tampering_digest  # type: ignore[method-assign]
    with host:
        sim = Simulator(CONFIG, host=host)
        run_random(sim, random.Random(11), steps=STEPS, arrivals=0.9, max_tokens=30, completion_rate=0.3,
                   fail_rate=0.05)
    return path


def _bisect(path: Path, capsys: pytest.CaptureFixture, expect: int) -> dict:
    capsys.readouterr()
    assert main(["bisect", str(path), "--json"]) == expect
    return json.loads(capsys.readouterr().out)


def _checked_from_start(path: Path):
    header, records = open_log(path)
    return replay(header.config, records, check_invariants=True).first_problem


def _events(path: Path) -> list[EventRecord]:
    return [r for r in open_log(path)[1] if isinstance(r, EventRecord)]


@pytest.fixture(scope="module")
def clean_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("bisect") / "clean.kvlog")


def test_a_clean_log_bisects_clean(clean_log: Path, capsys: pytest.CaptureFixture) -> None:
    data = _bisect(clean_log, capsys, 0)
    assert data["ok"] and data["segments"] == len(find_snapshots(clean_log).marks) + 1 >= 5
    assert data["events_replayed"] == len(_events(clean_log))


def test_an_engine_bug_that_fires_late_is_named_at_its_event(clean_log: Path, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    events = _events(clean_log)
    late = [r for r in events if isinstance(r.event, ev.RequestPreempted) and r.seq > len(events) * 2 // 3]
    assert late, "the workload must preempt late in the log"
    target = late[0].event.request_id
    original = reducer._HANDLERS[ev.RequestPreempted]

    def sticky(core, event, out):  # keeps a block of the one request it preempts: a bug on purpose
        original(core, event, out)
        if event.request_id == target:
            core.requests[event.request_id].table[0].append(1)

    monkeypatch.setitem(reducer._HANDLERS, ev.RequestPreempted, sticky)
    expected = _checked_from_start(clean_log)
    assert expected is not None and expected.kind == "invariant"
    data = _bisect(clean_log, capsys, 1)
    problem = data["first_problem"]
    assert (problem["seq"], problem["kind"]) == (expected.seq, "invariant") == (late[0].seq, "invariant")
    assert (problem["event_kind"], problem["request_id"]) == ("request_preempted", target)
    start, end = problem["segment"]
    assert start <= late[0].seq < (end if end is not None else len(events))
    assert start > 0, "the break is late: the search started at a snapshot"


def test_a_tampered_digest_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _record(tmp_path / "digest.kvlog", tamper_digest_step=STEPS - 60)
    expected = _checked_from_start(path)
    assert expected is not None and expected.kind == "digest"
    problem = _bisect(path, capsys, 1)["first_problem"]
    assert (problem["seq"], problem["kind"]) == (expected.seq, "digest")
    assert problem["segment"][0] > 0


def test_a_tampered_event_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _record(tmp_path / "event.kvlog", tamper_step=STEPS - 50)
    tampered = [r for r in _events(path) if isinstance(r.event, ev.StoreCompleted) and r.event.worker_index == 5]
    assert tampered
    problem = _bisect(path, capsys, 1)["first_problem"]
    assert (problem["seq"], problem["kind"], problem["event_kind"]) == (tampered[0].seq, "violation",
                                                                        "store_completed")


def test_bisect_reads_a_log_without_snapshots_as_one_segment(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "plain.jsonl"
    assert main(["simulate", "--steps", "80", "--format", "jsonl", "--out", str(path)]) == 0
    data = _bisect(path, capsys, 0)
    assert data["segments"] == 1 and data["snapshots_found_by"] == "none"
    capsys.readouterr()
    assert main(["bisect", str(tmp_path / "missing.kvlog")]) == 2
    assert "no such log" in capsys.readouterr().err


# `replay --jobs`: the same segments, counted.

def _replay_json(path: Path, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["replay", str(path), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("check", [[], ["--check"]])
def test_a_replay_in_segments_says_what_one_from_the_start_says(clean_log: Path, capsys: pytest.CaptureFixture,
                                                                 check: list[str]) -> None:
    code, whole = _replay_json(clean_log, capsys, *check)
    assert code == 0
    code, parts = _replay_json(clean_log, capsys, "--jobs", "2", *check)
    assert code == 0
    assert parts.pop("segments") == len(find_snapshots(clean_log).marks) + 1 >= 3
    assert parts == whole


def test_a_replay_in_segments_names_the_first_problem_as_one_from_the_start(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    for name, tamper in (("event", {"tamper_step": STEPS - 50}), ("digest", {"tamper_digest_step": STEPS - 60}),
                         ("early", {"tamper_step": 150})):
        path = _record(tmp_path / f"{name}.kvlog", **tamper)
        code, whole = _replay_json(path, capsys, "--check")
        assert code == 1
        code, parts = _replay_json(path, capsys, "--check", "--jobs", "2")
        assert code == 1
        assert parts["first_problem"] == whole["first_problem"], name


def test_a_replay_in_segments_of_a_log_cut_by_a_crash(clean_log: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    cut = tmp_path / "cut.kvlog"
    data = clean_log.read_bytes()
    cut.write_bytes(data[: len(data) * 3 // 4])
    code, whole = _replay_json(cut, capsys)
    assert code == 2
    code, parts = _replay_json(cut, capsys, "--jobs", "2")
    assert code == 2
    parts.pop("segments")
    assert parts["tear"]["last_good_seq"] == whole["tear"]["last_good_seq"]
    assert parts["events"] == whole["events"] and parts["stats"] == whole["stats"]


@pytest.mark.parametrize("flag", [["--from", "10"], ["--until", "10"], ["--request", "r"], ["--key", "abcd"]])
def test_a_replay_in_segments_is_of_the_whole_log(clean_log: Path, capsys: pytest.CaptureFixture,
                                                  flag: list[str]) -> None:
    assert main(["replay", str(clean_log), "--jobs", "2", *flag]) == 2
    assert f"does not go with {flag[0]}" in capsys.readouterr().err


def test_a_digest_just_after_a_snapshot_is_checked_once(clean_log: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """A step with no events but a digest, right after a snapshot: its digest lies after the
    snapshot in the file, at the snapshot's seq. The segment before reads it on its way to
    its end; the one after leaves it, so the count is a replay from the start's. The same
    at the end: a snapshot after the last step, then the end mark (a full digest)."""
    from itertools import groupby

    from kvledger.adapters.log_files import LogWriter
    from kvledger.engine.digest import digest, part_digest
    from kvledger.engine.snapshot import capture
    from kvledger.engine.state import initial_state

    header, records = open_log(clean_log)
    steps = [(index, [r.event for r in group]) for index, group in
             groupby((r for r in records if isinstance(r, EventRecord)), key=lambda r: r.step_index)]
    path = tmp_path / "empty-step.kvlog"
    writer = LogWriter(path, header, fmt="binary")
    state = initial_state(header.config)
    cuts = {len(steps) // 3, 2 * len(steps) // 3, len(steps) - 1}
    for number, (step_index, events) in enumerate(steps):
        for event in events:
            state, _ = reducer.reduce(state, event)
        snapshot = capture(state) if number in cuts else None
        writer.add_step(step_index, events, part_digest(state, 0, 1) if number % 5 == 0 else None, snapshot)
        if snapshot is not None and number < len(steps) - 1:
            writer.add_step(step_index, [], part_digest(state, 0, 1))  # no events: it follows the snapshot
    writer.add_step(steps[-1][0], [], digest(state))  # the end mark (a full digest), after the last snapshot
    writer.close()
    assert len(find_snapshots(path).marks) == 3
    code, whole = _replay_json(path, capsys, "--check")
    assert code == 0 and whole["closed"]
    code, parts = _replay_json(path, capsys, "--check", "--jobs", "2")
    assert code == 0
    assert parts.pop("segments") == 4
    assert parts == whole
