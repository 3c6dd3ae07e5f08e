"""reduce(state, event) -> Transition(state, effects): every transition lives here.

Each handler first validates the event against the state and raises
`ProtocolViolation` before touching anything (the checks live in `checks.py`);
only then does it apply the change. So a rejected event leaves the state
exactly as it was: the default mode returns it with a `ReportViolation`
effect, strict mode (tests, replay) raises. A broken internal invariant is an
`assert`. A request's next status comes from `transitions.REQUEST_MOVES`
(`_move`), a tier slot moves only through `slots.py`, and what a step stores
and a hit loads is decided in `admission.py`.

Cost: a scheduler step carries one `step_scheduled` for every running
request, and about one `blocks_allocated`, `blocks_freed`, `store_completed`
and `block_hashes_appended` per 16 of them (one per block boundary crossed).
So the per-request work of `step_scheduled` is one typed pass over its
columns (compiled, direct calls), and only requests whose horizon crossed a
block boundary reach the store planner (`admission.plan_stores`). Where a fast check fails, the handler runs
the check's per-item path, which names the violation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NamedTuple

from kvledger.events import types as ev
from kvledger.events.config import Protection, StoreMode
from kvledger.events.types import NULL_BLOCK_ID

from . import admission, hma, lower, slots
from . import construct as new
from . import effects as fx
from .checks import (
    ProtocolViolation,
    allocation_ok,
    allocation_problem,
    disagree,
    final_table_ok,
    final_table_problem,
    free_positions,
    free_problem,
    group_shape_problem,
    legal_request,
    reported_job,
    step_crossings,
    step_problem,
    touch_ok,
    touch_problem,
)
from .state import LOAD as _LOAD
from .state import SPILL as _SPILL
from .state import STORE as _STORE
from .state import Core, FreeRule, Job, JobKind, JobStage, RequestState, RequestStatus, State
from .transitions import ADMITTABLE as _ADMITTABLE
from .transitions import GONE, JOB_MOVES, REQUEST_MOVES, STEPPABLE, flush_job, moves_by_kind, sources

__all__ = ["ProtocolViolation", "Transition", "reduce", "reduce_step"]

_PIN: Final = Protection.PIN
_LAZY: Final = StoreMode.LAZY

# A job's life: its stage moves as `JOB_MOVES` says (`transitions.start_job`, `flush_job`).
# What the code around the moves relies on: only an in-flight store is flushed (`_flush`
# asserts it), and a job its last worker reported on is gone whatever its stage (its end
# is then handled by kind).
assert sources(JOB_MOVES, "flushed") == {JobStage.IN_FLIGHT}
assert all(JOB_MOVES[(stage, "last_worker_reported")] is GONE for stage in JobStage)

# REQUEST_MOVES as the handlers read it: {kind: {status before: status after}},
# and the statuses a step may schedule (`RequestState.step_limit` follows them).
_NEXT = moves_by_kind(REQUEST_MOVES)
_STEPPABLE = STEPPABLE
# Per kind, the statuses it leaves as they are, as tuples (membership by identity;
# an Enum's __hash__ is a Python call): a handler on a hot path skips the move.
_STAYS = {kind: tuple(s for s, t in moves.items() if s is t) for kind, moves in _NEXT.items()}
# Kinds whose handlers leave the status as it is (they never call `_move`): the
# table must agree. The step's fast check reads `step_limit`, kept by `_move`.
_KEEPING = ("block_hashes_appended", "blocks_touched", "blocks_freed", "step_scheduled")
assert all(before is after for kind in _KEEPING for before, after in _NEXT[kind].items())


class Transition(NamedTuple):
    state: State
    effects: tuple[fx.Effect, ...]


def _reported(violation: ProtocolViolation, event: ev.Event, core: Core) -> fx.ReportViolation:
    """The violation, with the keys of the job it names (the state is as it was before the event)."""
    job = core.jobs.get(violation.job_id)
    return fx.ReportViolation(
        code=violation.code, message=violation.message, event_kind=event.kind,
        request_id=violation.request_id, job_id=violation.job_id,
        keys=() if job is None else tuple(k for group in job.keys for k in group),
    )


# The per-event wrapper is a measurable share of a replay, so it avoids Python-level
# calls: `State.take` and the namedtuple's `__new__`, spelled out. `State` is a
# native class when compiled, so building a handle is a C call.
_new_tuple: Final = tuple.__new__


def reduce(state: State, event: ev.Event, *, strict: bool = False) -> Transition:
    core = state._core
    if core is None:
        core = state.take()  # raises StaleStateError
    state._core = None
    out: list[fx.Effect] = []
    try:
        _HANDLERS[type(event)](core, event, out)
    except ProtocolViolation as violation:
        if strict:
            state.restore(core)
            raise
        out = [_reported(violation, event, core)]
    return _new_tuple(Transition, (State(core), tuple(out) if out else ()))


def reduce_step(state: State, events: list[ev.Event] | tuple[ev.Event, ...], *, strict: bool = False,
                ends: list[int] | None = None) -> Transition:
    """Apply one scheduler step's events; equal to folding `reduce`.

    The fold's intermediate handles are never seen by the caller, so the
    tables move once, not once per event. As in the fold, a strict violation
    raises with the caller's handle restored only when the first event failed
    (later, the fold had consumed it). `ends`, when given, gets where each
    event's effects end in the step's, so a consumer can fold them event by event.
    """
    core = state.take()
    out: list[fx.Effect] = []
    handlers = _HANDLERS
    for index, event in enumerate(events):
        mark = len(out)
        try:
            handlers[type(event)](core, event, out)
        except ProtocolViolation as violation:
            if strict:
                if index == 0:
                    state.restore(core)
                raise
            del out[mark:]
            out.append(_reported(violation, event, core))
        if ends is not None:
            ends.append(len(out))
    return _new_tuple(Transition, (State(core), tuple(out) if out else ()))


# A request's moves.


def _move(core: Core, request: RequestState, kind: str) -> RequestStatus | None:
    """Move `request` where REQUEST_MOVES leads from its status on `kind` (the
    handler has checked the move is legal); a request that is gone gives its
    blocks back and is forgotten. Returns the new status."""
    target = _NEXT[kind][request.status]
    if target is GONE:
        _free_table(core, request)
        del core.requests[request.request_id]
    else:
        _enter(request, target)
    return target


def _enter(request: RequestState, status: RequestStatus) -> None:
    request.set_status(status, status in _STEPPABLE)


# Handlers.


def _request_added(core: Core, event: ev.RequestAdded, out: list[fx.Effect]) -> None:
    rid = event.request_id
    if rid in core.requests:
        legal_request(core, rid, event.kind)  # raises: only an unknown request may be added
    if event.num_prompt_tokens <= 0:
        raise ProtocolViolation("bad_prompt", f"num_prompt_tokens={event.num_prompt_tokens}", request_id=rid)
    if len(event.block_hashes) > event.num_prompt_tokens // core.config.hash_block_size:
        raise ProtocolViolation(
            "too_many_hashes", f"{len(event.block_hashes)} hashes for {event.num_prompt_tokens} tokens",
            request_id=rid)
    request = RequestState(rid, event.num_prompt_tokens, core.groups, core.free_rules)
    status = _NEXT[event.kind][None]  # from no request at all
    assert status is not None
    _enter(request, status)
    _append_hashes(core, request, event.block_hashes)
    core.requests[rid] = request


def _append_hashes(core: Core, request: RequestState, hashes: tuple[bytes, ...]) -> None:
    known = request.hashes
    known.extend(hashes)
    request.hashes_repr = ""
    for keys, (per_block, suffix) in zip(request.keys, core.key_rules):
        hma.append_keys(keys, known, per_block, suffix)


def _block_hashes_appended(core: Core, event: ev.BlockHashesAppended, out: list[fx.Effect]) -> None:
    rid = event.request_id
    request = legal_request(core, rid, event.kind)
    if event.num_tokens < request.num_tokens:
        raise ProtocolViolation("tokens_shrank", f"num_tokens {request.num_tokens} -> {event.num_tokens}",
                                request_id=rid)
    total = len(request.hashes) + len(event.block_hashes)
    if total > event.num_tokens // core.config.hash_block_size:
        raise ProtocolViolation("too_many_hashes", f"{total} hashes for {event.num_tokens} tokens",
                                request_id=rid)
    request.num_tokens = event.num_tokens
    _append_hashes(core, request, event.block_hashes)


def _block_hashes_rewound(core: Core, event: ev.BlockHashesRewound, out: list[fx.Effect]) -> None:
    """Forget the request's keys from the rewound hashes on. A block at a dropped
    position was never computed with the dropped token (vLLM rewinds a session to
    its computed tokens), so none was stored from it; should one hold such a key
    anyway, it is marked as holding unknown content, and no lazy store takes it.
    Positions already considered for storing stay considered: their blocks are
    not stored again under the keys that follow."""
    request = legal_request(core, event.request_id, event.kind)
    keep = event.num_hashes
    if not 0 <= keep <= len(request.hashes):
        raise ProtocolViolation("rewind_past_end", f"rewound to {keep} of {len(request.hashes)} hashes",
                                request_id=event.request_id)
    del request.hashes[keep:]
    request.hashes_repr = ""
    block_key = core.block_key
    lazy_keys = core.lazy_keys
    for keys, table, (per_block, _) in zip(request.keys, request.table, core.key_rules):
        kept = keep // per_block
        for position in range(kept, min(len(keys), len(table))):
            block = table[position]
            if block == NULL_BLOCK_ID:
                continue
            dropped = keys[position]
            if block_key[block] == dropped:
                block_key[block] = None
            if lazy_keys.get(block) == dropped:
                del lazy_keys[block]
        del keys[kept:]


def _blocks_touched(core: Core, event: ev.BlocksTouched, out: list[fx.Effect]) -> None:
    rid = event.request_id
    request = legal_request(core, rid, event.kind)
    block_ids = event.block_ids
    group_shape_problem(core, block_ids, rid)
    if any(request.table):
        raise ProtocolViolation("touch_after_alloc", "prefix blocks must be touched before allocation",
                                request_id=rid)
    spans = {len(ids) * size for ids, size in zip(block_ids, core.block_sizes)}
    if len(spans) != 1:
        raise ProtocolViolation("unaligned_touch", f"touched spans differ across groups: {sorted(spans)}",
                                request_id=rid)
    if not touch_ok(core, request, block_ids):
        touch_problem(core, request, block_ids)
        raise disagree("touch")
    block_key = core.block_key
    refs = core.block_refs
    for group_id, ids in enumerate(block_ids):
        keys = request.keys[group_id]
        for position, (block, key) in enumerate(zip(ids, keys)):
            if block:
                refs[block] += 1
                known = block_key[block]
                if known is None:
                    block_key[block] = key
                else:
                    keys[position] = known  # equal (touch_ok): share the block's object
        for block in ids[len(keys):]:
            if block:
                refs[block] += 1
        _extend_table(request, group_id, ids, core.free_rules)
    request.table_changed(core.block_sizes)
    request.num_computed_tokens = spans.pop()


def _blocks_allocated(core: Core, event: ev.BlocksAllocated, out: list[fx.Effect]) -> None:
    rid = event.request_id
    ext = event.num_external_tokens
    kind = "blocks_allocated+load" if ext else "blocks_allocated"
    request = legal_request(core, rid, kind)
    admitted = request.status in _ADMITTABLE
    local = request.num_computed_tokens
    first = len(out)
    block_ids = event.block_ids
    if sum(map(len, block_ids)) < 16:  # a decode step's block per group: the per-block path is cheapest
        allocation_problem(core, block_ids, rid)
    elif not allocation_ok(core, block_ids):
        allocation_problem(core, block_ids, rid)
        raise disagree("allocation")
    load = admission.plan_load(core, request, event) if ext else None

    # Apply. A block some store still reads is being handed out: in flush
    # mode that store must finish before this step's forward writes it.
    to_flush: list[int] = []
    refs = core.block_refs
    readers = core.block_readers
    generation = core.block_generation
    group_of = core.block_group
    block_key = core.block_key
    lazy_keys = core.lazy_keys  # lazy mode: a reallocated block's old content is gone
    for group_id, ids in enumerate(block_ids):
        # A block still read by a store, or noted for a lazy store, is rare: one
        # C-level pass each finds whether any is, not a lookup per block.
        if readers and not readers.keys().isdisjoint(ids):
            for block in ids:
                reading = readers.get(block)
                if reading is not None:
                    if isinstance(reading, int):
                        to_flush.append(reading)
                    else:
                        to_flush.extend(reading)
        if lazy_keys and not lazy_keys.keys().isdisjoint(ids):
            for block in ids:
                lazy_keys.pop(block, None)
        for block in ids:
            if block != NULL_BLOCK_ID:
                refs[block] = 1
                generation[block] += 1
                group_of[block] = group_id
                block_key[block] = None
        _extend_table(request, group_id, ids, core.free_rules)
    request.table_changed(core.block_sizes)
    if to_flush:
        _flush(core, sorted(set(to_flush)), out)
    if request.status not in _STAYS[kind]:  # a running request's growth: no move to make
        _move(core, request, kind)
    if load is not None:
        admission.start_load(core, request, ext, load, out)
    if admitted:  # first among the event's effects: what explains the admission comes before its consequences
        out.insert(first, fx.RequestAdmitted(request_id=rid, step_index=core.step_index,
                                             num_tokens=request.num_tokens, local_tokens=local, hit_tokens=ext,
                                             keys=tuple([tuple(keys) for keys in request.keys])))


def _flush(core: Core, job_ids: list[int], out: list[fx.Effect]) -> None:
    """The worker waits for these stores before the forward; their sources are free after it."""
    for job_id in job_ids:
        job = core.jobs[job_id]
        assert job.kind is _STORE and not job.flushed
        _release_sources(core, job)
        flush_job(job)
    core.stats.flushes += 1
    core.stats.jobs_flushed += len(job_ids)
    out.append(fx.FlushStores(job_ids=tuple(job_ids)))


def _release_sources(core: Core, job: Job) -> None:
    readers = core.block_readers
    job_id = job.job_id
    for ids in job.block_ids:
        for block in ids:
            jobs = readers[block]
            if isinstance(jobs, int):
                assert jobs == job_id, f"block {block}: read by job {jobs}, not {job_id}"
                del readers[block]
            else:
                jobs.remove(job_id)
                if len(jobs) == 1:
                    readers[block] = jobs[0]


def _blocks_freed(core: Core, event: ev.BlocksFreed, out: list[fx.Effect]) -> None:
    rid = event.request_id
    request = legal_request(core, rid, event.kind)
    block_ids = event.block_ids
    # Per group, the positions of the freed blocks. A block found in a table is in
    # range (tables hold only checked ids); any miss goes to the per-block check.
    search = free_positions(core, request, block_ids)
    if search is None:
        free_problem(core, request, block_ids)
        raise disagree("free")
    found, starts = search
    refs = core.block_refs
    floors = request.free_floor
    for group_id, (positions, table, start) in enumerate(zip(found, request.table, starts)):
        if not positions:
            continue
        for position in positions:
            refs[table[position]] -= 1
            table[position] = NULL_BLOCK_ID
        # Positions below the floor are all null: `index` starts there. Only a
        # group that freed a block can move its floor (a lower one stays true).
        floors[group_id] = _past_nulls(table, start)
    request.floor_changed(core.free_rules)


def _extend_table(request: RequestState, group_id: int, ids: tuple[int, ...],
                  free_rules: tuple[FreeRule, ...]) -> None:
    """Append to a group's table, keeping its free floor past any leading nulls:
    a window group admitted on a prefix hit starts with the positions vLLM skipped,
    and the planner's scan for window frees, which starts at the floor, would
    otherwise pass over them in every step."""
    table = request.table[group_id]
    table.extend(ids)
    floors = request.free_floor
    floor = floors[group_id]
    moved = _past_nulls(table, floor)
    if moved != floor:  # rare (a growing table's floor stays put): its free point moves too
        floors[group_id] = moved
        request.floor_changed(free_rules)


def _past_nulls(table: list[int], position: int) -> int:
    """The first position from `position` on that holds a block (the table's length if none)."""
    end = len(table)
    while position < end and table[position] == NULL_BLOCK_ID:
        position += 1
    return position


def _free_table(core: Core, request: RequestState) -> None:
    refs = core.block_refs
    for table, floor in zip(request.table, request.free_floor):
        for block in table[floor:] if floor else table:
            if block != NULL_BLOCK_ID:
                count = refs[block] - 1
                refs[block] = count
                assert count >= 0, f"block {block} ref count went negative"
    request.table = [[] for _ in core.groups]
    request.free_floor = [0] * len(core.groups)
    request.table_changed(core.block_sizes)
    request.floor_changed(core.free_rules)


def _request_preempted(core: Core, event: ev.RequestPreempted, out: list[fx.Effect]) -> None:
    request = legal_request(core, event.request_id, event.kind)
    admission.give_up(core, request, out)
    _free_table(core, request)
    _move(core, request, event.kind)
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    _restart_stores(request)
    core.stats.preemptions += 1


def _restart_stores(request: RequestState) -> None:
    """Consider every block again: keys already in the tier are skipped then."""
    request.next_store = [0] * len(request.next_store)
    request.next_store_tokens = 0


def _request_resumed(core: Core, event: ev.RequestResumed, out: list[fx.Effect]) -> None:
    _move(core, legal_request(core, event.request_id, event.kind), event.kind)


def _request_finished(core: Core, event: ev.RequestFinished, out: list[fx.Effect]) -> None:
    rid = event.request_id
    request = legal_request(core, rid, event.kind)
    if not final_table_ok(core, request, event.block_ids):
        final_table_problem(core, request, event.block_ids)
        raise disagree("final table")
    admission.give_up(core, request, out)
    _move(core, request, event.kind)
    core.stats.finished += 1


def _request_aborted(core: Core, event: ev.RequestAborted, out: list[fx.Effect]) -> None:
    request = legal_request(core, event.request_id, event.kind)
    core.stats.aborted += 1
    admission.give_up(core, request, out)
    _move(core, request, event.kind)  # a loading request keeps its blocks until the load ends


def _step_scheduled(core: Core, event: ev.StepScheduled, out: list[fx.Effect]) -> None:
    # One read-only pass checks every request and finds the few whose horizon
    # reached their next storable block.
    search = step_crossings(core, event)
    if search is None:
        step_problem(core, event)
        raise disagree("step")
    scheduled, crossed = search
    core.step_index = event.step_index
    for request, done in zip(scheduled, event.num_computed_tokens):
        request.changed()
        request.num_computed_tokens = done
    if crossed:
        admission.plan_stores(core, crossed, out)


def _blocks_near_eviction(core: Core, event: ev.BlocksNearEviction, out: list[fx.Effect]) -> None:
    """Lazy mode: store the free blocks vLLM is about to reuse, if their content is known."""
    limit = core.config.num_device_blocks
    for block in event.block_ids:
        if not 0 < block < limit:
            raise ProtocolViolation("block_out_of_range", f"block {block} not in (0, {limit})")
        if core.block_refs[block] or core.block_pins[block] or block in core.block_writer:
            raise ProtocolViolation("near_eviction_in_use", f"block {block} is held, not free")
    if core.config.store_mode is not _LAZY:
        return
    groups: list[int] = []
    blocks: list[int] = []
    keys: list[bytes] = []
    for block in event.block_ids:
        key = core.lazy_keys.pop(block, None)
        if key is not None and key not in core.slot_of_key:
            groups.append(core.block_group[block])
            blocks.append(block)
            keys.append(key)
    if keys:
        admission.admit_store(core, "", groups, blocks, keys, out)


def _writing_kind(core: Core, job_id: int) -> JobKind:
    """A store report names a store (device to host) or a spill (host to a lower tier)."""
    job = core.jobs.get(job_id)
    return _SPILL if job is not None and job.kind is _SPILL else _STORE


def _store_completed(core: Core, event: ev.StoreCompleted, out: list[fx.Effect]) -> None:
    job = reported_job(core, event.job_id, _writing_kind(core, event.job_id), event.worker_index)
    _worker_reported(core, job, event.worker_index, out)


def _store_failed(core: Core, event: ev.StoreFailed, out: list[fx.Effect]) -> None:
    job = reported_job(core, event.job_id, _writing_kind(core, event.job_id), event.worker_index)
    all_keys = {k for group in job.keys for k in group}
    failed = set(event.keys) or all_keys
    if not failed <= all_keys:
        raise ProtocolViolation("foreign_keys", f"store {job.job_id} failed keys it does not hold",
                                job_id=job.job_id)
    job.failed_keys = job.failed_keys | failed
    out.append(fx.TransferFailed(job_id=job.job_id, kind=job.kind.value, request_id=job.request_id,
                                 tier=job.tier, worker_index=event.worker_index, keys=tuple(sorted(failed)),
                                 reason=event.reason))
    _worker_reported(core, job, event.worker_index, out)


def _load_completed(core: Core, event: ev.LoadCompleted, out: list[fx.Effect]) -> None:
    job = reported_job(core, event.job_id, _LOAD, event.worker_index)
    _worker_reported(core, job, event.worker_index, out)


def _load_failed(core: Core, event: ev.LoadFailed, out: list[fx.Effect]) -> None:
    job = reported_job(core, event.job_id, _LOAD, event.worker_index)
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
    failed_keys = set(event.keys)
    for group_keys, group_blocks in zip(job.keys, job.block_ids):  # a failed block's key is suspect too
        failed_keys.update(k for k, b in zip(group_keys, group_blocks) if b in failed_blocks)
    job.failed_blocks = job.failed_blocks | failed_blocks
    job.failed_keys = job.failed_keys | failed_keys
    out.append(fx.TransferFailed(job_id=job.job_id, kind=job.kind.value, request_id=job.request_id, tier=0,
                                 worker_index=event.worker_index, keys=tuple(sorted(failed_keys)), reason=event.reason))
    _worker_reported(core, job, event.worker_index, out)


def _worker_reported(core: Core, job: Job, worker: int, out: list[fx.Effect]) -> None:
    job.pending_workers &= ~(1 << worker)
    if job.pending_workers:
        return  # its stage stays (`worker_reported` rows)
    # gone, whatever its stage (`last_worker_reported` rows)
    del core.jobs[job.job_id]
    failed = job.failed_keys
    out.append(fx.JobEnded(job_id=job.job_id, kind=job.kind.value, request_id=job.request_id, tier=job.tier,
                           keys=job.keys, failed_keys=tuple(sorted(failed)) if failed else (), stale=job.stale))
    if job.kind is _STORE:
        _store_ended(core, job, out)
    elif job.kind is _LOAD:
        _load_ended(core, job, out)
    else:
        lower.spill_ended(core, job, out)


def _store_ended(core: Core, job: Job, out: list[fx.Effect]) -> None:
    if not job.flushed:
        _release_sources(core, job)
    if core.config.protection is _PIN:
        flat = tuple(job.flat_blocks())
        pins = core.block_pins
        for block in flat:
            pins[block] -= 1
        out.append(fx.UnpinDeviceBlocks(block_ids=flat))
    stats = core.stats
    failed = job.failed_keys
    if failed:
        stats.store_failures += 1
        stats.keys_failed += len(failed)
    stored = slots.store_ended(core, job)
    stats.keys_stored += len(stored)
    if stored:
        out.append(new.keys_loadable(0, tuple(stored)))
    if core.lower and stored:
        slot_of_key = core.slot_of_key
        done = set(stored)
        keys = tuple(tuple(k for k in group_keys if k in done) for group_keys in job.keys)
        lower.plan_spills(core, keys, tuple(tuple(slot_of_key[k] for k in group) for group in keys), out)


def _load_ended(core: Core, job: Job, out: list[fx.Effect]) -> None:
    writer = core.block_writer
    block_key = core.block_key
    failed = job.failed_keys
    for group_keys, group_blocks in zip(job.keys, job.block_ids):
        for key, block in zip(group_keys, group_blocks):
            del writer[block]
            if failed and key in failed:
                block_key[block] = None
    host = lower.host_part(job)
    dropped = slots.load_ended(core, job if host is None else host)  # failed keys this load takes out of the index
    if host is not None:
        lower.promotions_ended(core, job, out)
    failed_any = bool(job.failed_keys or job.failed_blocks)
    if failed_any:
        core.stats.load_failures += 1
        core.stats.keys_failed += len(job.failed_keys)
        if dropped:  # a failed key already gone, or stored again since, is not reported
            out.append(new.keys_unloadable(0, tuple(sorted(dropped)), fx.Reason.FAILED))
    request = core.requests.get(job.request_id)
    if request is None or request.load_job_id != job.job_id:
        return
    request.changed()
    request.load_job_id = -1
    # vLLM 0.32 cannot take block-level errors with several groups: the request
    # is reported failed, its blocks are freed and it is admitted again from
    # scratch (with the failed keys gone from the tier). With one group it
    # recomputes from the first failed block, and frees the table when that
    # leaves no valid token.
    recompute = failed_any and (len(core.groups) > 1 or _first_failed_position(request, job) == 0)
    if _move(core, request, "load_failed+recompute" if recompute else "load_ended") is GONE:
        return  # aborted while loading: its blocks went back with it
    if recompute:
        out.append(fx.RequestRequeued(request_id=request.request_id, job_id=job.job_id))
    if failed_any:
        _restart_stores(request)  # the failed blocks are recomputed: store them again
    if recompute:
        _free_table(core, request)
        request.num_computed_tokens = 0


def _first_failed_position(request: RequestState, job: Job) -> int:
    bad = set(job.failed_blocks)
    for key, block in zip(job.keys[0], job.block_ids[0]):
        if key in job.failed_keys:
            bad.add(block)
    return min(i for i, block in enumerate(request.table[0]) if block in bad)


def _cache_reset(core: Core, event: ev.CacheReset, out: list[fx.Effect]) -> None:
    if event.epoch <= core.epoch:
        raise ProtocolViolation("epoch_not_increasing", f"epoch {event.epoch} after {core.epoch}")
    if event.keep_lower and event.rekeyed:
        raise ProtocolViolation("bad_reset", "a reset that keeps the tiers below host memory keeps their keys: "
                                "keep_lower with rekeyed")
    dropped = slots.drop_all(core)
    for job in core.jobs.values():
        job.stale = True  # its stage stays (`reset` rows)
    for request in core.requests.values():
        request.changed()
        _restart_stores(request)
        if event.rekeyed:
            request.hashes.clear()
            request.hashes_repr = ""
            for keys in request.keys:
                keys.clear()
    if event.forget_device:
        core.lazy_keys.clear()
        core.block_key = [None] * len(core.block_key)
    core.epoch = event.epoch
    core.stats.evictions += len(dropped)  # the engine's total counts both; metrics tell them apart by reason
    if dropped:
        out.append(new.keys_unloadable(0, dropped, fx.Reason.RESET))
    if core.lower and not event.keep_lower:  # kept: held keys stay (a spill in flight is stale: dropped at its end)
        lower.drop_all(core, out)


def _tier_keys_found(core: Core, event: ev.TierKeysFound, out: list[fx.Effect]) -> None:
    if not 1 <= event.tier <= len(core.lower):
        raise ProtocolViolation("unknown_tier", f"tier {event.tier}: the engine has {len(core.lower)} lower tiers")
    lower.keys_found(core, event.tier, event.keys, out)


def _tier_lookup_failed(core: Core, event: ev.TierLookupFailed, out: list[fx.Effect]) -> None:
    """On the record for `explain`; nothing in the state changes."""
    if not 1 <= event.tier <= len(core.lower):
        raise ProtocolViolation("unknown_tier", f"tier {event.tier}: the engine has {len(core.lower)} lower tiers")
    if event.reason not in ev.LOOKUP_FAILURES:
        raise ProtocolViolation("unknown_reason", f"lookup failure {event.reason!r} is not one of "
                                f"{', '.join(ev.LOOKUP_FAILURES)}", request_id=event.request_id)


def _first_generation_hashes(core: Core, event: ev.FirstGenerationHashes, out: list[fx.Effect]) -> None:
    """On the record for `explain`; nothing in the state changes. They must be the
    generation-0 hashes of the blocks the request just named."""
    request = core.requests.get(event.request_id)
    if request is None:
        raise ProtocolViolation("illegal_request_event", f"first_generation_hashes for an unknown request: "
                                f"{event.request_id!r}", request_id=event.request_id)
    if event.first < 0 or event.first + len(event.block_hashes) != len(request.hashes):
        raise ProtocolViolation("bad_first_generation_hashes", f"{len(event.block_hashes)} hashes from position "
                                f"{event.first} for a request with {len(request.hashes)}",
                                request_id=event.request_id)


def _restore_costs_measured(core: Core, event: ev.RestoreCostsMeasured, out: list[fx.Effect]) -> None:
    """The costs the next lookups weigh a hit by (`lookup.budget`)."""
    tiers = 1 + len(core.lower)
    if len(event.load_fixed_us) != tiers or len(event.load_ns_per_block) != tiers:
        raise ProtocolViolation("bad_restore_costs", f"{len(event.load_fixed_us)} and {len(event.load_ns_per_block)} "
                                f"tier costs for {tiers} tiers (host memory and each lower tier)")
    if min(event.compute_ns_per_token, *event.load_fixed_us, *event.load_ns_per_block) < 0:
        raise ProtocolViolation("bad_restore_costs", "a cost below zero")
    core.restore_costs = (event.compute_ns_per_token, event.load_fixed_us, event.load_ns_per_block)


def _restore_budgeted(core: Core, event: ev.RestoreBudgeted, out: list[fx.Effect]) -> None:
    """On the record for `explain`; nothing in the state changes."""
    request = core.requests.get(event.request_id)
    if request is None or request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        raise ProtocolViolation("illegal_request_event", f"restore_budgeted for a request not waiting: "
                                f"{event.request_id!r}", request_id=event.request_id)
    if not 0 <= event.kept_tokens < event.offered_tokens or min(event.load_us, event.compute_us) < 0:
        raise ProtocolViolation("bad_restore_budget", f"kept {event.kept_tokens} of {event.offered_tokens} tokens "
                                f"(load {event.load_us} us, compute {event.compute_us} us)",
                                request_id=event.request_id)


def _tier_pressure(core: Core, event: ev.TierPressure, out: list[fx.Effect]) -> None:
    """The fraction of spills to the tier dropped from here on (`lower.plan_spills`)."""
    if not 1 <= event.tier <= len(core.lower):
        raise ProtocolViolation("unknown_tier", f"tier {event.tier}: the engine has {len(core.lower)} lower tiers")
    if not 0 <= event.drop_ppm <= 1_000_000 or event.latency_ns_per_mib < 0:
        raise ProtocolViolation("bad_tier_pressure", f"drop {event.drop_ppm} ppm (0 to 1,000,000), latency "
                                f"{event.latency_ns_per_mib} ns a MiB")
    if core.pressure is None:
        core.pressure = [[0, 0] for _ in core.lower]
    core.pressure[event.tier - 1][0] = event.drop_ppm


_HANDLERS: Final[dict[type, Callable[[Core, Any, list[fx.Effect]], None]]] = {
    ev.RequestAdded: _request_added,
    ev.BlockHashesAppended: _block_hashes_appended,
    ev.BlockHashesRewound: _block_hashes_rewound,
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
    ev.TierKeysFound: _tier_keys_found,
    ev.TierLookupFailed: _tier_lookup_failed,
    ev.RestoreCostsMeasured: _restore_costs_measured,
    ev.RestoreBudgeted: _restore_budgeted,
    ev.FirstGenerationHashes: _first_generation_hashes,
    ev.TierPressure: _tier_pressure,
}
assert set(_HANDLERS) == set(ev.EVENT_TYPES), "every event kind needs a handler"
