"""The tier-hit query behind `get_num_new_matched_tokens`. Pure: it reads the
state and changes nothing, so vLLM may call it any number of times."""

from __future__ import annotations

import attrs

from kvledger.events.config import GroupKind

from . import hma, lower
from .state import RequestStatus, SlotState, State


@attrs.frozen
class LookupResult:
    """`num_hit_tokens` beyond the local hit, or `ready=False`: ask again later
    (a needed key is still being stored, or another request is loading it)."""

    num_hit_tokens: int
    ready: bool = True
    slots_taken: int = 0  # with lower tiers: host slots the hit's load takes from the evictable pool


MISS = LookupResult(0)
LATER = LookupResult(0, ready=False)


def lookup(state: State, request_id: str, num_local_tokens: int, slots_promised: int = 0) -> LookupResult:
    """`slots_promised`: host slots earlier hits of this step will take (the sum of
    their `slots_taken`): vLLM admits several requests before the engine sees any."""
    core = state.core
    request = core.requests.get(request_id)
    if request is None or request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        return MISS
    alignment = core.alignment
    if num_local_tokens % alignment:
        return MISS  # vLLM rounds the local hit down; anything else cannot extend
    best = (request.num_tokens - 1) // alignment * alignment  # leave one token to compute
    known = lower.known(core)

    # Full-attention groups bound the hit by their first missing key.
    for group in core.groups:
        if group.kind is not GroupKind.FULL:
            continue
        keys = request.keys[group.group_id]
        position = num_local_tokens // group.block_size
        limit = min(best // group.block_size, len(keys))
        while position < limit and known(keys[position]):
            position += 1
        best = min(best, position * group.block_size // alignment * alignment)

    # Window groups: walk down to the largest boundary every group can serve, and
    # whose keys from lower tiers fit in host memory on their way to the device.
    end = best
    partial = [g for g in core.groups if g.kind is not GroupKind.FULL]
    taken = 0
    while end > num_local_tokens:
        if all(_covers(core, request, g, num_local_tokens, end, known) for g in partial):
            slots = _slots_taken(core, request, num_local_tokens, end, slots_promised)
            if slots is None:
                return LATER
            if slots >= 0:
                taken = slots
                break
        end -= alignment
    if end <= num_local_tokens:
        return MISS
    return LookupResult(end - num_local_tokens, slots_taken=taken)


def _slots_taken(core, request, start: int, end: int, promised: int) -> int | None:
    """With lower tiers, the host slots the hit [start, end) takes from the
    evictable pool: a slot for each key a lower tier holds (a promotion), and
    each evictable host key it reads (pinned while it does); 0 without. None if
    a host key is still being stored or another request is loading it (ask
    again later), -1 if the promotions need more slots than can be freed."""
    slot_of_key = core.slot_of_key
    slot_state = core.slot_state
    slot_loads = core.slot_loads
    spill_reads = core.spill_reads
    policy = core.policy
    promotions = 0
    pinned = 0  # evictable host keys the load itself reads: not room for promotions
    for group in core.groups:
        keys = request.keys[group.group_id]
        for position in hma.needed_range(group, start, end):
            key = keys[position]
            slot = slot_of_key.get(key, -1)
            if slot < 0:
                promotions += 1  # a lower tier holds it
                continue
            if slot_state[slot] != SlotState.STORED:
                return None
            loads = slot_loads.get(slot, 0)
            if loads and loads > spill_reads.get(slot, 0):
                return None
            if core.lower:
                pinned += key in policy
    if promotions and promotions > core.num_free_slots() + len(policy) - pinned - promised:
        return -1
    return promotions + pinned


def _covers(core, request, group, start: int, end: int, known) -> bool:
    keys = request.keys[group.group_id]
    for position in hma.needed_range(group, start, end):
        if position >= len(keys) or not known(keys[position]):
            return False
    return True
