"""`kvledger demo`: real vLLM-CPU with kvledger on a prefix-reuse workload.

Long shared documents, each asked two questions. The first question computes
the document and kvledger stores it; the second restores it from the tier.
Then the tier is emptied and the second questions run again, recomputed, as
the reference for both time and output. vLLM's own prefix cache is off, so
every restored token came from kvledger. Prompts run one at a time, so time
to first token is not shared with other requests.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

from kvledger.adapters.cli.log_commands import cmd_replay, replay_args
from kvledger.adapters.settings import kv_transfer_config
from kvledger.adapters.testing.tiny_models import build_model


def _say(message: str, started: float) -> None:
    print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True)


def words(rng: random.Random, count: int) -> str:
    """A prompt of `count` tokens for the tiny models' one-word-one-token vocabulary."""
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(count))


def ask(llm, prompt: str, params) -> tuple[list[int], int, float]:
    """One prompt alone: (greedy tokens, tokens restored or cached, seconds to the first token)."""
    t0 = time.perf_counter()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    metrics = output.metrics  # present when vLLM keeps stats (disable_log_stats=False)
    ttft = metrics.first_token_latency if metrics is not None and metrics.first_token_latency else wall
    return list(output.outputs[0].token_ids), output.num_cached_tokens or 0, ttft


def run_demo(out_dir: str | Path, *, model: str = "small-llama", docs: int = 3, doc_words: int = 2000,
             max_tokens: int = 16) -> int:
    started = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "demo-events.log"
    log_path.unlink(missing_ok=True)  # the demo's own log from an earlier run; the connector never overwrites
    _say(f"building the local model {model!r} (random weights, no download)", started)
    model_dir = build_model(model, out / "models")

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process: faster start
    _say("starting vLLM-CPU with kvledger (this takes 10-30 s)", started)
    from vllm import LLM, SamplingParams  # seconds to import: after the message that says it is starting

    llm = LLM(
        model=str(model_dir), dtype="float32", max_model_len=doc_words + 256, block_size=32,
        enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20,
        max_num_seqs=4, seed=0, disable_log_stats=False,
        kv_transfer_config=kv_transfer_config(capacity_bytes=256 << 20, event_log=str(log_path)),
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rng = random.Random(0)
    documents = [words(rng, doc_words) for _ in range(docs)]
    first = [f"{d} {words(rng, 20)}" for d in documents]
    second = [f"{d} {words(rng, 24)}" for d in documents]

    _say(f"asking the first question of {docs} documents of {doc_words} words (computed, then stored)", started)
    for prompt in first:
        ask(llm, prompt, params)
    _say("asking the second questions (the documents restored from kvledger's tier)", started)
    restored = [ask(llm, p, params) for p in second]
    _say("emptying the tier and asking the second questions again (recomputed)", started)
    llm.reset_prefix_cache(reset_connector=True)
    recomputed = [ask(llm, p, params) for p in second]
    del llm

    prompt_tokens = sum(len(p.split()) for p in second)
    restored_tokens = sum(r[1] for r in restored)
    ttft_restored = statistics.median(r[2] for r in restored)
    ttft_recomputed = statistics.median(r[2] for r in recomputed)
    equal = all(a[0] == b[0] for a, b in zip(restored, recomputed))
    print()
    print("kvledger demo report")
    print(f"  model              {model} ({model_dir})")
    print(f"  hit rate           {restored_tokens / prompt_tokens:.1%} of the second questions' prompt tokens")
    print(f"  tokens restored    {restored_tokens} of {prompt_tokens}")
    print(f"  time to 1st token  {ttft_restored * 1000:.0f} ms restored vs {ttft_recomputed * 1000:.0f} ms "
          f"recomputed (median; {ttft_restored / ttft_recomputed:.2f}x)")
    print(f"  outputs            {'equal' if equal else 'DIFFERENT'} to full recompute ({docs} greedy answers)")
    print(f"  event log          {log_path}")
    print()
    report = out / "demo-report.html"
    _say(f"replaying the event log: kvledger replay {log_path} --check --report {report} --force", started)
    status = cmd_replay(replay_args(str(log_path), check=True, report=str(report), force=True))
    return 0 if equal and status == 0 else 1


if __name__ == "__main__":
    sys.exit(run_demo(sys.argv[1] if len(sys.argv) > 1 else "bench/out"))
