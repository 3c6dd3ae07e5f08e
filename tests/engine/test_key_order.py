"""`KeyOrder` answers as a dict of keys in insertion order does, whatever the
sequence of calls: a rule machine drives both alike, with runs of 4 keys, so
that runs fill, empty, shrink and go."""

from __future__ import annotations

from itertools import islice

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvledger.engine import key_order
from kvledger.engine.key_order import KeyOrder

KEYS = st.binary(min_size=1, max_size=3)


class Against(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.order = KeyOrder(capacity=3 * key_order.SHARD_KEYS, run_keys=4)  # four shards
        self.model: dict[bytes, None] = {}

    @rule(key=KEYS)
    def add(self, key: bytes) -> None:
        self.order.add(key)
        self.model[key] = None

    @rule(keys=st.lists(KEYS, max_size=40))
    def add_many(self, keys: list[bytes]) -> None:
        for key in keys:
            self.order.add(key)
            self.model[key] = None

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.order.remove(key)
        del self.model[key]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def move_to_end(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.order.move_to_end(key)
        del self.model[key]
        self.model[key] = None

    @rule(count=st.integers(0, 30))
    def remove_first(self, count: int) -> None:
        """An eviction: the oldest keys, read first, then removed."""
        victims = list(islice(self.order, count))
        assert victims == list(islice(self.model, count))
        for key in victims:
            self.order.remove(key)
            del self.model[key]

    @rule(key=KEYS)
    def remove_absent(self, key: bytes) -> None:
        if key not in self.model:
            with pytest.raises(KeyError):
                self.order.remove(key)

    @rule()
    def copy(self) -> None:
        self.order = self.order.copy()
        assert len(self.order._where) == 4  # as many shards as the original

    @precondition(lambda self: len(self.model) < 5)
    @rule()
    def clear(self) -> None:
        self.order.clear()
        self.model.clear()

    @invariant()
    def same(self) -> None:
        assert list(self.order) == list(self.model)
        assert len(self.order) == len(self.model)
        assert bool(self.order) == bool(self.model)
        for key in islice(self.model, 5):
            assert key in self.order
        assert self.order.isdisjoint([b"\xff" * 4]) and (not self.model or not self.order.isdisjoint(self.model))


def test_against_a_dict() -> None:
    Against.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
    Against.TestCase().runTest()


def test_runs_fill_and_empty() -> None:
    """Long enough that runs fill, empty, shrink and go, at the module's own sizes."""
    order = KeyOrder(capacity=1 << 20)
    model: dict[bytes, None] = {}
    keys = [i.to_bytes(4, "big") for i in range(3 * key_order.RUN_KEYS)]
    for key in keys:
        order.add(key)
        model[key] = None
    for key in keys[: key_order.RUN_KEYS + 7]:  # the first run goes, the second starts emptying
        order.remove(key)
        del model[key]
    for key in keys[5 * key_order.RUN_KEYS // 2::3]:  # from the tail run: moved to the end
        order.move_to_end(key)
        del model[key]
        model[key] = None
    for key in keys[key_order.RUN_KEYS + 7: 2 * key_order.RUN_KEYS - 3]:  # the second run down to 3 keys
        order.remove(key)
        del model[key]
    assert list(order) == list(model) and len(order) == len(model)
    assert len(order._runs) == 3  # the first run went; the second shrank (not gone)
    assert all(key in order for key in model) and keys[0] not in order
