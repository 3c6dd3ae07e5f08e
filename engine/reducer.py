"""reduce(state, event) -> Transition(state, effects): every transition lives here.

Each handler first validates the event against the state and raises
`ProtocolViolation` before touching anything; only then does it apply the
change. So a rejected event leaves the state exactly as it was: the default
mode returns it with a `ReportViolation` effect, strict mode (tests, replay)
raises. A broken internal invariant is an `assert`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvledger.events import types as ev
from kvledger.events.config import Protection, StoreMode
from kvledger.events.types import NULL_BLOCK_ID

from . import effects as fx
from . import hma
from .state import Core, Job, JobKind, RequestState, RequestStatus, SlotState, State
from .transitions import request_move


class ProtocolViolation(Exception):
    """The caller's event breaks the protocol; it was not applied."""

    def __init__(self, code: str, message: str, *, request_id: str = "", job_id: int = -1) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.job_id = job_id


class Transition(NamedTuple):
    state: State
    effects: tuple[fx.Effect, ...]


Effects = list


def reduce(state: State, event: ev.Event, *, strict: bool = False) -> Transition:
    core = state.take()
    out: Effects = []
    try:
        _HANDLERS[type(event)](core, event, out)
    except ProtocolViolation as violation:
        if strict:
            state.restore(core)
            raise
        out = [fx.ReportViolation(
            code=violation.code, message=violation.message, event_kind=event.kind,
            request_id=violation.request_id, job_id=violation.job_id,
        )]
    return Transition(State(core), tuple(out))


def reduce_step(state: State, events: list[ev.Event] | tuple[ev.Event, ...], *, strict: bool = False) -> Transition:
    """Apply one scheduler step's events; equal to folding `reduce`."""
    collected: list[fx.Effect] = []
    for event in events:
        state, produced = reduce(state, event, strict=strict)
        collected.extend(produced)
    return Transition(state, tuple(collected))


# Validation helpers: they raise, never mutate.


def _request(core: Core, request_id: str, kind: str) -> RequestState:
    request = core.requests.get(request_id)
    legal, _ = request_move(request.status if request else None, kind)
    if not legal:
        status = request.status.value if request else "unknown"
        raise ProtocolViolation("illegal_request_event", f"{kind} for {status} request {request_id!r}",
                                request_id=request_id)
    return request  # type: ignore[return-value]  # None only for request_added


def _check_group_shape(core: Core, block_ids: ev.BlockIdsByGroup, request_id: str) -> None:
    if len(block_ids) != len(core.groups):
        raise ProtocolViolation(
            "bad_group_count", f"{len(block_ids)} block lists for {len(core.groups)} KV groups",
            request_id=request_id)
    limit = core.config.num_device_blocks
    for ids in block_ids:
        for block in ids:
            if not 0 <= block < limit:
                raise ProtocolViolation("block_out_of_range", f"block {block} not in [0, {limit})",
                                        request_id=request_id)


def _job(core: Core, job_id: int, kind: JobKind, worker: int) -> Job:
    job = core.jobs.get(job_id)
    if job is None or job.kind is not kind:
        raise ProtocolViolation("unknown_job", f"no {kind.value} job {job_id} in flight", job_id=job_id)
    if not 0 <= worker < core.config.world_size:
        raise ProtocolViolation("bad_worker", f"worker {worker} not in [0, {core.config.world_size})",
                                job_id=job_id)
    if not job.pending_workers >> worker & 1:
        raise ProtocolViolation("duplicate_completion", f"worker {worker} already reported job {job_id}",
                                job_id=job_id)
    return job


# Handlers.


def _request_added(core: Core, event: ev.RequestAdded, out: Effects) -> None:
    rid = event.request_id
    _request(core, rid, event.kind)
    if event.num_prompt_tokens <= 0:
        raise ProtocolViolation("bad_prompt", f"num_prompt_tokens={event.num_prompt_tokens}", request_id=rid)
    if len(event.block_hashes) > event.num_prompt_tokens // core.config.hash_block_size:
        raise ProtocolViolation(
            "too_many_hashes", f"{len(event.block_hashes)} hashes for {event.num_prompt_tokens} tokens",
            request_id=rid)
    request = RequestState(rid, event.num_prompt_tokens, core.groups)
    _append_hashes(core, request, event.block_hashes)
    core.requests[rid] = request


