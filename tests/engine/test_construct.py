"""engine/construct.py builds the same objects as the classes' own constructors."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.engine import construct as new
from kvledger.engine import effects as fx
from kvledger.events import types as ev
from tests.strategies import block_tables, event_strategy, hash_tuples, ints, request_ids

pytestmark = pytest.mark.fast

# Each function with the class it stands for, by event kind.
BUILDERS = {
    "block_hashes_appended": new.hashes_appended,
    "blocks_freed": new.blocks_freed,
    "blocks_allocated": new.blocks_allocated,
    "blocks_touched": new.blocks_touched,
    "step_scheduled": new.step_scheduled,
}


def _same(built: object, expected: object) -> None:
    assert type(built) is type(expected)
    assert built == expected
    assert hash(built) == hash(expected)
    assert repr(built) == repr(expected)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        built.request_id = "changed"  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@given(data=st.data())
def test_an_event_built_here_equals_its_constructor(kind: str, data: st.DataObject) -> None:
    expected = data.draw(event_strategy(kind))
    _same(BUILDERS[kind](*attrs.astuple(expected, recurse=False)), expected)


@given(job_id=ints, request_id=request_ids, keys=st.lists(hash_tuples, max_size=3).map(tuple),
       sources=block_tables, targets=block_tables)
def test_a_start_store_built_here_equals_its_constructor(job_id: int, request_id: str, keys: fx.KeysByGroup,
                                                       sources: fx.IdsByGroup, targets: fx.IdsByGroup) -> None:
    expected = fx.StartStore(job_id=job_id, request_id=request_id, keys=keys, source_block_ids=sources,
                             target_slot_ids=targets)
    _same(new.start_store(job_id, request_id, keys, sources, targets), expected)


def test_a_class_whose_fields_changed_fails_at_import() -> None:
    with pytest.raises(TypeError, match="BlocksFreed has fields"):
        new._setters(ev.BlocksFreed, "block_ids", "request_id")


@given(job_id=ints, request_id=request_ids, keys=st.lists(hash_tuples, max_size=3).map(tuple),
       sources=block_tables, targets=block_tables, promote=st.one_of(st.just(()), block_tables))
def test_a_start_load_built_here_equals_its_constructor(job_id: int, request_id: str, keys: fx.KeysByGroup,
                                                      sources: fx.IdsByGroup, targets: fx.IdsByGroup,
                                                      promote: fx.IdsByGroup) -> None:
    expected = fx.StartLoad(job_id=job_id, request_id=request_id, keys=keys, source_slot_ids=sources,
                            target_block_ids=targets, promote_tiers=promote)
    _same(new.start_load(job_id, request_id, keys, sources, targets, promote), expected)
    assert new.start_load(job_id, request_id, keys, sources, targets) == attrs.evolve(expected, promote_tiers=())


@given(tier=st.integers(0, 3), keys=hash_tuples, reason=st.sampled_from(fx.Reason))
def test_key_notifications_built_here_equal_their_constructors(tier: int, keys: tuple[bytes, ...],
                                                              reason: fx.Reason) -> None:
    _same(new.keys_loadable(tier, keys), fx.KeysLoadable(tier=tier, keys=keys))
    _same(new.keys_unloadable(tier, keys, reason), fx.KeysUnloadable(tier=tier, keys=keys, reason=reason))
