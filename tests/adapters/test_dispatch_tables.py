"""Every consumer of the engine's effects and notifications dispatches through a table
naming each kind (`engine.effects.dispatch_table`), checked when it is imported: a new
kind is a decision in each of them, never a silent skip."""

from __future__ import annotations

import importlib

import pytest

from kvledger.engine import effects as fx

pytestmark = pytest.mark.fast

TABLES = [
    ("kvledger.adapters.log_tools.misses", "_FACTS"),
    ("kvledger.adapters.log_tools.whatif", "_MOVES"),
    ("kvledger.adapters.log_tools.whatif", "_FOLLOW"),
    ("kvledger.adapters.log_tools.whatif", "_ACCESSES"),
    ("kvledger.adapters.log_tools.report_series", "_SERIES"),
    ("kvledger.adapters.testing.simulator", "_PERFORM"),
]
VLLM_TABLES = [
    ("kvledger.adapters.vllm.scheduler_side", "_CARRY"),
    ("kvledger.adapters.vllm.kv_events", "_TRANSLATE"),
]


def test_a_table_missing_a_kind_or_naming_one_twice_or_a_stranger_fails_naming_them() -> None:
    def handle(effect: object) -> None:
        pass

    rest = [kind for kind in fx.EFFECT_TYPES if kind not in (fx.KeysNotAdmitted, fx.StartStore)]
    with pytest.raises(AssertionError, match="the report: .*missing KeysNotAdmitted"):
        fx.dispatch_table("the report", {fx.StartStore: handle}, ignored=rest)
    with pytest.raises(AssertionError, match="named twice StartStore"):
        fx.dispatch_table("the report", {fx.StartStore: handle}, ignored=[*rest, fx.KeysNotAdmitted, fx.StartStore])
    with pytest.raises(AssertionError, match="not effect kinds: int"):
        fx.dispatch_table("the report", {fx.StartStore: handle}, ignored=[*rest, fx.KeysNotAdmitted, int])
    table = fx.dispatch_table("the report", {fx.StartStore: handle}, ignored=[*rest, fx.KeysNotAdmitted])
    assert table == {**dict.fromkeys(fx.EFFECT_TYPES), fx.StartStore: handle}


@pytest.mark.parametrize(("module", "name"), TABLES)
def test_each_consumer_names_every_kind(module: str, name: str) -> None:
    assert set(getattr(importlib.import_module(module), name)) == set(fx.EFFECT_TYPES)


@pytest.mark.parametrize(("module", "name"), VLLM_TABLES)
def test_each_vllm_side_consumer_names_every_kind(module: str, name: str) -> None:
    pytest.importorskip("vllm", reason="needs the vllm package")
    assert set(getattr(importlib.import_module(module), name)) == set(fx.EFFECT_TYPES)
