"""The correctness contract (README.md, "Correctness", states it in prose), as
checks over the state.

`check(state)` verifies everything, recounting every derived table; it costs
O(blocks + slots) and runs at digest points and in tests. `check_event`
verifies only what one event touched (its request's O(groups) facts, the
blocks it names, the jobs it created or reported on and their slots), in
C-level passes where it can, cheap enough to run after every event of a long
replay; anything it leaves out (the rest of a request's table, other
requests, recounts) the next `check` covers.

Each fast pass sits beside the item-by-item check it stands for
(`_blocks_look_fine` / `_block_problems`, `_stores_look_fine` and
`_load_looks_fine` / `_job_problems`), and they agree: a pass vouches for
exactly the parts in which the item check finds nothing
(`tests/engine/test_checks.py`).
"""

from __future__ import annotations

from collections import Counter
from itertools import chain, repeat
from operator import eq
from typing import Any, Final, cast

import attrs
from mypy_extensions import mypyc_attr

from kvledger.events import types as ev
from kvledger.events.config import Protection
from kvledger.events.types import NULL_BLOCK_ID

from .policies import ARC
from .state import ABORTING as _ABORTING
from .state import LOAD as _LOAD
from .state import LOADING as _LOADING
from .state import PREEMPTED as _PREEMPTED
from .state import SPILL as _SPILL
from .state import STORE as _STORE
from .state import STORED as _STORED
from .state import (
    STORED_CODE,
    STORING_CODE,
    Core,
    Job,
    JobKind,
    RequestState,
    SlotState,
    State,
    counts_of,
    reader_ids,
)
from .transitions import STEPPABLE

_PIN: Final = Protection.PIN
_FREE: Final = int(SlotState.FREE)
_FREE_BYTE: Final = bytes([_FREE])
_STORING_BYTE: Final = bytes([STORING_CODE])


