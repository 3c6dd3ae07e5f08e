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

`snapshot-cost` measures what one snapshot costs the scheduler (the capture on
its thread, and the packing and compression on the writer's) and its size, on
states of bench/scheduler_overhead.py's size (48k device blocks, 192k tier
slots, ~170 running requests) and of bench/engine_step.py's (100k device
blocks, 1M tier slots, 256 running requests).

    python bench/long_logs.py generate --out DIR [--milestones 5e6,10e6,20e6]
    python bench/long_logs.py measure --out DIR
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

    def __init__(self, slice_s: float) -> None:
        self.slice_s = slice_s
        self.file = open(LOCK, "a")  # noqa: SIM115
        self.waited = 0.0
        self._take()

    def _take(self) -> None:
        start = time.monotonic()
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
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
