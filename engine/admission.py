"""Admission: what a step stores and what a hit loads, and the host slots each
takes. The reducer calls it once a step's or an allocation's event has passed
its checks; everything here changes the state, nothing validates an event
but the hit's own shape (`plan_load`).

Stores: a request whose horizon crossed a block boundary offers its newly
full blocks that no tier holds (`find_stores`); a step's candidates are
admitted in request order into free slots, evicting idle ones. What still does
not fit is not stored (`admit_store`, counted as `store_rejections`), unless
tiers below host memory wait for it: then its request offers it again each
step until slots free, and only what its end finds still unstored is counted
(`give_up`). The lookup likewise waits for slots (`lookup._slots_taken`).
Loads: each key of a hit is read from its host slot, or promoted from the
first lower tier that holds it (`plan_load`, `place_promotions`).
"""

from __future__ import annotations

from typing import Final, TypeVar, cast

from kvledger.events import types as ev
from kvledger.events.config import Protection, StoreJobs, StoreMode
from kvledger.events.types import NULL_BLOCK_ID

from . import construct as new
from . import effects as fx
from . import hma, lower, slots
from .checks import ProtocolViolation
from .offers import offered
from .state import LOAD as _LOAD
from .state import STORE as _STORE
from .state import STORED_CODE, Core, Job, RequestState
from .transitions import start_job

_T = TypeVar("_T")

_PIN: Final = Protection.PIN
_LAZY: Final = StoreMode.LAZY
_BY_REQUEST: Final = StoreJobs.REQUEST
_NONE: Final[frozenset[bytes]] = frozenset()
PAST_EVERY_HORIZON: Final = 1 << 62  # `next_store_tokens` of a request with nothing left to store


LOST: Final = -2  # `plan_load`'s mark for a key no tier holds any more: its block fails at once


def place_promotions(core: Core, keys: tuple, slot_ids: tuple, promote_tiers: tuple,
                      out: list[fx.Effect]) -> tuple:
    """Pin the host keys the load reads, then give each promoted key a host slot
    (-1 where none is left, or the key was lost). Returns the slots with the
    promoted ones filled in."""
    host = [tuple(k for k, t in zip(gk, gt) if not t) for gk, gt in zip(keys, promote_tiers)]
    host_slots = [tuple(s for s, t in zip(gs, gt) if not t) for gs, gt in zip(slot_ids, promote_tiers)]
    slots.load_planned(core, tuple(host), tuple(host_slots))  # first: eviction below must not take them
    promoted = [(g, t, k) for g, (gk, gt, gs) in enumerate(zip(keys, promote_tiers, slot_ids))
                for k, t, s in zip(gk, gt, gs) if t and s != LOST]
    placed = iter(lower.reserve_promotions(core, promoted, out))
    return tuple(tuple((-1 if s == LOST else next(placed)) if t else s for s, t in zip(gs, gt))
                 for gs, gt in zip(slot_ids, promote_tiers))


def plan_load(core: Core, request: RequestState, event: ev.BlocksAllocated) -> tuple[tuple, tuple, tuple, tuple]:
    """The keys, slots and target blocks of the hit this allocation admits, and
    per key the lower tier it is promoted from (0: in host memory; all 0: `()`)."""
    rid = request.request_id
    ext = event.num_external_tokens
    start = request.capacity_tokens
    end = start + ext
    if ext < 0 or end % core.alignment or end >= request.num_tokens:
        raise ProtocolViolation(
            "bad_hit", f"hit [{start}, {end}) is unaligned (alignment {core.alignment}) or leaves no token "
            f"to compute ({request.num_tokens} tokens)", request_id=rid)
    keys, slot_ids, targets, tiers = [], [], [], []
    promoting = False
    slot_of_key = core.slot_of_key
    slot_state = core.slot_state
    slot_key = core.slot_key
    for group, ids in zip(core.groups, event.block_ids):
        table = request.table[group.group_id] + list(ids)
        known = request.keys[group.group_id]
        span = hma.needed_range(group, start, end)
        group_keys, group_slots, group_blocks, group_tiers = [], [], [], []
        for position in span:
            if position >= len(table) or table[position] == NULL_BLOCK_ID:
                raise ProtocolViolation(
                    "load_target_missing", f"group {group.group_id} position {position} has no block",
                    request_id=rid)
            if position >= len(known):
                raise ProtocolViolation(
                    "load_key_unknown", f"group {group.group_id} position {position} has no hash",
                    request_id=rid)
            key = known[position]
            slot = slot_of_key.get(key, -1)
            tier = 0
            if slot >= 0 and slot_state[slot] != STORED_CODE:
                slot = -1
            if slot >= 0:
                # The tier's own key object (equal): the request takes it, and the
                # dicts of this load's later steps (and its lookups) compare by identity.
                key = cast(bytes, slot_key[slot])
                known[position] = key
            elif core.lower:
                # Not in host memory: promoted from a lower tier. Or, when an earlier
                # admission of this step took the slot it was found in, lost: that
                # block fails at once and is recomputed (no slot, tier 1's number).
                tier = lower.holder(core, key)
                if not tier:
                    tier, slot = 1, LOST
                promoting = True
            if slot == -1 and not tier:
                raise ProtocolViolation(
                    "load_not_stored", f"group {group.group_id} position {position}: key is not stored",
                    request_id=rid)
            group_keys.append(key)
            group_slots.append(slot)
            group_blocks.append(table[position])
            group_tiers.append(tier)
        keys.append(tuple(group_keys))
        slot_ids.append(tuple(group_slots))
        targets.append(tuple(group_blocks))
        tiers.append(tuple(group_tiers))
    if not promoting:
        return tuple(keys), tuple(slot_ids), tuple(targets), ()
    return tuple(keys), tuple(slot_ids), tuple(targets), tuple(tiers)