def _append_hashes(core: Core, request: RequestState, hashes: tuple[bytes, ...]) -> None:
    request.hashes.extend(hashes)
    for group in core.groups:
        hma.extend_keys(request.keys[group.group_id], request.hashes, group, core.config.hash_block_size)


def _block_hashes_appended(core: Core, event: ev.BlockHashesAppended, out: Effects) -> None:
    rid = event.request_id
    request = _request(core, rid, event.kind)
    if event.num_tokens < request.num_tokens:
        raise ProtocolViolation("tokens_shrank", f"num_tokens {request.num_tokens} -> {event.num_tokens}",
                                request_id=rid)
    total = len(request.hashes) + len(event.block_hashes)
    if total > event.num_tokens // core.config.hash_block_size:
        raise ProtocolViolation("too_many_hashes", f"{total} hashes for {event.num_tokens} tokens",
                                request_id=rid)
    request.num_tokens = event.num_tokens
    _append_hashes(core, request, event.block_hashes)


def _blocks_touched(core: Core, event: ev.BlocksTouched, out: Effects) -> None:
    rid = event.request_id
    request = _request(core, rid, event.kind)
    _check_group_shape(core, event.block_ids, rid)
    if any(request.table):
        raise ProtocolViolation("touch_after_alloc", "prefix blocks must be touched before allocation",
                                request_id=rid)
    spans = {len(ids) * g.block_size for ids, g in zip(event.block_ids, core.groups)}
    if len(spans) != 1:
        raise ProtocolViolation("unaligned_touch", f"touched spans differ across groups: {sorted(spans)}",
                                request_id=rid)
    for group, ids in zip(core.groups, event.block_ids):
        keys = request.keys[group.group_id]
        for position, block in enumerate(ids):
            if block == NULL_BLOCK_ID:
                continue
            if block in core.block_writer:
                raise ProtocolViolation("touch_loading_block", f"block {block} is still being loaded",
                                        request_id=rid)
            known = core.block_key[block]
            if known is not None and position < len(keys) and known != keys[position]:
                raise ProtocolViolation(
                    "touch_wrong_content",
                    f"block {block} holds {known.hex()[:16]}…, request expects {keys[position].hex()[:16]}…",
                    request_id=rid)
    for group, ids in zip(core.groups, event.block_ids):
        keys = request.keys[group.group_id]
        for position, block in enumerate(ids):
            if block != NULL_BLOCK_ID:
                core.block_refs[block] += 1
                if position < len(keys):
                    core.block_key[block] = keys[position]
        request.table[group.group_id].extend(ids)
    request.table_changed(core.groups)
    request.num_computed_tokens = spans.pop()


def _blocks_allocated(core: Core, event: ev.BlocksAllocated, out: Effects) -> None:
    rid = event.request_id
    ext = event.num_external_tokens
    kind = "blocks_allocated+load" if ext else "blocks_allocated"
    request = _request(core, rid, kind)
    if len(event.block_ids) != len(core.groups):
        _check_group_shape(core, event.block_ids, rid)
    seen: set[int] = set()
    limit = core.config.num_device_blocks
    for ids in event.block_ids:
        for block in ids:
            if block == NULL_BLOCK_ID:
                continue
            if not 0 < block < limit:
                _check_group_shape(core, event.block_ids, rid)
            if block in seen:
                raise ProtocolViolation("duplicate_block", f"block {block} allocated twice", request_id=rid)
            seen.add(block)
            if core.block_refs[block] or core.block_pins[block] or block in core.block_writer:
                raise ProtocolViolation(
                    "block_in_use",
                    f"block {block} allocated while held (refs={core.block_refs[block]}, "
                    f"pins={core.block_pins[block]}, loading={block in core.block_writer})",
                    request_id=rid)
    load = _plan_load(core, request, event) if ext else None

    # Apply. A block some store still reads is being handed out: in flush
    # mode that store must finish before this step's forward writes it.
    to_flush: list[int] = []
    lazy_keys = core.lazy_keys  # lazy mode: a reallocated block's old content is gone
    for group, ids in zip(core.groups, event.block_ids):
        for block in ids:
            if block == NULL_BLOCK_ID:
                continue
            readers = core.block_readers.get(block)
            if readers:
                to_flush.extend(readers)
            core.block_refs[block] = 1
            core.block_generation[block] += 1
            if lazy_keys:
                lazy_keys.pop(block, None)
            core.block_group[block] = group.group_id
            core.block_key[block] = None
        request.table[group.group_id].extend(ids)
    request.table_changed(core.groups)
    if to_flush:
        _flush(core, sorted(set(to_flush)), out)
    if load is None:
        if request.status is RequestStatus.WAITING:
            request.status = RequestStatus.RUNNING
        return
    keys, slots, targets = load
    job = Job(job_id=core.next_job_id, kind=JobKind.LOAD, request_id=rid, keys=keys, block_ids=targets,
              slot_ids=slots, generations=(), pending_workers=(1 << core.config.world_size) - 1,
              num_tokens=ext)
    core.next_job_id += 1
    core.jobs[job.job_id] = job
    for group_keys, group_slots, group_blocks in zip(keys, slots, targets):
        for key, slot, block in zip(group_keys, group_slots, group_blocks):
            loads = core.slot_loads.get(slot, 0)
            if loads == 0:
                core.policy.remove(key)
            core.slot_loads[slot] = loads + 1
            core.block_writer[block] = job.job_id
            core.block_key[block] = key
    request.status = RequestStatus.LOADING
    request.load_job_id = job.job_id
    request.num_computed_tokens += ext
    core.stats.loads += 1
    core.stats.hit_tokens += ext
    core.stats.keys_loaded += sum(len(k) for k in keys)
    out.append(fx.StartLoad(job_id=job.job_id, request_id=rid, keys=keys, source_slot_ids=slots,
                            target_block_ids=targets))


