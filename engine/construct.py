"""The events and effects built in every step, without attrs' `__init__`.

attrs generates `__init__` as Python source, so compiled code calling it pays
for a keyword dict and an interpreted frame: 0.55 µs an event, against 0.16
here, and a step builds dozens. `_build` sets the instance's slots as that
`__init__` does (frozen classes refuse `setattr`, not their slot setters).
Callers pass the canonical field types, so the converters (which return tuples
unchanged) are skipped; `tests/engine/test_construct.py` checks every function against
its class's own constructor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar

import attrs

from kvledger.events import types as ev

from . import effects as fx

_Setter = Callable[[object, object], None]
_E = TypeVar("_E")
_new: Final = object.__new__


def _setters(cls: type, *names: str) -> tuple[_Setter, ...]:
    """The slot setters of `names`, which must be all of `cls`'s fields, in order."""
    fields = tuple(field.name for field in attrs.fields(cls))
    if names != fields:
        raise TypeError(f"{cls.__name__} has fields {fields}, not {names}")
    return tuple(cls.__dict__[name].__set__ for name in names)


# Static in the compiled module: a class read as `ev.X` is two dict lookups a call.
_BlockHashesAppended: Final = ev.BlockHashesAppended
_BlocksFreed: Final = ev.BlocksFreed
_BlocksAllocated: Final = ev.BlocksAllocated
_BlocksTouched: Final = ev.BlocksTouched
_StepScheduled: Final = ev.StepScheduled
_StartStore: Final = fx.StartStore
_StartLoad: Final = fx.StartLoad
_KeysLoadable: Final = fx.KeysLoadable
_KeysUnloadable: Final = fx.KeysUnloadable

_APPENDED: Final = _setters(ev.BlockHashesAppended, "request_id", "num_tokens", "block_hashes")
_FREED: Final = _setters(ev.BlocksFreed, "request_id", "block_ids")
_ALLOCATED: Final = _setters(ev.BlocksAllocated, "request_id", "block_ids", "num_external_tokens")
_TOUCHED: Final = _setters(ev.BlocksTouched, "request_id", "block_ids")
_STEP: Final = _setters(ev.StepScheduled, "step_index", "request_ids", "num_computed_tokens",
                        "num_scheduled_tokens", "wall_time_us")
_STORE: Final = _setters(fx.StartStore, "job_id", "request_id", "keys", "source_block_ids", "target_slot_ids")
_LOAD: Final = _setters(fx.StartLoad, "job_id", "request_id", "keys", "source_slot_ids", "target_block_ids",
                        "promote_tiers")
_LOADABLE: Final = _setters(fx.KeysLoadable, "tier", "keys")
_UNLOADABLE: Final = _setters(fx.KeysUnloadable, "tier", "keys", "reason")


def _build(cls: type[_E], setters: tuple[_Setter, ...], *values: object) -> _E:
    """An instance of `cls` with its fields set to `values`, in field order."""
    made = _new(cls)
    for set_field, value in zip(setters, values):
        set_field(made, value)
    return made


def hashes_appended(request_id: str, num_tokens: int, block_hashes: tuple[bytes, ...]) -> ev.BlockHashesAppended:
    return _build(_BlockHashesAppended, _APPENDED, request_id, num_tokens, block_hashes)


def blocks_freed(request_id: str, block_ids: ev.BlockIdsByGroup) -> ev.BlocksFreed:
    return _build(_BlocksFreed, _FREED, request_id, block_ids)


def blocks_allocated(request_id: str, block_ids: ev.BlockIdsByGroup,
                     num_external_tokens: int = 0) -> ev.BlocksAllocated:
    return _build(_BlocksAllocated, _ALLOCATED, request_id, block_ids, num_external_tokens)


def blocks_touched(request_id: str, block_ids: ev.BlockIdsByGroup) -> ev.BlocksTouched:
    return _build(_BlocksTouched, _TOUCHED, request_id, block_ids)


def step_scheduled(step_index: int, request_ids: tuple[str, ...], num_computed_tokens: tuple[int, ...],
                   num_scheduled_tokens: tuple[int, ...], wall_time_us: int = 0) -> ev.StepScheduled:
    """The columns are aligned by the caller (the class's own check is skipped)."""
    return _build(_StepScheduled, _STEP, step_index, request_ids, num_computed_tokens, num_scheduled_tokens,
                  wall_time_us)


def start_store(job_id: int, request_id: str, keys: fx.KeysByGroup, source_block_ids: fx.IdsByGroup,
                target_slot_ids: fx.IdsByGroup) -> fx.StartStore:
    return _build(_StartStore, _STORE, job_id, request_id, keys, source_block_ids, target_slot_ids)


def start_load(job_id: int, request_id: str, keys: fx.KeysByGroup, source_slot_ids: fx.IdsByGroup,
               target_block_ids: fx.IdsByGroup, promote_tiers: fx.IdsByGroup = ()) -> fx.StartLoad:
    return _build(_StartLoad, _LOAD, job_id, request_id, keys, source_slot_ids, target_block_ids, promote_tiers)


def keys_loadable(tier: int, keys: tuple[bytes, ...]) -> fx.KeysLoadable:
    return _build(_KeysLoadable, _LOADABLE, tier, keys)


def keys_unloadable(tier: int, keys: tuple[bytes, ...], reason: fx.Reason) -> fx.KeysUnloadable:
    return _build(_KeysUnloadable, _UNLOADABLE, tier, keys, reason)
