"""The host tier's eviction order and key index under a full tier's churn: the steps
that stall the scheduler.

The engine keeps a tier's eviction order (`engine/policies.py`) and its index of keys
(`Core.slot_of_key`) in dicts. A full tier churns both every step: a store evicts as many
keys as it writes, and a load takes its keys out of the order while it reads them and puts
them back at the end (most recently used). A dict never reuses a deleted entry's place:
after enough deletions an insertion rebuilds the whole table, in one call, whatever the
step. This measures what those steps cost, on the engine's own (compiled) policies, at
`bench/scheduler_overhead.py`'s tier size (192k slots) and `bench/engine_step.py`'s (1M).

Each step: one store of `--store-blocks` new keys (the order's first keys evicted, the new
ones admitted and inserted, the index updated), then one load of `--load-blocks` stored
keys, a run of consecutive ones as a document's prefix is (removed from the order, put back
as reused). Timed per step: median, p99 and the slowest; and every stall (a step over ten
times the median), with which tables' memory changed in it (a rebuild to the same size, a
compaction, shows as none).

A tier below host memory (a disk's) is larger, and the engine keeps its keys in least
recently used order too (`LowerTier.held`): each step `--store-blocks` keys are spilled to it
(its oldest evicted) and `--load-blocks` read from it (moved to the end), at `--tier-blocks`
blocks, for at least as many steps as insert twice the keys the tier holds (a dict's table is
rebuilt about once per as many insertions as it holds keys).

A disk tier evicting as steadily keeps the keys it removed for `TOMBSTONE_S` (so a lookup
that raced a removal cannot bring one back), at most `TOMBSTONES_MAX`: the scheduler forgets
the oldest each step (`adapters/vllm/lower_tiers.py: _expire`, twice a step as `removed` and
the lookups' collection call it). Timed the same way, `--tombstone-keys` removed a step, a
step every 10 ms.

    python bench/policy_churn.py [--slots 192000 1000000] [--steps 5000] [--policy lru arc]
                                 [--tier-blocks 1000000 4000000]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path

from kvledger.engine.policies import make_policy
from kvledger.events.config import PolicyName


def churn(slots: int, steps: int, policy_name: str, store_blocks: int, load_blocks: int, seed: int) -> dict:
    rng = random.Random(seed)
    new_key = iter(rng.randbytes(16) + b"\x00\x00\x00\x00" for _ in iter(int, 1))
    policy = make_policy(PolicyName(policy_name), slots)
    keys = [next(new_key) for _ in range(slots)]  # stored, oldest first
    policy.admit_many(keys)
    policy.insert_many(keys, False)
    index = {key: slot for slot, key in enumerate(keys)}
    free: list[int] = []
    order_size, index_size = _table_size(policy), sys.getsizeof(index)
    times, resized = [], {}
    clock = time.perf_counter
    gc.disable()
    try:
        for step in range(steps):
            stored = [next(new_key) for _ in range(store_blocks)]
            start = rng.randrange(0, len(keys) - load_blocks)
            began = clock()
            victims = policy.evict(store_blocks)
            assert victims is not None
            for key in victims:
                free.append(index.pop(key))
            policy.admit_many(stored)
            for key in stored:
                index[key] = free.pop()
            policy.insert_many(stored, False)
            read = [key for key in keys[start:start + load_blocks] if key in index]
            policy.remove_many(read)
            policy.insert_many(read, True)
            elapsed = clock() - began
            times.append(elapsed)
            sizes = _table_size(policy), sys.getsizeof(index)
            if sizes != (order_size, index_size):
                resized[step] = "+".join(name for name, now, then in
                                         (("order", sizes[0], order_size), ("index", sizes[1], index_size))
                                         if now != then)
                order_size, index_size = sizes
            keys.extend(stored)  # untimed: the workload's own list of what was stored
    finally:
        gc.enable()
    ordered = sorted(times)
    median = ordered[len(ordered) // 2]
    stalls = [{"step": step, "ms": round(t * 1e3, 2), "resized": resized.get(step, "none")}
              for step, t in enumerate(times) if t > 10 * median]
    return {"slots": slots, "policy": policy_name, "steps": steps, "median_ms": round(median * 1e3, 3),
            "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1e3, 3),
            "max_ms": round(ordered[-1] * 1e3, 2), "stalls": stalls}


def tier_churn(blocks: int, steps: int, spill_blocks: int, read_blocks: int, seed: int) -> dict:
    """A full lower tier's held order: spills evict its oldest keys, reads move keys to the end."""
    from kvledger.engine import lower
    from kvledger.engine.state import LowerTier, TierKeyState

    held, absent = TierKeyState.HELD, TierKeyState.ABSENT
    rng = random.Random(seed)
    tier = LowerTier("disk", blocks)
    keys = [rng.randbytes(16) + b"\x00\x00\x00\x00" for _ in range(blocks)]
    for key in keys:
        lower._move(tier, key, absent, held)
    steps = max(steps, 2 * blocks // (spill_blocks + read_blocks))
    size = _memory(tier.held)
    times, resized = [], set()
    clock = time.perf_counter
    gc.disable()
    try:
        for step in range(steps):
            spilled = [rng.randbytes(16) + b"\x00\x00\x00\x00" for _ in range(spill_blocks)]
            start = rng.randrange(len(keys) - blocks, len(keys) - read_blocks)
            began = clock()
            lower._evict(tier, spill_blocks)
            for key in spilled:
                lower._move(tier, key, absent, held)
            for key in keys[start:start + read_blocks]:
                if key in tier.held:  # a read's end: the most recently used
                    lower._move(tier, key, held, absent)
                    lower._move(tier, key, absent, held)
            times.append(clock() - began)
            now = _memory(tier.held)
            if now != size:
                resized.add(step)
                size = now
            keys.extend(spilled)
    finally:
        gc.enable()
    ordered = sorted(times)
    median = ordered[len(ordered) // 2]
    return {"tier_blocks": blocks, "steps": steps, "median_ms": round(median * 1e3, 3),
            "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1e3, 3), "max_ms": round(ordered[-1] * 1e3, 2),
            "stalls": [{"step": step, "ms": round(t * 1e3, 2), "resized": "order" if step in resized else "none"}
                       for step, t in enumerate(times) if t > 10 * median]}


def tombstones(steps: int, per_step: int, seed: int) -> dict:
    from kvledger.adapters.vllm.lower_tiers import TOMBSTONE_S, _expire

    rng = random.Random(seed)
    kept: dict[bytes, float] = {}
    times = []
    now = 0.0
    clock = time.perf_counter
    gc.disable()
    try:
        for _ in range(steps):
            now += 0.01
            removed = [rng.randbytes(20) for _ in range(per_step)]
            began = clock()
            for key in removed:
                kept.pop(key, None)
                kept[key] = now
            _expire(kept, now - TOMBSTONE_S)
            _expire(kept, now - TOMBSTONE_S)
            times.append(clock() - began)
    finally:
        gc.enable()
    ordered = sorted(times)
    return {"tombstones": len(kept), "steps": steps, "removed_a_step": per_step,
            "median_ms": round(ordered[len(ordered) // 2] * 1e3, 3),
            "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1e3, 3), "max_ms": round(ordered[-1] * 1e3, 2)}


_ORDERS = {"LRU": ("_order",), "ARC": ("t1", "t2", "b1", "b2")}


def _table_size(policy: object) -> int:
    """The memory of the policy's orders (named here: a compiled class lists no `__slots__`):
    it changes when one is rebuilt to another size."""
    return sum(_memory(getattr(policy, name)) for name in _ORDERS[type(policy).__name__])


def _memory(order: object) -> int:
    """A dict's table, or a `KeyOrder`'s (its shards' and runs' tables)."""
    if isinstance(order, dict):
        return sys.getsizeof(order)
    runs = order._runs  # type: ignore[attr-defined]
    return (sum(map(sys.getsizeof, order._where)) + sys.getsizeof(runs)  # type: ignore[attr-defined]
            + sum(sys.getsizeof(run.keys) for run in runs.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, nargs="+", default=[192_000, 1_000_000])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--policy", nargs="+", default=["lru", "arc"])
    parser.add_argument("--tier-blocks", type=int, nargs="*", default=[1_000_000, 4_000_000],
                        help="a lower tier's held order at these sizes (none: skip)")
    parser.add_argument("--store-blocks", type=int, default=64, help="keys stored (and evicted) a step")
    parser.add_argument("--load-blocks", type=int, default=300, help="keys a step's load reads")
    parser.add_argument("--tombstone-keys", type=int, default=64, help="keys a disk tier removes a step (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "policy_churn.json"))
    args = parser.parse_args()
    rows = []
    print(f"python {platform.python_version()}, {platform.machine()}; store {args.store_blocks}, "
          f"load {args.load_blocks} blocks a step")
    for slots in args.slots:
        for name in args.policy:
            row = churn(slots, args.steps, name, args.store_blocks, args.load_blocks, args.seed)
            rows.append(row)
            shown = ", ".join(f"step {r['step']} {r['ms']} ms ({r['resized']} resized)"
                              for r in row["stalls"]) or "none"
            print(f"{name:4} {slots:>9,} slots: median {row['median_ms']:.3f} ms, p99 {row['p99_ms']:.3f}, "
                  f"max {row['max_ms']:.2f}; stalls: {shown}", flush=True)
    for blocks in args.tier_blocks:
        row = tier_churn(blocks, args.steps, args.store_blocks, args.load_blocks, args.seed)
        rows.append(row)
        shown = ", ".join(f"step {r['step']} {r['ms']} ms ({r['resized']} resized)" for r in row["stalls"]) or "none"
        print(f"tier {blocks:>9,} blocks ({row['steps']} steps): median {row['median_ms']:.3f} ms, p99 "
              f"{row['p99_ms']:.3f}, max {row['max_ms']:.2f}; stalls: {shown}", flush=True)
    if args.tombstone_keys:
        row = tombstones(args.steps, args.tombstone_keys, args.seed)
        rows.append(row)
        print(f"disk tier tombstones ({row['tombstones']:,} kept, {row['removed_a_step']} removed a step): median "
              f"{row['median_ms']:.3f} ms, p99 {row['p99_ms']:.3f}, max {row['max_ms']:.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
