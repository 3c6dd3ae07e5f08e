"""The tiers below host memory: what each holds, and the jobs that move keys
between them and host memory. The engine never reads a lower tier itself;
it knows what a tier holds from its own writes, from what was found there
at start or by a lookup (`tier_keys_found`), and from failed reads.

Write-through: a key is written down (a spill) as soon as its host store
succeeds, while the host keeps it. So a host eviction costs no I/O and waits
for none, and a crash loses only spills still in flight. The price is disk
bandwidth for keys the host would have served anyway (bench/RESULTS.md).

A spill reads its host slots the way a load does (their load count keeps
them from eviction until it ends); `Core.spill_reads` tells those reads
apart from device loads, which a lookup must wait for. A load that needs
a key only a lower tier holds promotes it: the key gets a host slot
(storing, as a store's would be), the worker reads the block into it and
then copies it to the device, and at the end the slot is stored or freed
like a store's.

A key's state in a tier (`key_state`: which of the tier's tables holds it)
moves only as `TIER_KEY_MOVES` says: each move's target is its row, read once
at import, and `_move` moves the key between the tables. The states each
function starts a move from, and the rows that leave a key where it is (a
read planned on a held key, a reset of one being written), are asserted below.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Final

from . import effects as fx
from . import slots
from .state import SPILL as _SPILL
from .state import Core, Job, LowerTier
from .state import TierKeyState as _K
from .transitions import TIER_KEY_MOVES as _MOVES
from .transitions import sources as _sources
from .transitions import start_job

# What the functions below rely on, where the moves start. plan_spills and keys_found
# take only keys the tier lacks; spill_ended ends what is being written; a read
# (reserve_promotions, promotions_ended) starts on a held key and may end on one a
# reset removed meanwhile; _evict and drop_all start on held keys, and a reset leaves a
# key being written until its spill ends. A read's count and a key's recency are not
# states: the functions keep them beside the moves.
assert _sources(_MOVES, "spill_planned") == {_K.ABSENT}
assert _sources(_MOVES, "found") == set(_K)
assert _sources(_MOVES, "spill_written") == _sources(_MOVES, "spill_failed") == {_K.WRITING}
assert _sources(_MOVES, "spill_ended_stale") == {_K.WRITING}
assert _sources(_MOVES, "read_planned") == {_K.HELD} and _MOVES[(_K.HELD, "read_planned")] is _K.HELD
assert _sources(_MOVES, "read_ended") == _sources(_MOVES, "read_failed") == {_K.HELD, _K.ABSENT}
assert _sources(_MOVES, "evicted") == {_K.HELD}
assert _sources(_MOVES, "reset") == {_K.HELD, _K.WRITING} and _MOVES[(_K.WRITING, "reset")] is _K.WRITING


# Each move's target, read from the table once, at import (a constant per move, as the
# slots' are): the per-key paths below look nothing up.
_EVICTED: Final = _MOVES[(_K.HELD, "evicted")]
_SPILL_PLANNED: Final = _MOVES[(_K.ABSENT, "spill_planned")]
_SPILL_WRITTEN: Final = _MOVES[(_K.WRITING, "spill_written")]
_SPILL_FAILED: Final = _MOVES[(_K.WRITING, "spill_failed")]
_SPILL_STALE: Final = _MOVES[(_K.WRITING, "spill_ended_stale")]
_HELD_RESET: Final = _MOVES[(_K.HELD, "reset")]
# Moves whose start is the key's state at the time: per state, its target.
_READ_ENDED: Final = {state: _MOVES[(state, "read_ended")] for state in _sources(_MOVES, "read_ended")}
_READ_FAILED: Final = {state: _MOVES[(state, "read_failed")] for state in _sources(_MOVES, "read_failed")}
_FOUND: Final = {state: _MOVES[(state, "found")] for state in _sources(_MOVES, "found")}


def _move(tier: LowerTier, key: bytes, before: _K, after: _K, job_id: int = 0) -> _K:
    """Move `key` from state `before` to `after` (a `TIER_KEY_MOVES` target): out of the
    table of its state, into the table of the next (a key entering HELD becomes the most
    recently used; `job_id` is the spill writing one that enters WRITING)."""
    if after is not before:
        if before is _K.HELD:
            tier.held.remove(key)
        elif before is _K.WRITING:
            del tier.writing[key]
        if after is _K.HELD:
            tier.held.add(key)
        elif after is _K.WRITING:
            tier.writing[key] = job_id
    return after


class _Part:
    """Some of a job's keys, in the shape `slots.store_ended`/`load_ended` read."""

    __slots__ = ("keys", "slot_ids", "failed_keys", "stale")

    def __init__(self, keys: tuple, slot_ids: tuple, failed_keys: AbstractSet[bytes], stale: bool) -> None:
        self.keys = keys
        self.slot_ids = slot_ids
        self.failed_keys = failed_keys
        self.stale = stale


