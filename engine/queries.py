"""What the world outside engine/ may ask of the state.

Adapters, the CLI, the report and the KV-events publisher read the engine
through these functions only, never through `Core`'s tables, so the tables
can change shape (a tier of its own per level, say) without touching them.
Each answer is a plain value or a frozen view: holding one never keeps the
engine's tables alive or lets a caller change them.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import Final, NamedTuple, cast

import attrs

from . import lower, transitions
from .state import STATS_FIELDS, STORED, JobStage, RequestStatus, State, TierKeyState

_TOTALS: Final = attrgetter(*STATS_FIELDS)

ADMITTABLE = transitions.ADMITTABLE


class TierUsage(NamedTuple):
    """A tuple: vLLM's stats call reads it every step, and an attrs class's
    `__init__` runs as Python even compiled (three times the cost)."""

    used_slots: int
    capacity_slots: int
    offered_keys: int  # keys a lookup may hit (stored or still storing)
    evictable_keys: int
    loading_slots: int


@attrs.frozen
class DeviceUsage:
    held_blocks: int
    pinned_blocks: int
    blocks_read_by_stores: int
    blocks_being_loaded: int


@attrs.frozen
class RequestView:
    request_id: str
    status: RequestStatus
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_hashes: int
    blocks_per_group: tuple[int, ...]  # blocks held (null positions not counted)
    table_positions: tuple[int, ...]
    load_job_id: int
    next_store_positions: tuple[int, ...]
    num_preemptions: int


@attrs.frozen
class JobView:
    job_id: int
    kind: str  # "store" or "load"
    request_id: str
    keys: tuple[bytes, ...]  # every group's, in group order
    blocks_per_group: tuple[int, ...]
    pending_workers: int  # bitmask of workers yet to report
    flushed: bool
    stale: bool


@attrs.frozen
class Position:
    step_index: int
    epoch: int
    next_job_id: int


def position(state: State) -> Position:
    core = state.core
    return Position(core.step_index, core.epoch, core.next_job_id)


def next_job_id(state: State) -> int:
    """The id the next job will get: `check_event`'s mark of which jobs an event created."""
    return state.core.next_job_id


@attrs.frozen
class LowerTierUsage:
    name: str
    capacity_blocks: int
    held_keys: int
    keys_being_written: int
    keys_being_read: int
    counts: dict[str, int]  # spills, keys_written, write_failures, keys_read, read_failures, evictions, ...


def lower_tier_usage(state: State) -> list[LowerTierUsage]:
    """Each tier below host memory, in order (empty without any)."""
    return [LowerTierUsage(t.name, t.capacity, len(t.held), len(t.writing), len(t.reading), dict(t.counts))
            for t in state.core.lower]


def tier_key_state(state: State, tier: int, key: bytes) -> TierKeyState:
    """`key`'s state in lower tier `tier` (1-based), as `TIER_KEY_MOVES` names it."""
    return lower.key_state(state.core.lower[tier - 1], key)


def job_stage(state: State, job_id: int) -> JobStage | None:
    """A job's stage as `JOB_MOVES` names it; None once it ended (or never started)."""
    job = state.core.jobs.get(job_id)
    if job is None:
        return None
    return JobStage.FLUSHED if job.flushed else JobStage.IN_FLIGHT


def tier_holds(state: State, tier: int, key: bytes) -> bool:
    """Whether lower tier `tier` (1-based) holds `key` whole."""
    return key in state.core.lower[tier - 1].held


