"""The protocol checks: each one's fast path beside the path that names the problem.

A handler checks an event against the state before it changes anything. Most
events are fine, and a scheduler step carries hundreds, so each check has a
fast path (`*_ok`, or a search that also yields what the handler needs) built
from C-level passes, which says only whether the event is fine; and a naming
path (`*_problem`) that walks item by item and raises the `ProtocolViolation`
that names the first problem, or returns if there is none. A handler runs the
naming path only when the fast path fails, and then it must raise: the two
agree (fast says fine iff the naming path finds nothing), which
`tests/engine/test_checks.py` checks for each pair with Hypothesis.

Both read the state and never change it. They rely on the engine's own
invariants (a table holds a block once, the null block is never held or
keyed): the agreement is over states the reducer can reach.
"""

from __future__ import annotations

from itertools import chain
from operator import eq, not_, or_
from typing import Final

from kvledger.events import types as ev
from kvledger.events.config import Protection
from kvledger.events.types import NULL_BLOCK_ID

from .state import Core, Job, JobKind, RequestState, RequestStatus, counts_of
from .transitions import REQUEST_MOVES, request_move

_PIN: Final = Protection.PIN


class ProtocolViolation(Exception):
    """The caller's event breaks the protocol; it was not applied."""

    def __init__(self, code: str, message: str, *, request_id: str = "", job_id: int = -1) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.job_id = job_id


def disagree(check: str) -> AssertionError:
    """For a handler whose fast path failed where the naming path found nothing."""
    return AssertionError(f"{check}: the fast check failed, the one that names problems found none")


# A request's status: is the move legal? (REQUEST_MOVES)

# REQUEST_MOVES by kind: the statuses of known requests a kind may meet, as tuples
# (membership by identity; an Enum's __hash__ is a Python call).
LEGAL_FROM: dict[str, tuple[RequestStatus, ...]] = {}
for (_status, _kind) in REQUEST_MOVES:
    LEGAL_FROM[_kind] = (*LEGAL_FROM.get(_kind, ()), *(() if _status is None else (_status,)))


def legal_request(core: Core, request_id: str, kind: str) -> RequestState:
    """The request, if `kind` may meet it, marked `changed` (its handler may change
    it). The fast path (one tuple membership) vouches for known requests only;
    `request_problem` decides the rest."""
    request = core.requests.get(request_id)
    if request is not None and request.status in LEGAL_FROM[kind]:
        request.changed()
        return request
    request_problem(request, request_id, kind)
    # Past the naming check, only an unknown request meeting request_added is left,
    # and that handler asks only about known requests.
    assert request is not None, f"{kind} for unknown request {request_id!r}"
    request.changed()
    return request


def request_problem(request: RequestState | None, request_id: str, kind: str) -> None:
    legal, _ = request_move(request.status if request else None, kind)
    if not legal:
        status = request.status.value if request else "unknown"
        raise ProtocolViolation("illegal_request_event", f"{kind} for {status} request {request_id!r}",
                                request_id=request_id)


# Block tables: one list per KV group, ids in range. No fast twin: its callers
# check the count inline, and the range comes with their own fast paths.


def group_shape_problem(core: Core, block_ids: ev.BlockIdsByGroup, request_id: str) -> None:
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


# blocks_touched: a prefix-cache hit on blocks that hold the request's content.


def touch_ok(core: Core, request: RequestState, block_ids: ev.BlockIdsByGroup) -> bool:
    """No touched block is being loaded, and none holds content other than the
    request's key at its position (a block's key is None where unknown)."""
    writer = core.block_writer
    block_key = core.block_key
    for ids, keys in zip(block_ids, request.keys):
        if writer and not writer.keys().isdisjoint(ids):
            return False
        for position in range(min(len(ids), len(keys))):  # typed: each read a direct call when compiled
            known = block_key[ids[position]]
            if known is not None and known != keys[position]:
                return False
    return True


def touch_problem(core: Core, request: RequestState, block_ids: ev.BlockIdsByGroup) -> None:
    for group_id, ids in enumerate(block_ids):
        keys = request.keys[group_id]
        for position, block in enumerate(ids):
            if block == NULL_BLOCK_ID:
                continue
            if block in core.block_writer:
                raise ProtocolViolation("touch_loading_block", f"block {block} is still being loaded",
                                        request_id=request.request_id)
            known = core.block_key[block]
            if known is not None and position < len(keys) and known != keys[position]:
                raise ProtocolViolation(
                    "touch_wrong_content",
                    f"block {block} holds {known.hex()[:16]}…, request expects {keys[position].hex()[:16]}…",
                    request_id=request.request_id)


