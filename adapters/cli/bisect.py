"""`kvledger bisect LOG`: the first event at which the log's replay breaks.

A break is a protocol violation, a broken invariant, a recorded digest the
replayed state does not match, or a segment whose replay does not end in the
state its closing snapshot recorded. Checking every event of a long log with
the invariants costs about twice a plain replay; the snapshots make that
unnecessary:

1. The snapshots cut the log into segments. Each segment is replayed from
   its opening snapshot without per-event checks (the snapshot's own state
   gets the full invariant check), checking the recorded digests on the way and
   comparing the end state with the closing snapshot, byte for byte in its
   packed form. The segments are independent: `--jobs N` checks N at a time,
   in processes of their own. The first failing segment (in log order) is the
   one to look into; every segment before it replayed into the state the log
   recorded.
2. That segment alone is replayed again with every invariant checked after
   every event, which names the event. Where even that finds nothing (the
   replay reaches a different state with every invariant holding), the finding
   is the segment's end: a changed event or snapshot, or an engine that decides
   differently from the one that recorded the log.

A log without snapshots (JSONL, older formats, or written with none) is one
segment: the search is then a checked replay from the start. A log cut by a
crash is checked up to the cut.

Exit status as the other log commands: 0 when every segment holds, 1 when a
problem is named, 2 when the log cannot be used (or is cut, with no problem
before the cut).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import attrs
import msgpack

from kvledger.adapters.log_files import open_log
from kvledger.adapters.log_seek import find_snapshots, load_snapshot, read_snapshot
from kvledger.engine.invariants import InvariantViolation, check
from kvledger.engine.replay import Finding, replay
from kvledger.engine.snapshot import SnapshotError, capture, restore
from kvledger.engine.state import State
from kvledger.events.log_binary import SnapshotMark
from kvledger.events.log_records import EventRecord, LogError, LogHeader, Record

from .log_commands import Prefix

EXIT_OK, EXIT_PROBLEM, EXIT_BAD_INPUT = 0, 1, 2


@attrs.frozen
class Verdict:
    """A segment's check: `finding` is None when it holds. `events` replayed."""

    start: int
    end: int | None  # the closing snapshot's seq; None: the log's end
    events: int
    finding: Finding | None
    event: tuple[str, str | None] | None = None  # (kind, request id) of the event at the finding's seq
    tear: str | None = None  # the last segment of a log cut by a crash: where it is cut
    # What `replay --jobs` sums over the segments:
    steps: int = 0
    by_kind: dict[str, int] = attrs.field(factory=dict)
    digests_checked: int = 0
    violations: tuple = ()  # (seq, ReportViolation) of each protocol violation
    last_seq: int = -1
    ends_with_full_digest: bool = False
    state: State | None = attrs.field(default=None, eq=False)  # the end state, kept in the process that asked


def _within(records: Iterable[Record], start: int, end: int | None) -> Iterator[Record]:
    """The segment's records: events before seq `end`, digests up to it. A digest at seq
    `start` that follows the opening snapshot (a step with no events) is the segment's
    before, which reads it on its way to its end: checked once, as a replay from the start
    checks it."""
    for record in records:
        seq = record.seq  # type: ignore[union-attr]
        if end is not None and seq >= end + (type(record) is not EventRecord):
            return
        if start and seq == start and type(record) is not EventRecord:
            continue
        yield record


def _open(path: str, start: SnapshotMark | None) -> tuple[LogHeader, State | None, Iterator[Record], Finding | None]:
    """The segment's opening state and records, or a finding about its snapshot."""
    if start is None:
        header, records = open_log(path)
        return header, None, records, None
    header, snapshot, records = read_snapshot(path, start)
    try:
        state = restore(header.config, snapshot.data)  # type: ignore[arg-type]
        check(state)
    except (SnapshotError, InvariantViolation) as exc:
        return header, None, records, Finding(start.seq, "snapshot", f"the snapshot after seq {start.seq - 1}: {exc}")
    return header, state, records, None


def _same_as_snapshot(path: str, mark: SnapshotMark, state: State) -> bool:
    recorded = load_snapshot(path, mark)
    return bool(msgpack.packb(capture(state)) == msgpack.packb(recorded.data))