@mypyc_attr(native_class=False)  # mypyc builds no native subclass of AssertionError
class InvariantViolation(AssertionError):
    """The state broke the contract: a bug in the engine, never the caller's fault."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
        self.problems = problems


def check(state: State) -> None:
    problems = find_problems(state.core)
    if problems:
        raise InvariantViolation(problems)


def check_event(state: State, event: ev.Event, first_new_job_id: int) -> None:
    """Check the footprint of `event`; `first_new_job_id` is `next_job_id` before it.

    The footprint is what the event touched: its request (the O(groups) facts,
    not every block of its table), the blocks it names, the jobs it created or
    reported on, and their slots. Each part has a C-level fast check; only a
    part that fails it is checked item by item, which names the problems. What
    lies outside the footprint (another request's table, a recount of every
    reference) is left to `check` at digest points and at the end.
    """
    core = state.core
    problems: list[str] = []
    has_request, has_blocks, has_job = _FOOTPRINT[type(event)]  # like the reducer, event types only
    any_event: Any = event  # its fields read by name, where `fields` says it has them
    request_id: str | None = any_event.request_id if has_request else None
    request = None if request_id is None else core.requests.get(request_id)
    if request is not None:
        _check_request_facts(core, request, problems, event.kind)
    named = any_event.block_ids if has_blocks else None
    if named:
        if type(named[0]) is tuple:
            blocks = list(chain.from_iterable(named))
            held = request is not None and event.kind in _HOLDING_KINDS and _table_ends_with(request, named)
        else:
            blocks, held = list(named), False
        # A few blocks (a decode step's, a free's) cost less one by one than in
        # the fast path's C-level passes, each a call; both find the same problems.
        if len(blocks) <= _FEW_BLOCKS or not _blocks_look_fine(core, blocks, held):
            _block_problems(core, blocks, held, request_id, problems)
    jobs = core.jobs
    job_id: int | None = any_event.job_id if has_job else None
    if job_id is not None or first_new_job_id != core.next_job_id:
        touched = [jobs.get(j) for j in range(first_new_job_id, core.next_job_id)]
        if job_id is not None:
            touched.append(jobs.get(job_id))
        if any(touched):  # an event that ended its job (most outcomes) touched none
            stores = [job for job in touched if job is not None and job.kind is _STORE]
            suspects = [] if not stores or _stores_look_fine(core, stores) else stores  # a step's new stores
            suspects += [job for job in touched if job is not None and (
                job.kind is _SPILL or (job.kind is _LOAD and not _load_looks_fine(core, job)))]
            _job_problems(core, suspects, problems)
    if problems:
        raise InvariantViolation(problems)


def _footprint_fields(kind: type) -> tuple[bool, bool, bool]:
    names = {field.name for field in attrs.fields(kind)}
    return "request_id" in names, "block_ids" in names, "job_id" in names


# Whether each event type has a request_id, block_ids and job_id, looked up per type:
# compiled, a getattr with a default makes and clears an AttributeError for a missing
# field, and that cost more than the whole check of a transfer outcome.
_FOOTPRINT = {kind: _footprint_fields(kind) for kind in ev.EVENT_TYPES}


_FEW_BLOCKS: Final = 4

# Events after which the request holds the blocks it names (if the event was applied:
# then its tables end with them).
_HOLDING_KINDS = frozenset({"blocks_allocated", "blocks_touched"})


def _table_ends_with(request: RequestState, block_ids: tuple[tuple[int, ...], ...]) -> bool:
    if len(block_ids) != len(request.table):
        return False
    for table, ids in zip(request.table, block_ids):
        if ids and table[len(table) - len(ids):] != list(ids):
            return False
    return True


# Blocks an event names: counts, readers and writer.


def _blocks_look_fine(core: Core, blocks: list[int], held: bool) -> bool:
    """`_block_problems` finds none, found by C-level passes."""
    if NULL_BLOCK_ID in blocks:  # the null block has rules of its own: never held, pinned or moved
        if (core.block_refs[0] or core.block_pins[0] or NULL_BLOCK_ID in core.block_readers
                or NULL_BLOCK_ID in core.block_writer):
            return False
        blocks = list(filter(None, blocks))
    if not blocks:
        return True
    if min(blocks) < 0:
        return False  # named by `_block_problems`
    counts = counts_of(blocks)  # reading them is the upper bound check
    try:
        if min(counts(core.block_refs)) <= (0 if held else -1):
            return False
    except IndexError:
        return False  # named by `_block_problems`
    # Pins change only with pinning stores (their jobs are checked); in flush mode never.
    if core.config.protection is _PIN and min(counts(core.block_pins)) < 0:
        return False
    readers = core.block_readers
    if readers and not readers.keys().isdisjoint(blocks):
        jobs = core.jobs
        for block in readers.keys() & set(blocks):
            for job_id in reader_ids(readers[block]):
                job = jobs.get(job_id)
                if job is None or job.flushed:
                    return False
    writer = core.block_writer
    if writer and not writer.keys().isdisjoint(blocks):
        refs_of = core.block_refs
        if any(refs_of[block] <= 0 for block in writer.keys() & set(blocks)):
            return False
    return True


def _block_problems(core: Core, blocks: list[int], held: bool, request_id: str | None,
                    problems: list[str]) -> None:
    """`_check_block` of each block and, if the request `request_id` now `held`
    them, a positive count."""
    for block in blocks:
        if not 0 <= block < len(core.block_refs):
            problems.append(f"block {block}: outside the device pool [0, {len(core.block_refs)})")
            continue
        _check_block(core, block, problems)
        if held and block != NULL_BLOCK_ID and core.block_refs[block] <= 0:
            problems.append(f"request {request_id}: holds block {block} whose ref count "
                            f"is {core.block_refs[block]}")


# Jobs an event created or reported on, and their slots.


def _frame_looks_fine(core: Core, job: Job) -> bool:
    """A job's pending workers and id in range, and its keys, blocks and slots aligned."""
    shape = list(map(len, job.keys))
    return (0 < job.pending_workers < 1 << core.config.world_size and 0 < job.job_id < core.next_job_id
            and shape == list(map(len, job.block_ids)) and shape == list(map(len, job.slot_ids)))


