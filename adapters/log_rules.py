"""The decision rules of a log written before logs named them (kvledger 0.1.0).

A log replays under the rules it was decided under (`events/config.py:RULES`).
From 0.2.0 on its header names them. A 0.1.0 header does not, and where the
kept rules decide differently (tiers below host memory) it cannot tell them
apart: builds 9d5f430 (rules 1) and b6b5af1 (rules 2) wrote the same header.
The log's own records can. Under the wrong rules the engine starts other store
jobs, so a recorded completion names a job that does not exist or a recorded
digest differs; under the right ones the fold reproduces the run.

So each kept rules version folds the log, newest first, without the invariant
checks, to its first problem. A clean fold settles it. Where every fold meets
a problem at the same seq, the problem is the run's own, whatever the rules,
and the newest rules are taken (the replay shows it as the run had it). Where
they meet problems at different seqs, no kept rules reproduce the run: the log
is refused, naming the builds that can replay it, rather than replayed into a
violation the run never had.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import attrs

from kvledger.engine.replay import replay
from kvledger.events.config import RULES, RULES_UNRESOLVED
from kvledger.events.log_records import LogError, LogHeader, Record

KEPT = tuple(range(RULES, 0, -1))  # the rules a 0.1.0 log may have been decided under, newest first
BUILDS_BY_RULES = {1: "9d5f430 and earlier", 2: "b6b5af1 to 325822e"}  # which 0.1.0 builds decided under each

Reader = Callable[[str], tuple[LogHeader, Iterator[Record]]]
_resolved: dict[tuple[str, int, int, int], int] = {}  # (path, inode, size, mtime) -> rules, for one process


def resolve(path: str, header: LogHeader, read: Reader) -> LogHeader:
    """`header` with the log's rules in its config: as recorded, or as its
    records show them (`read` opens the log again, its rules unresolved)."""
    if header.config.rules != RULES_UNRESOLVED:
        return header
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    rules = _resolved.get(key)
    if rules is None:
        rules = _infer(path, header, read)
        _resolved[key] = rules
    return attrs.evolve(header, config=attrs.evolve(header.config, rules=rules))


def _infer(path: str, header: LogHeader, read: Reader) -> int:
    firsts: dict[int, int] = {}  # rules -> the seq of the first problem a fold under them meets
    for rules in KEPT:
        result = replay(attrs.evolve(header.config, rules=rules), _up_to_tear(read(path)[1]))
        if result.first_problem is None:
            return rules
        firsts[rules] = result.first_problem.seq
    if len(set(firsts.values())) == 1:
        return KEPT[0]
    tried = ", ".join(f"rules {rules} from seq {seq}" for rules, seq in firsts.items())
    builds = ", ".join(f"{builds} decided under rules {rules}" for rules, builds in sorted(BUILDS_BY_RULES.items()))
    raise LogError(f"written by {header.writer}, which did not record its build's commit or rules, and no rules "
                   f"this build keeps reproduce its run (its records disagree with {tried}); replay it with the "
                   f"build that wrote it "
                   f"({builds}: git checkout COMMIT && pip install .)", source=path)


def _up_to_tear(records: Iterator[Record]) -> Iterator[Record]:
    """The records up to the first damage: a log cut by a crash is decided by what it holds."""
    try:
        yield from records
    except LogError:
        return