def _plan_load(core: Core, request: RequestState, event: ev.BlocksAllocated) -> tuple[tuple, tuple, tuple]:
    """The keys, slots and target blocks of the hit this allocation admits."""
    rid = request.request_id
    ext = event.num_external_tokens
    start = request.table_tokens(core.groups)
    end = start + ext
    if ext < 0 or end % core.alignment or end >= request.num_tokens:
        raise ProtocolViolation(
            "bad_hit", f"hit [{start}, {end}) is unaligned (alignment {core.alignment}) or leaves no token "
            f"to compute ({request.num_tokens} tokens)", request_id=rid)
    keys, slots, targets = [], [], []
    for group, ids in zip(core.groups, event.block_ids):
        table = request.table[group.group_id] + list(ids)
        group_keys, group_slots, group_blocks = [], [], []
        for position in hma.needed_range(group, start, end):
            if position >= len(table) or table[position] == NULL_BLOCK_ID:
                raise ProtocolViolation(
                    "load_target_missing", f"group {group.group_id} position {position} has no block",
                    request_id=rid)
            if position >= len(request.keys[group.group_id]):
                raise ProtocolViolation(
                    "load_key_unknown", f"group {group.group_id} position {position} has no hash",
                    request_id=rid)
            key = request.keys[group.group_id][position]
            slot = core.slot_of_key.get(key, -1)
            if slot < 0 or core.slot_state[slot] != SlotState.STORED:
                raise ProtocolViolation(
                    "load_not_stored", f"group {group.group_id} position {position}: key is not stored",
                    request_id=rid)
            group_keys.append(key)
            group_slots.append(slot)
            group_blocks.append(table[position])
        keys.append(tuple(group_keys))
        slots.append(tuple(group_slots))
        targets.append(tuple(group_blocks))
    return tuple(keys), tuple(slots), tuple(targets)


def _flush(core: Core, job_ids: list[int], out: Effects) -> None:
    """The worker waits for these stores before the forward; their sources are free after it."""
    for job_id in job_ids:
        job = core.jobs[job_id]
        assert job.kind is JobKind.STORE and not job.flushed
        _release_sources(core, job)
        job.flushed = True
    core.stats.flushes += 1
    core.stats.jobs_flushed += len(job_ids)
    out.append(fx.FlushStores(job_ids=tuple(job_ids)))


def _release_sources(core: Core, job: Job) -> None:
    readers = core.block_readers
    for block in job.flat_blocks():
        jobs = readers[block]
        jobs.remove(job.job_id)
        if not jobs:
            del readers[block]


