"""Lazy store mode: blocks are stored only when they near the eviction end."""

from __future__ import annotations

import random

import pytest

from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine.reducer import ProtocolViolation, reduce
from kvledger.engine.state import initial_state
from kvledger.events import types as ev
from kvledger.events.config import ConfigError, EngineConfig, GroupSpec


def _config(blocks: int, **extra) -> EngineConfig:
    return EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),
                                GroupSpec(group_id=1, kind="sliding", block_size=16, window=32)),
                        hash_block_size=16, num_device_blocks=blocks, num_tier_slots=64, store_mode="lazy",
                        **extra)


def _run(config: EngineConfig, seed: int) -> Simulator:
    sim = Simulator(config, check_every_event=True)
    run_random(sim, random.Random(seed), steps=150, arrivals=0.6, fail_rate=0.0, check_every=1)
    return sim


@pytest.mark.parametrize("seed", range(4))
def test_a_pool_that_never_fills_stores_nothing(seed):
    stats = _run(_config(4000), seed).state.core.stats
    assert stats.stores == 0 and stats.finished > 10


@pytest.mark.parametrize("seed", range(4))
def test_under_pressure_stores_happen_and_restore_the_right_content(seed):
    # The simulator checks every block a forward reads, restored ones included.
    sim = _run(_config(40), seed)
    stats = sim.state.core.stats
    assert stats.stores > 0 and stats.loads > 0
    assert stats.flushes > 0  # stored blocks are the next to be reused: flushes are common here


def test_lazy_mode_refuses_pin_protection():
    with pytest.raises(ConfigError, match="lazy store mode needs flush protection"):
        _config(40, protection="pin")


def test_a_block_still_held_is_not_near_eviction():
    config = _config(40)
    state = initial_state(config)
    state, _ = reduce(state, ev.RequestAdded(request_id="r", num_prompt_tokens=40, block_hashes=(b"a" * 16,) * 2))
    state, _ = reduce(state, ev.BlocksAllocated(request_id="r", block_ids=((1, 2, 3), (4, 5, 6))))
    with pytest.raises(ProtocolViolation, match="near_eviction_in_use"):
        reduce(state, ev.BlocksNearEviction(block_ids=(7, 2)), strict=True)
    state, effects = reduce(state, ev.BlocksNearEviction(block_ids=(7, 8)), strict=True)
    assert effects == ()  # free blocks whose content the engine never saw: nothing to store
