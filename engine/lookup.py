"""The tier-hit query behind `get_num_new_matched_tokens`. Pure: it reads the
state and changes nothing, so vLLM may call it any number of times."""

from __future__ import annotations

import attrs

from kvledger.events.config import GroupKind

from . import hma
from .state import RequestStatus, SlotState, State


@attrs.frozen
class LookupResult:
    """`num_hit_tokens` beyond the local hit, or `ready=False`: ask again later
    (a needed key is still being stored, or another request is loading it)."""

    num_hit_tokens: int
    ready: bool = True


MISS = LookupResult(0)
LATER = LookupResult(0, ready=False)


def lookup(state: State, request_id: str, num_local_tokens: int) -> LookupResult:
    core = state.core
    request = core.requests.get(request_id)
    if request is None or request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        return MISS
    alignment = core.alignment
    if num_local_tokens % alignment:
        return MISS  # vLLM rounds the local hit down; anything else cannot extend
    best = (request.num_tokens - 1) // alignment * alignment  # leave one token to compute
    slot_of_key = core.slot_of_key

    # Full-attention groups bound the hit by their first missing key.
    for group in core.groups:
        if group.kind is not GroupKind.FULL:
            continue
        keys = request.keys[group.group_id]
        position = num_local_tokens // group.block_size
        limit = min(best // group.block_size, len(keys))
        while position < limit and keys[position] in slot_of_key:
            position += 1
        best = min(best, position * group.block_size // alignment * alignment)

    # Window groups: walk down to the largest boundary every group can serve.
    end = best
    partial = [g for g in core.groups if g.kind is not GroupKind.FULL]
    while end > num_local_tokens and not all(_covers(core, request, g, num_local_tokens, end) for g in partial):
        end -= alignment
    if end <= num_local_tokens:
        return MISS

    for group in core.groups:
        keys = request.keys[group.group_id]
        for position in hma.needed_range(group, num_local_tokens, end):
            slot = slot_of_key[keys[position]]
            if core.slot_state[slot] != SlotState.STORED or slot in core.slot_loads:
                return LATER
    return LookupResult(end - num_local_tokens)


def _covers(core, request, group, start: int, end: int) -> bool:
    keys = request.keys[group.group_id]
    slot_of_key = core.slot_of_key
    for position in hma.needed_range(group, start, end):
        if position >= len(keys) or keys[position] not in slot_of_key:
            return False
    return True
