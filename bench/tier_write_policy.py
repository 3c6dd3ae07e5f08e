"""Write-through or cascade: what each would write to the disk tier, and what
a crash would lose, on the simulator's seeded workloads.

Write-through (what kvledger does) writes a block when its host store
succeeds; cascade would write it when host memory evicts it. The run uses
write-through; the blocks cascade would have written are the distinct keys
host memory evicted in the same run (the host tier's own order does not
depend on the disk's, and the disk is large enough to keep all of them).
"Lost on a crash" is the mean, over steps, of blocks only host memory held.
"""

from __future__ import annotations

import random
import statistics

from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine import effects as fx
from kvledger.events.config import EngineConfig, GroupSpec


def measure(host_slots: int, seed: int, steps: int = 400) -> dict:
    config = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),), hash_block_size=16,
                          num_device_blocks=48, num_tier_slots=host_slots,
                          lower_tiers=({"name": "1:fs", "num_blocks": 4096},))
    sim = Simulator(config, check_content=False)
    evicted: set[bytes] = set()  # cascade writes each of these once (the disk is large enough to keep it)
    emit = sim.emit

    def watching(event):
        effects = emit(event)
        for effect in effects:
            if isinstance(effect, fx.KeysUnloadable) and effect.tier == 0:
                evicted.update(effect.keys)
        return effects

    sim.emit = watching  # type: ignore[method-assign]
    rng = random.Random(seed)
    at_risk, host = [], []
    for _ in range(steps // 10):
        run_random(sim, rng, steps=10, arrivals=0.9, docs=12, max_prompt_blocks=8, max_tokens=8,
                   completion_rate=0.5, fail_rate=0.0)
        core = sim.state.core
        held = core.lower[0].held
        at_risk.append(sum(1 for k in core.slot_of_key if k not in held))
        host.append(len(core.slot_of_key))  # with cascade, none of these would be on disk yet
    core = sim.state.core
    return {"stored": core.stats.keys_stored, "write_through": core.lower[0].counts["keys_written"],
            "cascade": len(evicted), "at_risk_write_through": statistics.mean(at_risk),
            "at_risk_cascade": statistics.mean(host)}


def main() -> None:
    print(f"{'host slots':>10} {'stored':>8} {'written: write-through':>23} {'cascade':>8} "
          f"{'lost on a crash: write-through':>31} {'cascade':>8}")
    for slots in (16, 64, 256, 1024):
        rows = [measure(slots, seed) for seed in range(3)]
        mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
        print(f"{slots:>10} {mean['stored']:>8.0f} {mean['write_through']:>23.0f} {mean['cascade']:>8.0f} "
              f"{mean['at_risk_write_through']:>31.1f} {mean['at_risk_cascade']:>8.1f}")


if __name__ == "__main__":
    main()
