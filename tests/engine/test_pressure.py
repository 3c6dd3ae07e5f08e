"""vLLM's backpressure, decided by the engine: a lower tier under pressure has the share of
its spills it was given (`TierPressure`) dropped, each announced (`SpillDropped`)."""

from __future__ import annotations

from kvledger.engine import effects as fx
from kvledger.events import types as ev
from tests.engine.builders import Engine, full_only_config, only

BLOCK = 32  # full_only_config's

def test_a_pressured_tier_has_its_spills_dropped_by_the_share_it_was_given() -> None:
    engine = Engine(full_only_config(lower_tiers=({"name": "1:fs", "num_blocks": 64},), num_tier_slots=64))
    assert engine.reject(ev.TierPressure(tier=2, drop_ppm=0, latency_ns_per_mib=0)) == "unknown_tier"
    assert engine.reject(ev.TierPressure(tier=1, drop_ppm=1_000_001, latency_ns_per_mib=0)) == "bad_tier_pressure"
    engine.apply(ev.TierPressure(tier=1, drop_ppm=500_000, latency_ns_per_mib=40_000_000))
    written, dropped = [], []
    for n in range(4):
        rid = f"r{n}"
        engine.add(rid, BLOCK, tag=f"doc{n}")
        engine.alloc(rid, (n + 1,))
        (store,) = only(engine.step((rid, 0, BLOCK)), fx.StartStore)
        effects = engine.store_done(store.job_id)  # stored: its spill starts, or is dropped
        written += only(effects, fx.StartSpill)
        dropped += only(effects, fx.SpillDropped)
    assert len(written) == len(dropped) == 2  # every other one
    assert all(d.tier == 1 and len(d.keys) == 1 for d in dropped)
    engine.apply(ev.TierPressure(tier=1, drop_ppm=0, latency_ns_per_mib=1_000_000))  # well again
    engine.add("r9", BLOCK, tag="doc9")
    engine.alloc("r9", (9,))
    (store,) = only(engine.step(("r9", 0, BLOCK)), fx.StartStore)
    assert only(engine.store_done(store.job_id), fx.StartSpill)