def check_segment(path: str, start: SnapshotMark | None, end: SnapshotMark | None, checked: bool = False,
                  keep_state: bool = False) -> Verdict:
    """Replay one segment (with per-event invariant checks if `checked`) and say whether it
    holds, with its counts; with its end state if `keep_state` (in-process: a state does not
    travel between processes)."""
    start_seq = 0 if start is None else start.seq
    end_seq = None if end is None else end.seq
    header, state, records, finding = _open(path, start)
    if finding is not None:
        return Verdict(start_seq, end_seq, 0, finding)
    prefix = Prefix(records) if end is None else None  # a crash cuts only the last segment
    result = replay(header.config, _within(records if prefix is None else prefix, start_seq, end_seq),
                    check_invariants=checked, state=state)
    finding = result.first_problem
    if finding is None and end is not None and not _same_as_snapshot(path, end, result.state):
        finding = Finding(end.seq, "snapshot", f"the replay from seq {start_seq} does not reach the state the "
                          f"snapshot after seq {end.seq - 1} recorded")
    event = None
    if finding is not None and finding.kind in ("violation", "invariant"):
        event = _event_at(path, start, finding.seq)
    tear = None if prefix is None else prefix.tear
    return Verdict(start_seq, end_seq, result.events, finding, event, None if tear is None else str(tear),
                   steps=result.steps, by_kind=dict(result.by_kind), digests_checked=result.digests_checked,
                   violations=tuple(result.violations), last_seq=result.last_seq,
                   ends_with_full_digest=result.ends_with_full_digest, state=result.state if keep_state else None)


def _event_at(path: str, start: SnapshotMark | None, seq: int) -> tuple[str, str | None] | None:
    records = open_log(path)[1] if start is None else read_snapshot(path, start)[2]
    for record in records:
        if type(record) is EventRecord and record.seq == seq:
            return record.event.kind, getattr(record.event, "request_id", None)
    return None


def _segments(marks: tuple[SnapshotMark, ...]) -> list[tuple[SnapshotMark | None, SnapshotMark | None]]:
    bounds: list[SnapshotMark | None] = [None, *marks, None]
    return list(zip(bounds[:-1], bounds[1:]))


def _first_failing(path: str, segments: list, jobs: int) -> tuple[int, Verdict, int]:
    """(index, verdict) of the first failing segment in log order (else the last
    segment's), and the events replayed."""
    replayed = 0
    if jobs <= 1:
        for index, (start, end) in enumerate(segments):
            verdict = check_segment(path, start, end)
            replayed += verdict.events
            if verdict.finding is not None:
                return index, verdict, replayed
        return len(segments) - 1, verdict, replayed
    with ProcessPoolExecutor(jobs) as pool:
        futures: list[Future] = [pool.submit(check_segment, path, start, end) for start, end in segments]
        try:
            for index, future in enumerate(futures):
                verdict = future.result()
                replayed += verdict.events
                if verdict.finding is not None:
                    return index, verdict, replayed
        finally:
            for future in futures:
                future.cancel()
    return len(segments) - 1, verdict, replayed


def cmd_bisect(args: argparse.Namespace) -> int:
    try:
        snapshots = find_snapshots(args.log)
        segments = _segments(snapshots.marks)
        index, verdict, replayed = _first_failing(args.log, segments, args.jobs)
        tear = verdict.tear
        if verdict.finding is not None:
            # An opening snapshot that breaks the invariants was reached by the segment
            # before it, which replayed into it exactly: the breaking event is there.
            suspect = index - 1 if verdict.finding.kind == "snapshot" and verdict.finding.seq == verdict.start \
                else index
            if suspect >= 0:
                fine = check_segment(args.log, *segments[suspect], checked=True)
                replayed += fine.events
                if fine.finding is not None:
                    verdict = fine
    except LogError as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finding = verdict.finding
    data: dict = {"ok": finding is None, "segments": len(segments), "snapshots_found_by": snapshots.found_by,
                  "segments_checked": index + 1, "events_replayed": replayed, "first_problem": None}
    if tear is not None:
        data["tear"] = tear
    if finding is not None:
        data["first_problem"] = {
            "seq": finding.seq, "kind": finding.kind, "detail": finding.detail,
            "event_kind": verdict.event[0] if verdict.event else None,
            "request_id": verdict.event[1] if verdict.event else None,
            "segment": [verdict.start, verdict.end],
        }
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"segments    {data['segments']} (snapshots found by {data['snapshots_found_by']}), "
              f"{data['segments_checked']} checked, {replayed} events replayed")
        problem = data["first_problem"]
        if tear is not None:
            print(f"log end     cut: {tear}; checked up to there")
        if problem is None and tear is not None:
            print("result      TORN: every segment up to the cut replays into the state the log recorded")
        elif problem is None:
            print("result      ok: every segment replays into the state the log recorded")
        else:
            event = (f" ({problem['event_kind']}" + (f", request {problem['request_id']}" if problem["request_id"]
                                                     else "") + ")") if problem["event_kind"] else ""
            end = problem["segment"][1]
            print(f"result      FIRST PROBLEM at seq {problem['seq']}{event}, {problem['kind']}: {problem['detail']}")
            print(f"segment     seq {problem['segment'][0]} to {'the end' if end is None else end}")
    if finding is not None:
        return EXIT_PROBLEM
    return EXIT_OK if tear is None else EXIT_BAD_INPUT
