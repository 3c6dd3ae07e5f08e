"""Checks a transfer effect must pass before any byte moves.

The engine only emits valid effects, so a failure here means a bug on the
other side of the boundary (or a stale job). It must not corrupt memory or
crash the worker: the runner turns the message into a failure event.
"""

from __future__ import annotations

from collections import Counter

import attrs

from kvledger.engine.effects import StartLoad, StartStore
from kvledger.events.types import NULL_BLOCK_ID


@attrs.frozen(kw_only=True)
class Limits:
    num_groups: int
    num_device_blocks: int
    num_slots: int


def precondition_error(effect: StartStore | StartLoad, limits: Limits) -> str | None:
    """Why this effect must not run, or None when it may."""
    if isinstance(effect, StartStore):
        blocks, slots, targets = effect.source_block_ids, effect.target_slot_ids, "target slot"
    else:
        blocks, slots, targets = effect.target_block_ids, effect.source_slot_ids, "target block"
    keys = effect.keys
    if not len(keys) == len(blocks) == len(slots) == limits.num_groups:
        return (
            f"expected {limits.num_groups} groups, got {len(keys)} keys, "
            f"{len(blocks)} block lists and {len(slots)} slot lists"
        )
    for g, (k, b, s) in enumerate(zip(keys, blocks, slots)):
        if not len(k) == len(b) == len(s):
            return f"group {g}: {len(k)} keys, {len(b)} block ids and {len(s)} slot ids are not aligned"
        if not b:
            continue
        # min and max first (C loops, every job); the offender is looked for only when one is out.
        if min(b) <= NULL_BLOCK_ID or max(b) >= limits.num_device_blocks:
            bad_block = next(i for i in b if not NULL_BLOCK_ID < i < limits.num_device_blocks)
            return f"group {g}: block id {bad_block} is the null block or outside [1, {limits.num_device_blocks})"
        if min(s) < 0 or max(s) >= limits.num_slots:
            promoted = effect.promote_tiers[g] if isinstance(effect, StartLoad) and effect.promote_tiers else ()
            # A promoted key with no host slot (-1) is failed by the runner, not copied.
            bad_slot = next((i for j, i in enumerate(s) if not 0 <= i < limits.num_slots
                             and not (i == -1 and promoted and promoted[j])), None)
            if bad_slot is not None:
                return f"group {g}: slot id {bad_slot} is outside [0, {limits.num_slots})"
    target_ids = [i for ids in (slots if isinstance(effect, StartStore) else blocks) for i in ids]
    if len(set(target_ids)) == len(target_ids):
        return None
    repeated = sorted(i for i, n in Counter(target_ids).items() if n > 1)
    if repeated:
        return f"{targets} ids {repeated} appear more than once"
    return None