def start_load(core: Core, request: RequestState, ext: int, load: tuple[tuple, tuple, tuple, tuple],
               out: list[fx.Effect]) -> None:
    """The load job of a hit `plan_load` planned: its host slots pinned (or
    promoted keys placed), its target blocks marked as being written."""
    rid = request.request_id
    block_key = core.block_key
    keys, slot_ids, targets, promote_tiers = load
    writer = core.block_writer
    if promote_tiers:
        slot_ids = place_promotions(core, keys, slot_ids, promote_tiers, out)
    else:
        slots.load_planned(core, keys, slot_ids)
    job = Job(job_id=core.next_job_id, kind=_LOAD, request_id=rid, keys=keys, block_ids=targets,
              slot_ids=slot_ids, generations=(), pending_workers=(1 << core.config.world_size) - 1,
              num_tokens=ext)
    job.promote_tiers = promote_tiers
    start_job(job)
    core.next_job_id += 1
    core.jobs[job.job_id] = job
    for group_keys, group_blocks in zip(keys, targets):
        for key, block in zip(group_keys, group_blocks):
            writer[block] = job.job_id
            block_key[block] = key
    request.load_job_id = job.job_id
    request.num_computed_tokens += ext
    core.stats.loads += 1
    core.stats.hit_tokens += ext
    core.stats.keys_loaded += sum(len(k) for k in keys)
    out.append(new.start_load(job.job_id, rid, keys, slot_ids, targets, promote_tiers))


def plan_stores(core: Core, crossed: list[tuple[RequestState, int]], out: list[fx.Effect]) -> None:
    """The stores of a step, for the requests whose horizon crossed a block
    boundary: one job per request or one for the step, as configured; in lazy
    mode only their keys are noted, for when their blocks near eviction."""
    # The step's candidates as three columns (no tuple each: a new prompt has
    # hundreds), in request order and each request's in group order.
    cand_groups: list[int] = []
    cand_blocks: list[int] = []
    cand_keys: list[bytes] = []
    lazy = core.config.store_mode is _LAZY
    # With tiers below host memory, what host memory cannot take this step waits:
    # its request is considered again from where it was, each step, until slots
    # free (transfers end) or the request ends (`give_up`).
    # Rules 1 (events/config.py:RULES) dropped them at once.
    defer = not lazy and bool(core.lower) and core.config.rules >= 2
    counted = core.offers is not None  # vLLM's store threshold (`offers.py`)
    if not lazy and core.config.store_jobs is _BY_REQUEST:
        for request, horizon in crossed:
            saved = (list(request.next_store), request.next_store_tokens) if defer else None
            find_stores(core, request, horizon, cand_groups, cand_blocks, cand_keys)
            if counted:
                offered(core, request.request_id, cand_groups, cand_blocks, cand_keys, 0, out)
            if cand_keys:
                if admit_store(core, request.request_id, cand_groups, cand_blocks, cand_keys, out, defer=defer):
                    assert saved is not None
                    request.next_store, request.next_store_tokens = saved
                cand_groups.clear()  # the job holds tuples of its own
                cand_blocks.clear()
                cand_keys.clear()
        return
    marks: list[tuple[RequestState, list[int], int, int, int]] = []  # deferring: each request's columns
    if defer:
        for request, horizon in crossed:
            start = len(cand_keys)
            positions, tokens = list(request.next_store), request.next_store_tokens
            find_stores(core, request, horizon, cand_groups, cand_blocks, cand_keys)
            if counted:
                offered(core, request.request_id, cand_groups, cand_blocks, cand_keys, start, out)
            if len(cand_keys) > start:
                marks.append((request, positions, tokens, start, len(cand_keys)))
    else:
        for request, horizon in crossed:
            start = len(cand_keys)
            find_stores(core, request, horizon, cand_groups, cand_blocks, cand_keys)
            if counted:
                offered(core, request.request_id, cand_groups, cand_blocks, cand_keys, start, out)
    if lazy:  # only note the keys, for when their blocks near eviction
        lazy_keys = core.lazy_keys
        for block, key in zip(cand_blocks, cand_keys):
            lazy_keys[block] = key
    elif cand_keys:  # one job for the whole step
        offer = list(cand_keys) if marks else cand_keys  # admission cuts the columns' tail
        if len(set(cand_keys)) < len(cand_keys):
            drop_repeats(cand_groups, cand_blocks, cand_keys)
        # In request order: when the tier cannot take them all, the first
        # requests' blocks are stored, each with its every group.
        refused = admit_store(core, "", cand_groups, cand_blocks, cand_keys, out, defer=defer)
        if refused:
            for request, positions, tokens, start, end in marks:
                if not refused.isdisjoint(offer[start:end]):
                    request.next_store = positions
                    request.next_store_tokens = tokens


