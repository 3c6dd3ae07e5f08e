"""A seeded workload through the step planner, written as a JSONL event log.

`python -m tests.engine.planner_workload OUT` plays vLLM's scheduler by hand
(several admissions per step, chunked prefill, decode, window frees,
preemptions, finishes) and records every event with `EngineHost`. Run under
two hash seeds, the log must come out byte for byte the same.
"""

from __future__ import annotations

import random
import sys

from kvledger.adapters.engine_host import EngineHost
from kvledger.engine import effects as fx
from kvledger.engine.planner import Admission
from kvledger.events import types as ev
from tests.engine.builders import chain, make_config
from tests.support.fake_vllm import FakeVllm

BLOCK = 32


def run(out: str | None = None, steps: int = 120, seed: int = 7, *, preempt_rate: float = 0.1,
        check: bool = False, say_grown: bool = True, say_counts: bool = True,
        cached_reversed: bool = False) -> FakeVllm:
    """Play the workload; with `check`, after every step the engine's block
    tables must be vLLM's, position for position. `say_grown=False` keeps from
    the planner which tables grew, as a vLLM without `new_block_ids` would;
    `say_counts=False`, the token counts of vLLM's scheduler output;
    `cached_reversed=True` gives them out of vLLM's order."""
    rng = random.Random(seed)
    config = make_config(num_device_blocks=400, num_tier_slots=256)
    vllm = FakeVllm(config)
    vllm.say_grown = say_grown
    vllm.say_counts = say_counts
    vllm.cached_reversed = cached_reversed
    free = list(range(1, config.num_device_blocks))
    waiting: list[str] = []
    running: list[str] = []
    for number in range(40):
        rid = f"req-{number:03d}-{rng.randrange(10**6)}"
        tokens = BLOCK * rng.randint(2, 6)
        vllm.add(rid, tokens, chain(tokens // BLOCK, tag=f"doc{rng.randrange(4)}"))
        waiting.append(rid)
    for _ in range(steps):
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        done_stores = [e.job_id for e in vllm.effects if isinstance(e, fx.StartStore)]
        vllm.effects.clear()
        vllm.apply([ev.StoreCompleted(job_id=job_id) for job_id in done_stores])  # the workers' reports
        if running and rng.random() < preempt_rate:  # vLLM preempts the newest running request
            victim = running.pop()
            for group in vllm.tables:
                free.extend(b.block_id for b in group.get(victim, ()) if b.block_id)
            vllm.drop(victim)
            preempted.append(victim)
            waiting.append(victim)
        for rid in list(running):
            request = vllm.requests[rid]
            done = request.num_computed_tokens
            if done >= request.num_tokens:  # decode one token; a new block every BLOCK tokens
                request.num_tokens += 1
                if request.num_tokens % BLOCK == 0:
                    request.block_hashes = list(chain(request.num_tokens // BLOCK, tag=rid))
            need = -(-(request.num_computed_tokens + 1) // BLOCK)
            if len(vllm.tables[0][rid]) < need and len(free) >= 2:
                vllm.give(rid, (free.pop(0),), (free.pop(0),))
            if len(vllm.tables[0][rid]) * BLOCK <= request.num_computed_tokens:
                continue  # no block to grow into: not scheduled this step
            scheduled[rid] = min(request.num_tokens, len(vllm.tables[0][rid]) * BLOCK) - done or 1
            # A scheduled request's sliding group lets go of blocks that left its 64-token window.
            window_start = max(0, request.num_computed_tokens - 64) // BLOCK
            table = vllm.tables[1][rid]
            for position in range(min(window_start, len(table))):
                if table[position].block_id:
                    free.append(table[position].block_id)
                    vllm.null_out(rid, 1, position)
            if rng.random() < 0.05 and done >= request.num_tokens:
                running.remove(rid)
                scheduled.pop(rid, None)
                vllm.apply([ev.RequestFinished(request_id=rid, block_ids=vllm.table(rid))])
                for group in vllm.tables:
                    free.extend(b.block_id for b in group.pop(rid, ()) if b.block_id)
        admissions = []
        for rid in list(waiting[: rng.randint(0, 3)]):
            request = vllm.requests[rid]
            blocks = -(-request.num_tokens // BLOCK)
            if len(free) < 2 * blocks:
                break
            waiting.remove(rid)
            vllm.give(rid, tuple(free.pop(0) for _ in range(blocks)), tuple(free.pop(0) for _ in range(blocks)))
            admissions.append(Admission(rid, 0, 0))
            scheduled[rid] = request.num_tokens - 1
            running.append(rid)
        vllm.run(scheduled, admitted=tuple(admissions), preempted=tuple(preempted))
        if check:
            for rid in running:
                assert vllm.engine_table(rid) == vllm.table(rid), rid
    if out is not None:
        with EngineHost(config, log_path=out, fmt="jsonl", digest_interval=8, strict=True, overwrite=True) as host:
            for event in vllm.log:
                host.apply(event)
    return vllm


if __name__ == "__main__":
    run(sys.argv[1])
