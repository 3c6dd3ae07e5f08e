"""What `FsTierIO` and `ValkeyTierIO` share: jobs checked and queued for a
pool of I/O threads, a job's blocks settled as they finish on any thread, and
outcomes polled. Errors are per block and end as failed positions of the
job's outcome, never as exceptions: the caller drops a key that failed to
read and recomputes it."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from typing import Any

import attrs
import structlog
import torch

from kvledger.engine.effects import IdsByGroup, KeysByGroup
from kvledger.transfers.copies.backend import BackendClosed, join_all, wait_all
from kvledger.transfers.lower_tiers.block_errors import report_reason
from kvledger.transfers.lower_tiers.block_header import KEY_BYTES_MAX

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

    @property
    def reason(self) -> str:
        """The job's failure in one word for its report (`events.types.FAILURE_REASONS`): its
        blocks' most common reason ("" when none failed)."""
        return report_reason(self.reasons)


class TierJob:
    """A job's count of blocks still under way. `settle` is called under the
    I/O object's lock, for a block or a batch; the last call returns the outcome."""

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

    def settle(self, failed: list[tuple[int, int, str, str]], done: int, nbytes: int,
               span: tuple[float, float] | None) -> TierIoOutcome | None:
        """`done` blocks ended well (`nbytes` of payload between them), and `failed`
        ones, as (group, index, reason, where), did not."""
        self.failed.extend(failed)
        self.nbytes += nbytes
        if span is not None:
            self.started = min(self.started, span[0])
            self.ended = max(self.ended, span[1])
        self.remaining -= done + len(failed)
        if self.remaining:
            return None
        self.failed.sort()
        return TierIoOutcome(
            job_id=self.job_id, kind=self.kind, failed=tuple((f[0], f[1]) for f in self.failed),
            reasons=tuple(f[2] for f in self.failed),
            seconds=self.ended - self.started if self.ended >= self.started else 0.0, nbytes=self.nbytes)

    def finished(self, outcome: TierIoOutcome) -> None:
        """After the outcome is handed over, outside the lock: log failures, then wake
        waiters (so a waiter finds the job's line already logged). A job that failed
        only as unreachable logs at debug: the tier logs going down and coming back
        once, where every job while down would log again."""
        if self.failed:
            log = _log.debug if all(reason == "unreachable" for reason in outcome.reasons) else _log.warning
            log("tier_io_failed", job_id=self.job_id, kind=self.kind, blocks=self.total,
                failed=len(self.failed), reasons=dict(collections.Counter(outcome.reasons)),
                first_failed=self.failed[0][3])
        self.done.set()


Block = tuple[int, int, bytes, int]  # group, index, key, slot


