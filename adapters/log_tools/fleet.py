"""What a tier shared between replicas would have saved them, from their logs
recorded apart (`kvledger whatif LOG1 LOG2 ... --shared-tier JSON`).

Each replica's log is driven through an engine of its own configuration with
the shared tier below its host memory (replacing any lower tiers it had), as
`whatif.Redrive` drives one log; the replicas' steps are taken in the order of
their wall time (`StepScheduled.wall_time_us`), so one replica finds what
another wrote before; with `--together`, of their time since each log's first
step (logs recorded apart, taken as replicas serving side by side). The
shared tier is modelled as Valkey keeps it under `allkeys-lru`: every block
written through, the least recently written or read evicted when it is full;
a replica's promotion of a block another's writes evicted since it was found
fails and is recomputed, as it would.

Beyond what `whatif.py` keeps as recorded (each replica's schedule, transfer
timing), a lookup here finds at once what the shared tier holds, where a real
one answers a step later.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import attrs

from kvledger.events import types as ev
from kvledger.events.config import LowerTierSpec
from kvledger.events.log_records import EventRecord, LogHeader

from .whatif import Outcome, Redrive, SharedTier, events_of


@attrs.define
class Replica:
    name: str
    header: LogHeader
    records: list


def _steps(events: list, *, together: bool = False) -> Iterator[tuple[int, list[int]]]:
    """The log's steps in order, each with the wall time of its step event (or the last one
    known) and the indices of its events (a step event ends each step). `together`: the time
    since the log's first step time, as if every log had started at the same moment."""
    clock = start = 0
    step: list[int] = []
    for index, event in enumerate(events):
        step.append(index)
        if isinstance(event, ev.StepScheduled):
            clock = event.wall_time_us or clock
            if together and not start and clock:
                start = clock
            yield clock - start, step
            step = []
    if step:
        yield clock - start, step


def untimed(replicas: list[Replica]) -> list[str]:
    """The replicas whose logs record no step times (they cannot be interleaved)."""
    return [r.name for r in replicas
            if not any(getattr(rec.event, "wall_time_us", 0) for rec in r.records if isinstance(rec, EventRecord))]


def predict_fleet(replicas: list[Replica], tier: LowerTierSpec, *,
                  together: bool = False) -> tuple[list[Outcome], SharedTier]:
    """Every replica's outcome with the shared tier below it, and the tier's counts.
    `together`: logs recorded apart (one replica after the other, or on other days) taken as
    replicas that started serving at the same moment, each at its own recorded pace."""
    shared = SharedTier(tier.num_blocks)
    drives = []
    for replica in replicas:
        config = replica.header.config
        drive = Redrive(config, attrs.evolve(config, lower_tiers=(tier,)))
        drive.shared = shared
        drive.prepare(events_of(replica.records))
        drives.append(drive)
    # The replicas' steps merged by wall time (ties in the order the logs were given); each
    # replica's stay in its log's order, even where its clock stepped back.
    steps = [[(clock, index, step) for clock, step in _steps(drive.events, together=together)]
             for index, drive in enumerate(drives)]
    for _, index, step in heapq.merge(*steps, key=lambda item: item[:2]):
        for position in step:
            drives[index].feed_at(position)
    return [drive.outcome() for drive in drives], shared


def promoted_blocks(outcome: Outcome) -> int:
    return sum(count for name, count in outcome.moved.items() if name.startswith("promoted from tier 1"))

