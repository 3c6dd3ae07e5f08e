"""Time to first token of a 2k-token document on vLLM-CPU: recomputed,
restored from the host tier, and restored from a lower tier by a new process
(the host tier empty), side by side in one run.

Usage: python bench/tier_ttft.py [--store fs|valkey] [--phase ...]. Without
--phase it runs the phases as subprocesses, on one tier, and prints a table:
  phase "one": a fresh engine; per document, the first question (recomputed,
               stored and written to the tier), then a second one (host tier);
  phase "two": a new process; third questions (new ones), from the tier. With
               `--store fs` (a directory): first with the page cache dropped
               (as after a reboot, or on another machine), then again in a third
               process with the files in the page cache (as after a restart of
               vLLM alone). With `--store valkey` (a local valkey-server): once,
               as a second replica sharing the store would.
Each "two" phase runs again as "..., spinning": with the worker's empty steps
not waiting for the loads in flight (`worker_side.IDLE_WAIT_S` = 0), as
kvledger ran before that wait, side by side.

`--layouts files,packs` (the disk tier): the phases once per layout, each on a
directory of its own, a file per block (`pack_bytes` 0) beside packs (the
default), the spinning rows left out.
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
import time
from pathlib import Path

from fs_block_io import drop_caches  # the sibling script (bench/ is on sys.path when run)


def tier_config(store: str, where: str, pack_bytes: int | None = None) -> dict:
    if store == "valkey":
        return {"type": "valkey", "url": where, "capacity_bytes": 2 << 30}
    return {"type": "fs", "path": where, "capacity_bytes": 2 << 30,
            **({} if pack_bytes is None else {"pack_bytes": pack_bytes})}


def engine(model_dir: str, tier: dict | None, log: str, doc_words: int):
    """vLLM with kvledger over `tier`; with no tier, vLLM alone (the reference outputs)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from kvledger.adapters.settings import kv_transfer_config

    transfer = None if tier is None else kv_transfer_config(capacity_bytes=256 << 20, event_log=log,
                                                            secondary_tiers=[tier])
    return LLM(model=model_dir, dtype="float32", max_model_len=doc_words + 256, block_size=32,
               enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20,
               max_num_seqs=4, seed=0, disable_log_stats=False, kv_transfer_config=transfer)


def prompts(docs: int, doc_words: int, sets: int = 3) -> list[list[str]]:
    """Per document `sets` questions: the first (computed and stored), the second (restored from
    host memory), and one more for each new process (restored from the tier), each asked for the
    first time, so host memory and the tier hold the same blocks for it (before 2026-12-06 every
    new process asked the second question again, whose own blocks the tier then held: 2,016 tokens
    restored against host memory's 1,984). Seeded, so `bench/peer_ttft.py` asks LMCache the same."""
    from kvledger.adapters.cli.demo import words

    rng = random.Random(0)
    documents = [words(rng, doc_words) for _ in range(docs)]
    return [[f"{d} {words(rng, 20 + 4 * n)}" for d in documents] for n in range(sets)]


def run_phase(args) -> dict:
    from vllm import SamplingParams

    from kvledger.adapters.cli.demo import ask

    if args.spinning:  # the worker's empty steps do not wait for loads (as before IDLE_WAIT_S)
        from kvledger.adapters.vllm import worker_side

        worker_side.IDLE_WAIT_S = 0.0
    tier = None if args.phase == "reference" else tier_config(args.store, args.tier, args.pack_bytes)
    llm = engine(args.model_dir, tier, args.log, args.doc_words)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sets = prompts(args.docs, args.doc_words, 2 + args.new_processes)
    first, second = sets[:2]
    out: dict = {}
    stages: dict[str, list[dict]] = {}
    if args.phase == "reference":  # each new process's questions recomputed, for its outputs
        return {f"questions {n}": {"tokens": [ask(llm, p, params)[0] for p in sets[n]]} for n in range(2, len(sets))}
    restores = _restores(llm)
    if args.phase == "one":
        out["recompute"] = [ask(llm, p, params) for p in first]
        time.sleep(1.0)  # let the spills of the documents finish before the host questions
        restores.clear()
        out["host"] = [ask(llm, p, params) for p in second]
        stages["host"] = list(restores)
    else:
        out[args.label] = [ask(llm, p, params) for p in sets[args.questions]]
        stages[args.label] = list(restores)
    return {name: {"tokens": [r[0] for r in rows], "cached": [r[1] for r in rows], "ttft": [r[2] for r in rows],
                   "stages": stages.get(name, [])}
            for name, rows in out.items()}


