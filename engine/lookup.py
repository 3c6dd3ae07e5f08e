"""The tier-hit query behind `get_num_new_matched_tokens`. Pure: it reads the
state and changes nothing, so vLLM may call it any number of times.

And it does: vLLM asks again, in every step, about a waiting request that
does not fit the device pool, and a lookup walks every key of the prompt. So
an answer carries what it rests on, and a lookup given the request's last
answer back (`previous`) returns it unwalked while that holds:
- the question: the request (its last chain hash and length stand for its
  keys), the local hit and the slots promised;
- the tier's counters, which every change that could shorten or defer an
  answer moves: a key leaves host memory by eviction or a cache reset
  (`evictions`, `epoch`) or by failure (`keys_failed`), and a slot becomes
  busy only when a load starts (`loads`);
- the keys that could lengthen it (`awaits`): the missing keys the full
  attention walks stopped at. A hit a window group shortened could grow with
  any new key, so it rests on the count of stores planned instead.
Keys storing become stored and loads end: that only makes a ready answer more
so, and "ask again later" answers are never kept. Tiers below host memory change
without these counters: with any, nothing is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

import attrs

from kvledger.events.config import GroupKind, GroupSpec, RestoreBudget

from . import hma, lower
from .budget import budget_end
from .state import STORED_CODE, Core, RequestState, RequestStatus, State

_AUTO: Final = RestoreBudget.AUTO


@attrs.frozen
class LookupResult:
    """`num_hit_tokens` beyond the local hit, or `ready=False`: ask again later
    (a needed key is still being stored, or another request is loading it)."""

    num_hit_tokens: int
    ready: bool = True
    slots_taken: int = 0  # with lower tiers: host slots the hit's load takes from the evictable pool
    promotions: int = 0  # of those, the slots of keys promoted from a lower tier (the rest are read in place)
    # `restore_budget: "auto"` cut it (`budget.py`): the hit offered beyond the local
    # hit, and the estimates (us) of loading the part cut against computing it.
    budget: tuple[int, int, int] | None = None
    # What the answer rests on (`_basis`), None if it is not to be given back;
    # and the missing keys whose arrival would lengthen it.
    basis: tuple | None = attrs.field(default=None, eq=False, repr=False)
    awaits: Sequence[bytes] = attrs.field(default=(), eq=False, repr=False)


MISS: Final = LookupResult(0)
LATER: Final = LookupResult(0, ready=False)


def lookup(state: State, request_id: str, num_local_tokens: int, slots_promised: int = 0,
           previous: LookupResult | None = None, promotions_promised: int = 0,
           step_loads: Mapping[int, int] | None = None) -> LookupResult:
    """`slots_promised`: host slots earlier hits of this step will take (the sum of
    their `slots_taken`): vLLM admits several requests before the engine sees any;
    `promotions_promised`, the sum of their `promotions`.
    `previous`: this request's last answer, returned again if its basis holds.
    `step_loads`: per host slot, the loads this step's earlier admissions started, for a
    caller that applies each admission before the next lookup (`kvledger whatif`): vLLM's
    lookups of a step see none of them, so they do not make this one wait."""
    core = state.core
    request = core.requests.get(request_id)
    if request is None or request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        return MISS
    alignment = core.alignment
    if num_local_tokens % alignment:
        return MISS  # vLLM rounds the local hit down; anything else cannot extend
    most = (request.num_tokens - 1) // alignment * alignment  # leave one token to compute
    known = lower.known(core)
    if previous is not None and previous.basis is not None:
        stores_matter = previous.basis[-2] >= 0
        if (previous.basis == _basis(core, request, num_local_tokens, slots_promised, stores_matter)
                and not any(map(known, previous.awaits))):
            return previous

    # Full-attention groups bound the hit by their first missing key.
    best = most
    stops: list[bytes] = []  # the missing keys the walks stopped at
    for group in core.groups:
        if group.kind is not GroupKind.FULL:
            continue
        keys = request.keys[group.group_id]
        position = num_local_tokens // group.block_size
        limit = min(best // group.block_size, len(keys))
        while position < limit and known(keys[position]):
            position += 1
        if position < limit:
            stops.append(keys[position])
        best = min(best, position * group.block_size // alignment * alignment)

    # Window groups: walk down to the largest boundary every group can serve, and
    # whose keys from lower tiers fit in host memory on their way to the device.
    walked = _servable_end(core, request, num_local_tokens, best, known, slots_promised, promotions_promised,
                           step_loads)
    if walked is None:
        return LATER
    end, taken, promotions = walked
    hit = max(end - num_local_tokens, 0)
    budget = None
    if hit and core.restore_costs is not None and core.config.restore_budget is _AUTO:
        kept, load_us, compute_us = budget_end(core, request, num_local_tokens, end)
        if kept < end:
            # The shorter hit is walked as the first was: with windows it reads other
            # keys, and one of them may still be storing (ask later) or not fit.
            walked = _servable_end(core, request, num_local_tokens, kept, known, slots_promised,
                                   promotions_promised, step_loads)
            if walked is None:
                return LATER
            budget = (hit, load_us, compute_us)
            end, taken, promotions = walked
            hit = end - num_local_tokens
    if core.lower:
        return LookupResult(hit, slots_taken=taken, promotions=promotions, budget=budget)
    # Only the missing keys the full walks stopped at can lengthen a hit that no
    # window group shortened; a shortened one, any store.
    stores_matter = end < best
    basis = _basis(core, request, num_local_tokens, slots_promised, stores_matter)
    return LookupResult(hit, slots_taken=taken, budget=budget, basis=basis,
                        awaits=() if stores_matter else tuple(stops))


def _servable_end(core: Core, request: RequestState, start: int, end: int, known: Callable[[bytes], bool],
                  promised: int, promoting: int, step_loads: Mapping[int, int] | None) -> tuple[int, int, int] | None:
    """The largest boundary at or below `end` that every window group can serve
    and whose keys from lower tiers fit in host memory on their way to the
    device: (end, slots taken, promotions); `start` where none; None: ask later."""
    alignment = core.alignment
    partial = [g for g in core.groups if g.kind is not GroupKind.FULL]
    while end > start:
        if all(_covers(core, request, g, start, end, known) for g in partial):
            slots = _slots_taken(core, request, start, end, promised, promoting, step_loads)
            if slots is None:
                return None
            if slots[0] >= 0:
                return end, slots[0], slots[1]
        end -= alignment
    return start, 0, 0


def _basis(core: Core, request: RequestState, local: int, promised: int, stores_matter: bool) -> tuple:
    """Equal for two lookups whose answers are equal, unless a key the first
    awaits has arrived (module docstring)."""
    stats = core.stats
    hashes = request.hashes
    return (request.request_id, hashes[-1] if hashes else b"", len(hashes), request.num_tokens, local, promised,
            core.epoch, stats.evictions, stats.keys_failed, stats.loads, stats.stores if stores_matter else -1,
            core.restore_costs)


def _slots_taken(core: Core, request: RequestState, start: int, end: int, promised: int,
                 promoting: int, step_loads: Mapping[int, int] | None = None) -> tuple[int, int] | None:
    """With lower tiers, the host slots the hit [start, end) takes from the
    evictable pool: a slot for each key a lower tier holds (a promotion), and
    each evictable host key it reads (pinned while it does); 0 without. With
    the promotions among them: (slots, promotions). None if a host key is still
    being stored or another request is loading it (ask again later), and also
    when the hit needs more slots than are free or evictable now, but no more
    than host memory holds; (-1, 0) if it needs more.

    Earlier hits of the step that promote more keys than slots are free evict
    idle host keys when they are admitted, which may be the very keys this hit
    reads in place: then it too must fit in what their promises leave."""
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
            if slot_state[slot] != STORED_CODE:
                return None
            loads = slot_loads.get(slot, 0)
            if loads and step_loads:
                loads -= step_loads.get(slot, 0)
            if loads and loads > spill_reads.get(slot, 0):
                return None
            if core.lower:
                pinned += key in policy
    free = core.num_free_slots()
    if core.config.rules < 2:  # rules 1: a hit read in place never waits, nor one that fits in host memory
        if promotions and promotions > free + len(policy) - pinned - promised:
            return -1, 0
        return promotions + pinned, promotions
    evicting = promoting > free
    if (promotions or (pinned and evicting)) and promotions + pinned > free + len(policy) - promised:
        # The slots transfers in flight hold, and those this step's earlier hits will,
        # come back as they end: a hit that fits in host memory waits for them rather
        # than being cut short (recomputed). One larger than host memory takes what fits.
        if promotions + pinned <= core.config.num_tier_slots:
            return None
        return -1, 0
    return promotions + pinned, promotions


def _covers(core: Core, request: RequestState, group: GroupSpec, start: int, end: int,
            known: Callable[[bytes], bool]) -> bool:
    keys = request.keys[group.group_id]
    for position in hma.needed_range(group, start, end):
        if position >= len(keys) or not known(keys[position]):
            return False
    return True