def _blocks_freed(core: Core, event: ev.BlocksFreed, out: Effects) -> None:
    rid = event.request_id
    request = _request(core, rid, event.kind)
    _check_group_shape(core, event.block_ids, rid)
    positions: list[tuple[int, int]] = []
    for group, ids in zip(core.groups, event.block_ids):
        table = request.table[group.group_id]
        floor = request.free_floor[group.group_id]
        for block in ids:
            if block == NULL_BLOCK_ID:
                continue
            try:
                positions.append((group.group_id, table.index(block, floor)))
            except ValueError:
                raise ProtocolViolation(
                    "free_unheld_block", f"block {block} is not in group {group.group_id} of the request",
                    request_id=rid) from None
    if len(set(positions)) != len(positions):
        raise ProtocolViolation("duplicate_block", "a block is freed twice", request_id=rid)
    for group_id, position in positions:
        table = request.table[group_id]
        core.block_refs[table[position]] -= 1
        table[position] = NULL_BLOCK_ID
    for group_id, table in enumerate(request.table):
        floor = request.free_floor[group_id]
        while floor < len(table) and table[floor] == NULL_BLOCK_ID:
            floor += 1
        request.free_floor[group_id] = floor


def _free_table(core: Core, request: RequestState) -> None:
    for block in request.held_blocks():
        core.block_refs[block] -= 1
        assert core.block_refs[block] >= 0, f"block {block} ref count went negative"
    request.table = [[] for _ in core.groups]
    request.free_floor = [0] * len(core.groups)
    request.capacity_tokens = 0


