"""The compiled engine against its pure source, side by side on one trace.

bench/engine_step.py's trace and measures (engine time per step, replay events/s
without and with per-event invariant checks), each build in its own process
(KVLEDGER_PURE=1 for the source), alternating build by build for `--rounds`
rounds, so the machine's load falls on both alike. Each process reports the best
of `--repeat` runs of each measure; the table shows the best and the median
over rounds, and the ratio of the medians.

    python bench/compiled_core.py [--steps N] [--rounds R] [--repeat K]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

import engine_step as es

MEASURES = (("step_ms", "engine time per step, median (ms)", min),
            ("plain", "replay, no invariant checks (events/s)", max),
            ("checked", "replay, per-event invariant checks (events/s)", max))


def worker(trace_path: str, repeat: int) -> None:
    import kvledger

    with open(trace_path, "rb") as file:
        cfg, trace = pickle.load(file)
    events = [e for step in trace for e in step]
    step_ms = min(statistics.median(es.time_steps(cfg, trace)) for _ in range(repeat)) * 1e3
    plain = max(es.replay_speed(cfg, events, invariants=False) for _ in range(repeat))
    checked = max(es.replay_speed(cfg, events, invariants=True) for _ in range(repeat))
    print(json.dumps({"compiled": kvledger.BUILD.compiled, "step_ms": step_ms, "plain": plain, "checked": checked}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.repeat)
        return
    cfg = es.config(100_000, 1_000_000)
    start = time.perf_counter()
    trace = es.make_trace(cfg, steps=args.steps, running=256, seed=0)
    print(f"trace: {len(trace)} steps, {sum(map(len, trace))} events, built in {time.perf_counter() - start:.1f} s")
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trace.pickle")
        with open(path, "wb") as file:
            pickle.dump((cfg, trace), file)
        for _ in range(args.rounds):
            for compiled in (False, True):
                env = {k: v for k, v in os.environ.items() if k != "KVLEDGER_PURE"}
                if not compiled:
                    env["KVLEDGER_PURE"] = "1"
                out = subprocess.run([sys.executable, __file__, "--worker", path, "--repeat", str(args.repeat)],
                                     env=env, capture_output=True, text=True, check=True).stdout
                result = json.loads(out)
                if result["compiled"] != compiled:
                    raise SystemExit(f"asked for the {'compiled' if compiled else 'pure'} engine, got the other "
                                     f"(kvledger.BUILD: {result})")
                runs[compiled].append(result)
    print(f"{args.rounds} rounds, pure and compiled alternating, best of {args.repeat} runs each")
    print(f"{'measure':48s} {'pure: best / median':>24s} {'compiled: best / median':>26s} {'ratio':>6s}")
    for key, label, best in MEASURES:
        pure, comp = ([r[key] for r in runs[flag]] for flag in (False, True))
        fmt = (lambda v: f"{v:.3f}") if key == "step_ms" else (lambda v: f"{v:,.0f}")
        ratio = statistics.median(comp) / statistics.median(pure)
        print(f"{label:48s} {fmt(best(pure)) + ' / ' + fmt(statistics.median(pure)):>24s} "
              f"{fmt(best(comp)) + ' / ' + fmt(statistics.median(comp)):>26s} {ratio:6.2f}")


if __name__ == "__main__":
    main()
