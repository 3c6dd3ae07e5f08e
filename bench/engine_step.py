"""Engine cost per scheduler step, replay speed and log size, on one trace.

The trace comes from the simulator standing in for vLLM: 256 running
requests over 2 KV groups (full attention + a 1024-token sliding window,
16-token blocks), 100k device blocks, 1M tier slots, prompts of 1k-8k tokens
drawn from shared documents, 256 decoded tokens each, chunked prefill, and
preemptions when the pool runs short. The engine's time is then measured by
re-running the recorded events from a fresh state, one `reduce_step` per
scheduler step. `--store-jobs request` plans one store job per request per
step, as logs recorded before that option do (more events in the trace).

The machines this runs on are shared and noisy, so each timed measure runs
`--repeat` times and the best run is reported (the least disturbed one; the
spread is printed too).

    python bench/engine_step.py [--steps N] [--repeat R] [--store-jobs step|request] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import time

from kvledger.adapters.testing.simulator import Simulator
from kvledger.engine import queries
from kvledger.engine.fold import Fold, fold_events
from kvledger.engine.invariants import check
from kvledger.engine.reducer import reduce_step
from kvledger.engine.state import initial_state
from kvledger.events.config import EngineConfig, GroupSpec
from kvledger.events.log_records import read_event_record


def config(num_device_blocks: int, num_tier_slots: int, store_jobs: str = "step") -> EngineConfig:
    return EngineConfig(
        groups=(GroupSpec(group_id=0, kind="full", block_size=16),
                GroupSpec(group_id=1, kind="sliding", block_size=16, window=1024)),
        hash_block_size=16, num_device_blocks=num_device_blocks, num_tier_slots=num_tier_slots,
        store_jobs=store_jobs)


def make_trace(cfg: EngineConfig, *, steps: int, running: int, seed: int) -> list[list]:
    """Events grouped per scheduler step (each group ends with its step_scheduled)."""
    rng = random.Random(seed)
    events: list = []
    sim = Simulator(cfg, prefix_caching=True, chunk_tokens=2048, record=events.append, check_content=False)
    steps_out: list[list] = []
    mark = 0
    for _ in range(steps):
        while len(sim.requests) < running:
            sim.add_request(rng.randrange(32), rng.randint(1024, 8192), 256)
        for rid in sim.waiting():
            if not sim.admit(rid):
                break
        sim.step(sim.running())
        steps_out.append(events[mark:])
        mark = len(events)
        for job_id in sorted(sim.jobs):
            if rng.random() < 0.5:
                job = sim.jobs[job_id]
                sim.complete(job_id, min(job.pending), rng.random() < 0.01, rng)
    return steps_out


def time_steps(cfg: EngineConfig, trace: list[list]) -> list[float]:
    state = initial_state(cfg)
    gc.collect()
    gc.freeze()
    times = []
    clock = time.perf_counter
    for step_events in trace:
        start = clock()
        state, _ = reduce_step(state, step_events)
        times.append(clock() - start)
    gc.unfreeze()
    return times


def replay_speed(cfg: EngineConfig, records: list, *, invariants: bool) -> float:
    """Events per second of replay's own loop (`engine.fold`, as `kvledger replay` folds a log's
    records) over the whole trace (warm-up included), with `check_event` after each event if
    `invariants` (the full `check` at the end, timed on its own below, is not counted)."""
    fold = Fold(initial_state(cfg), -1)
    start = time.perf_counter()
    stopped = fold_events(fold, iter(records), invariants, -1, None)
    elapsed = time.perf_counter() - start
    assert stopped is None and fold.events == len(records) and fold.broken is None and not fold.violations
    return len(records) / elapsed


def step_records(trace: list[list]) -> list[list]:
    """Each step's events as a log's records (seq, step index), built before any timing."""
    steps, seq = [], 0
    for step_events in trace:
        step_index = next(e.step_index for e in step_events if e.kind == "step_scheduled")
        steps.append([read_event_record(seq + i, step_index, e) for i, e in enumerate(step_events)])
        seq += len(step_events)
    return steps


def best_of(repeat: int, measure, better=max) -> tuple[float, list[float]]:
    runs = [measure() for _ in range(repeat)]
    return better(runs), runs


def log_size(cfg: EngineConfig, trace: list[list]) -> dict[str, float]:
    """Bytes per event of the whole trace in each log form, and the binary form's
    cost per step (encode one frame, decode it again)."""
    import zstandard

    from kvledger import __version__
    from kvledger.events.log_binary import encode_binary_frame, encode_binary_header, read_binary
    from kvledger.events.log_records import LogHeader, encode_jsonl
    from kvledger.events.schema import Strings

    header = LogHeader(engine_version=__version__, config=cfg, digest_interval=0)
    steps = step_records(trace)
    seq = sum(map(len, steps))
    strings = Strings()
    head = encode_binary_header(header)
    start = time.perf_counter()
    frames = [encode_binary_frame(step[0].seq, step[0].step_index, step, strings=strings) for step in steps]
    encode = (time.perf_counter() - start) / len(steps)
    data = head + b"".join(frames)
    start = time.perf_counter()
    decoded = sum(1 for _ in read_binary(data)[1])
    decode = (time.perf_counter() - start) / len(steps)
    assert decoded == seq
    # The same rows without the zstd stream: what format version 1 wrote.
    stream = zstandard.ZstdDecompressor().decompressobj()
    rows = len(head) + sum(8 + len(stream.decompress(frame[9:])) for frame in frames)
    jsonl = len(encode_jsonl(header, [r for step in steps for r in step]))
    return {"binary": len(data) / seq, "rows": rows / seq, "jsonl": jsonl / seq,
            "encode_ms": encode * 1e3, "decode_ms": decode * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--device-blocks", type=int, default=100_000)
    parser.add_argument("--tier-slots", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each timed measure; the best is reported")
    parser.add_argument("--store-jobs", choices=("step", "request"), default="step",
                        help="one store job per step (the default), or per request per step (older logs)")
    parser.add_argument("--quick", action="store_true", help="a small run to check the script works")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.running, args.device_blocks, args.tier_slots = 60, 16, 4000, 20000
    cfg = config(args.device_blocks, args.tier_slots, args.store_jobs)
    t0 = time.perf_counter()
    trace = make_trace(cfg, steps=args.steps, running=args.running, seed=args.seed)
    events = [e for step in trace for e in step]
    print(f"trace: {len(trace)} steps, {len(events)} events ({len(events) / len(trace):.1f}/step), "
          f"built in {time.perf_counter() - t0:.1f} s")
    runs = [sorted(time_steps(cfg, trace)) for _ in range(args.repeat)]
    times = min(runs, key=statistics.median)
    # Warm-up (admitting the first 256 prompts at once) is in the tail, not hidden.
    median = statistics.median(times) * 1e3
    p99 = times[int(len(times) * 0.99) - 1] * 1e3
    medians = ", ".join(f"{statistics.median(r) * 1e3:.3f}" for r in runs)
    final = initial_state(cfg)
    final, _ = reduce_step(final, events)
    stats = queries.stats(final)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"engine per step: median {median:.3f} ms, p99 {p99:.3f} ms, max {times[-1] * 1e3:.1f} ms "
          f"(target median <= 0.5 ms; best of {args.repeat} runs, medians {medians})")
    print(f"trace outcome: {stats}")
    records = [record for step in step_records(trace) for record in step]
    plain, plain_runs = best_of(args.repeat, lambda: replay_speed(cfg, records, invariants=False))
    checked, checked_runs = best_of(args.repeat, lambda: replay_speed(cfg, records, invariants=True))
    print(f"replay: {plain:,.0f} events/s without invariants (target >= 200k), "
          f"{checked:,.0f} events/s with per-event invariant checks (target >= 100k); best of "
          f"{args.repeat}: {', '.join(f'{r:,.0f}' for r in plain_runs)} / {', '.join(f'{r:,.0f}' for r in checked_runs)}")
    start = time.perf_counter()
    check(final)
    print(f"full invariant check of the final state: {(time.perf_counter() - start) * 1e3:.0f} ms")
    from kvledger.engine.digest import digest

    start = time.perf_counter()
    digest(final)
    print(f"state digest of the final state: {(time.perf_counter() - start) * 1e3:.0f} ms")
    sizes = log_size(cfg, trace)
    print(f"log size: {sizes['binary']:.1f} bytes/event binary (target <= 64; the same rows uncompressed, as "
          f"format 1 wrote them: {sizes['rows']:.1f}), {sizes['jsonl']:.1f} bytes/event JSONL")
    print(f"binary log cost per step: encode {sizes['encode_ms']:.3f} ms, decode {sizes['decode_ms']:.3f} ms")


if __name__ == "__main__":
    main()