def known(core: Core) -> Callable[[bytes], bool]:
    """Whether some tier holds a key: host memory (whole or still being stored), or
    a lower tier (whole). Without lower tiers, the host index's own `in`."""
    slot_of_key = core.slot_of_key
    if not core.lower:
        return slot_of_key.__contains__
    helds = [tier.held for tier in core.lower]
    return lambda key: key in slot_of_key or any(key in held for held in helds)


def key_state(tier: LowerTier, key: bytes) -> _K:
    if key in tier.held:
        return _K.HELD
    return _K.WRITING if key in tier.writing else _K.ABSENT


def holder(core: Core, key: bytes) -> int:
    """The first lower tier (1-based) holding `key` whole, or 0."""
    for index, tier in enumerate(core.lower, start=1):
        if key in tier.held:
            return index
    return 0


def _evict(tier: LowerTier, count: int) -> list[bytes]:
    """Up to `count` least recently used keys that no load is reading."""
    reading = tier.reading
    victims: list[bytes] = []
    for key in tier.held:
        if len(victims) == count:
            break
        if key not in reading:
            victims.append(key)
    for key in victims:
        _move(tier, key, _K.HELD, _EVICTED)
    tier.counts["evictions"] += len(victims)
    return victims


def _removed(index: int, keys: tuple[bytes, ...], reason: fx.Reason, out: list[fx.Effect]) -> None:
    """Held keys that left tier `index`: its copies are removed, and they stop being loadable.
    (A failed or stale spill's keys were never held: `spill_ended` drops them alone.)"""
    out.append(fx.DropTierKeys(tier=index, keys=keys, reason=reason))
    out.append(fx.KeysUnloadable(tier=index, keys=keys, reason=reason))


def _make_room(core: Core, index: int, wanted: int, out: list[fx.Effect]) -> int:
    """Evict least recently used keys of tier `index` until `wanted` more fit, or
    none is left to evict (keys being read stay); the room there is then."""
    tier = core.lower[index - 1]
    room = tier.capacity - len(tier.held) - len(tier.writing)
    if wanted > room:
        victims = _evict(tier, wanted - room)
        if victims:
            _removed(index, tuple(victims), fx.Reason.EVICTED, out)
        room += len(victims)
    return room