def _restores(llm):
    """The scheduler's record of each restore's stages (`RestoreTimes.recent`):
    in this process, as vLLM's multiprocessing is off."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler.restores.recent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=("fs", "valkey"), default="fs")
    parser.add_argument("--phase", choices=("reference", "one", "two"))
    parser.add_argument("--model-dir")
    parser.add_argument("--tier")
    parser.add_argument("--log")
    parser.add_argument("--label", default="disk")
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--doc-words", type=int, default=2000)
    parser.add_argument("--pack-bytes", type=int, help="(a phase) the disk tier's pack_bytes")
    parser.add_argument("--questions", type=int, default=2, help="(phase two) which set of questions it asks")
    parser.add_argument("--new-processes", type=int, default=1, help="(a phase) how many sets phase two's runs ask")
    parser.add_argument("--layouts", default="", help="the disk tier's layouts side by side: files,packs")
    parser.add_argument("--spinning", action="store_true",
                        help="(a phase) empty steps do not wait for the loads in flight")
    args = parser.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(run_phase(args)), flush=True)
        return
    from kvledger.adapters.testing.tiny_models import build_model

    work = Path(tempfile.mkdtemp(prefix="kvledger-ttft-", dir=os.environ.get("KVLEDGER_BENCH_DIR", "/work")))
    model_dir = str(build_model("small-llama", work / "models"))
    server = None
    if args.store == "valkey":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.support
        from tests.support.valkey_servers import ServerProcess

        server = ServerProcess(maxmemory="2gb")
        where, phases = server.url, (("one", ""), ("two", "valkey"), ("two", "valkey, spinning"))
    elif args.layouts:
        where, phases = None, tuple((phase, f"disk {layout}{label}") for layout in args.layouts.split(",")
                                    for phase, label in (("one", ""), ("two", ", cold"), ("two", ", warm")))
    else:
        where, phases = str(work / "tier"), (("one", ""), ("two", "disk, cold"), ("two", "disk, warm"),
                                             ("two", "disk, cold, spinning"), ("two", "disk, warm, spinning"))
    results = {}
    try:
        twos = [label for phase, label in phases if phase == "two"]
        for phase, label in (("reference", ""), *phases):
            layout = label.split(",")[0].removeprefix("disk ") if args.layouts and phase != "reference" else None
            if layout is not None and layout not in ("files", "packs"):
                sys.exit(f"--layouts takes files and packs, not {layout!r}")
            if layout is not None:
                where = str(work / f"tier-{layout}")
            if ", cold" in label and not drop_caches():
                sys.exit("dropping the page cache needs root")
            proc = subprocess.run(
                [sys.executable, __file__, "--store", args.store, "--phase", phase, "--model-dir", model_dir,
                 "--tier", where or str(work / "no-tier"), "--log", str(work / f"{phase}-{label.replace(', ', '-') or 'one'}.log"),
                 "--docs", str(args.docs),
                 "--label", label or "disk", "--doc-words", str(args.doc_words),
                 *(["--pack-bytes", "0" if layout == "files" else str(2 << 20)] if layout else []),
                 *(["--spinning"] if label.endswith("spinning") else []),
                 "--new-processes", str(len(twos)),
                 *(["--questions", str(2 + twos.index(label))] if phase == "two" else [])],
                capture_output=True, text=True, timeout=900)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"phase {phase} failed:\n{proc.stderr[-3000:]}")
            results.update(json.loads(line[7:]))
    finally:
        if server is not None:
            server.close()
    tiered = [label for phase, label in phases if phase == "two"]
    print(f"{'source':<24}{'median TTFT ms':>16}{'cached tokens':>16}")
    for name in ("recompute", "host", *tiered):
        row = results[name]
        print(f"{name:<24}{statistics.median(row['ttft']) * 1000:>16.0f}{statistics.median(row['cached']):>16.0f}")
    same = all(results[name]["tokens"] == results[f"questions {2 + n}"]["tokens"] for n, name in enumerate(tiered))
    print(f"outputs from the {args.store} tier equal a recompute of the same questions: {same}")
    from kvledger.adapters.vllm.restore_timing import STAGES

    print("where a restore's time goes, median ms per stage (the scheduler's clock; see adapters/vllm/restore_timing.py):")
    for name in ("host", *tiered):
        rows = results[name]["stages"]
        cells = ", ".join(f"{stage} {statistics.median(r[stage] for r in rows if stage in r) * 1000:.1f}"
                          for stage in STAGES
                          if any(stage in r for r in rows))
        print(f"  {name:<24}{cells or 'no restore recorded'}")
    print("JSON " + json.dumps({n: {"ttft_ms": [round(t * 1000, 1) for t in r["ttft"]], "cached": r["cached"],
                                    "stages_ms": [{k: round(v * 1000, 2) for k, v in row.items()} for row in r["stages"]]}
                                for n, r in results.items() if "ttft" in r} | {"tier_equals_recompute": same,
                                                                               "store": args.store}))


if __name__ == "__main__":
    main()