def give_up(core: Core, request: RequestState, out: list[fx.Effect]) -> None:
    """A request ending, or preempted, with blocks that waited for host slots
    (`plan_stores`): they are not stored, and counted as not admitted. Those
    only its last step filled are not counted (the engine keeps no step's
    horizon, only the tokens computed before it)."""
    if core.config.rules < 2:  # nothing waited
        return
    if core.lower and request.num_computed_tokens and request.next_store_tokens <= request.num_computed_tokens:
        groups: list[int] = []
        blocks: list[int] = []
        keys: list[bytes] = []
        find_stores(core, request, request.num_computed_tokens, groups, blocks, keys)  # its next_store is reset after
        if keys:
            unique = tuple(dict.fromkeys(keys))
            core.stats.store_rejections += len(unique)
            out.append(fx.KeysNotAdmitted(keys=unique))


def drop_repeats(cand_groups: list[int], cand_blocks: list[int], cand_keys: list[bytes]) -> None:
    """Keep each key's first candidate. Requests of one step can share a block (a
    prefix hit on blocks allocated in the same step) or hold the same content
    twice; one copy is stored, as when each request's job was admitted in turn."""
    seen: set[bytes] = set()
    kept: list[int] = []
    for index, key in enumerate(cand_keys):
        if key not in seen:
            seen.add(key)
            kept.append(index)
    cand_groups[:] = [cand_groups[i] for i in kept]
    cand_blocks[:] = [cand_blocks[i] for i in kept]
    cand_keys[:] = [cand_keys[i] for i in kept]


def find_stores(core: Core, request: RequestState, horizon: int, cand_groups: list[int],
                 cand_blocks: list[int], cand_keys: list[bytes]) -> None:
    """Append every block of `request` that is full after this step and not yet
    in the tier (nor being written by a load) to the candidate columns."""
    slot_of_key = core.slot_of_key
    writer = core.block_writer
    next_store = request.next_store
    next_tokens = -1
    prompt_only = core.config.offload_prompt_only and horizon >= request.num_prompt_tokens
    if prompt_only:  # vLLM's `offload_prompt_only`: blocks whole within the prompt, none after
        horizon = request.num_prompt_tokens
    for (group_id, block_size, pattern, period), keys, table in zip(core.store_rules, request.keys, request.table):
        first = next_store[group_id]
        full = horizon // block_size
        if full > len(keys):
            full = len(keys)
        if full > len(table):
            full = len(table)
        if full > first:
            # One typed loop, the null test first: a window group's old positions
            # hold no block, and reading a table slot costs less than the tier
            # lookup. A decoding request has one position here; a new prompt, hundreds.
            for position in range(first, full):
                block = table[position]
                if block == NULL_BLOCK_ID:
                    continue
                key = keys[position]
                if key in slot_of_key or block in writer or (pattern is not None and not pattern[position % period]):
                    continue
                cand_groups.append(group_id)
                cand_blocks.append(block)
                cand_keys.append(key)
            next_store[group_id] = first = full
        reach = (first + 1) * block_size
        if next_tokens < 0 or reach < next_tokens:
            next_tokens = reach
    request.next_store_tokens = PAST_EVERY_HORIZON if prompt_only else max(next_tokens, 0)