def _stores_look_fine(core: Core, jobs: list[Job]) -> bool:
    """`_check_job` and `_check_slot` of store jobs, in one typed pass over all
    their rows (a step plans one per request that reached a storable block);
    False for anything it does not vouch for."""
    slot_state = core.slot_state
    slot_key = core.slot_key
    slot_loads = core.slot_loads
    generation = core.block_generation
    readers = core.block_readers
    keys: list[bytes] = []
    slots: list[int] = []
    for job in jobs:
        if not _frame_looks_fine(core, job):
            return False
        jid = job.job_id
        reading = not job.flushed  # a flushed store's sources are free
        if reading and list(map(len, job.generations)) != list(map(len, job.block_ids)):
            return False
        for group_keys, group_blocks, group_slots, group_gens in zip(
                job.keys, job.block_ids, job.slot_ids, job.generations if reading else repeat(())):
            for i, slot in enumerate(group_slots):
                block = group_blocks[i]
                if block == NULL_BLOCK_ID or slot_state[slot] != STORING_CODE or slot_key[slot] != group_keys[i]:
                    return False
                if reading:
                    if generation[block] != group_gens[i]:
                        return False
                    reader = readers.get(block)
                    if reader is None or (reader != jid if isinstance(reader, int) else jid not in reader):
                        return False
            keys.extend(group_keys)
            slots.extend(group_slots)
    return not ((slot_loads and not slot_loads.keys().isdisjoint(slots))
                or _offered_as_evictable(core, keys, slots))  # a storing slot is never evictable


def _load_looks_fine(core: Core, job: Job) -> bool:
    """`_check_job` and `_check_slot` of a load job, as C-level passes; False for
    anything a pass does not vouch for (then each item is checked on its own)."""
    jid = job.job_id
    if not _frame_looks_fine(core, job):
        return False
    if job.promote_tiers:  # rare: the item checks are the pass
        problems: list[str] = []
        _job_problems(core, [job], problems)
        return not problems
    slots = list(chain.from_iterable(job.slot_ids))
    if not slots:
        return True
    keys = list(chain.from_iterable(job.keys))
    blocks = list(chain.from_iterable(job.block_ids))
    loads = core.slot_loads
    if (NULL_BLOCK_ID in blocks
            or not all(map(_STORED.__eq__, map(core.slot_state.__getitem__, slots)))
            or list(map(core.slot_key.__getitem__, slots)) != keys
            or not all(map(loads.__contains__, slots)) or min(map(loads.__getitem__, slots)) <= 0
            or not all(map(eq, repeat(jid), map(core.block_writer.get, blocks)))  # not jid.__eq__: None
            or _offered_as_evictable(core, keys, slots)):  # a pinned slot is never evictable
        return False
    request = core.requests.get(job.request_id)
    return request is None or request.load_job_id != jid or set(request.held_blocks()).issuperset(blocks)


def _offered_as_evictable(core: Core, keys: list[bytes], slots: list[int]) -> bool:
    """Whether the policy holds a key its slot still serves (`_check_slot`'s test for
    a slot that is not evictable). A key the policy holds for another slot (dropped
    by a reset, stored again since) is no problem; the C-level pass rules out most."""
    if not core.policy.holds_any(keys):
        return False
    policy = core.policy
    slot_of_key = core.slot_of_key
    return any(key in policy and slot_of_key.get(key) == slot for key, slot in zip(keys, slots))


def _job_problems(core: Core, jobs: list[Job], problems: list[str]) -> None:
    """`_check_job` of each job, and `_check_slot` of each of its slots."""
    for job in jobs:
        _check_job(core, job, problems)
        for slots in job.slot_ids:
            for slot in slots:
                if slot >= 0:  # -1: a promotion that got no slot
                    _check_slot(core, slot, problems)


