"""Every legal state move, as data; the reducer and the tier's slot module run on it.

Request moves are keyed by (status, event kind); `None` is "no such request"
on the left and "forgotten" on the right. Some events have two outcomes,
chosen by a fact of the event (a load planned or not, a failed load that
vLLM recomputes from scratch or not); those facts are spelled out as
pseudo-kinds. The reducer takes both whether a move is legal and the status
it leads to from `REQUEST_MOVES` (a pair that is missing is a protocol
violation), and `engine/slots.py` takes each slot action's target from
`SLOT_MOVES`. A key's life in a tier below host memory is `TIER_KEY_MOVES`
(`engine/lower.py`), a transfer's between its start and its last report
`JOB_MOVES` (`start_job` and `flush_job`, below): each move's target is read
from its row once, at import, and the states the moves start from are asserted.
`tests/engine/test_transitions.py` checks the tables cell by cell, and that
the reducer consults every request row; `docs/transitions.md` is rendered
from them.
"""

from __future__ import annotations

from typing import Final

from .state import Job
from .state import JobStage as J
from .state import RequestStatus as R
from .state import SlotState as S
from .state import TierKeyState as K

GONE = None

REQUEST_MOVES: dict[tuple[R | None, str], R | None] = {
    (None, "request_added"): R.WAITING,
    (R.WAITING, "block_hashes_appended"): R.WAITING,
    (R.LOADING, "block_hashes_appended"): R.LOADING,
    (R.RUNNING, "block_hashes_appended"): R.RUNNING,
    (R.PREEMPTED, "block_hashes_appended"): R.PREEMPTED,
    (R.WAITING, "block_hashes_rewound"): R.WAITING,
    (R.RUNNING, "block_hashes_rewound"): R.RUNNING,
    (R.PREEMPTED, "block_hashes_rewound"): R.PREEMPTED,
    (R.WAITING, "blocks_touched"): R.WAITING,
    (R.WAITING, "blocks_allocated"): R.RUNNING,
    (R.WAITING, "blocks_allocated+load"): R.LOADING,
    (R.RUNNING, "blocks_allocated"): R.RUNNING,
    (R.RUNNING, "blocks_freed"): R.RUNNING,
    (R.RUNNING, "step_scheduled"): R.RUNNING,
    (R.RUNNING, "request_preempted"): R.PREEMPTED,
    (R.PREEMPTED, "request_resumed"): R.WAITING,
    (R.RUNNING, "request_finished"): GONE,
    (R.WAITING, "request_aborted"): GONE,
    (R.RUNNING, "request_aborted"): GONE,
    (R.PREEMPTED, "request_aborted"): GONE,
    (R.LOADING, "request_aborted"): R.ABORTING,
    (R.LOADING, "load_ended"): R.RUNNING,
    (R.ABORTING, "load_ended"): GONE,
    (R.LOADING, "load_failed+recompute"): R.WAITING,  # several groups, or no valid token left
    (R.ABORTING, "load_failed+recompute"): GONE,  # aborted: the outcome no longer matters
}

# Slot moves, keyed by (state, action). A slot leaves the index (stops being
# offered) on eviction, failure or reset, but is freed only when no job still
# reads or writes it. Each action has one row: `engine/slots.py` relies on it.
SLOT_MOVES: dict[tuple[S, str], S] = {
    (S.FREE, "store_planned"): S.STORING,
    (S.STORING, "store_succeeded"): S.STORED,
    (S.STORING, "store_failed"): S.FREE,
    (S.STORING, "store_ended_stale"): S.FREE,
    (S.STORED, "load_planned"): S.STORED,  # load count + 1
    (S.STORED, "load_ended"): S.STORED,  # load count - 1
    (S.STORED, "evicted"): S.FREE,  # only with load count 0
    (S.STORED, "released_orphan"): S.FREE,  # dropped from the index earlier, last load ended
}

# A key's moves in one lower tier, keyed by (state, action). Its tier never
# holds a key twice: a spill is planned only for an absent key, and a key
# found there (at start, or by a lookup) changes something only when absent. A read
# (a load promoting the key through a host slot) keeps it held and counts;
# eviction takes only keys no read counts. A reset removes what is held at
# once and a key being written when its stale spill ends; a read ending
# after its key was removed changes nothing.
TIER_KEY_MOVES: dict[tuple[K, str], K] = {
    (K.ABSENT, "spill_planned"): K.WRITING,
    (K.WRITING, "spill_written"): K.HELD,
    (K.WRITING, "spill_failed"): K.ABSENT,  # any partial copy removed
    (K.WRITING, "reset"): K.WRITING,  # removed when its spill ends, stale
    (K.WRITING, "spill_ended_stale"): K.ABSENT,
    (K.ABSENT, "found"): K.HELD,
    (K.WRITING, "found"): K.WRITING,  # already known: nothing changes
    (K.HELD, "found"): K.HELD,
    (K.HELD, "read_planned"): K.HELD,  # read count + 1
    (K.HELD, "read_ended"): K.HELD,  # read count - 1; most recently used
    (K.HELD, "read_failed"): K.ABSENT,  # a damaged copy is removed
    (K.ABSENT, "read_ended"): K.ABSENT,  # removed by a reset while read
    (K.ABSENT, "read_failed"): K.ABSENT,
    (K.HELD, "evicted"): K.ABSENT,  # only with read count 0
    (K.HELD, "reset"): K.ABSENT,
}

