"""A tier slot's life: every change to a slot's state, as `SLOT_MOVES` says.

The reducer decides when (a store planned or ended, a load planned or ended,
room needed, a cache reset); this module moves the slots, their index
(`slot_of_key`), their load counts and the eviction policy together, so the
tier's bookkeeping has one home. Each action's target state comes from the
table, looked up once at import (`_TO`: a store planned in a step costs what
writing a constant costs). The state before each action is the table's too:
checked at import against what each function relies on, asserted per slot
where that is cheap (eviction, reset, an orphan's release), and left to the
invariants (`invariants._check_slot`) in the per-key loops of storing and
loading, which run for every block a workload moves.

A slot leaves the index (stops being offered) on eviction, failure or reset,
but is freed only when no job still reads or writes it: a store that ends
after its key was dropped frees its slot as stale, and the last load of a
dropped key releases it as an orphan.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Final, Protocol

from .state import FREE as _FREE
from .state import STORED as _STORED
from .state import STORING as _STORING
from .state import Core
from .transitions import SLOT_MOVES


class Ended(Protocol):
    """What ending a store or load reads: a `Job`, or some of its keys (`lower._Part`)."""

    @property
    def keys(self) -> tuple: ...
    @property
    def slot_ids(self) -> tuple: ...
    @property
    def failed_keys(self) -> AbstractSet[bytes]: ...
    @property
    def stale(self) -> bool: ...

# Action -> (state before, state after), as plain ints (the states live in a bytearray).
_MOVES: dict[str, tuple[int, int]] = {action: (int(source), int(target))
                                      for (source, action), target in SLOT_MOVES.items()}
assert len(_MOVES) == len(SLOT_MOVES), "each slot action has one row: its state before is implied"
_TO = {action: target for action, (_, target) in _MOVES.items()}
# A slot that stops being used is released: it goes back on the free list, keyless.
_RELEASES = ("store_failed", "store_ended_stale", "evicted", "released_orphan")
assert all(_TO[action] == _FREE for action in _RELEASES), "a released slot is free"
# What the functions below rely on: a store takes free slots and ends on storing
# ones; a load leaves a stored slot stored (it counts the slot's loads instead).
assert _MOVES["store_planned"][0] == _FREE
assert all(_MOVES[action][0] == _STORING for action in ("store_succeeded", "store_failed", "store_ended_stale"))
assert all(_MOVES[action] == (_STORED, _STORED) for action in ("load_planned", "load_ended"))
# The storing paths' targets, as constants (Final: a static of the compiled module,
# where a plain global is a lookup in the module's dict).
_PLANNED_TO: Final = _TO["store_planned"]
_SUCCEEDED_TO: Final = _TO["store_succeeded"]
_FAILED_TO: Final = _TO["store_failed"]
_STALE_TO: Final = _TO["store_ended_stale"]


def _release(core: Core, slot: int, target: int) -> None:
    core.slot_key[slot] = None
    core.slot_state[slot] = target
    core.free_slots.append(slot)


def reserve(core: Core, keys: list[bytes]) -> list[int]:
    """store_planned: a free slot for each key (the free list's last freed
    first, then fresh ones), indexed to it; the policy learns of them. Returns
    their slots, in order. A plain loop: a step plans a few keys per store,
    where C-level passes cost more to set up than they save."""
    free_slots = core.free_slots
    slot_of_key = core.slot_of_key
    slot_key = core.slot_key
    slot_state = core.slot_state
    fresh = core.next_fresh_slot
    slots = []
    for key in keys:
        if free_slots:
            slot = free_slots.pop()
        else:
            slot = fresh
            fresh += 1
        slot_of_key[key] = slot
        slot_key[slot] = key
        slot_state[slot] = _PLANNED_TO
        slots.append(slot)
    core.next_fresh_slot = fresh
    core.policy.admit_many(keys)
    return slots


def reserve_unindexed(core: Core, keys: list[bytes]) -> list[int]:
    """store_planned for keys another job already has a slot for (a second load
    promoting the same key in one step): a slot each, storing, but not indexed,
    so `store_ended` frees it as stale."""
    taken = []
    for key in keys:
        if core.free_slots:
            slot = core.free_slots.pop()
        else:
            slot = core.next_fresh_slot
            core.next_fresh_slot += 1
        core.slot_key[slot] = key
        core.slot_state[slot] = _PLANNED_TO
        taken.append(slot)
    return taken


def store_ended(core: Core, job: Ended) -> list[bytes]:
    """The store's last worker reported: each slot is stored (and evictable), or
    freed, failed or stale (its key was dropped, or the store predates a cache
    reset). Returns the keys stored."""
    slot_of_key = core.slot_of_key
    slot_state = core.slot_state
    stale = job.stale
    failed = job.failed_keys
    stored: list[bytes] = []  # into the policy in this order
    for group_keys, group_slots in zip(job.keys, job.slot_ids):
        for key, slot in zip(group_keys, group_slots):
            if stale or slot_of_key.get(key) != slot:  # stale, or no longer indexed
                _release(core, slot, _STALE_TO)
            elif failed and key in failed:
                del slot_of_key[key]
                _release(core, slot, _FAILED_TO)
            else:
                slot_state[slot] = _SUCCEEDED_TO
                stored.append(key)
    if stored:
        core.policy.insert_many(stored, False)
    return stored


def load_planned(core: Core, keys: tuple[tuple[bytes, ...], ...], slots: tuple[tuple[int, ...], ...]) -> None:
    """A load reads these slots (stored: the reducer checked): each one's load
    count goes up, and a slot's first load takes its key out of the policy (a
    slot being read is never evicted)."""
    slot_loads = core.slot_loads
    pinned: list[bytes] = []  # out of the policy in one call (its type is known only at run time)
    for group_keys, group_slots in zip(keys, slots):
        for key, slot in zip(group_keys, group_slots):
            loads = slot_loads.get(slot, 0)
            if loads == 0:
                pinned.append(key)
            slot_loads[slot] = loads + 1
    if pinned:
        core.policy.remove_many(pinned)


def load_ended(core: Core, job: Ended) -> list[bytes]:
    """The load's last worker reported: each slot's load count goes down. A
    failed key leaves the index; a slot no load reads any more is evictable
    again if still indexed, else released as an orphan. Returns the failed keys
    this load took out of the index."""
    orphaned = _MOVES["released_orphan"]
    slot_state = core.slot_state
    slot_loads = core.slot_loads
    slot_of_key = core.slot_of_key
    failed = job.failed_keys
    dropped: list[bytes] = []
    reusable: list[bytes] = []  # back into the policy (as reused) in this order
    for group_keys, group_slots in zip(job.keys, job.slot_ids):
        for key, slot in zip(group_keys, group_slots):
            loads = slot_loads[slot] - 1
            if loads:
                slot_loads[slot] = loads
            else:
                del slot_loads[slot]
            indexed = slot_of_key.get(key) == slot
            if failed and indexed and key in failed:
                del slot_of_key[key]
                dropped.append(key)
                indexed = False
            if loads:
                continue  # load_ended: another load still reads it
            if indexed:
                reusable.append(key)  # load_ended: stored, and evictable again
            else:
                assert slot_state[slot] == orphaned[0], f"slot {slot}: an orphan that is not stored"
                _release(core, slot, orphaned[1])
    if reusable:
        core.policy.insert_many(reusable, True)
    return dropped


def evict(core: Core, count: int) -> list[bytes]:
    """Make room: the policy's first `count` keys leave the index, and their slots are freed."""
    source, target = _MOVES["evicted"]
    victims = core.policy.evict(count)
    assert victims is not None
    slot_of_key = core.slot_of_key
    for key in victims:
        slot = slot_of_key.pop(key)
        assert core.slot_state[slot] == source, f"slot {slot}: evicted but not stored"
        _release(core, slot, target)
    return victims


def drop_all(core: Core) -> tuple[bytes, ...]:
    """A cache reset: every key leaves the index. Idle stored slots are evicted
    now; a slot a job still uses is freed when that job ends. Returns the keys
    that were stored (in index order)."""
    source, target = _MOVES["evicted"]
    slot_of_key = core.slot_of_key
    slot_state = core.slot_state
    dropped = tuple(key for key, slot in slot_of_key.items() if slot_state[slot] == _STORED)
    policy = core.policy
    for key, slot in slot_of_key.items():
        if key in policy:  # stored and not being loaded
            policy.remove(key)
            assert slot_state[slot] == source, f"slot {slot}: evictable but not stored"
            _release(core, slot, target)
    slot_of_key.clear()
    assert not len(policy)
    policy.clear()
    return dropped
