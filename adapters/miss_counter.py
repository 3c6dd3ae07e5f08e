"""Missed prompt tokens by cause, counted while serving.

The causes are `kvledger explain`'s (`misses.MissLedger`), folded over the
events the engine applies, on a twin of the engine's state kept on a thread
of its own. The ledger reads the state after each event, which the
scheduler's one `reduce_step` per step never shows, and folding event by
event costs about what the engine's step itself does: the scheduler's
thread hands over each batch of events and goes on.

The twin holds as much as the engine's state, and the ledger at most about
`max_keys` keys' facts. A counter that falls `MAX_QUEUED` batches behind,
or whose fold raises, stops (logged once; `stopped` says why) and serving
goes on without it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import structlog

from kvledger.adapters.log_tools.misses import Admission, MissLedger
from kvledger.engine.reducer import reduce
from kvledger.engine.state import initial_state
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig

_log = structlog.get_logger("kvledger.adapters.miss_counter")

MAX_KEYS = 262_144
"""Keys whose facts the live counter remembers by default: about 100 MB at
most, and four times the blocks of a host tier of 64k slots."""


class MissCounter:
    """`feed` the events the engine applied, in order; `take` the missed
    tokens by cause counted since the last `take`. `background=False` folds
    in `feed` (tests, the simulator)."""

    MAX_QUEUED = 1024
    CLOSE_TIMEOUT_S = 30.0

    def __init__(self, config: EngineConfig, *, max_keys: int = MAX_KEYS, background: bool = True) -> None:
        self._state = initial_state(config)
        self._seq = 0
        self._ledger = MissLedger(config, on_admission=self._count, max_keys=max_keys)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self.stopped: str | None = None
        self._queue: queue.Queue[Sequence[ev.Event] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(self.MAX_QUEUED)
            self._thread = threading.Thread(target=self._drain, name="kvledger-misses", daemon=True)
            self._thread.start()

    def feed(self, events: Sequence[ev.Event]) -> None:
        if self.stopped is not None or not events:
            return
        if self._queue is None:
            self._fold(events)
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self._stop(f"the fold fell {self.MAX_QUEUED} batches of events behind")

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts

    def settle(self) -> None:
        """Wait until every batch fed so far is folded (or the counter stopped)."""
        if self._queue is not None and self.stopped is None:
            self._queue.join()

    def close(self) -> None:
        """Fold what is queued, then stop the thread."""
        if self._thread is None:
            return
        assert self._queue is not None
        if self.stopped is None:
            self._queue.put(None)
        self._thread.join(self.CLOSE_TIMEOUT_S)
        self._thread = None

    # The thread's side.

    def _drain(self) -> None:
        assert self._queue is not None
        while (events := self._queue.get()) is not None:
            if self.stopped is None:
                self._fold(events)
            self._queue.task_done()

    def _fold(self, events: Sequence[ev.Event]) -> None:
        try:
            for event in events:
                self._state, effects = reduce(self._state, event)
                self._ledger.observe(self._seq, event, self._state, effects)
                self._seq += 1
        except Exception as exc:  # a defect of the fold: the counts stop, serving does not
            self._stop(f"{type(exc).__name__}: {exc}")

    def _count(self, admission: Admission) -> None:
        if admission.superseded_at >= 0:  # a failed load sent it back to waiting: its next admission counts
            return
        with self._lock:
            for run in admission.runs:
                if run.outcome == "missed":
                    self._counts[run.cause] = self._counts.get(run.cause, 0) + run.tokens

    def _stop(self, why: str) -> None:
        if self.stopped is not None:
            return
        self.stopped = why
        _log.error("miss_counter_stopped", reason=why, events_folded=self._seq)
        self._ledger = None  # type: ignore[assignment]  # free the facts and the twin state
        self._state = None  # type: ignore[assignment]
        if self._queue is not None:
            while True:  # free what waits; the thread then ends at the None that close() or this puts
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
                self._queue.task_done()
            self._queue.put_nowait(None)
