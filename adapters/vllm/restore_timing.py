"""Where a restore's time goes, on the scheduler's clock.

A restore passes four waits before its request computes again: its lookup
(from vLLM's first question about the request to the answer that offers a
hit: a shared tier's lookup, or slots still being freed, make it "ask
again"), its admission (from that answer to vLLM allocating the request's
blocks), its load (from the allocation, which starts the load, to the
load's end reaching the scheduler: promotions from a lower tier, then the
device copy) and its first step (from there to the first step that
schedules the request). Each wait becomes an observation of
`vllm:kvledger_restore_stage_seconds{stage}`; the load's is `load_host`
or `load_promoted`, by whether it read a lower tier. The engine never sees
these times: they are the adapter's, like the log's wall time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container

STAGES = ("lookup", "admission", "load_host", "load_promoted", "first_step")


class RestoreTimes:
    """`recent` keeps the last `keep` restores' stages, for benchmarks and debugging."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, keep: int = 256) -> None:
        self._clock = clock
        self._marks: dict[str, list[float]] = {}  # request -> the times it passed so far
        self._promoted: dict[str, bool] = {}
        self._jobs: dict[int, str] = {}  # load job -> its request
        self._loaded: dict[str, None] = {}  # requests whose load ended: their first step is next
        # Bounded: vLLM asks for stats only while it logs them.
        self._taken: deque[tuple[str, float]] = deque(maxlen=4 * keep * len(STAGES))
        self.recent: deque[dict[str, float]] = deque(maxlen=keep)

    def asked(self, rid: str) -> None:
        if rid not in self._marks:
            self._marks[rid] = [self._clock()]

    def answered(self, rid: str, tokens: int | None) -> None:
        marks = self._marks.get(rid)
        if marks is None:
            return
        if tokens == 0:  # nothing to restore: not a restore
            del self._marks[rid]
        elif tokens is not None and len(marks) == 1:
            marks.append(self._clock())

    def admitted(self, rid: str, num_external_tokens: int) -> None:
        marks = self._marks.get(rid)
        if marks is None:
            return
        if len(marks) != 2:  # not yet answered; or loaded already, and the rest of the prompt allocated
            return
        if num_external_tokens:
            marks.append(self._clock())
        else:  # admitted without the hit: no restore
            self._forget(rid)

    def load_started(self, job_id: int, rid: str, promoted: bool) -> None:
        if rid in self._marks:
            self._jobs[job_id] = rid
            self._promoted[rid] = promoted

    def load_ended(self, job_id: int, ok: bool) -> None:
        rid = self._jobs.pop(job_id, None)
        marks = self._marks.get(rid) if rid is not None else None
        if marks is None:
            return
        if ok and len(marks) == 3:
            marks.append(self._clock())
            self._loaded[rid] = None
        else:  # a failed load is recomputed: its time is not a restore's
            self._forget(rid)  # type: ignore[arg-type]

    def scheduled(self, rids: Container[str]) -> None:
        """The step schedules `rids` (vLLM's `num_scheduled_tokens`): the loaded requests among
        them end their restores. Asked about the few loaded ones, not every running one."""
        if not self._loaded:
            return
        for rid in [rid for rid in self._loaded if rid in rids]:  # each with its four marks
            marks = self._marks[rid]
            marks.append(self._clock())
            load = "load_promoted" if self._promoted.get(rid) else "load_host"
            stages = dict(zip(("lookup", "admission", load, "first_step"), (b - a for a, b in zip(marks, marks[1:]))))
            self._taken.extend(stages.items())
            self.recent.append(stages)
            self._forget(rid)

    def forget(self, rid: str) -> None:
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._marks.pop(rid, None)
        self._promoted.pop(rid, None)
        self._loaded.pop(rid, None)

    def take(self) -> list[tuple[str, float]]:
        """(stage, seconds) of the restores completed since the last take."""
        taken = list(self._taken)
        self._taken.clear()
        return taken