def find_problems(core: Core) -> list[str]:
    problems: list[str] = []
    for request in core.requests.values():
        _check_request(core, request, problems)
    for job in core.jobs.values():
        _check_job(core, job, problems)
    _check_block_counts(core, problems)
    _check_tier(core, problems)
    _check_offers(core, problems)
    if core.pressure is not None and (len(core.pressure) != len(core.lower) or any(
            not 0 <= drop <= 1_000_000 or not 0 <= owed < 1_000_000 for drop, owed in core.pressure)):
        problems.append(f"the lower tiers' pressure is not a share and a debt below one per tier: {core.pressure}")
    return problems


def _check_offers(core: Core, problems: list[str]) -> None:
    """The store threshold's tracker: within `max_tracker_size`, each key with a count of
    at least one and its last offerer, in one order."""
    offers = core.offers
    if (offers is not None) != (core.config.store_threshold >= 2):
        problems.append(f"an offer tracker {'without' if offers is None else 'beside'} a store threshold of "
                        f"{core.config.store_threshold}")
        return
    if offers is None:
        return
    if len(offers.counts) > core.config.max_tracker_size:
        problems.append(f"the offer tracker holds {len(offers.counts)} keys, past max_tracker_size "
                        f"{core.config.max_tracker_size}")
    if list(offers.counts) != list(offers.last) or min(offers.counts.values(), default=1) < 1:
        problems.append("the offer tracker's counts and last offerers differ in keys or order, or a count is 0")


def _check_request(core: Core, request: RequestState, problems: list[str]) -> None:
    _check_request_facts(core, request, problems)
    rid = request.request_id
    for group in core.groups:
        table = request.table[group.group_id]
        for block in table:
            if block != NULL_BLOCK_ID and core.block_refs[block] <= 0:
                problems.append(f"request {rid}: holds block {block} whose ref count is {core.block_refs[block]}")
        floor = request.free_floor[group.group_id]
        if floor > len(table) or table[:floor].count(NULL_BLOCK_ID) != floor:
            problems.append(f"request {rid}: group {group.group_id} has a held block below its free floor {floor}")
    point = request.free_point(core.free_rules)
    if request.next_free_tokens != point:  # above it, the planner would miss a free
        problems.append(f"request {rid}: next_free_tokens {request.next_free_tokens}, not its free point {point}")


def _check_request_facts(core: Core, request: RequestState, problems: list[str], kind: str = "") -> None:
    """What holds of a request in O(groups): its status, load, keys and derived counts.
    With an event `kind`, only the facts that kind can change (all of them without)."""
    rid = request.request_id
    status = request.status
    has_load = request.load_job_id != -1
    if (status is _LOADING or status is _ABORTING) != has_load:
        problems.append(f"request {rid}: status {status.value} with load job {request.load_job_id}")
    if has_load:
        job = core.jobs.get(request.load_job_id)
        if job is None or job.kind is not _LOAD or job.request_id != rid:
            problems.append(f"request {rid}: load job {request.load_job_id} is not its open load")
    if status is _PREEMPTED and any(request.table):
        problems.append(f"request {rid}: preempted but still holds blocks")
    if not kind or kind in _HASHING_KINDS:
        hashes = len(request.hashes)
        for group_id, (keys, (per_block, _suffix)) in enumerate(zip(request.keys, core.key_rules)):
            if len(keys) != hashes // per_block:
                problems.append(f"request {rid}: group {group_id} keys do not match its hashes")
    if not kind or kind not in _TABLE_KEEPING_KINDS:
        capacity = request.table_tokens(core.block_sizes)
        limit = capacity if status in STEPPABLE else -1  # the reducer's rule, from the same table
        if request.capacity_tokens != capacity or request.step_limit != limit:
            problems.append(f"request {rid}: derived counts (capacity {request.capacity_tokens}, step limit "
                            f"{request.step_limit}) differ from its table and status ({capacity}, {limit})")


# Kinds that change a request's hashes; kinds that change neither its table's length nor its status.
_HASHING_KINDS = frozenset({"request_added", "block_hashes_appended"})
_TABLE_KEEPING_KINDS = frozenset({"block_hashes_appended", "blocks_freed"})


