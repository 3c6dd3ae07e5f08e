"""A decode step's scheduler-side cost at long context, on a sliding-window model.

A request admitted on a prefix hit (vLLM's own cache or a tier load) gets a
window group table that starts with null blocks: every position before the
window. One computed from scratch reaches the same table by window frees.
The planner looks for new window frees in every step, for every running
request, so a step's cost must depend neither on how a table got its nulls
nor on the context length. This times a decode step's planning and applying
(`plan_step`, then `reduce_step`) for both kinds of request side by side, at
several context lengths (16-token blocks, a 1024-token window, as in Gemma 3's
local layers), with vLLM's tables played by `FakeVllm`.

    python bench/planner_long_context.py [--running N] [--contexts 4096,32768,131072]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.support

from kvledger.engine.planner import Admission  # noqa: E402
from kvledger.events.config import EngineConfig, GroupSpec  # noqa: E402
from tests.support.fake_vllm import FakeVllm  # noqa: E402

BLOCK = 16
WINDOW = 1024
WINDOW_BLOCKS = WINDOW // BLOCK
ROOM = 4  # blocks past the context, so the timed decode steps need no growth


def step_ms(context: int, running: int, *, hit: bool, steps: int) -> float:
    """Median ms of a decode step with `running` requests at `context` tokens."""
    blocks = context // BLOCK
    vllm = FakeVllm(EngineConfig(
        groups=(GroupSpec(group_id=0, kind="full", block_size=BLOCK),
                GroupSpec(group_id=1, kind="sliding", block_size=BLOCK, window=WINDOW)),
        hash_block_size=BLOCK, num_device_blocks=running * 2 * (blocks + ROOM) + 1, num_tier_slots=16))
    skipped = range(blocks - WINDOW_BLOCKS)
    next_block = 1
    for i in range(running):
        rid = f"r{i}"
        vllm.add(rid, context + 1, tuple(f"{rid}:{n}".encode().ljust(32, b".") for n in range(blocks)))
        ids = range(next_block, next_block + 2 * (blocks + ROOM))
        next_block = ids.stop
        vllm.give(rid, tuple(ids[: blocks + ROOM]), tuple(ids[blocks + ROOM:]))
        if hit:  # vLLM hands the window group nulls before the window
            vllm.null_out(rid, 1, *skipped)
            vllm.requests[rid].num_computed_tokens = context
    admissions = tuple(Admission(rid, context if hit else 0, 0) for rid in vllm.requests)
    vllm.run(dict.fromkeys(vllm.requests, 1 if hit else context), admitted=admissions)
    if not hit:  # computed from scratch: the window frees what it left behind
        for rid in vllm.requests:
            vllm.null_out(rid, 1, *skipped)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        vllm.run(dict.fromkeys(vllm.requests, 1))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=128)
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps (each within the table's room)")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}; "
          f"{args.running} running requests, {BLOCK}-token blocks, {WINDOW}-token window")
    print("context | computed from scratch, ms/step | admitted on a prefix hit, ms/step | hit / scratch")
    for context in map(int, args.contexts.split(",")):
        scratch = step_ms(context, args.running, hit=False, steps=args.steps)
        hit = step_ms(context, args.running, hit=True, steps=args.steps)
        print(f"{context:7,d} | {scratch:.3f} | {hit:.3f} | {hit / scratch:.2f}")


if __name__ == "__main__":
    main()
