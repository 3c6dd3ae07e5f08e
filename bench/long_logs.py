"""Long event logs: what snapshots cost and what they buy.

`generate` records a long binary log with the simulator standing in for vLLM
(two KV groups, a sliding window, 1,024 device blocks, 8,192 tier slots, a
few new requests per step over shared documents), written by the engine host
with snapshots, and beside it the same events in a log without snapshots (to
compare sizes). At each milestone (`--milestones`, events) it keeps a closed
copy of the snapshot log, as the host would have closed it there: the bytes so
far, the end mark and the index. It takes the shared heavy-job lock itself,
in slices of at most `--slice-s` seconds, so other jobs run in between.

`measure` times, on those logs, `kvledger inspect --at` at the start, middle
and end, `replay --from` near the end, `inspect` on a copy cut by a crash
(no index), and `bisect` with an engine bug that fires near the end.

`measure-tools` times each log tool (`replay`, `--check`, `--jobs 2`, `explain`,
`whatif`, `bisect`) on the largest log, with its peak memory, beside the reducer's
own fold speed.

`snapshot-cost` measures what one snapshot costs the scheduler (the capture on
its thread, and the packing and compression on the writer's) and its size, on
states of bench/scheduler_overhead.py's size (48k device blocks, 192k tier
slots, ~170 running requests) and of bench/engine_step.py's (100k device
blocks, 1M tier slots, 256 running requests).

    python bench/long_logs.py generate --out DIR [--milestones 5e6,10e6,20e6]
    python bench/long_logs.py measure --out DIR
    python bench/long_logs.py measure-tools --out DIR [--only 'replay --check' ...]
    python bench/long_logs.py snapshot-cost
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = "/tmp/kvledger-heavy.lock"


class SlicedLock:
    """The shared heavy-job lock, held in slices: `tick` gives it up for a moment
    once a slice has run `slice_s` seconds, so no one waits longer than that."""

    enabled = True  # off (--no-lock) only for small smoke runs

    def __init__(self, slice_s: float) -> None:
        self.slice_s = slice_s
        self.file = open(LOCK, "a")  # noqa: SIM115
        self.waited = 0.0
        self._take()

    def _take(self) -> None:
        start = time.monotonic()
        if self.enabled:
            fcntl.flock(self.file, fcntl.LOCK_EX)
        self.waited += time.monotonic() - start
        self.since = time.monotonic()

    def tick(self) -> None:
        if time.monotonic() - self.since > self.slice_s:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            time.sleep(3)
            self._take()

    def release(self) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)


def long_config():
    from kvledger.events.config import EngineConfig

    return EngineConfig.from_dict(dict(
        groups=[{"group_id": 0, "kind": "full", "block_size": 32},
                {"group_id": 1, "kind": "sliding", "block_size": 32, "window": 64}],
        hash_block_size=32, num_device_blocks=1024, num_tier_slots=8192))


def generate(args: argparse.Namespace) -> None:
    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.log_files import LogWriter
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from kvledger.engine.digest import digest
    from kvledger.events.log_binary import encode_binary_frame, encode_index
    from kvledger.events.log_records import DigestRecord
    from kvledger.events.schema import Strings

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    milestones = sorted(int(float(m)) for m in args.milestones.split(","))
    cfg = long_config()
    lock = SlicedLock(args.slice_s)
    os.nice(5)
    path, plain_path = out / "snap.kvlog", out / "plain.kvlog"
    host = EngineHost(cfg, log_path=path, fmt="binary", digest_interval=64, overwrite=True,
                      snapshot_interval_events=args.interval)
    plain = LogWriter(plain_path, host.writer.header, "binary", overwrite=True)
    add_step = host.writer.add_step
    end_digests: dict[int, str] = {}  # seq -> the state's digest at a snapshot taken at a milestone

    def tee(step_index: int, events: list, digest_hex: str | None = None, snapshot: object = None) -> None:
        add_step(step_index, events, digest_hex, snapshot)
        plain.add_step(step_index, events, digest_hex)
        if snapshot is not None and milestones and host.writer.next_seq >= milestones[0]:
            end_digests[host.writer.next_seq] = digest(host.state)  # later events of the step are not in yet

    host.writer.add_step = tee  # type: ignore[method-assign]
    sim = Simulator(cfg, host=host, check_content=False)
    rng = random.Random(args.seed)
    start, steps, results = time.perf_counter(), 0, []
    marks_seen = 0
    while milestones:
        for _ in range(3):
            sim.add_request(rng.randrange(8), rng.randint(1, 6) * 32 + rng.randrange(32), rng.randint(1, 30))
        run_random(sim, rng, steps=1, arrivals=1.0, docs=8, max_tokens=30, completion_rate=0.3, fail_rate=0.02)
        steps += 1
        writer = host.writer
        if len(writer.snapshots) == marks_seen:
            if steps % 256 == 0:
                lock.tick()
            continue
        marks_seen = len(writer.snapshots)
        events = writer.next_seq
        if events < milestones[0]:
            continue
        milestones.pop(0)
        # A closed copy, as the host closes a log here: the end mark, then the index. Right
        # after a snapshot the writer's string table and stream are fresh, as they are here.
        end = encode_binary_frame(events, host.next_step, [DigestRecord(seq=events, step_index=host.next_step,
                                                                       digest=end_digests[events])], strings=Strings())
        copy = out / f"snap-{events}.kvlog"
        data = path.read_bytes() + end
        copy.write_bytes(data + encode_index(writer.snapshots, len(data)))
        row = {"events": events, "steps": host.next_step, "snapshots": len(writer.snapshots),
               "bytes_with_snapshots": copy.stat().st_size, "bytes_without": plain_path.stat().st_size,
               "log": str(copy), "elapsed_s": round(time.perf_counter() - start, 1),
               "lock_waited_s": round(lock.waited, 1)}
        results.append(row)
        print(json.dumps(row), flush=True)
    host.close()
    plain.close()
    lock.release()
    (out / "generated.json").write_text(json.dumps({"interval": args.interval, "logs": results,
                                                    "stats": sim.state.core.stats.as_dict()}, indent=2))


def _cli(*args: str) -> tuple[float, dict]:
    """Run the kvledger command in a fresh process; (wall seconds, its JSON output)."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", *args, "--json"], env=env,
                          capture_output=True, text=True, timeout=3600)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{args}: exit {done.returncode}: {done.stderr[-2000:]}")
    return elapsed, json.loads(done.stdout)