def _check_block(core: Core, block: int, problems: list[str]) -> None:
    if block == NULL_BLOCK_ID:
        if core.block_refs[0] or core.block_pins[0] or 0 in core.block_readers or 0 in core.block_writer:
            problems.append("the null block is held, pinned or transferred")
        return
    # Pin counts only in pin mode: nothing else changes them, and `check` recounts them.
    if core.block_refs[block] < 0 or (core.config.protection is _PIN and core.block_pins[block] < 0):
        problems.append(f"block {block}: negative count (refs={core.block_refs[block]}, pins={core.block_pins[block]})")
    for job_id in reader_ids(core.block_readers.get(block, [])):
        job = core.jobs.get(job_id)
        if job is None or job.flushed:
            problems.append(f"block {block}: stale reader job {job_id}")
    writer = core.block_writer.get(block)
    if writer is not None and core.block_refs[block] <= 0:
        problems.append(f"block {block}: load {writer} writes a block nobody holds")


def _check_job(core: Core, job: Job, problems: list[str]) -> None:
    jid = job.job_id
    everyone = (1 << core.config.world_size) - 1
    if not 0 < job.pending_workers <= everyone or job.pending_workers & ~everyone:
        problems.append(f"job {jid}: pending workers {job.pending_workers:b} out of range")
    if not 0 < jid < core.next_job_id:
        problems.append(f"job {jid}: id not yet issued")
    if job.kind is _SPILL:
        _check_spill(core, job, problems)
        return
    shape = [len(k) for k in job.keys]
    if shape != [len(b) for b in job.block_ids] or shape != [len(s) for s in job.slot_ids]:
        problems.append(f"job {jid}: keys, blocks and slots are not aligned")
    promote = job.promote_tiers or tuple(repeat((), len(job.keys)))
    if job.promote_tiers and [len(t) for t in job.promote_tiers] != shape:
        problems.append(f"job {jid}: promotion tiers are not aligned with its keys")
    for group_keys, group_blocks, group_slots, group_tiers in zip(job.keys, job.block_ids, job.slot_ids, promote):
        for key, block, slot, tier in zip(group_keys, group_blocks, group_slots, group_tiers or repeat(0)):
            if tier:
                _check_promotion(core, job, key, block, slot, tier, problems)
                continue
            if block == NULL_BLOCK_ID:
                problems.append(f"job {jid}: moves the null block")
            if core.slot_state[slot] == SlotState.FREE:
                problems.append(f"job {jid}: uses free slot {slot}")
            elif core.slot_key[slot] != key:
                problems.append(f"job {jid}: slot {slot} holds another key")
            if job.kind is JobKind.STORE and core.slot_state[slot] != SlotState.STORING:
                problems.append(f"job {jid}: store target slot {slot} is not storing")
            if job.kind is JobKind.LOAD:
                if core.slot_state[slot] != SlotState.STORED or core.slot_loads.get(slot, 0) <= 0:
                    problems.append(f"job {jid}: load source slot {slot} is not stored and pinned")
                if core.block_writer.get(block) != jid:
                    problems.append(f"job {jid}: target block {block} is not marked as being loaded")
    if job.kind is JobKind.STORE and not job.flushed:
        # Contract 1: a store's source is never overwritten while it reads it.
        for group_blocks, group_gens in zip(job.block_ids, job.generations):
            for block, generation in zip(group_blocks, group_gens):
                if core.block_generation[block] != generation:
                    problems.append(f"job {jid}: source block {block} was reallocated while the store reads it")
                if jid not in reader_ids(core.block_readers.get(block, [])):
                    problems.append(f"job {jid}: source block {block} does not record its reader")
    if job.kind is JobKind.LOAD:
        # Contract 2: a load's destination stays held by its request until the load ends.
        request = core.requests.get(job.request_id)
        if request is not None and request.load_job_id == jid:
            held = set(request.held_blocks())
            for block in job.flat_blocks():
                if block not in held:
                    problems.append(f"job {jid}: target block {block} is no longer held by {job.request_id}")