def unknown_keys(state: State, request_id: str, from_tokens: int) -> list[bytes]:
    """The request's block keys from token `from_tokens` on that no tier is known
    to hold: what a lookup in a shared tier may find."""
    core = state.core
    request = core.requests.get(request_id)
    if request is None:
        return []
    known = lower.known(core)
    return [key for group, keys in zip(core.groups, request.keys)
            for key in keys[from_tokens // group.block_size:] if not known(key)]


def stats(state: State) -> dict[str, int]:
    """The running totals (hits, loads, stores, failures, evictions, ...)."""
    return state.core.stats.as_dict()


def totals(state: State) -> tuple[int, ...]:
    """The running totals as one tuple, in `STATS_FIELDS` order (one C-level
    read of each): a caller asking every step compares it whole."""
    return cast(tuple[int, ...], _TOTALS(state.core.stats))


def tier_usage(state: State) -> TierUsage:
    core = state.core
    return TierUsage(core.num_used_slots(), core.config.num_tier_slots, len(core.slot_of_key),
                     len(core.policy), len(core.slot_loads))


def device_usage(state: State) -> DeviceUsage:
    core = state.core
    return DeviceUsage(sum(1 for c in core.block_refs if c), sum(1 for c in core.block_pins if c),
                       len(core.block_readers), len(core.block_writer))


def is_loadable(state: State, key: bytes) -> bool:
    """The key is in the tier and its store completed on every worker: a hit may load it."""
    core = state.core
    slot = core.slot_of_key.get(key, -1)
    return slot >= 0 and core.slot_state[slot] == STORED


def loadable_keys(state: State) -> list[bytes]:
    core = state.core
    state_of = core.slot_state
    return sorted(k for k, s in core.slot_of_key.items() if state_of[s] == STORED)


def num_requests(state: State) -> int:
    return len(state.core.requests)


def request_ids(state: State) -> list[str]:
    return sorted(state.core.requests)


def request_status(state: State, request_id: str) -> RequestStatus | None:
    request = state.core.requests.get(request_id)
    return None if request is None else request.status


def request_view(state: State, request_id: str) -> RequestView | None:
    r = state.core.requests.get(request_id)
    if r is None:
        return None
    return RequestView(
        r.request_id, r.status, r.num_prompt_tokens, r.num_tokens, r.num_computed_tokens, len(r.hashes),
        tuple(sum(1 for b in t if b) for t in r.table), tuple(len(t) for t in r.table), r.load_job_id,
        tuple(r.next_store), r.num_preemptions)


def request_keys(state: State, request_id: str) -> tuple[tuple[bytes, ...], ...]:
    """The request's block keys so far, per KV group (empty for an unknown request)."""
    r = state.core.requests.get(request_id)
    return () if r is None else tuple(tuple(keys) for keys in r.keys)


def request_table(state: State, request_id: str) -> tuple[tuple[int, ...], ...]:
    """The request's block table, per KV group (empty for an unknown request)."""
    r = state.core.requests.get(request_id)
    return () if r is None else tuple(tuple(table) for table in r.table)


def has_jobs_in_flight(state: State) -> bool:
    return bool(state.core.jobs)


def num_jobs_in_flight(state: State) -> int:
    return len(state.core.jobs)


def job_ids(state: State) -> list[int]:
    return sorted(state.core.jobs)


def blocks_free(state: State, block_ids: Iterable[int]) -> bool:
    """No request holds any of these device blocks, none is pinned and none is being loaded into."""
    core = state.core
    refs, pins, writer = core.block_refs, core.block_pins, core.block_writer
    return not any(refs[b] or pins[b] or b in writer for b in block_ids)


def jobs_on_blocks(state: State, block_ids: Iterable[int]) -> list[int]:
    """The jobs in flight that read or write any of these device blocks, in job order."""
    wanted = set(block_ids)
    return [j.job_id for j in state.core.jobs.values()
            if any(not wanted.isdisjoint(group) for group in j.block_ids)]


def job_view(state: State, job_id: int) -> JobView | None:
    """A transfer still in flight; None once it ended (or never existed)."""
    j = state.core.jobs.get(job_id)
    if j is None:
        return None
    return JobView(j.job_id, j.kind.value, j.request_id, tuple(k for group in j.keys for k in group),
                   tuple(len(k) for k in j.keys), j.pending_workers, j.flushed, j.stale)
