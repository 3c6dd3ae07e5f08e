"""The correctness contract (DESIGN.md §Correctness, protocol reference §5.7),
as checks over the state.

`check(state)` verifies everything, recounting every derived table; it costs
O(blocks + slots) and runs at digest points and in tests. `check_event`
verifies only what one event touched (its request, its blocks, its job and
their slots), cheap enough to run after every event of a long replay.
"""

from __future__ import annotations

from collections import Counter

from kvledger.events import types as ev
from kvledger.events.config import Protection
from kvledger.events.types import NULL_BLOCK_ID

from .policies import ARC
from .state import Core, Job, JobKind, RequestState, RequestStatus, SlotState, State


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
    """Check the footprint of `event`; `first_new_job_id` is `next_job_id` before it."""
    core = state.core
    problems: list[str] = []
    request = core.requests.get(getattr(event, "request_id", ""))
    if request is not None:
        _check_request(core, request, problems)
    for ids in getattr(event, "block_ids", ()):
        for block in ids if isinstance(ids, tuple) else (ids,):
            _check_block(core, block, problems)
    touched_jobs = [core.jobs.get(j) for j in range(first_new_job_id, core.next_job_id)]
    job = core.jobs.get(getattr(event, "job_id", -1))
    for j in [*touched_jobs, job]:
        if j is not None:
            _check_job(core, j, problems)
            for slots in j.slot_ids:
                for slot in slots:
                    _check_slot(core, slot, problems)
    if problems:
        raise InvariantViolation(problems)


def find_problems(core: Core) -> list[str]:
    problems: list[str] = []
    for request in core.requests.values():
        _check_request(core, request, problems)
    for job in core.jobs.values():
        _check_job(core, job, problems)
    _check_block_counts(core, problems)
    _check_tier(core, problems)
    return problems


def _check_request(core: Core, request: RequestState, problems: list[str]) -> None:
    rid = request.request_id
    status = request.status
    has_load = request.load_job_id != -1
    if (status in (RequestStatus.LOADING, RequestStatus.ABORTING)) != has_load:
        problems.append(f"request {rid}: status {status.value} with load job {request.load_job_id}")
    if has_load:
        job = core.jobs.get(request.load_job_id)
        if job is None or job.kind is not JobKind.LOAD or job.request_id != rid:
            problems.append(f"request {rid}: load job {request.load_job_id} is not its open load")
    if status is RequestStatus.PREEMPTED and any(request.table):
        problems.append(f"request {rid}: preempted but still holds blocks")
    for group in core.groups:
        per_block = group.block_size // core.config.hash_block_size
        if len(request.keys[group.group_id]) != len(request.hashes) // per_block:
            problems.append(f"request {rid}: group {group.group_id} keys do not match its hashes")
        for block in request.table[group.group_id]:
            if block != NULL_BLOCK_ID and core.block_refs[block] <= 0:
                problems.append(f"request {rid}: holds block {block} whose ref count is {core.block_refs[block]}")


def _check_block(core: Core, block: int, problems: list[str]) -> None:
    if block == NULL_BLOCK_ID:
        if core.block_refs[0] or core.block_pins[0] or 0 in core.block_readers or 0 in core.block_writer:
            problems.append("the null block is held, pinned or transferred")
        return
    if core.block_refs[block] < 0 or core.block_pins[block] < 0:
        problems.append(f"block {block}: negative count (refs={core.block_refs[block]}, pins={core.block_pins[block]})")
    for job_id in core.block_readers.get(block, ()):
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
    shape = [len(k) for k in job.keys]
    if shape != [len(b) for b in job.block_ids] or shape != [len(s) for s in job.slot_ids]:
        problems.append(f"job {jid}: keys, blocks and slots are not aligned")
    for group_keys, group_blocks, group_slots in zip(job.keys, job.block_ids, job.slot_ids):
        for key, block, slot in zip(group_keys, group_blocks, group_slots):
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
                if jid not in core.block_readers.get(block, ()):
                    problems.append(f"job {jid}: source block {block} does not record its reader")
    if job.kind is JobKind.LOAD:
        # Contract 2: a load's destination stays held by its request until the load ends.
        request = core.requests.get(job.request_id)
        if request is not None and request.load_job_id == jid:
            held = set(request.held_blocks())
            for block in job.flat_blocks():
                if block not in held:
                    problems.append(f"job {jid}: target block {block} is no longer held by {job.request_id}")


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
        else:
            for block in job.flat_blocks():
                if block in writers:
                    problems.append(f"block {block}: two loads write it")
                writers[block] = job.job_id
    if {b: sorted(j) for b, j in readers.items()} != {b: sorted(j) for b, j in core.block_readers.items()}:
        problems.append("block readers do not match the unflushed stores")
    if writers != core.block_writer:
        problems.append("block writers do not match the open loads")
    for block, count in enumerate(core.block_pins):
        if count != pins.get(block, 0):
            problems.append(f"block {block}: {count} pins, {pins.get(block, 0)} pinning stores")


def _check_tier(core: Core, problems: list[str]) -> None:
    for key, slot in core.slot_of_key.items():
        if core.slot_key[slot] != key or core.slot_state[slot] == SlotState.FREE:
            problems.append(f"slot {slot}: index points at a slot holding another key or none")
    used: Counter[int] = Counter()
    loads: Counter[int] = Counter()
    for job in core.jobs.values():
        for slots in job.slot_ids:
            used.update(slots)
            if job.kind is JobKind.LOAD:
                loads.update(slots)
    if dict(loads) != core.slot_loads:
        problems.append("slot load counts do not match the open loads")
    free = set(core.free_slots)
    if len(free) != len(core.free_slots):
        problems.append("a slot is on the free list twice")
    if any(core.slot_state[core.next_fresh_slot:]):
        problems.append("a slot beyond the fresh mark is in use")
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
        key = core.slot_key[slot]
        if core.slot_of_key.get(key) != slot and not used[slot]:  # type: ignore[arg-type]
            problems.append(f"slot {slot}: dropped from the index but no job will free it")
        if state == SlotState.STORING and used[slot] != 1:
            problems.append(f"slot {slot}: storing without exactly one store job")
    if isinstance(core.policy, ARC):
        arc = core.policy
        if len(arc.t1) + len(arc.t2) > arc.capacity or len(arc.b1) + len(arc.b2) > arc.capacity:
            problems.append("arc: a list pair exceeds capacity")
        if not 0 <= arc.p <= arc.capacity:
            problems.append(f"arc: target {arc.p} out of [0, {arc.capacity}]")
    evictable = sum(1 for k, s in core.slot_of_key.items()
                    if core.slot_state[s] == SlotState.STORED and s not in core.slot_loads)
    if evictable != len(core.policy):
        problems.append(f"policy holds {len(core.policy)} keys, {evictable} are evictable")