def _check_promotion(core: Core, job: Job, key: bytes, block: int, slot: int, tier: int,
                     problems: list[str]) -> None:
    """A key a load reads from a lower tier into a host slot of its own (or, with
    no slot to be had, not at all: that block fails)."""
    jid = job.job_id
    if block == NULL_BLOCK_ID:
        problems.append(f"job {jid}: moves the null block")
    if core.block_writer.get(block) != jid:
        problems.append(f"job {jid}: target block {block} is not marked as being loaded")
    if not 0 < tier <= len(core.lower):
        problems.append(f"job {jid}: promotes from tier {tier}, which does not exist")
        return
    if slot < 0:
        return
    if core.slot_state[slot] != SlotState.STORING or core.slot_key[slot] != key:
        problems.append(f"job {jid}: promotion slot {slot} is not storing its key")
    if core.lower[tier - 1].reading.get(key, 0) <= 0:
        problems.append(f"job {jid}: tier {tier} does not record that key {key.hex()[:16]} is being read")


def _check_spill(core: Core, job: Job, problems: list[str]) -> None:
    """A spill reads stored host slots and writes keys its tier records as being written."""
    jid = job.job_id
    if [len(k) for k in job.keys] != [len(s) for s in job.slot_ids] or any(job.block_ids):
        problems.append(f"job {jid}: a spill's keys and slots are not aligned, or it names device blocks")
    if not 0 < job.tier <= len(core.lower):
        problems.append(f"job {jid}: spills to tier {job.tier}, which does not exist")
        return
    writing = core.lower[job.tier - 1].writing
    for group_keys, group_slots in zip(job.keys, job.slot_ids):
        for key, slot in zip(group_keys, group_slots):
            if core.slot_state[slot] != SlotState.STORED or core.slot_key[slot] != key:
                problems.append(f"job {jid}: spill source slot {slot} does not hold its key stored")
            if core.spill_reads.get(slot, 0) <= 0 or core.slot_loads.get(slot, 0) < core.spill_reads[slot]:
                problems.append(f"job {jid}: spill source slot {slot} is not counted as read")
            if writing.get(key) != jid:
                problems.append(f"job {jid}: tier {job.tier} does not record the spill writing {key.hex()[:16]}")


def _check_slot(core: Core, slot: int, problems: list[str]) -> None:
    state = core.slot_state[slot]
    key = core.slot_key[slot]
    if (state == SlotState.FREE) != (key is None):
        problems.append(f"slot {slot}: state {SlotState(state).name} with key {key!r:.20}")
    if key is not None and core.slot_of_key.get(key) == slot:
        evictable = state == SlotState.STORED and slot not in core.slot_loads
        if evictable != (key in core.policy):
            problems.append(f"slot {slot}: evictable={evictable} but policy membership disagrees")
    if slot in core.slot_loads and state != SlotState.STORED:
        problems.append(f"slot {slot}: loads from a slot that is not stored")


def _check_block_counts(core: Core, problems: list[str]) -> None:
    refs: Counter[int] = Counter()
    for request in core.requests.values():
        refs.update(request.held_blocks())
    for block, count in enumerate(core.block_refs):
        if count != refs.get(block, 0):
            problems.append(f"block {block}: ref count {count}, held {refs.get(block, 0)} times")
    if core.block_refs[0] or core.block_pins[0]:
        problems.append("the null block is held or pinned")
    readers: dict[int, list[int]] = {}
    writers: dict[int, int] = {}
    pins: Counter[int] = Counter()
    for job in core.jobs.values():
        if job.kind is JobKind.STORE:
            if core.config.protection is Protection.PIN:
                pins.update(job.flat_blocks())
            if not job.flushed:
                for block in job.flat_blocks():
                    readers.setdefault(block, []).append(job.job_id)
        elif job.kind is JobKind.LOAD:
            for block in job.flat_blocks():
                if block in writers:
                    problems.append(f"block {block}: two loads write it")
                writers[block] = job.job_id
    if {b: sorted(j) for b, j in readers.items()} != {b: sorted(reader_ids(j)) for b, j in core.block_readers.items()}:
        problems.append("block readers do not match the unflushed stores")
    if writers != core.block_writer:
        problems.append("block writers do not match the open loads")
    for block, count in enumerate(core.block_pins):
        if count != pins.get(block, 0):
            problems.append(f"block {block}: {count} pins, {pins.get(block, 0)} pinning stores")


