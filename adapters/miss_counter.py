"""Missed prompt tokens by cause, counted while serving.

The causes are `kvledger explain`'s: the same fold (`misses.MissLedger`) over
the events the engine applied and the effects it answered each with. The
fold reads no engine state, only the events and the engine's notifications,
so it runs on the scheduler's thread beside the engine, with no copy of the
engine's state: its cost is the fold's alone (`bench/scheduler_overhead.py`,
`kvledger-counted` against `kvledger`).

The ledger keeps at most about `max_keys` keys' facts. A fold that raises
stops the counter (logged once; `stopped` says why) and serving goes on
without it.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from kvledger.adapters.log_tools.misses import Admission, MissLedger
from kvledger.engine import effects as fx
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig

_log = structlog.get_logger("kvledger.adapters.miss_counter")

MAX_KEYS = 262_144
"""Keys whose facts the live counter remembers by default: about 100 MB at
most, and four times the blocks of a host tier of 64k slots."""


class MissCounter:
    """`feed` each batch of events the engine applied, with its effects and
    where each event's effects end (`reduce_step`'s `ends`); `take` the missed
    tokens by cause counted since the last `take`."""

    def __init__(self, config: EngineConfig, *, max_keys: int = MAX_KEYS) -> None:
        self._seq = 0
        self._ledger: MissLedger | None = MissLedger(config, on_admission=self._count, max_keys=max_keys)
        self._counts: dict[str, int] = {}
        self.stopped: str | None = None

    def feed(self, events: Sequence[ev.Event], effects: tuple[fx.Effect, ...], ends: Sequence[int]) -> None:
        ledger = self._ledger
        if ledger is None or not events:
            return
        seq = self._seq
        try:
            start = 0
            for event, end in zip(events, ends, strict=True):
                ledger.observe(seq, event, effects[start:end])
                start = end
                seq += 1
            ledger.bound()
        except Exception as exc:  # a defect of the fold: the counts stop, serving does not
            self._stop(f"{type(exc).__name__}: {exc}")
        self._seq = seq

    def take(self) -> dict[str, int]:
        counts, self._counts = self._counts, {}
        return counts

    def close(self) -> None:
        self._ledger = None

    def _count(self, admission: Admission) -> None:
        if admission.superseded_at >= 0:  # a failed load sent it back to waiting: its next admission counts
            return
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