# blocks_allocated: fresh blocks, in range, named once, that nothing holds.


def allocation_ok(core: Core, block_ids: ev.BlockIdsByGroup) -> bool:
    if len(block_ids) != len(core.groups):
        return False
    fresh = list(filter(None, chain.from_iterable(block_ids)))  # every non-null block, in order
    if not fresh:
        return True
    # One C-level pass per fact; reading the counts is the upper bound check.
    # Pins are counted only by pinning stores: in flush mode every count is 0.
    if min(fresh) < 0 or len(set(fresh)) != len(fresh):
        return False
    held = counts_of(fresh)
    try:
        if any(held(core.block_refs)):
            return False
    except IndexError:
        return False
    writer = core.block_writer
    return not ((core.config.protection is _PIN and any(held(core.block_pins)))
                or (writer and not writer.keys().isdisjoint(fresh)))


def allocation_problem(core: Core, block_ids: ev.BlockIdsByGroup, request_id: str) -> None:
    """Cheaper than `allocation_ok` for a few blocks (a decode step's one per group)."""
    if len(block_ids) != len(core.groups):
        group_shape_problem(core, block_ids, request_id)
    seen: set[int] = set()
    limit = core.config.num_device_blocks
    refs = core.block_refs
    pins = core.block_pins
    writer = core.block_writer
    for ids in block_ids:
        for block in ids:
            if block == NULL_BLOCK_ID:
                continue
            if not 0 < block < limit:
                group_shape_problem(core, block_ids, request_id)
            if block in seen:
                raise ProtocolViolation("duplicate_block", f"block {block} allocated twice", request_id=request_id)
            seen.add(block)
            if refs[block] or pins[block] or block in writer:
                raise ProtocolViolation(
                    "block_in_use",
                    f"block {block} allocated while held (refs={refs[block]}, "
                    f"pins={pins[block]}, loading={block in writer})",
                    request_id=request_id)


# blocks_freed: blocks the request holds, each named once.


def free_positions(core: Core, request: RequestState,
                   block_ids: ev.BlockIdsByGroup) -> tuple[list[list[int]], list[int]] | None:
    """Per group, the table positions of the freed blocks, and where the next
    search may start; None if a block is not held past the group's floor, or
    named twice. vLLM frees a window's blocks oldest first, often many at once:
    the search starts past the run of positions that are null or freed by this
    event, so each is found where it starts (the first occurrence past the
    floor, as `table.index(block, floor)` would find it: a table names a block once)."""
    if len(block_ids) != len(core.groups):
        return None
    found: list[list[int]] = []
    starts: list[int] = []
    for ids, table, floor in zip(block_ids, request.table, request.free_floor):
        if len(ids) > 1 and _repeats_a_block(ids):
            return None
        positions = []
        end = len(table)
        start = floor
        for block in ids:
            if block == NULL_BLOCK_ID:
                continue
            if start < end and table[start] == block:  # the usual free: the oldest held block
                position = start
            else:
                try:
                    position = table.index(block, start)
                except (ValueError, TypeError):
                    return None
            positions.append(position)
            if position == start:
                start += 1
                while start < end and table[start] == NULL_BLOCK_ID:
                    start += 1
        found.append(positions)
        starts.append(start)
    return found, starts


def _repeats_a_block(ids: tuple[int, ...]) -> bool:
    distinct = set(ids)
    distinct.discard(NULL_BLOCK_ID)
    return len(distinct) != len(ids) - ids.count(NULL_BLOCK_ID)


def free_problem(core: Core, request: RequestState, block_ids: ev.BlockIdsByGroup) -> None:
    request_id = request.request_id
    group_shape_problem(core, block_ids, request_id)
    positions: list[tuple[int, int]] = []
    for group, ids in zip(core.groups, block_ids):
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
                    request_id=request_id) from None
    if len(set(positions)) != len(positions):
        raise ProtocolViolation("duplicate_block", "a block is freed twice", request_id=request_id)


# step_scheduled: a later step, each request once, each one a step may schedule,
# with no more tokens than its table covers.