def _check_tier(core: Core, problems: list[str]) -> None:
    index = core.slot_of_key
    indexed = list(index.values())
    # Each index entry's slot holds its key and is in use: one C-level pass each, item by item
    # only where they differ (a slot past the table raises there, as it always did).
    try:
        clean = list(map(core.slot_key.__getitem__, indexed)) == list(index.keys())
        codes = bytes(map(core.slot_state.__getitem__, indexed))
    except IndexError:
        clean, codes = False, b""
    if not clean or _FREE_BYTE in codes:
        for key, slot in index.items():
            if core.slot_key[slot] != key or core.slot_state[slot] == SlotState.FREE:
                problems.append(f"slot {slot}: index points at a slot holding another key or none")
    used: Counter[int] = Counter()
    loads: Counter[int] = Counter()
    spills: Counter[int] = Counter()
    for job in core.jobs.values():
        promote = job.promote_tiers or [()] * len(job.slot_ids)
        for slots, tiers in zip(job.slot_ids, promote):
            used.update(s for s in slots if s >= 0)
            if job.kind is JobKind.LOAD:
                loads.update(s for s, t in zip(slots, tiers or repeat(0)) if not t)
            elif job.kind is JobKind.SPILL:
                loads.update(slots)
                spills.update(slots)
    if dict(loads) != core.slot_loads:
        problems.append("slot load counts do not match the open loads and spills")
    if dict(spills) != core.spill_reads:
        problems.append("slot spill counts do not match the open spills")
    _check_lower(core, problems)
    free = set(core.free_slots)
    if len(free) != len(core.free_slots):
        problems.append("a slot is on the free list twice")
    if any(core.slot_state[core.next_fresh_slot:]):
        problems.append("a slot beyond the fresh mark is in use")
    if not _slots_look_fine(core, free, used):
        _slot_problems(core, free, used, problems)
    if isinstance(core.policy, ARC):
        arc = core.policy
        if len(arc.t1) + len(arc.t2) > arc.capacity or len(arc.b1) + len(arc.b2) > arc.capacity:
            problems.append("arc: a list pair exceeds capacity")
        if not 0 <= arc.p <= arc.capacity:
            problems.append(f"arc: target {arc.p} out of [0, {arc.capacity}]")
    # The indexed slots that are stored and not being read.
    evictable = codes.count(STORED_CODE)
    if core.slot_loads:
        times = Counter(indexed)
        for slot in core.slot_loads:
            count = times.get(slot, 0)
            if count and core.slot_state[slot] == STORED_CODE:
                evictable -= count
    if evictable != len(core.policy):
        problems.append(f"policy holds {len(core.policy)} keys, {evictable} are evictable")


def _slot_problems(core: Core, free: set[int], used: Counter[int], problems: list[str]) -> None:
    """Each slot below the fresh mark, item by item: its state, key, index entry, policy
    membership and loads, against the free list and the open jobs' slots (`used`)."""
    for slot in range(core.next_fresh_slot):
        state = core.slot_state[slot]
        if slot in free:
            if state != SlotState.FREE:
                problems.append(f"slot {slot}: on the free list but {SlotState(state).name}")
            else:
                _check_slot(core, slot, problems)  # a free slot holds no key and no load
            continue
        if state == SlotState.FREE:
            problems.append(f"slot {slot}: FREE but neither fresh nor on the free list")
            continue
        _check_slot(core, slot, problems)
        held_key = core.slot_key[slot]
        if (held_key is None or core.slot_of_key.get(held_key) != slot) and not used[slot]:
            problems.append(f"slot {slot}: dropped from the index but no job will free it")
        if state == SlotState.STORING and used[slot] != 1:
            problems.append(f"slot {slot}: storing without exactly one store job")


