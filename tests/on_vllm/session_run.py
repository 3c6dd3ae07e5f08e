"""A streaming session through vLLM's real scheduler with kvledger's connector
(no model: the forward samples fixed tokens), in its own process. Turn 1 ends
with a sampled token that fills a hash block; turn 2's input replaces it, and
vLLM hashes that block again. Prints `RESULT {json}`: vLLM's hashes and the
engine's, the dropped hash, the keys the tier holds, and the events logged.

Usage: python tests/on_vllm/session_run.py MODEL_DIR [--async-scheduling]

Under async scheduling vLLM's `AsyncScheduler` schedules each step before it
has processed the last one's output, as `EngineCore.step_with_batch_queue` does.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench_module():
    spec = importlib.util.spec_from_file_location("scheduler_overhead", REPO / "bench" / "scheduler_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    from kvledger.adapters.settings import kv_transfer_config
    from kvledger.engine.hma import group_suffix

    so = bench_module()
    async_scheduling = "--async-scheduling" in sys.argv
    scheduler, hasher = so.build_scheduler(
        Path(sys.argv[1]), kv_transfer_config(capacity_bytes=so.tier_bytes(256), log_level="warning"),
        device_blocks=256, concurrency=4, retention_interval=None, max_prompt_tokens=256,
        async_scheduling=async_scheduling)
    depth = 2 if async_scheduling else 1
    in_flight: list = []
    worker = so.LedgerWorker(delay=0)
    ledger = scheduler.connector._scheduler
    kinds: list[str] = []
    apply = ledger._apply

    def logged(events):
        kinds.extend(e.kind for e in events)
        return apply(events)

    ledger._apply = logged
    step = 0

    def run_turn(request_id: str, sampled_token: int) -> None:
        nonlocal step
        session = scheduler.requests[request_id]
        while session.status is not RequestStatus.WAITING_FOR_STREAMING_REQ or in_flight:
            out = scheduler.schedule()
            ids = list(out.num_scheduled_tokens)
            sampled = [[sampled_token] if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens
                       else [] for rid in ids]
            in_flight.append((out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled,
                kv_connector_output=worker.output(step, out.kv_connector_metadata))))
            while len(in_flight) >= depth or (in_flight and not ids):  # nothing scheduled: drain
                scheduler.update_from_output(*in_flight.pop(0))
            step += 1
            assert step < 200, "the session never paused"

    block = scheduler.hash_block_size
    prompt = list(range(100, 100 + 2 * block + 8))  # the 8th sampled token fills block 2
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    scheduler.add_request(Request("s", prompt, params, None, block_hasher=hasher, resumable=True))
    run_turn("s", 7)
    session = scheduler.requests["s"]
    dropped = session.block_hashes[-1]
    turn_1 = len(session.block_hashes)
    scheduler.add_request(Request("s", list(range(900, 900 + block)), SamplingParams(max_tokens=4, ignore_eos=True),
                                  None, block_hasher=hasher, resumable=True))
    run_turn("s", 9)
    core = ledger.host.state.core
    mine = core.requests["s"]
    groups = len(core.groups)
    print("RESULT " + json.dumps({
        "turn_1_hashes": turn_1, "dropped": dropped.hex(),
        "vllm": [h.hex() for h in session.block_hashes], "engine": [h.hex() for h in mine.hashes],
        "tier_keys_from_dropped": [g for g in range(groups) if dropped + group_suffix(g) in core.slot_of_key],
        "tier_keys_of_the_session": [sum(h + group_suffix(g) in core.slot_of_key for h in session.block_hashes)
                                     for g in range(groups)],
        "events": kinds, "num_computed_tokens": session.num_computed_tokens,
    }))


if __name__ == "__main__":
    main()
