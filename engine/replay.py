"""Replay: a fold of `reduce` over a log, with the checks that make it a
debugger. Pure: the caller decodes the log and passes its records in."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import attrs

from kvledger.events import types as ev
from kvledger.events.config import EngineConfig

from . import effects as fx
from .digest import matches
from .fold import Fold, fold_events
from .invariants import InvariantViolation, check
from .state import State, initial_state


@attrs.frozen
class Finding:
    """The first thing that went wrong, and where."""

    seq: int
    kind: str  # "violation" | "invariant" | "digest"
    detail: str


@attrs.define
class ReplayResult:
    state: State
    events: int = 0
    steps: int = 0
    by_kind: Counter = attrs.field(factory=Counter)
    violations: list[tuple[int, fx.ReportViolation]] = attrs.field(factory=list)
    digests_checked: int = 0
    first_problem: Finding | None = None
    last_seq: int = -1
    ends_with_full_digest: bool = False  # a live engine's end mark (its other digests are part digests)

    @property
    def ok(self) -> bool:
        return self.first_problem is None


def replay(
    config: EngineConfig,
    records: Iterable[object],
    *,
    check_invariants: bool = False,
    until_seq: int | None = None,
    observe: Callable[[int, ev.Event, State, tuple[fx.Effect, ...]], None] | None = None,
    state: State | None = None,
) -> ReplayResult:
    """Fold the records. Records are event records (`.seq`, `.event`) and
    `DigestRecord`s, in log order. `state` (consumed) is
    where they begin: a restored snapshot (whose own state the caller checks);
    the initial state by default.

    It stops at the first invariant break (the state is no longer trusted)
    but carries on past protocol violations and digest mismatches, keeping the
    first of them.
    """
    state = initial_state(config) if state is None else state
    result = ReplayResult(state=state)
    last_good: dict[str, int] = {}  # per digest part ("" for full digests): the seq it last matched
    fold = Fold(state, result.last_seq)
    full_digest_last = False  # the last record a full digest (no event after it)
    events_at_digest = -1
    stream = iter(records)
    while not fold.done:
        # The events up to the next digest record, in the compiled loop (`fold`).
        reported = len(fold.violations)
        record = fold_events(fold, stream, check_invariants, -1 if until_seq is None else until_seq, observe)
        if result.first_problem is None and len(fold.violations) > reported:
            seq, first = fold.violations[reported]
            result.first_problem = Finding(seq, "violation", f"{first.code}: {first.message}")
        if fold.broken is not None:
            _record_break(result, fold.broken_seq, fold.broken)
        if record is None:
            break
        seq = record.seq  # type: ignore[attr-defined]
        recorded = record.digest  # type: ignore[attr-defined]
        full_digest_last = ":" not in recorded
        events_at_digest = fold.events
        if check_invariants:
            if not _full_check(fold.state, result, seq):
                break
        part = recorded.partition(":")[0] if ":" in recorded else ""
        try:
            same = matches(fold.state, recorded)
        except ValueError as bad:
            if result.first_problem is None:
                result.first_problem = Finding(seq, "digest", str(bad))
            continue
        result.digests_checked += 1
        if not same and result.first_problem is None:
            what = f"part {part} of the state" if part else "the state"
            result.first_problem = Finding(
                seq, "digest", f"{what} differs from the recorded digest at seq {seq}; it last matched "
                f"at seq {last_good.get(part, -1)}, so the first divergent event is in "
                f"({last_good.get(part, -1)}, {seq}]")
        elif same:
            last_good[part] = seq
    state = fold.state
    result.violations = fold.violations
    result.events, result.steps, result.last_seq = fold.events, fold.steps, fold.last_seq
    result.ends_with_full_digest = full_digest_last and fold.events == events_at_digest
    for kind, count in fold.by_type.items():
        result.by_kind[kind.kind] += count
    if check_invariants and (result.first_problem is None or result.first_problem.kind != "invariant"):
        _full_check(state, result, result.last_seq)
    result.state = state
    return result


def _full_check(state: State, result: ReplayResult, seq: int) -> bool:
    try:
        check(state)
    except InvariantViolation as broken:
        _record_break(result, seq, broken)
        return False
    return True


def _record_break(result: ReplayResult, seq: int, broken: InvariantViolation) -> None:
    finding = Finding(seq, "invariant", str(broken))
    if result.first_problem is None or result.first_problem.kind != "invariant":
        result.first_problem = finding


def breaks_invariants(state: State) -> bool:
    try:
        check(state)
    except InvariantViolation:
        return True
    return False
