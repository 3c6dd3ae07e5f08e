"""A tier job's blocks as they finish, on any I/O thread: what `FsTierIO` and
`ValkeyTierIO` share. Errors are per block and end as failed positions of the
job's outcome, never as exceptions: the caller drops a key that failed to
read and recomputes it."""

from __future__ import annotations

import collections
import threading

import attrs
import structlog

_log = structlog.get_logger("kvledger.transfers.tier_io")


@attrs.frozen
class TierIoOutcome:
    job_id: int
    kind: str  # "write" (host slots -> tier) or "read" (tier -> host slots)
    failed: tuple[tuple[int, int], ...]  # (group, index) positions, sorted
    reasons: tuple[str, ...]  # per failed position: a BlockFileError reason, or "cancelled"
    seconds: float  # from the start of the first block's I/O to the end of the last
    nbytes: int  # payload bytes of the positions that succeeded

    @property
    def ok(self) -> bool:
        return not self.failed


class TierJob:
    """A job's count of blocks still under way. `settle` is called under the
    I/O object's lock, once per block; the last call returns the outcome."""

    __slots__ = ("job_id", "kind", "total", "remaining", "failed", "nbytes", "started", "ended", "done")

    def __init__(self, job_id: int, kind: str, total: int) -> None:
        self.job_id = job_id
        self.kind = kind
        self.total = total
        self.remaining = total
        self.failed: list[tuple[int, int, str, str]] = []  # group, index, reason, where (a path, a key)
        self.nbytes = 0
        self.started = float("inf")
        self.ended = float("-inf")
        self.done = threading.Event()

    def settle(self, g: int, i: int, reason: str | None, where: str, nbytes: int,
               span: tuple[float, float] | None) -> TierIoOutcome | None:
        if reason is None:
            self.nbytes += nbytes
        else:
            self.failed.append((g, i, reason, where))
        if span is not None:
            self.started = min(self.started, span[0])
            self.ended = max(self.ended, span[1])
        self.remaining -= 1
        if self.remaining:
            return None
        self.failed.sort()
        return TierIoOutcome(
            job_id=self.job_id, kind=self.kind, failed=tuple((f[0], f[1]) for f in self.failed),
            reasons=tuple(f[2] for f in self.failed),
            seconds=self.ended - self.started if self.ended >= self.started else 0.0, nbytes=self.nbytes)

    def finished(self, outcome: TierIoOutcome) -> None:
        """After the outcome is handed over, outside the lock: wake waiters, log failures."""
        self.done.set()
        if self.failed:
            _log.warning("tier_io_failed", job_id=self.job_id, kind=self.kind, blocks=self.total,
                         failed=len(self.failed), reasons=dict(collections.Counter(outcome.reasons)),
                         first_failed=self.failed[0][3])