# A transfer's life: started by the reducer (a store, a load, a spill), ended
# by its last worker's report. A report from a worker that already reported,
# or for a job not in flight, is a protocol violation (no row). Only a store
# is flushed; a reset makes any job stale (its outcome no longer counts)
# without changing its stage.
JOB_MOVES: dict[tuple[J | None, str], J | None] = {
    (None, "started"): J.IN_FLIGHT,
    (J.IN_FLIGHT, "worker_reported"): J.IN_FLIGHT,  # other workers still to report
    (J.IN_FLIGHT, "last_worker_reported"): GONE,
    (J.IN_FLIGHT, "flushed"): J.FLUSHED,
    (J.FLUSHED, "worker_reported"): J.FLUSHED,
    (J.FLUSHED, "last_worker_reported"): GONE,
    (J.IN_FLIGHT, "reset"): J.IN_FLIGHT,
    (J.FLUSHED, "reset"): J.FLUSHED,
}


def sources(moves: dict, action: str) -> frozenset:
    """The states an action may start from, in one of the tables."""
    return frozenset(state for state, act in moves if act == action)


def request_move(status: R | None, kind: str) -> tuple[bool, R | None]:
    """(legal, next status)."""
    key = (status, kind)
    if key in REQUEST_MOVES:
        return True, REQUEST_MOVES[key]
    return False, status


def slot_move(state: S, action: str) -> S:
    return SLOT_MOVES[(state, action)]


def tier_key_move(state: K, action: str) -> K:
    return TIER_KEY_MOVES[(state, action)]


def job_move(stage: J | None, action: str) -> J | None:
    return JOB_MOVES[(stage, action)]


# A job's moves, their targets read from the table once, here (a constant per move, as the
# slots' are). A report from a worker that others still owe, and a reset, leave a job in its
# stage (their rows, asserted), so those moves set nothing; the last report ends it, gone.
def _stage_after(stage: J | None, action: str) -> J:
    after = JOB_MOVES[(stage, action)]
    assert after is not None, (stage, action)
    return after


_STARTED: Final = _stage_after(None, "started")
_FLUSHED: Final = _stage_after(J.IN_FLIGHT, "flushed")
assert all(JOB_MOVES[(stage, "worker_reported")] is stage for stage in J)
assert all(JOB_MOVES[(stage, "reset")] is stage for stage in J)
assert all(JOB_MOVES[(stage, "last_worker_reported")] is GONE for stage in J)


def start_job(job: Job) -> None:
    """A job begins its life as `JOB_MOVES` says: the reducer's, admission's and the lower tiers' jobs alike."""
    job.stage = _STARTED


def flush_job(job: Job) -> None:
    """An in-flight store the worker waits for before the step's forward (`flushed`)."""
    job.stage = _FLUSHED


def moves_by_kind(moves: dict[tuple[R | None, str], R | None]) -> dict[str, dict[R | None, R | None]]:
    """`REQUEST_MOVES` regrouped by kind, {kind: {status before: status after}}: the reducer's lookup."""
    by_kind: dict[str, dict[R | None, R | None]] = {}
    for (status, kind), target in moves.items():
        by_kind.setdefault(kind, {})[status] = target
    return by_kind


def steppable(moves: dict[tuple[R | None, str], R | None]) -> tuple[R, ...]:
    """The statuses a step may schedule (those with a `step_scheduled` move): a
    request's `step_limit` is -1 outside them, which is how a step checks status."""
    return tuple(status for (status, kind) in moves if kind == "step_scheduled" and status is not None)


STEPPABLE = steppable(REQUEST_MOVES)
# The statuses a request is admitted from (a preempted one once resumed): an allocation in
# any other is a running request's growth.
ADMITTABLE = (R.WAITING, R.PREEMPTED)
assert {s for (s, kind), t in REQUEST_MOVES.items() if kind.startswith("blocks_allocated") and s is not t} <= set(
    ADMITTABLE)
