"""The whole engine state as plain data, and back: what a log's snapshot holds.

A replay that starts at a snapshot must decide every later event exactly as
the uninterrupted run did, so a snapshot holds every table the reducer reads,
not only what `digest` hashes: derived per-request fields (`capacity_tokens`,
`step_limit`, `free_floor`), the free-slot stack in its order, the policy's
orders, and every dict in its insertion order (eviction and planning iterate
some of them). Only what `Core.__init__` derives from the config, and
`next_free_tokens` (recomputed from the floors), are left out;
`restore` takes the config from the log's header.

The data is lists, ints, bytes, strs, bools and None, so that msgpack (or any
serializer of plain values) carries it. Dense int columns travel as packed
little-endian int64 bytes: a 1M-slot stack packs and unpacks at C speed.

`capture` copies what it takes, so the state may change right after it
returns: a live writer captures on the scheduler's thread (list and dict
copies, C loops) and serializes on its own thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from kvledger.events.config import EngineConfig

from .key_order import KeyOrder
from .policies import ARC, LRU
from .state import Core, Job, JobKind, JobStage, LowerTier, RequestState, RequestStatus, State, reader_ids

SNAPSHOT_VERSION = 1
"""Bumped when the data's shape changes; `restore` refuses other versions."""

_STATUSES = {s.value: s for s in RequestStatus}
_JOB_KINDS = {k.value: k for k in JobKind}


class SnapshotError(ValueError):
    """Snapshot data that does not describe a state of this engine and config."""


def _ints(values: Iterable[int]) -> bytes:
    return array("q", values).tobytes()


def _unints(data: object) -> list[int]:
    if type(data) is not bytes or len(data) % 8:
        raise SnapshotError("a packed int column must be bytes of a multiple of 8")
    column = array("q")
    column.frombytes(data)
    return column.tolist()


def _request(r: RequestState) -> list[Any]:
    return [
        r.request_id, r.status.value, r.num_prompt_tokens, r.num_tokens, list(r.hashes),
        [list(k) for k in r.keys], [list(t) for t in r.table], r.num_computed_tokens, list(r.next_store),
        r.next_store_tokens, r.load_job_id, r.num_preemptions, r.capacity_tokens, r.step_limit,
        list(r.free_floor),
    ]


def _job(j: Job) -> list[Any]:
    return [
        j.job_id, j.kind.value, j.request_id, j.keys, j.block_ids, j.slot_ids, j.generations,
        j.pending_workers, sorted(j.failed_keys), sorted(j.failed_blocks), j.flushed, j.stale, j.num_tokens,
        j.tier, j.promote_tiers,
    ]


def _policy(policy: LRU | ARC) -> list[Any]:
    if isinstance(policy, ARC):
        return ["arc", policy.capacity, policy.p, list(policy.t1), list(policy.t2), list(policy.b1),
                list(policy.b2)]
    return ["lru", list(policy._order)]


def _lower(t: LowerTier) -> list[Any]:
    return [t.name, t.capacity, list(t.held), list(t.writing.items()), list(t.reading.items()),
            [t.counts[name] for name in LowerTier.COUNTS]]


def capture(state: State) -> list[Any]:
    """The state as plain data (copies throughout)."""
    c = state.core
    return [
        SNAPSHOT_VERSION,
        [c.step_index, c.epoch, c.next_job_id, c.next_fresh_slot],
        [_ints(c.block_refs), _ints(c.block_pins), _ints(c.block_generation), _ints(c.block_group)],
        list(c.block_key),
        [[b, list(reader_ids(jobs))] for b, jobs in c.block_readers.items()],
        list(c.block_writer.items()),
        list(c.lazy_keys.items()),
        [list(c.slot_of_key), _ints(c.slot_of_key.values())],
        list(c.slot_key),
        bytes(c.slot_state),
        list(c.slot_loads.items()),
        _ints(c.free_slots),
        _policy(c.policy),
        [_lower(t) for t in c.lower],
        list(c.spill_reads.items()),
        [_request(r) for r in c.requests.values()],
        [_job(j) for j in c.jobs.values()],
        list(c.stats.as_dict().values()),
        # Parts of later settings, only where set (so that other snapshots keep their shape).
        *([_optional(c)] if c.offers is not None or c.restore_costs is not None or c.pressure is not None
          else []),
    ]