def plan_spills(core: Core, keys: tuple, slot_ids: tuple, out: list[fx.Effect]) -> None:
    """Write these just-stored host keys (per group) to every lower tier that
    lacks them; what a tier cannot make room for is not written."""
    pressure = core.pressure
    for index, tier in enumerate(core.lower, start=1):
        held, writing = tier.held, tier.writing
        wanted = [(g, key, slot) for g, (group_keys, group_slots) in enumerate(zip(keys, slot_ids))
                  for key, slot in zip(group_keys, group_slots) if key not in held and key not in writing]
        if not wanted:
            continue
        if pressure is not None and pressure[index - 1][0]:  # vLLM's backpressure: this share of spills dropped
            row = pressure[index - 1]
            row[1] += row[0]
            if row[1] >= 1_000_000:
                row[1] -= 1_000_000
                out.append(fx.SpillDropped(tier=index, keys=tuple(key for _, key, _ in wanted)))
                continue
        room = _make_room(core, index, len(wanted), out)
        if len(wanted) > room:
            tier.counts["write_rejections"] += len(wanted) - room
            wanted = wanted[:room]
        if not wanted:
            continue
        groups = range(len(core.groups))
        job_keys = tuple(tuple(k for g, k, _ in wanted if g == group) for group in groups)
        job_slots = tuple(tuple(s for g, _, s in wanted if g == group) for group in groups)
        job_id = core.next_job_id
        core.next_job_id = job_id + 1
        job = Job(job_id, _SPILL, "", job_keys, tuple(() for _ in groups), job_slots, (),
                  (1 << core.config.world_size) - 1)
        job.tier = index
        start_job(job)
        core.jobs[job_id] = job
        slots.load_planned(core, job_keys, job_slots)  # the slots are read until the spill ends
        spill_reads = core.spill_reads
        for _, key, slot in wanted:
            _move(tier, key, _K.ABSENT, _SPILL_PLANNED, job_id)
            spill_reads[slot] = spill_reads.get(slot, 0) + 1
        tier.counts["spills"] += 1
        out.append(fx.StartSpill(job_id=job_id, tier=index, keys=job_keys, source_slot_ids=job_slots))


def spill_ended(core: Core, job: Job, out: list[fx.Effect]) -> None:
    """Written keys join the tier's held keys (most recent end); a failed or
    stale one is removed wherever some worker wrote it. The host keeps every
    key: a failed write never drops the host's copy."""
    slots.load_ended(core, _Part(job.keys, job.slot_ids, set(), job.stale))
    spill_reads = core.spill_reads
    for group_slots in job.slot_ids:
        for slot in group_slots:
            count = spill_reads[slot] - 1
            if count:
                spill_reads[slot] = count
            else:
                del spill_reads[slot]
    tier = core.lower[job.tier - 1]
    failed = job.failed_keys
    drop: list[bytes] = []
    written: list[bytes] = []
    for group_keys in job.keys:
        for key in group_keys:
            after = _SPILL_STALE if job.stale else _SPILL_FAILED if key in failed else _SPILL_WRITTEN
            (written if _move(tier, key, _K.WRITING, after) is _K.HELD else drop).append(key)
    tier.counts["keys_written"] += len(written)
    tier.counts["write_failures"] += len(failed)
    if written:
        out.append(fx.KeysLoadable(tier=job.tier, keys=tuple(written)))
    if drop:
        out.append(fx.DropTierKeys(tier=job.tier, keys=tuple(drop),
                                    reason=fx.Reason.RESET if job.stale else fx.Reason.FAILED))


def reserve_promotions(core: Core, promoted: list[tuple[int, int, bytes]], out: list[fx.Effect]) -> list[int]:
    """Host slots for keys a load reads from a lower tier first ((group, tier, key)
    each), evicting idle host keys as needed; -1 where none could be had (that
    block fails, and is recomputed). Each lower tier learns its key is being read."""
    free = core.num_free_slots()
    short = len(promoted) - free
    if short > 0:
        evicted = slots.evict(core, min(short, len(core.policy)))
        core.stats.evictions += len(evicted)
        free += len(evicted)
        if evicted:
            out.append(fx.KeysUnloadable(tier=0, keys=tuple(evicted), reason=fx.Reason.EVICTED))
    taken = promoted[:free]
    # A key another load in this step is promoting already has a slot: this load
    # reads the block again into a slot of its own, left out of the index.
    again = {key for _, _, key in taken if key in core.slot_of_key}
    placed = slots.reserve(core, [key for _, _, key in taken if key not in again])
    spare = slots.reserve_unindexed(core, [key for _, _, key in taken if key in again])
    fresh, twice = iter(placed), iter(spare)
    got = [next(twice) if key in again else next(fresh) for _, _, key in taken]
    for _, tier_index, key in taken:
        reading = core.lower[tier_index - 1].reading  # held still (`read_planned`), and counted as read
        reading[key] = reading.get(key, 0) + 1
    return got + [-1] * (len(promoted) - len(taken))


