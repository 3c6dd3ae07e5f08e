"""The step planner's cost per decode step at long context, on a sliding-window model.

A request admitted on a prefix hit (vLLM's own cache or a tier load) gets a
window group table that starts with null blocks: every position before the
window. One computed from scratch reaches the same table by window frees.
The planner looks for new window frees in every step, for every running
request, so its cost must not depend on how the table got its nulls, nor
on the context length. This measures a decode step's planning and applying
(`plan_step`, then `reduce_step`) for both
kinds of request side by side, at several context lengths (16-token blocks,
a 1024-token window, as in Gemma 3's local layers), with vLLM's tables
played by plain objects.

    python bench/planner_long_context.py [--running N] [--contexts 4096,32768,131072]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import attrs

from kvledger.engine.planner import Admission, StepInputs, plan_step
from kvledger.engine.reducer import reduce_step
from kvledger.engine.state import initial_state
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupSpec

BLOCK = 16
WINDOW = 1024
WINDOW_BLOCKS = WINDOW // BLOCK
ROOM = 4  # blocks past the context, so the timed decode steps need no growth


@attrs.define
class Block:
    block_id: int


@attrs.define
class Request:
    num_tokens: int
    num_computed_tokens: int
    block_hashes: list[bytes]


def planner_ms(context: int, running: int, *, hit: bool, steps: int) -> float:
    """Median ms of a decode step's `plan_step` and `reduce_step`, `running` requests at `context` tokens."""
    blocks = context // BLOCK
    cfg = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=BLOCK),
                               GroupSpec(group_id=1, kind="sliding", block_size=BLOCK, window=WINDOW)),
                       hash_block_size=BLOCK, num_device_blocks=running * 2 * (blocks + ROOM) + 1, num_tier_slots=16)
    state = initial_state(cfg)
    requests: dict[str, Request] = {}
    tables: tuple[dict[str, list[Block]], dict[str, list[Block]]] = ({}, {})
    next_block = 1
    events: list[ev.Event] = []
    for i in range(running):
        rid = f"r{i}"
        hashes = [f"{rid}:{n}".encode().ljust(32, b".") for n in range(blocks)]
        requests[rid] = Request(context + 1, context if hit else 0, hashes)
        full = list(range(next_block, next_block + blocks + ROOM))
        window = list(range(next_block + blocks + ROOM, next_block + 2 * (blocks + ROOM)))
        next_block += 2 * (blocks + ROOM)
        tables[0][rid] = [Block(b) for b in full]
        tables[1][rid] = [Block(b) for b in window]
        events.append(ev.RequestAdded(request_id=rid, num_prompt_tokens=context + 1, block_hashes=tuple(hashes)))
    state, _ = reduce_step(state, events)
    if hit:  # vLLM hands the window group nulls before the window
        for rid in requests:
            for position in range(blocks - WINDOW_BLOCKS):
                tables[1][rid][position] = Block(ev.NULL_BLOCK_ID)
    admissions = tuple(Admission(rid, context if hit else 0, 0) for rid in requests)
    scheduled = {rid: 1 if hit else context for rid in requests}
    state = _step(state, 1, scheduled, requests, tables, admissions)
    if not hit:  # computed from scratch: the window frees what it left behind
        for rid in requests:
            for position in range(blocks - WINDOW_BLOCKS):
                tables[1][rid][position] = Block(ev.NULL_BLOCK_ID)
    times = []
    for step in range(2, steps + 2):
        decode = dict.fromkeys(requests, 1)
        start = time.perf_counter()
        state = _step(state, step, decode, requests, tables, ())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _step(state, step: int, scheduled: dict[str, int], requests: dict[str, Request], tables, admissions):
    events = plan_step(state, StepInputs(step_index=step, scheduled=scheduled, admissions=admissions,
                                         requests=requests, tables=tables, grown=set()))
    state, _ = reduce_step(state, events, strict=True)
    for rid, count in scheduled.items():
        requests[rid].num_computed_tokens += count
        requests[rid].num_tokens = requests[rid].num_computed_tokens + 1
    return state


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
        scratch = planner_ms(context, args.running, hit=False, steps=args.steps)
        hit = planner_ms(context, args.running, hit=True, steps=args.steps)
        print(f"{context:7,d} | {scratch:.3f} | {hit:.3f} | {hit / scratch:.2f}")


if __name__ == "__main__":
    main()