def step_crossings(core: Core, event: ev.StepScheduled
                   ) -> tuple[list[RequestState], list[tuple[RequestState, int]]] | None:
    """The scheduled requests, and those whose horizon reached their next
    storable block (about one in block_size decoding requests per step), with
    that horizon; None if the step fails a check. One read-only pass: a
    request's `step_limit` is -1 unless a step may schedule it, so one
    comparison checks status and allocation."""
    rids = event.request_ids
    if event.step_index <= core.step_index or len(set(rids)) != len(rids):
        return None
    requests = core.requests
    scheduled: list[RequestState] = []
    crossed: list[tuple[RequestState, int]] = []
    for rid, done, count in zip(rids, event.num_computed_tokens, event.num_scheduled_tokens):
        request = requests.get(rid)
        if request is None:
            return None
        horizon = done + count
        if horizon > request.step_limit or done < 0 or count < 0:
            return None
        if horizon >= request.next_store_tokens:
            crossed.append((request, horizon))
        scheduled.append(request)
    return scheduled, crossed


def step_problem(core: Core, event: ev.StepScheduled) -> None:
    if event.step_index <= core.step_index:
        raise ProtocolViolation("step_not_increasing", f"step {event.step_index} after {core.step_index}")
    rids = event.request_ids
    if len(set(rids)) != len(rids):
        raise ProtocolViolation("duplicate_request", "a request is scheduled twice in one step")
    for rid, computed, count in zip(rids, event.num_computed_tokens, event.num_scheduled_tokens):
        request = legal_request(core, rid, event.kind)
        horizon = computed + count
        if computed < 0 or count < 0:
            raise ProtocolViolation("bad_token_count", f"computed={computed} scheduled={count}", request_id=rid)
        if horizon > request.capacity_tokens:
            raise ProtocolViolation(
                "unallocated_tokens", f"{horizon} tokens scheduled but the block table covers "
                f"{request.capacity_tokens}", request_id=rid)


# request_finished: vLLM's final table is the engine's, but where vLLM has
# nulled a block (a sliding window's, freed without telling).


def final_table_ok(core: Core, request: RequestState, final_ids: ev.BlockIdsByGroup) -> bool:
    if len(final_ids) != len(core.groups):
        return False
    if list(map(list, final_ids)) == request.table:  # the common case
        return True
    for final, table in zip(final_ids, request.table):
        if len(final) != len(table) or not all(map(or_, map(eq, final, table), map(not_, final))):
            return False
    return True


def final_table_problem(core: Core, request: RequestState, final_ids: ev.BlockIdsByGroup) -> None:
    group_shape_problem(core, final_ids, request.request_id)
    for group, final in zip(core.groups, final_ids):
        table = request.table[group.group_id]
        if len(final) != len(table) or any(f != t and f != NULL_BLOCK_ID for f, t in zip(final, table)):
            raise ProtocolViolation(
                "final_table_mismatch", f"group {group.group_id}: final blocks {list(final)[:8]}… differ "
                f"from the engine's table {table[:8]}…", request_id=request.request_id)


# A worker's report on a job: a job of that kind in flight, a worker in range
# that has not reported it yet.


def report_ok(job: Job | None, kind: JobKind, worker: int, world_size: int) -> bool:
    return (job is not None and job.kind is kind and 0 <= worker < world_size
            and job.pending_workers >> worker & 1 == 1)


def report_problem(core: Core, job_id: int, kind: JobKind, worker: int) -> None:
    job = core.jobs.get(job_id)
    if job is None or job.kind is not kind:
        raise ProtocolViolation("unknown_job", f"no {kind.value} job {job_id} in flight", job_id=job_id)
    if not 0 <= worker < core.config.world_size:
        raise ProtocolViolation("bad_worker", f"worker {worker} not in [0, {core.config.world_size})",
                                job_id=job_id)
    if not job.pending_workers >> worker & 1:
        raise ProtocolViolation("duplicate_completion", f"worker {worker} already reported job {job_id}",
                                job_id=job_id)


def reported_job(core: Core, job_id: int, kind: JobKind, worker: int) -> Job:
    """The job a worker's report names, if the report is legal."""
    job = core.jobs.get(job_id)
    if not report_ok(job, kind, worker, core.config.world_size):
        report_problem(core, job_id, kind, worker)
        raise disagree("report")
    assert job is not None  # report_ok vouched for it
    return job
