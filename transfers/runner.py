"""The effect runner: performs the worker's effects (`StartStore`,
`StartLoad`, `FlushStores`, and on tiers below host memory `StartSpill` and
`DropTierKeys`: the worker phases of `engine.effects.ROUTES`). A load that
promotes keys from a lower tier reads them into their host slots first
(`tier_jobs`), then copies what was read to the device.

The engine describes work; this is where it happens. Outcomes come back as
events from `poll()`, never as callbacks, one per job, carrying this
worker's index. Nothing that goes wrong in a copy escapes as an exception:
a failed precondition or copy is a failure event. The only exceptions are
for waits that run out of time, because then the caller cannot go on
safely (a forward would read blocks still being written). A load that is
polled rather than waited for and outlives `load_timeout_s` fails (its
request is recomputed); device work queued later is ordered after its
copy, so a late copy cannot overwrite the recomputed blocks. So does a
promotion whose tier reads outlive it; the host slots such a read may still
write fail every job until it ends (`LowerTierJobs.quarantined`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import attrs
import structlog

from kvledger.engine.effects import (
    ROUTES,
    WORKER_PHASES,
    DropTierKeys,
    Effect,
    FlushStores,
    StartLoad,
    StartSpill,
    StartStore,
)
from kvledger.events.keys import hex_keys
from kvledger.events.types import StoreFailed, TransferEvent, transfer_report
from kvledger.transfers.copies.backend import CopyBackend, CopyJob, Direction, JobOutcome, TransferTimeout
from kvledger.transfers.lower_tiers.tier_jobs import LowerTierJobs, Position, TierIO, TierStat
from kvledger.transfers.preconditions import Limits, precondition_error

_log = structlog.get_logger("kvledger.transfers.runner")


@attrs.frozen
class TransferStat:
    """One finished job, for metrics: blocks moved per group and the copy time."""

    direction: Direction
    blocks_per_group: tuple[int, ...]
    seconds: float
    ok: bool


@attrs.frozen
class _Job:
    effect: StartStore | StartLoad
    copy: CopyJob
    kept: tuple[tuple[int, ...], ...] | None = None  # a promoted load's copy skips what failed to read
    failed: frozenset[Position] = frozenset()  # positions that failed before the copy
    started_s: float = 0.0  # when the copy was submitted, on the runner's clock
    reason: str = ""  # why the positions before the copy failed (a lower tier's read)


class TransferRunner:
    def __init__(
        self,
        backend: CopyBackend,
        *,
        num_groups: int,
        num_device_blocks: int,
        num_slots: int,
        worker_index: int = 0,
        timeout_s: float = 60.0,
        load_timeout_s: float = 30.0,
        lower_tiers: Mapping[int, TierIO] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`timeout_s` bounds waits; `load_timeout_s` (0: none) bounds a
        polled load's tier reads, and its device copy."""
        self._backend = backend
        self._lower = LowerTierJobs(lower_tiers or {}, num_slots, worker_index, read_timeout_s=load_timeout_s,
                                    clock=clock)
        self._limits = Limits(num_groups=num_groups, num_device_blocks=num_device_blocks, num_slots=num_slots)
        self.worker_index = worker_index
        self.timeout_s = timeout_s
        self.load_timeout_s = load_timeout_s
        self._clock = clock
        self._jobs: dict[int, _Job] = {}
        self._abandoned: set[int] = set()  # loads failed by timeout whose copy may still end
        self._ready: list[TransferEvent] = []
        self._stats: list[TransferStat] = []
        self._closed = False
        self._suspended = False  # vLLM's KV cache memory is unmapped (sleep): no device copy may run

    @property
    def backend(self) -> CopyBackend:
        """The backend the runner drives (fault injection included)."""
        return self._backend

    @property
    def in_flight(self) -> frozenset[int]:
        """Jobs started whose completion event has not been returned yet."""
        return frozenset(self._jobs) | self._lower.in_flight

    def submit(self, effects: Iterable[Effect]) -> None:
        """Run worker effects in order. Any other kind is a routing bug, refused by name."""
        for effect in effects:
            run = _RUN.get(type(effect))
            if run is None:
                raise TypeError(f"{type(effect).__name__} is not a worker effect (its route is "
                                f"{ROUTES.get(type(effect))}); the runner carries out only "
                                f"{sorted(kind.__name__ for kind in _RUN)}")
            run(self, effect)

    def _flush(self, effect: FlushStores) -> None:
        self.wait(effect.job_ids, what="flush of stores")

    def _spill(self, effect: StartSpill) -> None:
        failed = self._lower.spill(effect) if not self._closed else StoreFailed(
            job_id=effect.job_id, worker_index=self.worker_index, keys=tuple(k for g in effect.keys for k in g),
            reason="rejected")
        if failed is not None:
            self._ready.append(failed)

    def _drop(self, effect: DropTierKeys) -> None:
        if not self._closed:
            self._lower.drop(effect)

    def _start(self, effect: StartStore | StartLoad) -> None:
        if self._closed:
            self._reject(effect, "the runner was shut down")
            return
        if self._suspended:
            self._reject(effect, _ASLEEP)
            return
        if effect.job_id in self._jobs or effect.job_id in self._lower:
            # The running job keeps going and reports too: two events for one id
            # let the engine see its own protocol error rather than lose a job.
            self._reject(effect, f"job {effect.job_id} is already in flight")
            return
        problem = precondition_error(effect, self._limits) or self._quarantine_problem(effect)
        if problem is not None:
            self._reject(effect, problem)
            return
        if isinstance(effect, StartLoad) and effect.promote_tiers:
            failed = self._lower.promote(effect)
            if failed is not None:  # nothing to read: copy what needs no promotion
                self._copy(effect, failed, "rejected")
            return
        self._copy(effect, set())

    def _quarantine_problem(self, effect: StartStore | StartLoad) -> str | None:
        """A job on a host slot that a timed-out tier read may still write fails:
        its bytes could change under it."""
        held = self._lower.quarantined
        if not held:
            return None
        slots = effect.target_slot_ids if isinstance(effect, StartStore) else effect.source_slot_ids
        stray = sorted({s for group in slots for s in group} & held)
        if not stray:
            return None
        return f"host slot(s) {stray[:8]} may still be written by a tier read that timed out"

    def _copy(self, effect: StartStore | StartLoad, failed: set[Position], reason: str = "") -> None:
        """Start the device copy of every position but the `failed` ones (failed for `reason`)."""
        if isinstance(effect, StartStore):
            direction, blocks, slots = Direction.STORE, effect.source_block_ids, effect.target_slot_ids
        else:
            direction, blocks, slots = Direction.LOAD, effect.target_block_ids, effect.source_slot_ids
        # A promoted key with no host slot (-1) is always among `failed`: `without` drops it.
        copy = CopyJob(job_id=effect.job_id, direction=direction, block_ids=blocks, slot_ids=slots)
        kept = None
        if failed:
            copy, kept = copy.without(failed)
            if not copy.num_blocks:
                self._ready.append(self._event(effect, JobOutcome(
                    job_id=effect.job_id, direction=direction, failed=tuple(sorted(failed)),
                    error="no block could be read from a lower tier"), reason))
                return
        try:
            self._backend.submit(copy)
        except Exception as exc:
            self._reject(effect, f"the copy backend refused the job: {exc!r}")
            return
        self._jobs[effect.job_id] = _Job(effect, copy, kept, frozenset(failed), self._clock(), reason)

    def _reject(self, effect: StartStore | StartLoad, problem: str) -> None:
        """Every block of a job that never ran has failed."""
        keys = tuple(k for group in effect.keys for k in group)
        _log.warning(
            "transfer_rejected",
            job_id=effect.job_id,
            request_id=effect.request_id,
            kind=type(effect).__name__,
            keys=hex_keys(keys),
            problem=problem,
        )
        load = not isinstance(effect, StartStore)
        blocks = tuple(b for group in effect.target_block_ids for b in group) if load else ()
        self._ready.append(transfer_report(effect.job_id, self.worker_index, load=load, failed=True,
                                           block_ids=blocks, keys=keys, reason="rejected"))

    def poll(self) -> list[TransferEvent]:
        """Completion events since the last poll, in the order jobs finished."""
        if not (self._jobs or self._ready or self._abandoned or self._lower.active):
            return []  # vLLM asks every step; most steps have no job in flight
        spilled, promoted = self._lower.poll()
        self._ready.extend(spilled)
        for effect, failed, reason in promoted:
            if self._closed:
                self._reject(effect, "the runner was shut down")
            elif self._suspended:
                self._reject(effect, _ASLEEP)
            else:
                self._copy(effect, failed, reason)
        events, self._ready = self._ready, []
        for outcome in self._backend.poll():
            job = self._jobs.pop(outcome.job_id, None)
            if job is None:
                if outcome.job_id in self._abandoned:
                    self._abandoned.discard(outcome.job_id)
                    _log.info("timed_out_load_ended", job_id=outcome.job_id, ok=outcome.ok)
                else:
                    _log.warning("unknown_job_outcome", job_id=outcome.job_id)
                continue
            outcome = _in_own_positions(job, outcome)
            moved = [len(ids) for ids in job.effect.keys]
            for g, _ in outcome.failed:
                moved[g] -= 1
            self._stats.append(TransferStat(outcome.direction, tuple(moved), outcome.seconds, outcome.ok))
            if not outcome.ok:
                _log.error(
                    "transfer_failed",
                    job_id=outcome.job_id,
                    worker_index=self.worker_index,
                    request_id=job.effect.request_id,
                    direction=outcome.direction.value,
                    failed=len(outcome.failed),
                    keys=hex_keys(job.effect.keys[g][i] for g, i in outcome.failed),
                    error=outcome.error,
                )
            events.append(self._event(job.effect, outcome, _failure(job, outcome)))
        events.extend(self._time_out_loads())
        return events

    def _time_out_loads(self) -> list[TransferEvent]:
        """Fail the loads whose copy outlived `load_timeout_s`, and order later
        device work after their copies (on CUDA, without blocking the host)."""
        if not self.load_timeout_s:
            return []
        now = self._clock()
        late = [job for job in self._jobs.values()
                if isinstance(job.effect, StartLoad) and now - job.started_s > self.load_timeout_s]
        events = []
        for job in late:
            del self._jobs[job.effect.job_id]
            self._abandoned.add(job.effect.job_id)
            _log.error("load_timed_out", job_id=job.effect.job_id, request_id=job.effect.request_id,
                       timeout_s=self.load_timeout_s, effect="the request is recomputed")
            try:
                self._backend.order_after([job.effect.job_id], 0.0)
            except TransferTimeout:  # a host-memory backend cannot order a copy that is still running
                _log.error("timed_out_load_still_running", job_id=job.effect.job_id)
            outcome = JobOutcome(job_id=job.effect.job_id, direction=Direction.LOAD, failed=job.copy.positions(),
                                 error=f"no outcome within {self.load_timeout_s:.3g} s")
            outcome = _in_own_positions(job, outcome)
            self._stats.append(TransferStat(Direction.LOAD, tuple(0 for _ in job.effect.keys), 0.0, False))
            events.append(self._event(job.effect, outcome, "timed_out"))
        return events

    def take_stats(self) -> list[TransferStat]:
        """Jobs that finished since the last call (polled ones only)."""
        stats, self._stats = self._stats, []
        return stats

    def take_tier_stats(self) -> list[TierStat]:
        """Lower-tier reads and writes that finished since the last call."""
        return self._lower.take_stats()

    def _event(self, effect: StartStore | StartLoad, outcome: JobOutcome, reason: str = "") -> TransferEvent:
        job_id, worker = effect.job_id, self.worker_index
        keys = tuple(effect.keys[g][i] for g, i in outcome.failed)
        reason = reason if not outcome.ok else ""
        if isinstance(effect, StartStore):
            return transfer_report(job_id, worker, load=False, failed=not outcome.ok, keys=keys, reason=reason)
        blocks = tuple(effect.target_block_ids[g][i] for g, i in outcome.failed)
        return transfer_report(job_id, worker, load=True, failed=not outcome.ok, block_ids=blocks, keys=keys,
                               reason=reason)

    def wait_loads(self, timeout_s: float) -> None:
        """Block, up to `timeout_s` and without raising, until every load in
        flight has ended: its promotions' reads, then its device copy, which
        starts here rather than at the next `poll`. For a step with nothing to
        compute: vLLM steps again at once while loads are in flight, and those
        empty steps would take the interpreter from the tiers' I/O threads for
        nothing. The outcomes come with the next `poll`."""
        deadline = time.monotonic() + timeout_s
        if not self._lower.wait_reads(deadline):
            return
        self._ready = self.poll()  # the promotions' copies start; what ended so far waits for the next poll
        copies = tuple(job_id for job_id, job in self._jobs.items() if isinstance(job.effect, StartLoad))
        remaining = deadline - time.monotonic()
        if copies and remaining > 0:
            try:
                self._backend.wait(copies, remaining)
            except TransferTimeout:
                pass

    def wait(self, job_ids: Iterable[int], timeout_s: float | None = None, what: str = "jobs") -> None:
        """Block until these jobs finished (a flush of stores, or loads a caller must see done)."""
        self._bounded(self._backend.wait, job_ids, self.timeout_s if timeout_s is None else timeout_s,
                      f"waiting for {what}")

    def _bounded(self, call: Callable[[tuple[int, ...], float], None], job_ids: Iterable[int], timeout_s: float,
                 what: str) -> None:
        """A backend wait or ordering; running out of time is logged and raised, naming the jobs."""
        job_ids = tuple(job_ids)
        try:
            call(job_ids, timeout_s)
        except TransferTimeout as exc:
            _log.error("transfer_wait_timed_out", what=what, job_ids=job_ids, timeout_s=timeout_s)
            raise TransferTimeout(f"{what} {list(job_ids)} timed out: {exc}") from exc

    @property
    def suspended(self) -> bool:
        return self._suspended

    def suspend(self, timeout_s: float | None = None) -> None:
        """vLLM is about to unmap its KV cache (sleep). Every device copy started
        ends first; until `resume`, a device copy asked for fails without running
        (its load is recomputed, its store is not offered), and so does a promotion
        whose tier read ends meanwhile. Lower-tier reads and writes go on: they
        touch host memory only. Outcomes are polled as usual. Idempotent."""
        self._suspended = True
        # A load failed by its timeout may still be copying: it is waited for too.
        self.wait((*self._jobs, *self._abandoned), timeout_s, what="device copies before the KV cache is unmapped")

    def resume(self) -> None:
        """vLLM mapped its KV cache back, at the same addresses. Idempotent."""
        self._suspended = False

    def order_after(self, job_ids: Iterable[int]) -> None:
        """Device work queued from now on runs after these jobs (see `CopyBackend.order_after`)."""
        self._bounded(self._backend.order_after, job_ids, self.timeout_s, "ordering after jobs")

    def shutdown(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Finish (drain) or cancel outstanding copies; `poll()` still returns their events."""
        if self._closed:
            return
        self._closed = True
        self._lower.shutdown(drain=drain, timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        self._backend.shutdown(drain=drain, timeout_s=self.timeout_s if timeout_s is None else timeout_s)


def _in_own_positions(job: _Job, outcome: JobOutcome) -> JobOutcome:
    """A promoted load's copy skipped the positions whose tier read failed:
    its outcome's positions, back in the load's own, with those added."""
    if job.kept is None:
        return outcome
    mapped = {(g, job.kept[g][i]) for g, i in outcome.failed}
    return attrs.evolve(outcome, failed=tuple(sorted(mapped | job.failed)))


_ASLEEP = "vLLM's KV cache is unmapped (asleep): unregister_kv_caches came before this job"

# Every worker effect (the worker phases of `engine.effects.ROUTES`) and what carries it out.
_RUN = {StartStore: TransferRunner._start, StartLoad: TransferRunner._start, FlushStores: TransferRunner._flush,
        StartSpill: TransferRunner._spill, DropTierKeys: TransferRunner._drop}
assert set(_RUN) == {kind for kind, phase in ROUTES.items() if phase in WORKER_PHASES}, \
    "the runner must carry out every worker effect, and only those"


def _failure(job: _Job, outcome: JobOutcome) -> str:
    """Why a copy's outcome failed: a lower tier's read for the positions it failed before
    the copy, else the copy itself."""
    if outcome.ok:
        return ""
    if job.failed and job.reason and any(position in job.failed for position in outcome.failed):
        return job.reason
    return "rejected" if outcome.error == "cancelled" else "copy_failed"  # cancelled: shut down undrained
