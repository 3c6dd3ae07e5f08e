"""The small interface every copy backend offers the runner.

A backend moves bytes for jobs that already passed the runner's checks and
reports, per job, which (group, index) positions failed. It knows nothing of
keys or events; the runner turns outcomes into events. Backends never raise
for a failed copy: the failure is an outcome. They raise only for a wait
that ran out of time, or a submit after shutdown.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable
from typing import Protocol

import attrs

Positions = tuple[tuple[int, int], ...]
"""(group, index) pairs into a job's per-group id tuples."""


class Direction(enum.Enum):
    STORE = "store"  # device blocks -> tier slots
    LOAD = "load"  # tier slots -> device blocks


class TransferTimeout(TimeoutError):
    """A bounded wait for copies ran out of time."""


def wait_all(done: Iterable[tuple[int, threading.Event | None]], timeout_s: float, what: str) -> None:
    """Wait for each job's event ((job id, event); None: finished or unknown) under one
    deadline for them all; `TransferTimeout` names the first job still running at it."""
    deadline = time.monotonic() + timeout_s
    for job_id, event in done:
        if event is not None and not event.wait(max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(f"{what} {job_id} did not finish within {timeout_s:.3g} s")


def join_all(threads: Iterable[threading.Thread], timeout_s: float, what: str) -> None:
    """Join each thread under one deadline for them all; `TransferTimeout` names the first still alive."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise TransferTimeout(f"{what} {thread.name} did not stop within {timeout_s:.3g} s")


class BackendClosed(RuntimeError):
    """The backend was shut down and takes no more jobs."""


def _id_table(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in ids) for ids in value)


@attrs.frozen(kw_only=True)
class CopyJob:
    """Per group g: block `block_ids[g][i]` pairs with slot `slot_ids[g][i]`."""

    job_id: int
    direction: Direction
    block_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=_id_table)
    slot_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=_id_table)

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids in self.block_ids)

    def positions(self) -> Positions:
        return tuple((g, i) for g, ids in enumerate(self.block_ids) for i in range(len(ids)))

    def without(self, drop: set[tuple[int, int]]) -> tuple[CopyJob, tuple[tuple[int, ...], ...]]:
        """This job minus `drop`, and for each group the original index of each kept entry."""
        kept = tuple(tuple(i for i in range(len(ids)) if (g, i) not in drop) for g, ids in enumerate(self.block_ids))
        job = attrs.evolve(
            self,
            block_ids=[[self.block_ids[g][i] for i in idx] for g, idx in enumerate(kept)],
            slot_ids=[[self.slot_ids[g][i] for i in idx] for g, idx in enumerate(kept)],
        )
        return job, kept


@attrs.frozen(kw_only=True)
class JobOutcome:
    job_id: int
    direction: Direction
    failed: Positions = ()
    error: str = ""
    seconds: float = 0.0
    """Copy time the backend measured (for metrics); 0.0 when it did not run."""

    @property
    def ok(self) -> bool:
        return not self.failed


class CopyBackend(Protocol):
    def submit(self, job: CopyJob) -> None:
        """Start the copies; returns before they finish."""

    def poll(self) -> list[JobOutcome]:
        """Outcomes of jobs that finished since the last poll; never blocks."""

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """Block until these jobs finished (unknown ids count as finished)."""

    def order_after(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """Make device work the caller queues from now on start after these
        jobs end. A backend with streams does it on the device, without
        blocking the host; one without streams waits."""

    def shutdown(self, *, drain: bool, timeout_s: float) -> None:
        """Finish (drain) or cancel queued jobs, then release threads and streams."""
