"""`kvledger replay LOG --jobs N`: the whole log replayed in segments, N at a time.

The snapshots cut a log into segments that replay independently (as `bisect`
checks them): each from its opening snapshot, with every check a replay from
the beginning makes (`--check`: the invariants after every event and at each
digest, and the opening snapshot's own state), and each ending in the state its
closing snapshot recorded, compared in the snapshot's packed form. So the
segments, all holding, replay exactly what one replay from the beginning does,
and their counts add up to its counts. The last segment runs in this process,
for the final state the summary reads; the rest in N processes.

On a log with no snapshot (JSONL, older formats, written without) there is one
segment, and this is a plain replay.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from kvledger import __version__
from kvledger.adapters.log_files import log_header
from kvledger.adapters.log_seek import find_snapshots
from kvledger.engine.replay import Finding, ReplayResult

from .bisect import Verdict, _segments, check_segment
from .log_commands import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEM, BadArgument, _print_summary, summary

_WHOLE_LOG_ONLY = ("start", "until", "request", "key", "report")


def cmd_replay_segments(args: argparse.Namespace) -> int:
    for name in _WHOLE_LOG_ONLY:
        if getattr(args, name) is not None:
            flag = "--from" if name == "start" else f"--{name}"
            raise BadArgument(f"--jobs replays the whole log in segments: it does not go with {flag}")
    header = log_header(args.log)
    segments = _segments(find_snapshots(args.log).marks)
    with ProcessPoolExecutor(min(args.jobs, max(1, len(segments) - 1))) as pool:
        futures = [pool.submit(check_segment, args.log, start, end, args.check) for start, end in segments[:-1]]
        last = check_segment(args.log, *segments[-1], args.check, keep_state=True)
        verdicts = [future.result() for future in futures] + [last]
    if last.state is None:  # the last segment's own snapshot did not restore: its finding says why
        assert last.finding is not None
        print(f"kvledger: {last.finding.detail}", file=sys.stderr)
        return EXIT_PROBLEM
    result = _merged(verdicts, last)
    data = summary(header, result)
    data["segments"] = len(segments)
    if args.check:
        data["checked"] = {"invariants_after_events": result.events, "digests": result.digests_checked}
    if last.tear is not None:
        data["tear"] = {"error": last.tear, "last_good_seq": result.last_seq}
    elif header.schema_version >= 2:
        data["closed"] = result.ends_with_full_digest
    if header.engine_version != __version__:
        data["replayed_by"] = __version__
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_summary(data)
        print(f"segments    {len(segments)}, replayed {min(args.jobs, len(segments))} at a time from the log's "
              "snapshots, each ending in the state the next one recorded")
    if last.tear is not None:
        print(f"kvledger: {last.tear}; the records up to seq {result.last_seq} were replayed "
              "(the summary above stops there)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK if result.first_problem is None else EXIT_PROBLEM


def _merged(verdicts: list[Verdict], last: Verdict) -> ReplayResult:
    """One replay's result from its segments': counts summed, the first problem in log order."""
    assert last.state is not None
    result = ReplayResult(state=last.state)
    kinds: Counter = Counter()
    for verdict in verdicts:
        result.events += verdict.events
        result.steps += verdict.steps
        kinds.update(verdict.by_kind)
        result.digests_checked += verdict.digests_checked
        result.violations.extend(verdict.violations)
        if result.first_problem is None and verdict.finding is not None:
            result.first_problem = Finding(verdict.finding.seq, verdict.finding.kind, verdict.finding.detail)
    result.by_kind = kinds
    result.last_seq = max((v.last_seq for v in verdicts), default=-1)
    # The log's last record is in the last segment that read any: a closed log's end mark, at the
    # last snapshot's seq when that snapshot ends the log, is read by the segment before it.
    read = [v for v in verdicts if v.events or v.digests_checked]
    result.ends_with_full_digest = bool(read) and read[-1].ends_with_full_digest
    return result