def _optional(c: Core) -> dict[str, Any]:
    parts: dict[str, Any] = {}
    if c.offers is not None:  # a store threshold (`offers.py`)
        parts["offers"] = [list(row) for row in c.offers.canonical()]
    if c.restore_costs is not None:  # restore_budget "auto"
        compute, fixed, per_block = c.restore_costs
        parts["restore_costs"] = [compute, list(fixed), list(per_block)]
    if c.pressure is not None:  # a tier under pressure (vLLM's backpressure)
        parts["pressure"] = [list(row) for row in c.pressure]
    return parts


# --- restore ------------------------------------------------------------------


def _tuples(value: object) -> Any:
    """A nested sequence as nested tuples (how the reducer builds job fields)."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value


def _pairs(items: object, what: str) -> list[tuple[Any, Any]]:
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in items):
        raise SnapshotError(f"{what}: expected a list of pairs")
    return [(p[0], p[1]) for p in items]


def _column(values: object, length: int, what: str) -> list[Any]:
    if not isinstance(values, (list, tuple)) or len(values) != length:
        raise SnapshotError(f"{what}: expected {length} entries")
    return list(values)


def _restore_request(row: Sequence[Any], groups: int) -> RequestState:
    (rid, status, num_prompt_tokens, num_tokens, hashes, keys, table, num_computed_tokens, next_store,
     next_store_tokens, load_job_id, num_preemptions, capacity_tokens, step_limit, free_floor) = row
    r = RequestState(rid, num_prompt_tokens, ())  # a compiled class has no bare __new__
    r.request_id = rid
    r.status = _STATUSES[status]
    r.num_prompt_tokens = num_prompt_tokens
    r.num_tokens = num_tokens
    r.hashes = list(hashes)
    r.hashes_repr = ""
    r.canonical_text = ""
    r.keys = [list(k) for k in keys]
    r.table = [list(t) for t in table]
    r.num_computed_tokens = num_computed_tokens
    r.next_store = list(next_store)
    r.next_store_tokens = next_store_tokens
    r.load_job_id = load_job_id
    r.num_preemptions = num_preemptions
    r.capacity_tokens = capacity_tokens
    r.step_limit = step_limit
    r.free_floor = list(free_floor)
    if not len(r.keys) == len(r.table) == len(r.next_store) == len(r.free_floor) == groups:
        raise SnapshotError(f"request {rid!r}: per-group fields for {groups} groups expected")
    return r


def _restore_job(row: Sequence[Any]) -> Job:
    (job_id, kind, rid, keys, block_ids, slot_ids, generations, pending_workers, failed_keys, failed_blocks,
     flushed, stale, num_tokens, tier, promote_tiers) = row
    j = Job(job_id, _JOB_KINDS[kind], rid, _tuples(keys), _tuples(block_ids), _tuples(slot_ids),
            _tuples(generations), pending_workers, num_tokens)
    j.failed_keys = frozenset(failed_keys)
    j.failed_blocks = frozenset(failed_blocks)
    j.stage = JobStage.FLUSHED if flushed else JobStage.IN_FLIGHT
    j.stale = bool(stale)
    j.tier = tier
    j.promote_tiers = _tuples(promote_tiers)
    return j


def _restore_policy(core: Core, row: Sequence[Any]) -> None:
    name = row[0]
    if name == "arc" and isinstance(core.policy, ARC):
        _name, capacity, p, t1, t2, b1, b2 = row
        policy = core.policy
        if capacity != policy.capacity:
            raise SnapshotError(f"ARC capacity {capacity}, the config's {policy.capacity}")
        policy.p = p
        policy.t1, policy.t2 = dict.fromkeys(t1), dict.fromkeys(t2)
        policy.b1, policy.b2 = dict.fromkeys(b1), dict.fromkeys(b2)
    elif name == "lru" and isinstance(core.policy, LRU):
        core.policy._order = dict.fromkeys(row[1])
    else:
        raise SnapshotError(f"policy {name!r} differs from the config's {core.config.policy.value!r}")


def _restore_lower(core: Core, rows: Sequence[Any]) -> None:
    if len(rows) != len(core.lower):
        raise SnapshotError(f"{len(rows)} lower tiers, the config has {len(core.lower)}")
    for tier, (name, capacity, held, writing, reading, counts) in zip(core.lower, rows):
        if (name, capacity) != (tier.name, tier.capacity):
            raise SnapshotError(f"lower tier {name!r} of {capacity} blocks differs from the config's")
        tier.held = KeyOrder(held, capacity=tier.capacity)
        tier.writing = dict(_pairs(writing, "lower tier writing"))
        tier.reading = dict(_pairs(reading, "lower tier reading"))
        tier.counts = dict(zip(LowerTier.COUNTS, _column(counts, len(LowerTier.COUNTS), "lower tier counts")))


def restore(config: EngineConfig, data: Sequence[Any]) -> State:
    """The state `capture` took, on an engine of `config` (the log's header).
    Raises SnapshotError for data of another version, shape or config."""
    if not isinstance(data, (list, tuple)) or not data or data[0] != SNAPSHOT_VERSION:
        version = data[0] if isinstance(data, (list, tuple)) and data else None
        raise SnapshotError(f"snapshot version {version!r}; this engine reads version {SNAPSHOT_VERSION}")
    try:
        return _restore(config, data)
    except SnapshotError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise SnapshotError(f"malformed snapshot: {type(exc).__name__}: {exc}") from None


def _restore(config: EngineConfig, data: Sequence[Any]) -> State:
    (_version, scalars, columns, block_key, block_readers, block_writer, lazy_keys, slot_index, slot_key,
     slot_state, slot_loads, free_slots, policy, lower, spill_reads, requests, jobs, stats) = data[:18]
    core = Core(config)
    optional = data[18] if len(data) == 19 else {}
    if len(data) > 19 or not isinstance(optional, dict) or set(optional) - {"offers", "restore_costs", "pressure"}:
        raise SnapshotError(f"snapshot of {len(data)} parts, or an optional part this engine does not know")
    if (core.offers is not None) != ("offers" in optional):
        raise SnapshotError(f"snapshot {'without' if core.offers is not None else 'with'} offers for a store "
                            f"threshold of {config.store_threshold}")
    if core.offers is not None:
        for key, count, request_id in optional["offers"]:
            if type(key) is not bytes or type(count) is not int or count < 1 or type(request_id) is not str:
                raise SnapshotError("offers: expected rows of key, count, request")
            core.offers.counts[key] = count
            core.offers.last[key] = request_id
    if "restore_costs" in optional:
        compute, fixed, per_block = optional["restore_costs"]
        core.restore_costs = (compute, tuple(_column(fixed, len(config.lower_tiers) + 1, "restore_costs")),
                              tuple(_column(per_block, len(config.lower_tiers) + 1, "restore_costs")))
    if "pressure" in optional:
        core.pressure = [list(_column(row, 2, "pressure")) for row in _column(optional["pressure"],
                                                                                 len(config.lower_tiers), "pressure")]
    n, m = config.num_device_blocks, config.num_tier_slots
    core.step_index, core.epoch, core.next_job_id, core.next_fresh_slot = scalars
    core.block_refs, core.block_pins, core.block_generation, core.block_group = (
        _column(_unints(c), n, "device block column") for c in columns)
    core.block_key = _column(block_key, n, "block_key")
    core.block_readers = {b: jobs[0] if len(jobs) == 1 else list(jobs)
                          for b, jobs in _pairs(block_readers, "block_readers")}
    core.block_writer = dict(_pairs(block_writer, "block_writer"))
    core.lazy_keys = dict(_pairs(lazy_keys, "lazy_keys"))
    keys, slots = slot_index
    core.slot_of_key = dict(zip(keys, _column(_unints(slots), len(keys), "slot_of_key")))
    core.slot_key = _column(slot_key, m, "slot_key")
    if type(slot_state) is not bytes or len(slot_state) != m:
        raise SnapshotError(f"slot_state: expected {m} bytes")
    core.slot_state = bytearray(slot_state)
    core.slot_loads = dict(_pairs(slot_loads, "slot_loads"))
    core.free_slots = _unints(free_slots)
    _restore_policy(core, policy)
    _restore_lower(core, lower)
    core.spill_reads = dict(_pairs(spill_reads, "spill_reads"))
    groups = len(config.groups)
    core.requests = {r.request_id: r for r in (_restore_request(row, groups) for row in requests)}
    for request in core.requests.values():
        request.floor_changed(core.free_rules)  # derived, not stored
    core.jobs = {j.job_id: j for j in (_restore_job(row) for row in jobs)}
    names = list(core.stats.as_dict())
    for name, value in zip(names, _column(stats, len(names), "stats")):
        setattr(core.stats, name, value)
    return State(core)


__all__ = ["SNAPSHOT_VERSION", "SnapshotError", "capture", "restore"]