def promotions_ended(core: Core, job: Job, out: list[fx.Effect]) -> None:
    """A load's promoted keys: each slot is stored or freed as a store's would
    be; a key that failed to read leaves its lower tier (its file is removed)."""
    failed = job.failed_keys
    drops: dict[int, list[bytes]] = {}
    kept_keys, kept_slots = [], []
    for tier_index, key, slot, _ in job.promoted():
        if slot < 0:
            continue  # never read: no slot, and nothing wrong with the tier's copy
        tier = core.lower[tier_index - 1]
        count = tier.reading[key] - 1
        if count:
            tier.reading[key] = count
        else:
            del tier.reading[key]
        before = _K.HELD if key in tier.held else _K.ABSENT  # a reset may have removed it meanwhile
        if key in failed:
            if _move(tier, key, before, _READ_FAILED[before]) is not before:
                drops.setdefault(tier_index, []).append(key)
            tier.counts["read_failures"] += 1
        else:
            if _move(tier, key, before, _READ_ENDED[before]) is _K.HELD:  # most recently used now
                tier.held.move_to_end(key)
            tier.counts["keys_read"] += 1
        kept_keys.append(key)
        kept_slots.append(slot)
    if kept_keys:
        stored = slots.store_ended(core, _Part((tuple(kept_keys),), (tuple(kept_slots),), failed, job.stale))
        if stored:
            out.append(fx.KeysLoadable(tier=0, keys=tuple(stored)))
    for tier_index, keys in drops.items():
        _removed(tier_index, tuple(keys), fx.Reason.FAILED, out)


def host_part(job: Job) -> _Part | None:
    """A load's keys read from host slots it did not promote (all of them, without promotions)."""
    if not job.promote_tiers:
        return None
    keys = tuple(tuple(k for k, t in zip(group_keys, tiers) if not t)
                 for group_keys, tiers in zip(job.keys, job.promote_tiers))
    slot_ids = tuple(tuple(s for s, t in zip(group_slots, tiers) if not t)
                     for group_slots, tiers in zip(job.slot_ids, job.promote_tiers))
    return _Part(keys, slot_ids, job.failed_keys, job.stale)


def keys_found(core: Core, index: int, keys: tuple[bytes, ...], out: list[fx.Effect]) -> None:
    tier = core.lower[index - 1]
    new = []
    for key in dict.fromkeys(keys):
        before = key_state(tier, key)
        if _move(tier, key, before, _FOUND[before]) is not before:
            new.append(key)
    tier.counts["keys_found"] += len(new)
    if new:
        out.append(fx.KeysLoadable(tier=index, keys=tuple(new)))
    _make_room(core, index, 0, out)  # found beyond capacity: the oldest go


def drop_all(core: Core, out: list[fx.Effect]) -> int:
    """A cache reset: every lower tier forgets (and removes) what it holds;
    keys being written are removed when their (now stale) spills end."""
    dropped = 0
    for index, tier in enumerate(core.lower, start=1):
        keys = tuple(tier.held)
        for key in keys:  # what is being written stays so (`reset` rows), removed when its now stale spill ends
            _move(tier, key, _K.HELD, _HELD_RESET)
        tier.counts["evictions"] += len(keys)
        dropped += len(keys)
        if keys:
            _removed(index, keys, fx.Reason.RESET, out)
    return dropped