def _snapshot_bytes(path: Path) -> list[int]:
    from kvledger.adapters.log_seek import find_snapshots

    sizes = []
    with path.open("rb") as file:
        for mark in find_snapshots(path).marks:
            file.seek(mark.offset)
            sizes.append(8 + int.from_bytes(file.read(4), "little"))
    return sizes


def measure(args: argparse.Namespace) -> None:
    """Sizes, and `inspect --at` / `replay --from` times at the start, middle and end of each log."""
    out = Path(args.out)
    generated = json.loads((out / "generated.json").read_text())
    lock = SlicedLock(1e9)
    rows = []
    for log in generated["logs"]:
        path, events = Path(log["log"]), log["events"]
        sizes = _snapshot_bytes(path)
        row = {"events": events, "snapshots": len(sizes),
               "bytes_per_event_with": round(log["bytes_with_snapshots"] / events, 2),
               "bytes_per_event_without": round(log["bytes_without"] / events, 2),
               "snapshot_bytes_mean": round(sum(sizes) / max(len(sizes), 1))}
        for name, at in (("start", 1_000), ("middle", events // 2), ("end", events - 1_000)):
            runs = [_cli("inspect", str(path), "--at", str(at)) for _ in range(args.repeat)]
            row[f"inspect_{name}_s"] = round(min(t for t, _ in runs), 2)
            row[f"inspect_{name}_replayed"] = at + 1 - runs[0][1]["replayed_from_seq"]
        elapsed, data = _cli("replay", str(path), "--from", str(events - 1_000))
        row["replay_from_end_s"] = round(elapsed, 2)
        row["replay_from_end_events"] = data["events"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    lock.release()
    (out / "measured.json").write_text(json.dumps(rows, indent=2))


def measure_cut(args: argparse.Namespace) -> None:
    """The largest log cut by a crash in its second last segment (no index): `inspect --at` near its end."""
    out = Path(args.out)
    log = json.loads((out / "generated.json").read_text())["logs"][-1]
    path = Path(log["log"])
    from kvledger.adapters.log_seek import find_snapshots

    marks = find_snapshots(path).marks
    lock = SlicedLock(1e9)
    cut = out / "cut.kvlog"
    with path.open("rb") as src, cut.open("wb") as dst:
        left = (marks[-2].offset + marks[-1].offset) // 2  # inside the segment before the last snapshot
        while left:
            chunk = src.read(min(left, 1 << 24))
            dst.write(chunk)
            left -= len(chunk)
    start = time.perf_counter()
    found = find_snapshots(cut)
    scan_s = time.perf_counter() - start
    at = marks[-2].seq + 1_000
    elapsed, data = _cli("inspect", str(cut), "--at", str(at))
    row = {"events": log["events"], "found_by": found.found_by, "snapshots_found": len(found.marks),
           "scan_s": round(scan_s, 2), "inspect_at_s": round(elapsed, 2), "replayed_from_seq": data["replayed_from_seq"]}
    print(json.dumps(row), flush=True)
    cut.unlink()
    lock.release()
    (out / "measured_cut.json").write_text(json.dumps(row, indent=2))


def measure_from_start(args: argparse.Namespace) -> None:
    """The baseline: `inspect --at` near the end of the smallest log, replayed from its start."""
    out = Path(args.out)
    log = json.loads((out / "generated.json").read_text())["logs"][0]
    lock = SlicedLock(1e9)
    elapsed, data = _cli("inspect", log["log"], "--at", str(log["events"] - 1_000), "--from-start")
    row = {"events": log["events"], "inspect_end_from_start_s": round(elapsed, 2)}
    print(json.dumps(row), flush=True)
    lock.release()
    (out / "measured_from_start.json").write_text(json.dumps(row, indent=2))


TOOLS = (("replay",), ("replay", "--check"), ("replay", "--jobs", "2"), ("replay", "--check", "--jobs", "2"),
         ("explain",), ("whatif",), ("whatif", "--jobs", "2"), ("bisect", "--jobs", "2"))


def measure_tools(args: argparse.Namespace) -> None:
    """Each log tool on the largest log, one at a time in a fresh process (wall time, events/s, peak
    memory), beside the reducer's own fold over the log's first `--fold-events` events."""
    out = Path(args.out)
    log = json.loads((out / "generated.json").read_text())["logs"][-1]
    path, events = log["log"], log["events"]
    lock = SlicedLock(1e9)
    rows = []
    for tool in TOOLS:
        if args.only and " ".join(tool) not in args.only:
            continue
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "kvledger.adapters.cli.main", tool[0], path, *tool[1:]],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _pid, status, usage = os.wait4(child.pid, 0)
        elapsed = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) not in (0, 1):
            raise RuntimeError(f"{tool}: exit {os.waitstatus_to_exitcode(status)}: {child.stderr.read()[-2000:]!r}")
        row = {"tool": " ".join(tool), "events": events, "seconds": round(elapsed, 1),
               "events_per_s": round(events / elapsed), "max_rss_mb": round(usage.ru_maxrss / 1024)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # Last: the fold holds its events in this process, whose memory a tool started after it would
    # be charged with (its peak counted from the fork, before it ran anything).
    rows.append(_fold_speed(path, args.fold_events))
    print(json.dumps(rows[-1]), flush=True)
    lock.release()
    (out / "measured_tools.json").write_text(json.dumps(rows, indent=2))


def _fold_speed(path: str, count: int) -> dict:
    """The reducer alone over the log's first `count` events, decoded beforehand (best of two)."""
    from itertools import islice

    from kvledger.adapters.log_files import open_log
    from kvledger.engine.reducer import reduce
    from kvledger.engine.state import initial_state

    header, records = open_log(path)
    events = [r.event for r in islice(records, count) if hasattr(r, "event")]
    records.close()  # type: ignore[attr-defined]
    best = float("inf")
    for _ in range(2):
        state = initial_state(header.config)
        start = time.perf_counter()
        for event in events:
            state, _effects = reduce(state, event)
        best = min(best, time.perf_counter() - start)
    return {"tool": "the reducer's fold", "events": len(events), "seconds": round(best, 2),
            "events_per_s": round(len(events) / best)}


def measure_bisect(args: argparse.Namespace) -> None:
    """`kvledger bisect` on the largest log, with an engine bug that fires in its last
    segments: the `blocks_freed` of one request there leak a reference to their first block."""
    from kvledger.adapters.cli.main import main as cli
    from kvledger.adapters.log_seek import find_snapshots, read_snapshot
    from kvledger.engine import reducer
    from kvledger.events import types as ev

    out = Path(args.out)
    log = json.loads((out / "generated.json").read_text())["logs"][-1]
    path = Path(log["log"])
    marks = find_snapshots(path).marks
    _header, _snapshot, records = read_snapshot(path, marks[-2])
    target = None
    for record in records:
        event = getattr(record, "event", None)
        if isinstance(event, ev.BlocksFreed) and any(event.block_ids):
            target = (record.seq, event.request_id)
            break
    records.close()  # type: ignore[attr-defined]
    assert target is not None
    original = reducer._HANDLERS[ev.BlocksFreed]

    def leaky(core, event, out_):
        original(core, event, out_)
        if event.request_id == target[1] and any(event.block_ids):
            core.block_refs[next(ids for ids in event.block_ids if ids)[0]] += 1

    reducer._HANDLERS[ev.BlocksFreed] = leaky
    lock = SlicedLock(1e9)
    import contextlib
    import io

    buffer = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(buffer):
        status = cli(["bisect", str(path), "--json", "--jobs", str(args.jobs)])
    elapsed = time.perf_counter() - start
    lock.release()
    data = json.loads(buffer.getvalue())
    row = {"events": log["events"], "jobs": args.jobs, "bisect_s": round(elapsed, 1), "exit": status,
           "bug_first_fires_at_seq": target[0], "bug_request": target[1], "found": data["first_problem"],
           "segments": data["segments"], "events_replayed": data["events_replayed"]}
    if args.verify:  # the same bug, a checked replay from the start (small logs: it takes long)
        from kvledger.adapters.log_files import open_log
        from kvledger.engine.replay import replay

        header, records = open_log(path)
        start = time.perf_counter()
        problem = replay(header.config, records, check_invariants=True).first_problem
        row["checked_replay_from_start"] = {"s": round(time.perf_counter() - start, 1),
                                            "seq": problem and problem.seq, "kind": problem and problem.kind}
    print(json.dumps(row), flush=True)
    (out / f"measured_bisect_jobs{args.jobs}.json").write_text(json.dumps(row, indent=2))


def _fill_tier(state) -> None:
    """Every never-used tier slot stored with a key of its own (20 bytes, as the engine's:
    a 16-byte hash and a group suffix) and evictable: the tier of a server that has run
    for hours, which a trace of minutes does not reach. Synthetic: a benchmark input only."""
    from kvledger.engine.state import SlotState

    core, rng = state.core, random.Random(1)
    keys = [rng.randbytes(20) for _ in range(core.next_fresh_slot, core.config.num_tier_slots)]
    for slot, key in enumerate(keys, start=core.next_fresh_slot):
        core.slot_key[slot] = key
        core.slot_state[slot] = SlotState.STORED
        core.slot_of_key[key] = slot
    core.policy.insert_many(keys, False)
    core.next_fresh_slot = core.config.num_tier_slots


def snapshot_cost(args: argparse.Namespace) -> None:
    """One snapshot's cost to the scheduler (capture on its thread; pack and compress
    on the writer's), its size, and what restoring it costs a reader."""
    import statistics

    import msgpack

    sys.path.insert(0, str(ROOT / "bench"))
    from engine_step import config, make_trace

    from kvledger.engine import queries
    from kvledger.engine.reducer import reduce_step
    from kvledger.engine.snapshot import capture, restore
    from kvledger.engine.state import initial_state
    from kvledger.events.log_binary import encode_snapshot_frame
    from kvledger.events.schema import Strings

    lock = SlicedLock(1e9)
    rows = []
    for name, blocks, slots, running in (("scheduler_overhead", 48_000, 192_000, 170),
                                         ("engine_step", 100_000, 1_000_000, 256),
                                         ("engine_step, tier filled", 100_000, 1_000_000, 256)):
        cfg = config(blocks, slots)
        trace = make_trace(cfg, steps=args.steps, running=running, seed=0)
        state = initial_state(cfg)
        for step in trace:
            state, _ = reduce_step(state, step)
        if name.endswith("filled"):
            _fill_tier(state)
        times: dict[str, list[float]] = {"capture_ms": [], "encode_ms": [], "pack_ms": [], "restore_ms": []}
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            data = capture(state)
            t1 = time.perf_counter()
            frame = encode_snapshot_frame(1, 1, data, strings=Strings())
            t2 = time.perf_counter()
            packed_bytes = msgpack.packb(data)  # the part of encoding that holds the GIL
            t25 = time.perf_counter()
            restore(cfg, msgpack.unpackb(packed_bytes, use_list=False))
            t4 = time.perf_counter()
            times["capture_ms"].append((t1 - t0) * 1e3)
            times["encode_ms"].append((t2 - t1) * 1e3)
            times["pack_ms"].append((t25 - t2) * 1e3)
            times["restore_ms"].append((t4 - t25) * 1e3)  # unpack and restore, as a reader does
        tier = queries.tier_usage(state)
        row = {"state": name, "device_blocks": blocks, "tier_slots": slots, "running": running,
               "steps": len(trace), "requests": queries.num_requests(state), "tier_used_slots": tier.used_slots,
               "held_device_blocks": queries.device_usage(state).held_blocks,
               "packed_bytes": len(msgpack.packb(data)), "frame_bytes": len(frame),
               **{f"{k}_best": round(min(v), 1) for k, v in times.items()},
               **{f"{k}_median": round(statistics.median(v), 1) for k, v in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    lock.release()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "snapshot_cost.json").write_text(json.dumps(rows, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate")
    p.add_argument("--out", required=True)
    p.add_argument("--milestones", default="5e6,10e6,20e6")
    p.add_argument("--interval", type=int, default=250_000, help="snapshot_interval_events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slice-s", type=float, default=480.0)
    p.set_defaults(func=generate)
    for name, func in (("measure", measure), ("measure-cut", measure_cut), ("measure-from-start", measure_from_start),
                       ("measure-bisect", measure_bisect)):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--repeat", type=int, default=2)
        p.add_argument("--jobs", type=int, default=1)
        p.add_argument("--verify", action="store_true", help="bisect: also a checked replay from the start")
        p.set_defaults(func=func)
    p = sub.add_parser("measure-tools")
    p.add_argument("--out", required=True)
    p.add_argument("--fold-events", type=int, default=2_000_000)
    p.add_argument("--only", nargs="*", help="these tools alone, as TOOLS spells them ('replay --check')")
    p.set_defaults(func=measure_tools)
    p = sub.add_parser("snapshot-cost")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--repeat", type=int, default=5)
    p.set_defaults(func=snapshot_cost)
    for p in sub.choices.values():
        p.add_argument("--no-lock", action="store_true", help="without the heavy-job lock: small smoke runs only")
    args = parser.parse_args()
    SlicedLock.enabled = not args.no_lock
    args.func(args)


if __name__ == "__main__":
    main()