class ThreadedTierIO:
    """Moves blocks between `rows[slot, :payload_bytes[g]]` and a store, on
    `threads` threads. A subclass says how a job's blocks become queue items
    (`_items`), how a thread runs one (`_run`), and how a cancelled one ends
    (`_cancel`); it sets its own fields before calling `__init__`, which starts
    the threads."""

    what = "the tier"  # for messages

    def __init__(self, *, rows: torch.Tensor, payload_bytes: tuple[int, ...], threads: int, name: str) -> None:
        if rows.dim() != 2 or rows.dtype != torch.int8 or rows.device.type != "cpu" or not rows.is_contiguous():
            raise ValueError(f"rows must be a contiguous 2-D int8 CPU tensor, got {rows.dtype} {tuple(rows.shape)} "
                             f"on {rows.device}")
        if not payload_bytes or any(not 0 < n <= rows.shape[1] for n in payload_bytes):
            raise ValueError(f"payload_bytes {payload_bytes} must each be in [1, {rows.shape[1]}]")
        if threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")
        self.payload_bytes = tuple(int(n) for n in payload_bytes)
        self.rows = rows  # also keeps the memory under `_array` alive
        self._array = rows.numpy()
        self._cond = threading.Condition()
        self._queue: collections.deque[Any] = collections.deque()
        self._pending: dict[int, TierJob] = {}
        self._finished: list[TierIoOutcome] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"kvledger-{name}-{n}", daemon=True)
                         for n in range(threads)]
        for thread in self._threads:
            thread.start()

    # -- the caller's side -------------------------------------------------------------------------

    def write(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._submit(job_id, "write", keys, slot_ids)

    def read(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._submit(job_id, "read", keys, slot_ids)

    def _submit(self, job_id: int, kind: str, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._check(keys, slot_ids, kind)
        blocks = [(g, i, bytes(k), int(s)) for g, (ks, ss) in enumerate(zip(keys, slot_ids))
                  for i, (k, s) in enumerate(zip(ks, ss))]
        job = TierJob(job_id, kind, len(blocks))
        with self._cond:
            if self._closed:
                raise BackendClosed(f"{self.what} was shut down")
            if job_id in self._pending:
                raise ValueError(f"job {job_id} is already in flight")
            if not blocks:
                self._finished.append(TierIoOutcome(job_id, kind, (), (), 0.0, 0))
                return
            self._pending[job_id] = job
            items = self._items(job, blocks)
            self._queue.extend(items)
            self._cond.notify(len(items))

    def _check(self, keys: KeysByGroup, slot_ids: IdsByGroup, kind: str) -> None:
        """A malformed job is the caller's bug: refused whole, before any I/O. A
        read lands each block in its own slot: one slot named twice would be
        written by two blocks at once (a slot is a row, whatever the group)."""
        if len(keys) != len(self.payload_bytes) or len(slot_ids) != len(self.payload_bytes):
            raise ValueError(f"a job names {len(keys)} key groups and {len(slot_ids)} slot groups; "
                             f"this tier has {len(self.payload_bytes)} groups")
        num_slots = self._array.shape[0]
        for g, (ks, ss) in enumerate(zip(keys, slot_ids)):
            if len(ks) != len(ss):
                raise ValueError(f"group {g}: {len(ks)} keys for {len(ss)} slots")
            if any(not 0 < len(k) <= KEY_BYTES_MAX for k in ks):
                raise ValueError(f"group {g}: a key is 1 to {KEY_BYTES_MAX} bytes")
            if any(not 0 <= s < num_slots for s in ss):
                raise ValueError(f"group {g}: a slot is outside [0, {num_slots})")
        if kind == "read" and len(named := [s for ss in slot_ids for s in ss]) != len(set(named)):
            twice = next(s for s, n in collections.Counter(named).items() if n > 1)
            raise ValueError(f"a read names slot {twice} for two blocks")

    def poll(self) -> list[TierIoOutcome]:
        with self._cond:
            outcomes, self._finished = self._finished, []
        return outcomes

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """Unknown or finished ids count as finished."""
        wait_all(((job_id, self._done_event(job_id)) for job_id in job_ids), timeout_s, "tier job")

    def _done_event(self, job_id: int) -> threading.Event | None:
        with self._cond:
            job = self._pending.get(job_id)
        return None if job is None else job.done

    def shutdown(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Without `drain`, items not yet started are cancelled (`_cancel`);
        items under way finish either way."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            cancelled = [] if drain else list(self._queue)
            if not drain:
                self._queue.clear()
            self._queue.extend([None] * len(self._threads))
            self._cond.notify_all()
        for item in cancelled:
            self._cancel(item)
        join_all(self._threads, timeout_s, "tier thread")

    # -- the threads' side -------------------------------------------------------------------------

    def _work(self) -> None:
        context = self._thread_context()
        try:
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    item = self._queue.popleft()
                if item is None:
                    return
                self._run(item, context)
        finally:
            self._thread_done(context)

    def _settled(self, job: TierJob, outcome: TierIoOutcome | None) -> bool:
        """Under `_cond`: record a finished job's outcome. True when it finished."""
        if outcome is None:
            return False
        self._finished.append(outcome)
        del self._pending[job.job_id]
        return True

    # -- what a subclass says ----------------------------------------------------------------------

    def _items(self, job: TierJob, blocks: list[Block]) -> list:
        raise NotImplementedError

    def _run(self, item: Any, context: Any) -> None:
        raise NotImplementedError

    def _cancel(self, item: Any) -> None:
        raise NotImplementedError

    def _thread_context(self) -> Any:
        """Per thread state (a connection, a staging buffer), made when the thread starts."""
        return None

    def _thread_done(self, context: Any) -> None:
        pass
