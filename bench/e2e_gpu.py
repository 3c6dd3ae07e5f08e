"""End to end on a GPU: kvledger against vLLM's own CPU offloading connectors.

The same engine settings and the same prompts for every connector, in one
process, one engine at a time:

1. TTFT on CPU-tier hits: a long prompt is computed (and offloaded), vLLM's
   GPU prefix cache is emptied (`reset_prefix_cache()`, which leaves the
   connector's tier alone), and the prompt is asked again, so its prefix can
   only come from the CPU tier. Reported against the recomputed TTFT.
2. Throughput with reuse: documents that together overflow the GPU cache,
   each asked twice with different questions; hits can only come from CPU.
3. Throughput without reuse: unique prompts; what storing every block costs.

Connectors: none, kvledger, OffloadingConnector, SimpleCPUOffloadConnector,
all with the same CPU capacity. Needs CUDA and the GPU build of vLLM (0.33);
it refuses to run otherwise, because a CPU run answers a different question
(see bench/e2e_vllm_cpu.py).

Usage: python bench/e2e_gpu.py [--quick] [--out bench/out] [--connectors none,kvledger,...]
       python bench/e2e_gpu.py --cpu-smoke   # the script's own logic on vLLM-CPU, tiny sizes, no timings
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # reach the engine's stats in-process

from kvledger.adapters.cli.demo import ask, words  # noqa: E402
from kvledger.adapters.settings import kv_transfer_config  # noqa: E402
from kvledger.adapters.testing.tiny_models import build_model  # noqa: E402


def connectors(capacity: int) -> dict[str, dict | None]:
    """Every connector with the same CPU capacity in bytes."""
    vllm_cpu = {"cpu_bytes_to_use": capacity}
    return {
        "none": None,
        "kvledger": kv_transfer_config(capacity_bytes=capacity),
        "offloading": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": dict(vllm_cpu)},
        "simple_cpu": {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": dict(vllm_cpu)},
    }


ENGINE = dict(dtype="bfloat16", block_size=16, enable_prefix_caching=True, max_num_seqs=64, seed=0,
              disable_log_stats=False)
SMOKE_ENGINE = dict(dtype="float32", block_size=32, enforce_eager=True)  # what vLLM-CPU needs


def _llm(model: Path, transfer: dict | None, *, max_model_len: int, gpu_kv_bytes: int):
    from vllm import LLM

    kwargs = dict(ENGINE, model=str(model), max_model_len=max_model_len, kv_cache_memory_bytes=gpu_kv_bytes)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    return LLM(**kwargs)


def ttft_cpu_hits(model: Path, transfer: dict | None, docs: int, doc_words: int, gpu_kv_bytes: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rng = random.Random(2)
    llm = _llm(model, transfer, max_model_len=doc_words + 64, gpu_kv_bytes=gpu_kv_bytes)
    llm.generate([words(rng, 256)], params, use_tqdm=False)  # warm up
    cold, warm, cached, equal = [], [], [], []
    for _ in range(docs):
        prompt = words(rng, doc_words)
        first = ask(llm, prompt, params)
        time.sleep(0.2)  # let asynchronous stores land, as they would between user turns
        llm.reset_prefix_cache()  # the GPU prefix cache only: hits must come from the CPU tier
        second = ask(llm, prompt, params)
        cold.append(first[2])
        warm.append(second[2])
        cached.append(second[1])
        equal.append(first[0] == second[0])
    del llm
    gc.collect()
    return {"recomputed_s": cold, "restored_s": warm, "cached_tokens": cached, "outputs_equal": all(equal),
            "ratio": statistics.median(warm) / statistics.median(cold)}


def throughput(model: Path, transfer: dict | None, *, docs: int, doc_words: int, question_words: int,
               out_tokens: int, reuse: bool, gpu_kv_bytes: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    rng = random.Random(3)
    documents = [words(rng, doc_words) for _ in range(docs)]
    first = [d + " " + words(rng, question_words) for d in documents]
    second = ([d + " " + words(rng, question_words) for d in documents] if reuse
              else [words(rng, doc_words + question_words) for _ in documents])
    llm = _llm(model, transfer, max_model_len=doc_words + question_words + out_tokens + 32,
               gpu_kv_bytes=gpu_kv_bytes)
    llm.generate([words(rng, doc_words) for _ in range(4)], params, use_tqdm=False)  # warm up
    t0 = time.perf_counter()
    llm.generate(first, params, use_tqdm=False)
    outputs = llm.generate(second, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    del llm
    gc.collect()
    tokens = 2 * docs * (doc_words + question_words + out_tokens)
    return {"seconds": seconds, "tokens_per_s": tokens / seconds,
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads, for a smoke run")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--model", default="gpu-llama")
    parser.add_argument("--connectors", default="none,kvledger,offloading,simple_cpu")
    parser.add_argument("--cpu-gib", type=float, default=32.0, help="CPU tier capacity of every connector")
    parser.add_argument("--gpu-kv-gib", type=float, default=8.0, help="GPU KV cache of every engine")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run this script's logic on vLLM-CPU with a tiny model (none and kvledger only)")
    args = parser.parse_args()
    import torch

    if args.cpu_smoke:
        ENGINE.update(SMOKE_ENGINE)
        args.quick, args.model, args.connectors = True, "tiny-llama", "none,kvledger"
        args.cpu_gib, args.gpu_kv_gib = 0.25, 1 / 64
    elif not torch.cuda.is_available():
        print("e2e_gpu: no CUDA device; on CPU run bench/e2e_vllm_cpu.py instead", file=sys.stderr)
        return 2
    import vllm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(args.model, out / "models")
    available = connectors(int(args.cpu_gib * (1 << 30)))
    names = args.connectors.split(",")
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"e2e_gpu: unknown connectors {unknown}; known: {list(available)}", file=sys.stderr)
        return 2
    gpu_kv = int(args.gpu_kv_gib * (1 << 30))
    doc_words = 4096 if args.quick else 8192
    docs = 16 if args.quick else 64  # 64 x 8k tokens at 1 MiB per 16 tokens: 32 GiB, four times the GPU cache
    if args.cpu_smoke:
        doc_words, docs = 480, 8
    device = "cpu (smoke run)" if args.cpu_smoke else torch.cuda.get_device_name()
    result: dict = {"device": device, "vllm": vllm.__version__, "model": args.model,
                    "cpu_gib": args.cpu_gib, "gpu_kv_gib": args.gpu_kv_gib, "runs": {}}
    for name in names:
        transfer = available[name]
        runs = {"ttft": ttft_cpu_hits(model, transfer, docs=3 if args.quick else 8, doc_words=doc_words,
                                      gpu_kv_bytes=gpu_kv)}
        for reuse in (True, False):
            runs["reuse" if reuse else "unique"] = throughput(
                model, transfer, docs=docs, doc_words=doc_words, question_words=64, out_tokens=64,
                reuse=reuse, gpu_kv_bytes=gpu_kv)
        result["runs"][name] = runs
        print(f"{name:<11} ttft restored/recomputed {runs['ttft']['ratio']:.3f}x "
              f"(cached {runs['ttft']['cached_tokens']}); reuse {runs['reuse']['tokens_per_s']:.0f} tok/s "
              f"(cached {runs['reuse']['cached_tokens']}); unique {runs['unique']['tokens_per_s']:.0f} tok/s",
              flush=True)
    base = result["runs"].get("none")
    if base is not None:
        for runs in result["runs"].values():
            for workload in ("reuse", "unique"):
                runs[workload]["ratio_to_none"] = runs[workload]["tokens_per_s"] / base[workload]["tokens_per_s"]
                runs[workload]["outputs_equal_to_none"] = runs[workload]["tokens"] == base[workload]["tokens"]
    for runs in result["runs"].values():
        for workload in ("reuse", "unique"):
            runs[workload].pop("tokens")
    (out / "e2e_gpu.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({n: {"ttft_ratio": r["ttft"]["ratio"],
                          **{w: r[w].get("ratio_to_none") for w in ("reuse", "unique")}}
                      for n, r in result["runs"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
