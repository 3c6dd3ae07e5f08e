"""A realistic-looking event trace, for log-size and throughput checks.

It imitates a serving run with prefix caching and offloading: up to
`num_running` requests at once with vLLM-style ids, prompt hashes at arrival,
one step_scheduled per step, a block per group every `block_size` decoded
tokens (the sliding group freeing the block that left its window), a hash
and a store completion per filled block, and finished requests replaced by
new ones. It is shaped like the engine's input, not checked against the
engine's rules: use it to measure the log, not to test the reducer.
"""

from __future__ import annotations

import random

from kvledger.events import types as ev

BLOCK_SIZE = 16
WINDOW_BLOCKS = 4  # a 64-token sliding window


def realistic_trace(
    num_running: int = 64, num_steps: int = 200, *, seed: int = 0, hash_bytes: int = 32
) -> list[list[ev.Event]]:
    """Events per step, `num_steps` steps."""
    rng = random.Random(seed)
    next_block = iter(range(1, 1 << 30))
    next_job = iter(range(1 << 30))
    running: dict[str, dict] = {}
    pending_completions: list[ev.Event] = []
    steps: list[list[ev.Event]] = []

    def new_hash() -> bytes:
        return rng.getrandbits(8 * hash_bytes).to_bytes(hash_bytes, "little")

    def admit(events: list[ev.Event]) -> None:
        request_id = f"cmpl-{rng.getrandbits(128):032x}-0"
        prompt = rng.randint(64, 1024)
        num_blocks = -(-prompt // BLOCK_SIZE)
        full = tuple(next(next_block) for _ in range(num_blocks))
        sliding = tuple(
            next(next_block) if i >= num_blocks - WINDOW_BLOCKS else ev.NULL_BLOCK_ID for i in range(num_blocks)
        )
        events.append(
            ev.RequestAdded(
                request_id=request_id,
                num_prompt_tokens=prompt,
                block_hashes=tuple(new_hash() for _ in range(prompt // BLOCK_SIZE)),
            )
        )
        events.append(ev.BlocksAllocated(request_id=request_id, block_ids=(full, sliding)))
        running[request_id] = {
            "tokens": prompt,
            "computed": 0,
            "left": rng.randint(32, 512),
            "table": [list(full), list(sliding)],
        }

    for step in range(num_steps):
        events: list[ev.Event] = pending_completions
        pending_completions = []
        while len(running) < num_running:
            admit(events)
        ids = tuple(running)
        computed = tuple(running[r]["computed"] for r in ids)
        scheduled = tuple(running[r]["tokens"] - running[r]["computed"] for r in ids)
        events.append(
            ev.StepScheduled(
                step_index=step, request_ids=ids, num_computed_tokens=computed, num_scheduled_tokens=scheduled
            )
        )
        for request_id in ids:
            req = running[request_id]
            req["computed"] = req["tokens"]
            req["tokens"] += 1
            req["left"] -= 1
            if req["left"] == 0:
                del running[request_id]
                events.append(
                    ev.RequestFinished(
                        request_id=request_id, block_ids=tuple(tuple(g) for g in req["table"])
                    )
                )
                continue
            if req["tokens"] % BLOCK_SIZE == 0:
                events.append(
                    ev.BlockHashesAppended(
                        request_id=request_id, num_tokens=req["tokens"], block_hashes=(new_hash(),)
                    )
                )
                pending_completions.append(ev.StoreCompleted(job_id=next(next_job)))
            if req["tokens"] % BLOCK_SIZE == 1:
                full, sliding = req["table"]
                new = (next(next_block), next(next_block))
                events.append(ev.BlocksAllocated(request_id=request_id, block_ids=((new[0],), (new[1],))))
                full.append(new[0])
                sliding.append(new[1])
                leaving = len(sliding) - 1 - WINDOW_BLOCKS
                if leaving >= 0 and sliding[leaving] != ev.NULL_BLOCK_ID:
                    events.append(ev.BlocksFreed(request_id=request_id, block_ids=((), (sliding[leaving],))))
                    sliding[leaving] = ev.NULL_BLOCK_ID
        steps.append(events)
    return steps
