"""Shared inputs for the log tests: the test config and header, and numbered records."""

from __future__ import annotations

import attrs

from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupSpec
from kvledger.events.log_records import DigestRecord, EventRecord, LogHeader
from tests.strategies import EXAMPLE_EVENTS

CONFIG = EngineConfig(
    groups=(
        GroupSpec(group_id=0, kind="full", block_size=16),
        GroupSpec(group_id=1, kind="sliding", block_size=16, window=64),
    ),
    hash_block_size=16,
    num_device_blocks=1000,
    num_tier_slots=4000,
)
HEADER = LogHeader(engine_version="0.1.0", config=CONFIG, digest_interval=4)
DIGEST = "0f" * 16


def records_of(steps: list[list[ev.Event]], digest_every: int = 0) -> list[EventRecord | DigestRecord]:
    """Number the events of each step the way a writer does, digests at step ends."""
    records: list[EventRecord | DigestRecord] = []
    seq = 0
    for step_index, events in enumerate(steps):
        for event in events:
            if isinstance(event, ev.StepScheduled):  # it belongs to the step it is logged in
                event = attrs.evolve(event, step_index=step_index)
            records.append(EventRecord(seq=seq, step_index=step_index, event=event))
            seq += 1
        if digest_every and step_index % digest_every == 0:
            records.append(DigestRecord(seq=seq, step_index=step_index, digest=DIGEST))
    return records


EXAMPLE_RECORDS = records_of([list(EXAMPLE_EVENTS.values())[:8], list(EXAMPLE_EVENTS.values())[8:]], 1)
