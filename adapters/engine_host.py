"""Runs the engine and records its inputs: the one place a live system (the
vLLM connector, the simulator) turns events into state, effects and a log."""

from __future__ import annotations

import contextlib
import os

import structlog

from kvledger import __version__
from kvledger._identity import commit
from kvledger.adapters.log_files import LogWriter
from kvledger.engine import effects as fx
from kvledger.engine.digest import digest, part_digest, parts_for
from kvledger.engine.reducer import reduce, reduce_step
from kvledger.engine.snapshot import capture
from kvledger.engine.state import State, initial_state
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig
from kvledger.events.log_records import LogError, LogHeader

_log = structlog.get_logger("kvledger.adapters.engine_host")

SNAPSHOT_INTERVAL_EVENTS = 250_000
"""Events between snapshots in a binary log, by default. A reader starting at a
snapshot replays at most this many events to reach any point: about 3 s at the
~80k events/s replay runs at on 2 shared cores (bench/history/2026-11-25.md, "Long logs").
At about 70 events per step that is one snapshot every ~3,600 steps, minutes of
serving, so the capture's 16-36 ms on the scheduler's thread (130 ms with a
full 1M-slot tier) comes once in thousands of steps."""

SNAPSHOT_BYTES_RATIO = 1.0
"""A snapshot also waits until the log has grown since the last one by this many
times that snapshot's bytes (0: no wait), so snapshots take at most about half
of the log. A large tier's state outweighs 250k events' records (a full 1M-slot
tier snapshots to 66 MB, 250k events of bench/engine_step.py's trace take 8 MB):
there the interval stretches, and a reader replays more, instead of the log
growing several times over. In background mode the writer's counts lag behind
the steps still queued, so where snapshots fall then depends on the writer's
progress (the records do not; with 0 the log is the same byte for byte)."""


class EngineHost:
    """The live engine: `apply(event)` or `apply_step(events)` reduces, and,
    when a log is open, appends the events to it.

    Events before a `step_scheduled` belong to that step; the step's records
    are written as one unit when it is scheduled, with a state digest every
    `digest_interval` steps: a part digest (see `engine.digest`), the parts
    taken in turn, so that no step pays for hashing the whole state.
    `background` writes on the log writer's own thread (see `LogWriter`).

    A binary log also gets a snapshot of the whole state (`engine.snapshot`)
    at the end of the first step after every `snapshot_interval_events` events
    (0: none) and `snapshot_bytes_ratio` times the last snapshot's bytes of
    log, so a reader can start there. The state is copied here, on the
    scheduler's thread; packing and compressing it happen where the step is
    encoded (the writer's thread in background mode).
    """

    def __init__(self, config: EngineConfig, *, log_path: str | os.PathLike | None = None,
                 fmt: str = "binary", digest_interval: int = 64, strict: bool = False,
                 overwrite: bool = False, background: bool = False, next_free: bool = False,
                 keep_serving: bool = False, snapshot_interval_events: int = SNAPSHOT_INTERVAL_EVENTS,
                 snapshot_bytes_ratio: float = SNAPSHOT_BYTES_RATIO) -> None:
        """`keep_serving`: a log that cannot be written (a full disk, an I/O error)
        is stopped, with one error logged and `log_failure` set, and the engine
        goes on; without it the failure is raised to the caller."""
        self.state: State = initial_state(config)
        self.strict = strict
        self.digest_interval = digest_interval
        self.next_step = 0
        self.digest_parts = parts_for(config)
        self.snapshot_interval_events = snapshot_interval_events if fmt == "binary" else 0
        self.snapshot_bytes_ratio = snapshot_bytes_ratio
        self._events_since_snapshot = 0
        self._pending: list[ev.Event] = []  # this step's events, written when it is scheduled
        self.keep_serving = keep_serving
        self.log_failure: Exception | None = None  # why the log stopped, when it did
        self.writer: LogWriter | None = None
        if log_path is not None:
            header = LogHeader(engine_version=__version__, commit=commit(), config=config,
                               digest_interval=digest_interval)
            self.writer = LogWriter(log_path, header, fmt, overwrite=overwrite,  # type: ignore[arg-type]
                                    background=background, next_free=next_free,
                                    snapshot_interval_events=self.snapshot_interval_events)

    def apply(self, event: ev.Event) -> tuple[fx.Effect, ...]:
        self.state, effects = reduce(self.state, event, strict=self.strict)
        if self.writer is not None:
            self._record((event,))
        return effects

    def apply_step(self, events: list[ev.Event], ends: list[int] | None = None) -> tuple[fx.Effect, ...]:
        """A planned step's events in one `reduce_step` (the tables move once);
        a `step_scheduled` may only come last. Strict mode folds `apply`, so
        a violation leaves the state before the event that broke it. `ends`:
        as `reduce_step`'s, where each event's effects end."""
        if self.strict:
            out: list[fx.Effect] = []
            for event in events:
                out.extend(self.apply(event))
                if ends is not None:
                    ends.append(len(out))
            return tuple(out)
        if not events:
            return ()
        assert ev.StepScheduled not in map(type, events[:-1]), "step_scheduled ends a step"
        self.state, effects = reduce_step(self.state, events, ends=ends)
        if self.writer is not None:
            self._record(events)
        return effects

    def _record(self, events: list[ev.Event] | tuple[ev.Event, ...]) -> None:
        """Hold the events for their step; a `step_scheduled` (last) writes the step."""
        assert self.writer is not None
        self._pending.extend(events)
        last = events[-1]
        if isinstance(last, ev.StepScheduled):
            try:
                self.writer.add_step(last.step_index, self._pending, self._digest_due(last.step_index),
                                     self._snapshot_due(len(self._pending)))
            except (LogError, ValueError) as exc:  # ValueError: closed at interpreter exit, before us
                self._log_failed(exc)
            self._pending.clear()
            self.next_step = last.step_index + 1

    def _log_failed(self, exc: Exception) -> None:
        if not self.keep_serving:
            raise exc
        writer, self.writer = self.writer, None
        self.log_failure = exc
        _log.error("event_log_stopped", path=str(writer.path) if writer is not None else None, error=str(exc),
                   next_step=self.next_step)
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()

    def _snapshot_due(self, events: int) -> object:
        self._events_since_snapshot += events
        if not self.snapshot_interval_events or self._events_since_snapshot < self.snapshot_interval_events:
            return None
        writer = self.writer
        assert writer is not None
        if writer.bytes_since_snapshot() < self.snapshot_bytes_ratio * writer.last_snapshot_bytes:
            return None
        self._events_since_snapshot = 0
        return capture(self.state)

    def _digest_due(self, step_index: int) -> str | None:
        interval = self.digest_interval
        if not interval or step_index % interval:
            return None
        return part_digest(self.state, step_index // interval % self.digest_parts, self.digest_parts)

    def close(self) -> None:
        """Write what is pending, then the end mark: a full digest of the final
        state (every other digest is a part digest), which says the log was
        closed, not cut, and lets a replay check the state it ends in."""
        if self.writer is not None:
            try:
                if self._pending:
                    self.writer.add_step(self.next_step, self._pending)
                self._pending.clear()
                self.writer.add_step(self.next_step, [], digest(self.state))
                self.writer.close()
            except (LogError, ValueError) as exc:
                self._log_failed(exc)

    def __enter__(self) -> EngineHost:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
