"""Fault injection around any copy backend.

Failing mode: chosen jobs, chosen device blocks, or a seeded random share of
jobs or blocks fail. Failed positions are taken out of the job before the
inner backend sees it, so their destination keeps its old bytes, as after a
real failed read, and the outcome names exactly those positions.

Corrupt mode (loads only): the chosen blocks load normally and then have
every payload byte flipped, and the job reports success. End-to-end tests
use it as a negative control: if output does not change, the restored KV
was never read.

Choices come from `random.Random(seed)` in submission order, so a run
replays exactly from its seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import attrs
import structlog
import torch

from kvledger.transfers.copies.backend import CopyBackend, CopyJob, Direction, JobOutcome
from kvledger.transfers.copies.layout import CanonicalKVCaches

_log = structlog.get_logger("kvledger.transfers.faults")


def _frozen_ints(value: Iterable[int]) -> frozenset[int]:
    return frozenset(int(v) for v in value)


def _directions(value: Iterable[Direction | str]) -> frozenset[Direction]:
    return frozenset(Direction(v) for v in value)


@attrs.frozen(kw_only=True)
class FaultPlan:
    """Which copies go wrong. A job or block matches if any rule picks it."""

    job_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_frozen_ints)
    block_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_frozen_ints)
    job_rate: float = 0.0
    block_rate: float = 0.0
    seed: int = 0
    corrupt: bool = False
    directions: frozenset[Direction] = attrs.field(
        default=frozenset(Direction), converter=_directions
    )

    def __attrs_post_init__(self) -> None:
        for name in ("job_rate", "block_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {rate}")


class FaultInjectingBackend:
    def __init__(self, inner: CopyBackend, plan: FaultPlan, layout: CanonicalKVCaches | None = None) -> None:
        if plan.corrupt and layout is None:
            raise ValueError("corrupt mode needs the canonical layout to reach device blocks")
        self._inner = inner
        self._plan = plan
        self._layout = layout
        self._random = random.Random(plan.seed)
        self._ready: list[JobOutcome] = []
        self._dropped: dict[int, tuple[frozenset[tuple[int, int]], tuple[tuple[int, ...], ...]]] = {}
        self._to_corrupt: dict[int, tuple[tuple[int, ...], ...]] = {}

    def _choose(self, job: CopyJob) -> set[tuple[int, int]]:
        plan = self._plan
        whole = job.job_id in plan.job_ids
        if plan.job_rate and self._random.random() < plan.job_rate:
            whole = True
        chosen = set()
        for g, ids in enumerate(job.block_ids):
            for i, block_id in enumerate(ids):
                hit = whole or block_id in plan.block_ids
                if plan.block_rate and self._random.random() < plan.block_rate:
                    hit = True
                if hit:
                    chosen.add((g, i))
        return chosen

    def submit(self, job: CopyJob) -> None:
        if job.direction not in self._plan.directions:
            self._inner.submit(job)
            return
        chosen = self._choose(job)
        if not chosen:
            self._inner.submit(job)
        elif self._plan.corrupt:
            if job.direction is Direction.LOAD:
                self._to_corrupt[job.job_id] = tuple(
                    tuple(ids[i] for i in range(len(ids)) if (g, i) in chosen) for g, ids in enumerate(job.block_ids)
                )
            self._inner.submit(job)
        else:
            _log.info("fault_injected", job_id=job.job_id, direction=job.direction.value, positions=len(chosen))
            kept_job, kept = job.without(chosen)
            failed = tuple(sorted(chosen))
            if not kept_job.positions():
                self._ready.append(
                    JobOutcome(job_id=job.job_id, direction=job.direction, failed=failed, error="injected fault")
                )
            else:
                self._dropped[job.job_id] = (frozenset(chosen), kept)
                self._inner.submit(kept_job)

    def poll(self) -> list[JobOutcome]:
        outcomes, self._ready = self._ready, []
        for outcome in self._inner.poll():
            outcomes.append(self._finish(outcome))
        return outcomes

    def _finish(self, outcome: JobOutcome) -> JobOutcome:
        if outcome.ok:
            self._corrupt(outcome.job_id)
        self._to_corrupt.pop(outcome.job_id, None)
        dropped = self._dropped.pop(outcome.job_id, None)
        if dropped is None:
            return outcome
        chosen, kept = dropped
        failed = set(chosen) | {(g, kept[g][i]) for g, i in outcome.failed}
        return attrs.evolve(outcome, failed=tuple(sorted(failed)), error=outcome.error or "injected fault")

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        job_ids = list(job_ids)
        self._inner.wait(job_ids, timeout_s)
        for job_id in job_ids:
            self._corrupt(job_id)

    def order_after(self, job_ids: Iterable[int], timeout_s: float) -> None:
        self._inner.order_after(job_ids, timeout_s)

    def _corrupt(self, job_id: int) -> None:
        """Flip the bytes of a finished load's chosen blocks, once."""
        blocks_by_group = self._to_corrupt.pop(job_id, None)
        if blocks_by_group is None:
            return
        assert self._layout is not None
        for group, blocks in enumerate(blocks_by_group):
            if not blocks:
                continue
            ids = torch.tensor(blocks, dtype=torch.long, device=self._layout.device)
            for span in self._layout.group_spans[group]:
                view = self._layout.span_view(span)
                view.index_copy_(0, ids, view.index_select(0, ids).bitwise_not())
        _log.info("load_corrupted", job_id=job_id, blocks=sum(len(b) for b in blocks_by_group))

    def shutdown(self, *, drain: bool, timeout_s: float) -> None:
        self._inner.shutdown(drain=drain, timeout_s=timeout_s)


class DelayingBackend:
    """Holds jobs of one direction back for `polls` polls before they start.

    A slow transfer, made on purpose: a store that outlives the reuse of its
    source block is exactly what the flush protocol exists for, and on a CPU
    copies finish too fast for end-to-end tests to meet one otherwise. A
    held job waited for starts at once, as a flush makes it.
    """

    def __init__(self, inner: CopyBackend, direction: Direction, polls: int) -> None:
        self._inner = inner
        self._direction = direction
        self._polls = polls
        self._held: dict[int, tuple[CopyJob, int]] = {}

    def submit(self, job: CopyJob) -> None:
        if job.direction is self._direction and self._polls > 0:
            self._held[job.job_id] = (job, self._polls)
        else:
            self._inner.submit(job)

    def _release(self, job_id: int) -> None:
        job, _ = self._held.pop(job_id)
        self._inner.submit(job)

    def poll(self) -> list[JobOutcome]:
        for job_id, (job, left) in list(self._held.items()):
            if left <= 1:
                self._release(job_id)
            else:
                self._held[job_id] = (job, left - 1)
        return self._inner.poll()

    def _started(self, job_ids: Iterable[int]) -> list[int]:
        """Start the held ones among these jobs now, as a flush makes them."""
        job_ids = list(job_ids)
        for job_id in job_ids:
            if job_id in self._held:
                self._release(job_id)
        return job_ids

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        self._inner.wait(self._started(job_ids), timeout_s)

    def order_after(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """A held job is started first, as for a wait: the order is on what runs."""
        self._inner.order_after(self._started(job_ids), timeout_s)

    def shutdown(self, *, drain: bool, timeout_s: float) -> None:
        for job_id in list(self._held):
            self._release(job_id)  # the inner backend drains or cancels them with the rest
        self._inner.shutdown(drain=drain, timeout_s=timeout_s)