def _request_preempted(core: Core, event: ev.RequestPreempted, out: Effects) -> None:
    request = _request(core, event.request_id, event.kind)
    _free_table(core, request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    _restart_stores(request)
    core.stats.preemptions += 1


def _restart_stores(request: RequestState) -> None:
    """Consider every block again: keys already in the tier are skipped then."""
    request.next_store = [0] * len(request.next_store)
    request.next_store_tokens = 0


def _request_resumed(core: Core, event: ev.RequestResumed, out: Effects) -> None:
    request = _request(core, event.request_id, event.kind)
    request.status = RequestStatus.WAITING


def _request_finished(core: Core, event: ev.RequestFinished, out: Effects) -> None:
    rid = event.request_id
    request = _request(core, rid, event.kind)
    _check_group_shape(core, event.block_ids, rid)
    for group, final in zip(core.groups, event.block_ids):
        table = request.table[group.group_id]
        if len(final) != len(table) or any(f != t and f != NULL_BLOCK_ID for f, t in zip(final, table)):
            raise ProtocolViolation(
                "final_table_mismatch", f"group {group.group_id}: final blocks {list(final)[:8]}… differ "
                f"from the engine's table {table[:8]}…", request_id=rid)
    _free_table(core, request)
    del core.requests[rid]
    core.stats.finished += 1


def _request_aborted(core: Core, event: ev.RequestAborted, out: Effects) -> None:
    request = _request(core, event.request_id, event.kind)
    core.stats.aborted += 1
    if request.status is RequestStatus.LOADING:
        request.status = RequestStatus.ABORTING  # vLLM frees the blocks once the load ends
        return
    _free_table(core, request)
    del core.requests[event.request_id]


def _step_scheduled(core: Core, event: ev.StepScheduled, out: Effects) -> None:
    if event.step_index <= core.step_index:
        raise ProtocolViolation("step_not_increasing", f"step {event.step_index} after {core.step_index}")
    if len(set(event.request_ids)) != len(event.request_ids):
        raise ProtocolViolation("duplicate_request", "a request is scheduled twice in one step")
    requests = core.requests
    scheduled: list[tuple[RequestState, int]] = []
    for rid, computed, count in zip(event.request_ids, event.num_computed_tokens, event.num_scheduled_tokens):
        request = requests.get(rid)
        if request is None or request.status is not RequestStatus.RUNNING:
            _request(core, rid, event.kind)  # raises with the precise status
        assert request is not None
        horizon = computed + count
        if computed < 0 or count < 0:
            raise ProtocolViolation("bad_token_count", f"computed={computed} scheduled={count}", request_id=rid)
        if horizon > request.capacity_tokens:
            raise ProtocolViolation(
                "unallocated_tokens", f"{horizon} tokens scheduled but the block table covers "
                f"{request.capacity_tokens}", request_id=rid)
        scheduled.append((request, horizon))
    core.step_index = event.step_index
    lazy = core.config.store_mode is StoreMode.LAZY
    for (request, horizon), computed in zip(scheduled, event.num_computed_tokens):
        request.num_computed_tokens = computed
        if horizon >= request.next_store_tokens:
            _plan_stores(core, request, horizon, out, lazy=lazy)


def _plan_stores(core: Core, request: RequestState, horizon: int, out: Effects, *, lazy: bool = False) -> None:
    """Store every block that is full after this step and not yet in the tier;
    in lazy mode, only note its key, for when the block nears eviction."""
    candidates: list[tuple[int, int, bytes]] = []  # (group, block, key)
    slot_of_key = core.slot_of_key
    writer = core.block_writer
    next_tokens = None
    for group in core.groups:
        gid = group.group_id
        keys = request.keys[gid]
        table = request.table[gid]
        first = request.next_store[gid]
        full = min(horizon // group.block_size, len(keys), len(table))
        for position in range(first, full):
            block = table[position]
            if block == NULL_BLOCK_ID or block in writer:
                continue
            key = keys[position]
            if key in slot_of_key or not hma.is_reachable(group, position, core.alignment):
                continue
            candidates.append((gid, block, key))
        if full > first:
            request.next_store[gid] = full
        reach = (request.next_store[gid] + 1) * group.block_size
        next_tokens = reach if next_tokens is None else min(next_tokens, reach)
    request.next_store_tokens = next_tokens or 0
    if lazy:
        for _, block, key in candidates:
            core.lazy_keys[block] = key
    elif candidates:
        _admit_store(core, request.request_id, candidates, out)


def _admit_store(core: Core, request_id: str, candidates: list[tuple[int, int, bytes]],
                 out: Effects) -> None:
    """Reserve slots, evicting if needed; what cannot fit is not stored."""
    wanted = len(candidates)
    free = core.num_free_slots()
    admitted = min(wanted, free + len(core.policy))
    if admitted < wanted:
        core.stats.store_rejections += wanted - admitted
        candidates = candidates[:admitted]
    if not candidates:
        return
    evicted: list[bytes] = []
    if admitted > free:
        victims = core.policy.evict(admitted - free)
        assert victims is not None
        for key in victims:
            slot = core.slot_of_key.pop(key)
            _free_slot(core, slot)
        evicted = victims
        core.stats.evictions += len(victims)
    n = len(core.groups)
    keys: list[list[bytes]] = [[] for _ in range(n)]
    blocks: list[list[int]] = [[] for _ in range(n)]
    slots: list[list[int]] = [[] for _ in range(n)]
    gens: list[list[int]] = [[] for _ in range(n)]
    job_id = core.next_job_id
    core.next_job_id += 1
    for gid, block, key in candidates:
        slot = _take_slot(core)
        core.policy.admit(key)
        core.slot_of_key[key] = slot
        core.slot_key[slot] = key
        core.slot_state[slot] = SlotState.STORING
        core.block_key[block] = key
        core.block_readers.setdefault(block, []).append(job_id)
        keys[gid].append(key)
        blocks[gid].append(block)
        slots[gid].append(slot)
        gens[gid].append(core.block_generation[block])
    job = Job(job_id=job_id, kind=JobKind.STORE, request_id=request_id,
              keys=tuple(map(tuple, keys)), block_ids=tuple(map(tuple, blocks)),
              slot_ids=tuple(map(tuple, slots)), generations=tuple(map(tuple, gens)),
              pending_workers=(1 << core.config.world_size) - 1)
    core.jobs[job_id] = job
    core.stats.stores += 1
    if evicted:
        out.append(fx.EvictKeys(keys=tuple(evicted)))
    if core.config.protection is Protection.PIN:
        flat = tuple(job.flat_blocks())
        for block in flat:
            core.block_pins[block] += 1
        out.append(fx.PinDeviceBlocks(block_ids=flat))
    out.append(fx.StartStore(job_id=job_id, request_id=request_id, keys=job.keys,
                             source_block_ids=job.block_ids, target_slot_ids=job.slot_ids))


def _blocks_near_eviction(core: Core, event: ev.BlocksNearEviction, out: Effects) -> None:
    """Lazy mode: store the free blocks vLLM is about to reuse, if their content is known."""
    limit = core.config.num_device_blocks
    for block in event.block_ids:
        if not 0 < block < limit:
            raise ProtocolViolation("block_out_of_range", f"block {block} not in (0, {limit})")
        if core.block_refs[block] or core.block_pins[block] or block in core.block_writer:
            raise ProtocolViolation("near_eviction_in_use", f"block {block} is held, not free")
    if core.config.store_mode is not StoreMode.LAZY:
        return
    candidates: list[tuple[int, int, bytes]] = []
    for block in event.block_ids:
        key = core.lazy_keys.pop(block, None)
        if key is not None and key not in core.slot_of_key:
            candidates.append((core.block_group[block], block, key))
    if candidates:
        _admit_store(core, "", candidates, out)


def _take_slot(core: Core) -> int:
    if core.free_slots:
        return core.free_slots.pop()
    slot = core.next_fresh_slot
    core.next_fresh_slot += 1
    return slot


def _free_slot(core: Core, slot: int) -> None:
    core.slot_key[slot] = None
    core.slot_state[slot] = SlotState.FREE
    core.free_slots.append(slot)


def _drop_key(core: Core, key: bytes) -> bool:
    """Stop offering `key`. Its slot is freed now if nothing uses it, else by
    the job that ends last. Returns whether the key was indexed."""
    slot = core.slot_of_key.pop(key, -1)
    if slot < 0:
        return False
    if key in core.policy:
        core.policy.remove(key)
        _free_slot(core, slot)
    return True


def _store_completed(core: Core, event: ev.StoreCompleted, out: Effects) -> None:
    job = _job(core, event.job_id, JobKind.STORE, event.worker_index)
    _worker_reported(core, job, event.worker_index, out)


def _store_failed(core: Core, event: ev.StoreFailed, out: Effects) -> None:
    job = _job(core, event.job_id, JobKind.STORE, event.worker_index)
    all_keys = {k for group in job.keys for k in group}
    failed = set(event.keys) or all_keys
    if not failed <= all_keys:
        raise ProtocolViolation("foreign_keys", f"store {job.job_id} failed keys it does not hold",
                                job_id=job.job_id)
    job.failed_keys |= failed
    _worker_reported(core, job, event.worker_index, out)


def _load_completed(core: Core, event: ev.LoadCompleted, out: Effects) -> None:
    job = _job(core, event.job_id, JobKind.LOAD, event.worker_index)
    _worker_reported(core, job, event.worker_index, out)


def _load_failed(core: Core, event: ev.LoadFailed, out: Effects) -> None:
    job = _job(core, event.job_id, JobKind.LOAD, event.worker_index)
    if not set(event.block_ids) <= set(job.flat_blocks()):
        raise ProtocolViolation("foreign_blocks", f"load {job.job_id} failed blocks it does not target",
                                job_id=job.job_id)
    if not set(event.keys) <= {k for group in job.keys for k in group}:
        raise ProtocolViolation("foreign_keys", f"load {job.job_id} failed keys it does not read",
                                job_id=job.job_id)
    if not event.block_ids and not event.keys:
        raise ProtocolViolation("empty_failure", f"load {job.job_id} failed with no blocks or keys",
                                job_id=job.job_id)
    failed_blocks = set(event.block_ids)
    job.failed_blocks |= failed_blocks
    job.failed_keys.update(event.keys)
    for group_keys, group_blocks in zip(job.keys, job.block_ids):  # a failed block's key is suspect too
        job.failed_keys.update(k for k, b in zip(group_keys, group_blocks) if b in failed_blocks)
    _worker_reported(core, job, event.worker_index, out)


def _worker_reported(core: Core, job: Job, worker: int, out: Effects) -> None:
    job.pending_workers &= ~(1 << worker)
    if job.pending_workers:
        return
    del core.jobs[job.job_id]
    if job.kind is JobKind.STORE:
        _store_ended(core, job, out)
    else:
        _load_ended(core, job, out)


def _store_ended(core: Core, job: Job, out: Effects) -> None:
    if not job.flushed:
        _release_sources(core, job)
    if core.config.protection is Protection.PIN:
        flat = tuple(job.flat_blocks())
        for block in flat:
            core.block_pins[block] -= 1
        out.append(fx.UnpinDeviceBlocks(block_ids=flat))
    stats = core.stats
    if job.failed_keys:
        stats.store_failures += 1
        stats.keys_failed += len(job.failed_keys)
    for group_keys, group_slots in zip(job.keys, job.slot_ids):
        for key, slot in zip(group_keys, group_slots):
            indexed = core.slot_of_key.get(key) == slot
            if job.stale or not indexed:
                _free_slot(core, slot)
            elif key in job.failed_keys:
                del core.slot_of_key[key]
                _free_slot(core, slot)
            else:
                core.slot_state[slot] = SlotState.STORED
                core.policy.insert(key, False)
                stats.keys_stored += 1


def _load_ended(core: Core, job: Job, out: Effects) -> None:
    dropped: list[bytes] = []  # failed keys this load takes out of the index
    for group_keys, group_slots, group_blocks in zip(job.keys, job.slot_ids, job.block_ids):
        for key, slot, block in zip(group_keys, group_slots, group_blocks):
            del core.block_writer[block]
            loads = core.slot_loads[slot] - 1
            if loads:
                core.slot_loads[slot] = loads
            else:
                del core.slot_loads[slot]
            if key in job.failed_keys:
                core.block_key[block] = None
            indexed = core.slot_of_key.get(key) == slot
            if indexed and key in job.failed_keys:
                del core.slot_of_key[key]
                dropped.append(key)
                indexed = False
            if loads:
                continue
            if indexed:
                core.policy.insert(key, True)
            else:
                _free_slot(core, slot)
    if job.failed_keys or job.failed_blocks:
        core.stats.load_failures += 1
        core.stats.keys_failed += len(job.failed_keys)
        if dropped:  # a failed key already gone, or stored again since, is not reported
            out.append(fx.EvictKeys(keys=tuple(sorted(dropped))))
    request = core.requests.get(job.request_id)
    if request is None or request.load_job_id != job.job_id:
        return
    request.load_job_id = -1
    if request.status is RequestStatus.ABORTING:
        _free_table(core, request)
        del core.requests[request.request_id]
        return
    if job.failed_keys or job.failed_blocks:
        _restart_stores(request)  # the failed blocks are recomputed: store them again
    if (job.failed_keys or job.failed_blocks) and (
            len(core.groups) > 1 or _first_failed_position(request, job) == 0):
        # vLLM 0.32 cannot take block-level errors with several groups: the
        # request is reported failed, its blocks are freed and it is admitted
        # again from scratch (with the failed keys gone from the tier). With
        # one group it recomputes from the first failed block, and frees the
        # table when that leaves no valid token.
        _free_table(core, request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        return
    request.status = RequestStatus.RUNNING  # one group: vLLM recomputes from the first failed block


def _first_failed_position(request: RequestState, job: Job) -> int:
    bad = set(job.failed_blocks)
    for key, block in zip(job.keys[0], job.block_ids[0]):
        if key in job.failed_keys:
            bad.add(block)
    return min(i for i, block in enumerate(request.table[0]) if block in bad)


def _cache_reset(core: Core, event: ev.CacheReset, out: Effects) -> None:
    if event.epoch <= core.epoch:
        raise ProtocolViolation("epoch_not_increasing", f"epoch {event.epoch} after {core.epoch}")
    dropped = tuple(k for k, s in core.slot_of_key.items() if core.slot_state[s] == SlotState.STORED)
    for key in list(core.slot_of_key):
        _drop_key(core, key)
    assert not len(core.policy)
    core.policy.clear()
    for job in core.jobs.values():
        job.stale = True
    for request in core.requests.values():
        _restart_stores(request)
    core.epoch = event.epoch
    core.stats.evictions += len(dropped)
    if dropped:
        out.append(fx.EvictKeys(keys=dropped))


_HANDLERS: dict[type, Callable[[Core, object, Effects], None]] = {
    ev.RequestAdded: _request_added,
    ev.BlockHashesAppended: _block_hashes_appended,
    ev.BlocksTouched: _blocks_touched,
    ev.BlocksAllocated: _blocks_allocated,
    ev.BlocksFreed: _blocks_freed,
    ev.BlocksNearEviction: _blocks_near_eviction,
    ev.RequestPreempted: _request_preempted,
    ev.RequestResumed: _request_resumed,
    ev.RequestFinished: _request_finished,
    ev.RequestAborted: _request_aborted,
    ev.StepScheduled: _step_scheduled,
    ev.StoreCompleted: _store_completed,
    ev.StoreFailed: _store_failed,
    ev.LoadCompleted: _load_completed,
    ev.LoadFailed: _load_failed,
    ev.CacheReset: _cache_reset,
}
assert set(_HANDLERS) == set(ev.EVENT_TYPES), "every event kind needs a handler"