def admit_store(core: Core, request_id: str, cand_groups: list[int], cand_blocks: list[int],
                 cand_keys: list[bytes], out: list[fx.Effect], *, defer: bool = False) -> frozenset[bytes]:
    """Reserve slots, evicting if needed; what cannot fit is not stored now. The
    candidates are columns (group, block, key); slots are taken in their order.
    The keys refused, when `defer` (the caller considers them again later; else
    they are counted as not admitted)."""
    wanted = len(cand_keys)
    free = len(core.free_slots) + core.config.num_tier_slots - core.next_fresh_slot  # core.num_free_slots()
    evicted: list[bytes] = []
    refused: frozenset[bytes] = _NONE
    if wanted > free:
        admitted = min(wanted, free + len(core.policy))
        if admitted < wanted:
            if defer:
                refused = frozenset(cand_keys[admitted:])
            else:
                core.stats.store_rejections += wanted - admitted
                out.append(fx.KeysNotAdmitted(keys=tuple(cand_keys[admitted:])))
            del cand_groups[admitted:], cand_blocks[admitted:], cand_keys[admitted:]
        if not cand_keys:
            return refused
        if admitted > free:
            evicted = slots.evict(core, admitted - free)
            core.stats.evictions += len(evicted)
    job_id = core.next_job_id
    core.next_job_id = job_id + 1
    candidate_slots = slots.reserve(core, cand_keys)
    block_key = core.block_key
    readers = core.block_readers
    generation = core.block_generation
    # Columns in candidate order. The planner's candidates come in group order,
    # so each group's part is one slice of the flat tuple; others are regrouped.
    candidate_gens: list[int] = []
    counts = [0] * len(core.groups)
    in_order = True
    last_group = 0
    for group_id, block, key in zip(cand_groups, cand_blocks, cand_keys):
        if group_id < last_group:
            in_order = False
        last_group = group_id
        block_key[block] = key
        reading = readers.get(block)
        if reading is None:
            readers[block] = job_id
        elif isinstance(reading, int):
            readers[block] = [reading, job_id]
        else:
            reading.append(job_id)
        candidate_gens.append(generation[block])
        counts[group_id] += 1
    keys: tuple[tuple[bytes, ...], ...]
    blocks: tuple[tuple[int, ...], ...]
    slot_ids: tuple[tuple[int, ...], ...]
    gens: tuple[tuple[int, ...], ...]
    if in_order and len(counts) == 2:  # the usual two groups: two slices each
        cut = counts[0]
        flat_keys = tuple(cand_keys)
        keys = (flat_keys[:cut], flat_keys[cut:])
        flat_ints = tuple(cand_blocks)
        blocks = (flat_ints[:cut], flat_ints[cut:])
        flat_ints = tuple(candidate_slots)
        slot_ids = (flat_ints[:cut], flat_ints[cut:])
        flat_ints = tuple(candidate_gens)
        gens = (flat_ints[:cut], flat_ints[cut:])
    elif in_order:
        spans = []
        start = 0
        for count in counts:
            spans.append((start, start + count))
            start += count
        keys = _split(tuple(cand_keys), spans)
        blocks = _split(tuple(cand_blocks), spans)
        slot_ids = _split(tuple(candidate_slots), spans)
        gens = _split(tuple(candidate_gens), spans)
    else:
        keys = _regroup(cand_groups, cand_keys, len(counts))
        blocks = _regroup(cand_groups, cand_blocks, len(counts))
        slot_ids = _regroup(cand_groups, candidate_slots, len(counts))
        gens = _regroup(cand_groups, candidate_gens, len(counts))
    job = Job(job_id, _STORE, request_id, keys, blocks, slot_ids, gens, (1 << core.config.world_size) - 1)
    start_job(job)
    core.jobs[job_id] = job
    core.stats.stores += 1
    if evicted:
        out.append(new.keys_unloadable(0, tuple(evicted), fx.Reason.EVICTED))
    if core.config.protection is _PIN:
        pinned = tuple(job.flat_blocks())
        pins = core.block_pins
        for block in pinned:
            pins[block] += 1
        out.append(fx.PinDeviceBlocks(block_ids=pinned))
    out.append(new.start_store(job_id, request_id, keys, blocks, slot_ids))
    return refused


def _split(flat: tuple[_T, ...], spans: list[tuple[int, int]]) -> tuple[tuple[_T, ...], ...]:
    return tuple([flat[start:end] for start, end in spans])


def _regroup(groups: list[int], column: list[_T], num_groups: int) -> tuple[tuple[_T, ...], ...]:
    """`column`'s items by group, each group's in their order (one pass: a step's
    job lists its requests in turn, each in group order)."""
    parts: list[list[_T]] = [[] for _ in range(num_groups)]
    for group_id, item in zip(groups, column):
        parts[group_id].append(item)
    return tuple([tuple(part) for part in parts])
