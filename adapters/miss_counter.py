"""Missed prompt tokens by cause, counted while serving.

The causes are `kvledger explain`'s: the same fold (`misses.MissLedger`) over
the events the engine applied and the effects it answered each with. The
fold reads no engine state, only the events and the engine's notifications.

Served (`background=True`), the scheduler's thread only queues each batch;
a thread of the counter's own folds the queue a few times a second, handing
the interpreter back every half millisecond of folding, so the fold runs in
the time the scheduler waits for the model and not inside its steps
(`bench/scheduler_overhead.py`, `kvledger` against `kvledger-uncounted`, and
the thread's CPU beside them). A queue past `max_queued` events (the fold
falling behind for half a minute or more) stops the counter rather than
hold memory without end.

The ledger keeps at most about `max_keys` keys' facts (`default_keys`: four
times what the tiers hold). A fold that raises stops the counter (logged
once; `stopped` says why) and serving goes on without it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import structlog

from kvledger.adapters.log_tools.misses import Admission, MissLedger
from kvledger.engine import effects as fx
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig

_log = structlog.get_logger("kvledger.adapters.miss_counter")

MAX_KEYS = 262_144
"""The most keys whose facts the counter remembers unless told otherwise
(`miss_memory_keys`): four times the blocks of a host tier of 64k slots."""

MIN_KEYS = 16_384
"""The fewest it remembers unless told otherwise, however small the tiers."""


def default_keys(config: EngineConfig) -> int:
    """Four times the blocks every tier holds, host memory and each tier below it,
    from `MIN_KEYS` to `MAX_KEYS`: a key's facts matter while it may come back, and
    one not named again while the tiers turned over four times would mostly miss
    anyway. A fixed 262,144 grew a small fleet replica's scheduler by about 0.7 MB
    a minute for hours before the bound was reached (8.4 MB over 12 minutes of its
    log: `bench/fleet_soak.py`)."""
    blocks = config.num_tier_slots + sum(tier.num_blocks for tier in config.lower_tiers)
    return min(MAX_KEYS, max(MIN_KEYS, 4 * blocks))

MAX_QUEUED = 1_000_000
"""Events the scheduler may queue ahead of the fold before the counter stops:
minutes of a busy server's events, some hundreds of MB at most."""

_COUNTING = frozenset({fx.RequestAdmitted, fx.JobEnded})  # the effects after which a count may change

POLL_S = 0.005  # how often the thread looks for batches: batches held longer outlive young collections
SLICE_S = 0.0005  # folding this long, the thread lets the scheduler's thread run


class MissCounter:
    """`feed` each batch of events the engine applied, with its effects and
    where each event's effects end (`reduce_step`'s `ends`); `take` the missed
    tokens by cause counted since the last `take`. In the background, `settle`
    waits for the queue to be folded; `close` folds what is queued and ends
    the thread."""

    def __init__(self, config: EngineConfig, *, max_keys: int | None = None, background: bool = False,
                 max_queued: int = MAX_QUEUED) -> None:
        """`max_keys`: `default_keys(config)` where None."""
        self._seq = 0
        self.max_keys = default_keys(config) if max_keys is None else max_keys
        self._ledger: MissLedger | None = MissLedger(config, on_admission=self._count, max_keys=self.max_keys)
        self._counts: dict[str, int] = {}
        self._counts_lock = threading.Lock()
        self.stopped: str | None = None
        self.cpu_seconds = 0.0  # the folding thread's CPU time so far
        self._max_queued = max_queued
        self._queue: deque[tuple[Sequence[ev.Event], tuple[fx.Effect, ...], Sequence[int]]] = deque()
        # Events and batches queued (written by the scheduler's thread alone) and taken (by the fold's):
        # each count has one writer.
        self._events_in = self._events_out = 0
        self._fed = self._done = 0
        self._counting_fed = 0  # the last batch queued whose effects may count (`unpublished`)
        self._closing = False
        self._wake = threading.Event()
        self._drained = threading.Condition()  # notified after each time the thread empties the queue
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="kvledger-misses", daemon=True)
            self._thread.start()

    def feed(self, events: Sequence[ev.Event], effects: tuple[fx.Effect, ...], ends: Sequence[int]) -> None:
        if self._ledger is None or not events:
            return
        if self._thread is None:
            self._fold(events, effects, ends)
            return
        self._events_in += len(events)
        behind = self._events_in - self._events_out
        if behind > self._max_queued:
            self._stop(f"the fold fell {behind} events behind the engine")
            return
        self._queue.append((events, effects, ends))
        self._fed += 1
        if not _COUNTING.isdisjoint(map(type, effects)):
            self._counting_fed = self._fed

    def unpublished(self) -> bool:
        """Counts not yet taken, or a queued batch that may add some (an admission, a
        job's end): the connector keeps vLLM stepping until `take` has them, or a server
        gone idle would hold its last request's counts back."""
        if self._ledger is None:
            return False
        thread = self._thread
        folding = thread is not None and thread.is_alive() and self._done < self._counting_fed
        return folding or bool(self._counts)

    def take(self) -> dict[str, int]:
        with self._counts_lock:
            counts, self._counts = self._counts, {}
        return counts

    def settle(self, timeout: float = 10.0) -> bool:
        """Background: wait until every batch fed so far is folded (True) or `timeout` passes."""
        if self._thread is None:
            return True
        thread, fed, deadline = self._thread, self._fed, time.monotonic() + timeout
        with self._drained:
            while self._done < fed and thread.is_alive() and self._ledger is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.set()
                self._drained.wait(min(left, POLL_S))
        return self._done >= fed or self._ledger is None

    def close(self, timeout: float = 10.0) -> None:
        """Fold what is queued (for the last counts) and end the thread."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._closing = True
            self._wake.set()
            thread.join(timeout)
        self._ledger = None

    # The folding thread.

    def _run(self) -> None:
        clock = time.thread_time
        while True:
            self._wake.wait(POLL_S)
            self._wake.clear()
            closing = self._closing
            started = clock()
            self._drain()
            self.cpu_seconds += clock() - started
            with self._drained:
                self._drained.notify_all()
            if closing:
                return

    def _drain(self) -> None:
        queue, now = self._queue, time.perf_counter
        since = now()
        while queue:
            events, effects, ends = queue.popleft()
            self._events_out += len(events)
            if self._ledger is not None:
                self._fold(events, effects, ends)
            self._done += 1
            if now() - since > SLICE_S:
                time.sleep(0)  # the scheduler's thread first, if it waits for the interpreter
                since = now()

    def _fold(self, events: Sequence[ev.Event], effects: tuple[fx.Effect, ...], ends: Sequence[int]) -> None:
        ledger = self._ledger
        if ledger is None:
            return
        seq = self._seq
        try:
            start = 0
            for event, end in zip(events, ends, strict=True):
                ledger.observe(seq, event, None, effects[start:end])
                start = end
                seq += 1
            ledger.bound()
        except Exception as exc:  # a defect of the fold: the counts stop, serving does not
            self._stop(f"{type(exc).__name__}: {exc}")
        self._seq = seq

    def _count(self, admission: Admission) -> None:
        if admission.superseded_at >= 0:  # a failed load sent it back to waiting: its next admission counts
            return
        with self._counts_lock:
            counts = self._counts
            for run in admission.runs:
                if run.outcome == "missed":
                    counts[run.cause] = counts.get(run.cause, 0) + run.tokens

    def _stop(self, why: str) -> None:
        if self.stopped is not None:
            return
        self.stopped = why
        _log.error("miss_counter_stopped", reason=why, events_folded=self._seq)
        self._ledger = None  # free the facts
        self._queue.clear()