def _slots_look_fine(core: Core, free: set[int], used: Counter[int]) -> bool:
    """`_slot_problems` finds none, found by C-level passes: every slot in use holds a key
    indexed at it, the evictable ones' keys (and no other) are in the policy, a storing slot
    has its one store and a loaded slot is stored; one dropped from the index has a job
    that will free it. A long log's `replay --check` spent most of its full checks' time
    in the item check."""
    n = core.next_fresh_slot
    states = core.slot_state
    keys = core.slot_key
    loads = core.slot_loads
    freed = [slot for slot in free if slot < n]
    for slot in freed:
        if states[slot] != _FREE or keys[slot] is not None or slot in loads:
            return False
    if freed:
        gone = set(freed)
        in_use = [slot for slot in range(n) if slot not in gone]
        held = [keys[slot] for slot in in_use]
        codes = bytes([states[slot] for slot in in_use])
    else:
        in_use = list(range(n))
        held = keys[:n]
        codes = bytes(states[:n])
    if _FREE_BYTE in codes or None in held:
        return False
    present = cast("list[bytes]", held)
    exempt: set[int] = set()  # dropped from the index (a job will free it): no policy rule
    indexed: list[int | None] = [core.slot_of_key.get(key) for key in present]
    if indexed != in_use:
        for at, slot in zip(indexed, in_use):
            if at != slot:
                if not used[slot]:
                    return False
                exempt.add(slot)
    busy: set[int] = set()  # not evictable: storing, or read by a load
    at = codes.find(_STORING_BYTE)
    while at >= 0:
        slot = in_use[at]
        if used[slot] != 1:
            return False
        busy.add(slot)
        at = codes.find(_STORING_BYTE, at + 1)
    for slot in loads:
        if slot < n:
            if states[slot] != STORED_CODE:
                return False
            busy.add(slot)
    policy = core.policy
    busy -= exempt
    for slot in busy:
        if cast(bytes, keys[slot]) in policy:
            return False
    exempt_held = 0
    for slot in exempt:
        if cast(bytes, keys[slot]) in policy:
            exempt_held += 1
    return sum(map(policy.__contains__, present)) - exempt_held == len(in_use) - len(exempt) - len(busy)


def _check_lower(core: Core, problems: list[str]) -> None:
    """Each lower tier: held and written keys apart and within capacity (keys being
    read may hold it over until their loads end), and its records of what is
    being written and read match the open spills and loads."""
    writing: list[dict[bytes, int]] = [{} for _ in core.lower]
    reading: list[Counter[bytes]] = [Counter() for _ in core.lower]
    for job in core.jobs.values():
        if job.kind is JobKind.SPILL and 0 < job.tier <= len(core.lower):
            for keys in job.keys:
                writing[job.tier - 1].update(dict.fromkeys(keys, job.job_id))
        for tier, key, slot, _ in job.promoted():
            if slot >= 0 and 0 < tier <= len(core.lower):
                reading[tier - 1][key] += 1
    for index, lower in enumerate(core.lower, start=1):
        if not lower.held.isdisjoint(lower.writing):
            problems.append(f"tier {index}: a key is both held and being written")
        pinned = sum(1 for key in lower.reading if key in lower.held)
        if len(lower.held) + len(lower.writing) - pinned > lower.capacity:
            problems.append(f"tier {index}: {len(lower.held)} held and {len(lower.writing)} being written "
                            f"exceed its capacity of {lower.capacity}")
        if writing[index - 1] != lower.writing:
            problems.append(f"tier {index}: keys being written do not match the open spills")
        if dict(reading[index - 1]) != lower.reading:
            problems.append(f"tier {index}: keys being read do not match the open loads")
