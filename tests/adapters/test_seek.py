"""`inspect --at` and `replay --from` start at a snapshot and reach what a replay
from the beginning reaches: on a closed log (its index), on one cut by a crash
(the walk of its frame heads), on a damaged index, and on logs without
snapshots (JSONL, format 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvledger.adapters.cli.main import main
from kvledger.adapters.log_seek import find_snapshots, open_log_at
from kvledger.events.log_binary import TRAILER_BYTES

pytestmark = pytest.mark.fast
FIXTURES = Path(__file__).parents[1] / "events" / "fixtures"


@pytest.fixture(scope="module")
def snap_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seek") / "snap.kvlog"
    assert main(["simulate", "--scenario", "hybrid", "--steps", "400", "--seed", "4", "--snapshot-interval-events",
                 "300", "--out", str(path)]) == 0
    return path


def _inspect(path: Path, at: int, capsys: pytest.CaptureFixture, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["inspect", str(path), "--at", str(at), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _same_state(a: dict, b: dict) -> None:
    drop = ("replayed_from_seq", "violations_replayed")
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def test_the_closed_log_has_an_index_of_its_snapshots(snap_log: Path) -> None:
    snapshots = find_snapshots(snap_log)
    assert snapshots.found_by == "index" and len(snapshots.marks) >= 4
    assert all(a.seq < b.seq for a, b in zip(snapshots.marks, snapshots.marks[1:]))


def test_inspect_from_a_snapshot_is_inspect_from_the_start(snap_log: Path, capsys: pytest.CaptureFixture) -> None:
    marks = find_snapshots(snap_log).marks
    last = json.loads(_replay(snap_log, capsys))["last_seq"]
    points = {0, 1, last // 2, last}
    for mark in (marks[0], marks[len(marks) // 2], marks[-1]):
        points |= {mark.seq - 2, mark.seq - 1, mark.seq}  # just before, at and just after a snapshot
    for at in sorted(points):
        view = _inspect(snap_log, at, capsys)
        _same_state(view, _inspect(snap_log, at, capsys, "--from-start"))
        expected = max([m.seq for m in marks if m.seq <= at + 1], default=0)
        assert view["replayed_from_seq"] == expected, at


def _replay(path: Path, capsys: pytest.CaptureFixture, *extra: str) -> str:
    capsys.readouterr()
    assert main(["replay", str(path), "--json", *extra]) == 0
    return capsys.readouterr().out


def test_replay_from_a_point_ends_where_the_whole_replay_ends(snap_log: Path, capsys: pytest.CaptureFixture) -> None:
    whole = json.loads(_replay(snap_log, capsys, "--check"))
    marks = find_snapshots(snap_log).marks
    for start in (0, marks[1].seq + 5, marks[-1].seq):
        part = json.loads(_replay(snap_log, capsys, "--check", "--from", str(start)))
        assert part["replayed_from_seq"] == max([m.seq for m in marks if m.seq <= start], default=0)
        assert part["events"] == whole["events"] - part["replayed_from_seq"]
        for key in ("final_digest", "last_seq", "closed", "ok", "tier", "requests_live"):
            assert part[key] == whole[key], key
        # The totals count from the snapshot, as the events do: with those before it, the whole log's.
        before = _inspect(snap_log, part["replayed_from_seq"] - 1, capsys)["stats"] if part["replayed_from_seq"] \
            else dict.fromkeys(whole["stats"], 0)
        assert {k: part["stats"][k] + before[k] for k in whole["stats"]} == whole["stats"]


def test_a_log_cut_by_a_crash_is_walked_for_its_snapshots(snap_log: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    marks = find_snapshots(snap_log).marks
    data = snap_log.read_bytes()
    for cut in (marks[-2].offset + 20, marks[-1].offset - 3, len(data) - TRAILER_BYTES - 5):
        path = tmp_path / f"cut-{cut}.kvlog"
        path.write_bytes(data[:cut])
        found = find_snapshots(path)
        assert found.found_by == "scan"
        whole = tuple(m for m in marks if m.offset + 8 + int.from_bytes(data[m.offset:m.offset + 4], "little") <= cut)
        assert found.marks == whole
        at = found.marks[-1].seq + 3 if found.marks else 10
        _same_state(_inspect(path, at, capsys), _inspect(path, at, capsys, "--from-start"))


def test_a_damaged_index_falls_back_to_the_walk(snap_log: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    data = bytearray(snap_log.read_bytes())
    data[-TRAILER_BYTES - 3] ^= 0xFF  # inside the index frame: its CRC fails
    path = tmp_path / "damaged.kvlog"
    path.write_bytes(bytes(data))
    found = find_snapshots(path)
    assert found.found_by == "scan" and found.marks == find_snapshots(snap_log).marks
    start = open_log_at(path, found.marks[-1].seq)
    assert start.snapshot is not None and start.snapshot.seq == found.marks[-1].seq
    start.records.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["jsonl", "format_v2"])
def test_logs_without_snapshots_start_at_their_beginning(name: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    if name == "jsonl":
        path = tmp_path / "log.jsonl"
        assert main(["simulate", "--steps", "60", "--format", "jsonl", "--snapshot-interval-events", "20",
                     "--out", str(path)]) == 0
    else:
        path = tmp_path / "v2.kvlog"
        shutil.copy(FIXTURES / "format_v2.kvlog", path)
    assert find_snapshots(path).found_by == "none"
    view = _inspect(path, 150, capsys)
    assert view["replayed_from_seq"] == 0
    _same_state(view, _inspect(path, 150, capsys, "--from-start"))


@pytest.mark.parametrize("ratio", [0.0, 1.0, 3.0])
def test_snapshots_wait_for_the_log_to_outgrow_them(tmp_path: Path, ratio: float) -> None:
    """With `snapshot_bytes_ratio` r, the log between two snapshots is at least r times the
    first one's bytes: snapshots never take more than 1/(1+r) of the log."""
    import random

    from kvledger.adapters.cli.log_commands import SCENARIOS
    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from kvledger.events.config import EngineConfig

    config = EngineConfig.from_dict(SCENARIOS["hybrid"])
    path = tmp_path / "ratio.kvlog"
    with EngineHost(config, log_path=path, snapshot_interval_events=1, snapshot_bytes_ratio=ratio) as host:
        run_random(Simulator(config, host=host), random.Random(2), steps=300, arrivals=0.9, max_tokens=30)
        steps = host.next_step
    marks = find_snapshots(path).marks
    data = path.read_bytes()
    sizes = [8 + int.from_bytes(data[m.offset:m.offset + 4], "little") for m in marks]
    gaps = [b.offset - (a.offset + size) for a, b, size in zip(marks, marks[1:], sizes)]
    if ratio == 0:
        assert len(marks) == steps  # every step passes an interval of 1 event
    else:
        assert 3 <= len(marks) < steps / 4
        assert all(gap >= ratio * size for gap, size in zip(gaps, sizes))
        assert all(gap < ratio * size + 1000 for gap, size in zip(gaps, sizes))  # and not much more: a step or two


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_background_writer_writes_the_same_log(tmp_path: Path, ratio: float) -> None:
    """The live scheduler's mode: snapshots captured on the caller's thread, encoded on the
    writer's. The same bytes, except where the size rule reads the writer's counts, which lag
    behind in background mode: then the snapshots may fall elsewhere, the records do not."""
    import random

    from kvledger.adapters.cli.log_commands import SCENARIOS
    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.log_files import open_log
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from kvledger.events.config import EngineConfig

    config = EngineConfig.from_dict(SCENARIOS["mamba"])
    paths = []
    for background in (False, True):
        path = tmp_path / f"log-{background}.kvlog"
        with EngineHost(config, log_path=path, snapshot_interval_events=50, snapshot_bytes_ratio=ratio,
                        background=background) as host:
            run_random(Simulator(config, host=host), random.Random(5), steps=200, arrivals=0.9, max_tokens=30)
        paths.append(path)
        # In the background the size rule reads counts that lag by however far the writer is
        # behind (the machine's load): how many snapshots pass it varies there, not the first.
        assert len(find_snapshots(path).marks) >= (1 if background and ratio else 3)
    if ratio == 0:
        assert paths[0].read_bytes() == paths[1].read_bytes()
    assert list(open_log(paths[0])[1]) == list(open_log(paths[1])[1])
