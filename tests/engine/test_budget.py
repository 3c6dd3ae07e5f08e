"""Load or recompute, by the clock: under `restore_budget: "auto"` a hit keeps the end
that saves the most time by the measured costs, and says what it cut and why."""

from __future__ import annotations

import pytest

from kvledger.engine.lookup import LATER, lookup
from kvledger.engine.state import SlotState
from kvledger.events import types as ev
from tests.engine.builders import Engine, chain, full_only_config, key, make_config, seed_tier

BLOCK = 32  # full_only_config's


def _engine(**config: object) -> tuple[Engine, list[bytes]]:
    """A waiting request of 8 blocks (and a token): blocks 0-3 in host memory, 4-7 on the disk below."""
    engine = Engine(full_only_config(lower_tiers=({"name": "1:fs", "num_blocks": 64},), **config))
    hashes = chain(8, "doc")
    keys = [key(h, 0) for h in hashes]
    seed_tier(engine.state, keys[:4])
    engine.apply(ev.TierKeysFound(tier=1, keys=tuple(keys[4:])))
    engine.add("r", 8 * BLOCK + 1, hashes=hashes)
    return engine, keys


def _costs(engine: Engine, compute_ns: int, fixed_us: tuple[int, int], per_block_ns: tuple[int, int]) -> None:
    engine.apply(ev.RestoreCostsMeasured(compute_ns_per_token=compute_ns, load_fixed_us=fixed_us,
                                         load_ns_per_block=per_block_ns))


def test_without_measured_costs_or_with_load_every_hit_is_loaded() -> None:
    engine, _ = _engine(restore_budget="auto")
    assert lookup(engine.state, "r", 0).num_hit_tokens == 8 * BLOCK  # no costs measured yet
    engine, _ = _engine()  # restore_budget "load"
    _costs(engine, 1, (0, 10_000_000), (0, 10_000_000))
    result = lookup(engine.state, "r", 0)
    assert result.num_hit_tokens == 8 * BLOCK and result.budget is None


def test_a_slow_disk_tail_is_computed_and_the_host_prefix_loaded() -> None:
    engine, _ = _engine(restore_budget="auto")
    # A token computes in 10 us (320 us a block); host reads 20 us a block, the disk 2 ms.
    _costs(engine, 10_000, (50, 500), (20_000, 2_000_000))
    result = lookup(engine.state, "r", 0)
    assert result.num_hit_tokens == 4 * BLOCK
    offered, load_us, compute_us = result.budget
    # The cut: 4 disk blocks make the whole load a disk read: 500 us + 8 x 2 ms, against 50 us + 4 x 20 us.
    assert offered == 8 * BLOCK and compute_us == 4 * BLOCK * 10
    assert load_us == (500 + 8 * 2_000) - (50 + 4 * 20)


def test_a_fixed_cost_larger_than_the_hit_computes_it_whole() -> None:
    engine, _ = _engine(restore_budget="auto")
    _costs(engine, 100, (100_000, 100_000), (1_000, 1_000))  # 0.1 us a token; a load costs 100 ms whatever
    result = lookup(engine.state, "r", 0)
    assert result.num_hit_tokens == 0 and result.budget[0] == 8 * BLOCK
    _costs(engine, 1_000_000, (100_000, 100_000), (1_000, 1_000))  # 1 ms a token: load it all
    assert lookup(engine.state, "r", 0).num_hit_tokens == 8 * BLOCK


@pytest.mark.parametrize("window_tail", [SlotState.STORING, SlotState.STORED])
def test_a_shorter_hit_is_walked_again_for_the_window_keys_it_reads(window_tail: SlotState) -> None:
    """The cut hit's window reads other blocks than the whole hit's: one still being
    stored makes it wait, as the whole hit would (a hypothesis example offered it)."""
    engine = Engine(make_config(lower_tiers=({"name": "1:fs", "num_blocks": 64},), restore_budget="auto"))
    hashes = chain(8, "doc")
    full = [key(h, 0) for h in hashes]
    window = [key(h, 1) for h in hashes]
    seed_tier(engine.state, full[:4] + window[2:3])
    seed_tier(engine.state, window[3:4], window_tail)  # the cut hit's last window block
    engine.apply(ev.TierKeysFound(tier=1, keys=(*full[4:], *window[6:])))
    engine.add("r", 8 * BLOCK + 1, hashes=hashes)
    _costs(engine, 10_000, (50, 500), (20_000, 2_000_000))  # the disk too slow: keep the host prefix
    result = lookup(engine.state, "r", 0)
    if window_tail is SlotState.STORING:
        assert result == LATER
    else:
        assert result.num_hit_tokens == 4 * BLOCK and result.budget[0] == 8 * BLOCK


def test_the_decision_is_on_the_record() -> None:
    engine, _ = _engine(restore_budget="auto")
    assert engine.reject(ev.RestoreCostsMeasured(compute_ns_per_token=1, load_fixed_us=(1,), load_ns_per_block=(1,))) \
        == "bad_restore_costs"  # one tier's costs for two tiers
    assert engine.reject(ev.RestoreCostsMeasured(compute_ns_per_token=-1, load_fixed_us=(1, 1),
                                                 load_ns_per_block=(1, 1))) == "bad_restore_costs"
    budgeted = ev.RestoreBudgeted(request_id="r", offered_tokens=256, kept_tokens=128, load_us=16_370,
                                  compute_us=1_280)
    assert engine.apply(budgeted) == ()
    assert engine.reject(ev.RestoreBudgeted(request_id="r", offered_tokens=64, kept_tokens=64, load_us=1,
                                            compute_us=1)) == "bad_restore_budget"
    assert engine.reject(ev.RestoreBudgeted(request_id="nobody", offered_tokens=64, kept_tokens=0, load_us=1,
                                            compute_us=1)) == "illegal_request_event"


@pytest.mark.parametrize("budget", ["load", "auto"])
def test_the_config_keeps_other_logs_digests(budget: str) -> None:
    config = full_only_config(restore_budget=budget)
    assert ("restore_budget" in config.to_dict()) == (budget == "auto")

