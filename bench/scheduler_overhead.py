"""Scheduler-side cost of kvledger's connector against vLLM's own, on one trace.

vLLM calls a KV connector's scheduler half inside every `schedule()` and
`update_from_output()`, on the engine's critical path: time spent there is
time no forward runs. This benchmark builds a real vLLM `Scheduler` per
connector (kvledger's `KVLedgerConnector`, vLLM's `OffloadingConnector` and
`SimpleCPUOffloadConnector`, all in role SCHEDULER) and feeds each the same
trace: 256 requests kept in flight over 32 shared documents, prompts of
1k-8k tokens (`--prompt-tokens`), 256 decoded tokens each, chunked prefill of 8192 tokens a
step, and a device pool small enough that vLLM preempts. The KV cache has
two groups, full attention and a 1024-token sliding window, in 16-token
blocks; every tier holds the same number of blocks.

No model and no worker run. Each request's sampled tokens come from the
trace; every store or load a connector starts is reported done
`--delay-steps` steps later (at once when the connector asks the worker to
wait for it), in the form that connector's own worker reports it. The
schedulers step in turn, in a rotating order, so machine noise lands on all
of them alike. The calls are the same kind but not the same sequence: what
a connector answers (a hit, "ask again later") steers vLLM's scheduling.

Timed: every scheduler-side method of the connector that vLLM calls, summed
per step. Reported per connector: that time per step (median, p99, mean),
its ratio to vLLM's `OffloadingConnector`, the tokens vLLM admitted as
external hits, the tokens it computed, preemptions, and for kvledger the
protocol violations its engine reported (a run with any is not valid), and
the cyclic garbage collector's runs during each connector's steps and inside
its calls (a collection is paid by whoever's allocation crosses the
threshold, so the connector whose objects outlive its calls is charged
some, and vLLM's code around them the rest); and what the slowest 1% of
steps admitted, in hit tokens a step and the connector's time a hit
token (longer hits let vLLM admit more requests in one step).

`kvledger-logged` is kvledger writing its event log (`--event-log`, binary,
a part digest every 64 steps). Run beside `kvledger`, their ratio is what
the log costs the scheduler:

    python bench/scheduler_overhead.py --connectors kvledger,kvledger-logged

`kvledger` runs as configured by default, its live miss counter on
(`miss_metrics`); `kvledger-uncounted` is kvledger with the counter off.
Side by side, what the counter costs the scheduler's calls (the scheduler's
thread queues each batch; the counter's thread folds them), with the
counter's thread's own CPU per step printed beside it. The benchmark waits
for the fold where a server runs its model (untimed, its wall time
printed); `--counter-contends` lets the thread fold whenever it gets the
interpreter instead, as when every step is CPU-bound:

    python bench/scheduler_overhead.py --connectors kvledger,kvledger-uncounted,kvledger-uncounted-twin

(`kvledger-uncounted-twin` is the same row again: the spread between two rows
with nothing between them, which a cost must clear to be seen.)

    python bench/scheduler_overhead.py [--requests 256] [--steps 1000] [--seed 0] [--out PATH]

With a tier below host memory: `kvledger-fs` is kvledger over a disk tier
(`--disk-blocks`), `vllm-tiering-fs` is vLLM 0.33's `OffloadingConnector`
with `TieringOffloadingSpec` and its `fs` secondary tier, both in a fresh
folder under `--disk-dir`. vLLM 0.33's tiers do their I/O and lookups on
threads of the scheduler's process (the simulated worker writes nothing, so
its files are the only ones written); kvledger's worker does the I/O, and
only its lookups run in the scheduler's process. The CPU those threads use is
printed per step. Make `--tier-blocks` smaller than the workload so blocks
come back from the disk. Run it where vLLM 0.33 is installed:

    VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python bench/scheduler_overhead.py \
        --connectors kvledger,kvledger-fs,vllm-offloading,vllm-tiering-fs --tier-blocks 48000

`--async-scheduling` builds vLLM's `AsyncScheduler` and schedules each step
before the previous step's output is processed, with two batches in flight,
as a GPU server runs by default; `--early-stops` ends every other request on
a stop token, so requests finish while a step is in flight.

The default run takes about 2 minutes on 2 cores; raw numbers go to
bench/out/scheduler_overhead.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path
from types import GeneratorType
from typing import Any

HERE = Path(__file__).resolve().parent
BLOCK_TOKENS = 16
WINDOW_TOKENS = 1024
NUM_LAYERS = 4  # tiny-gemma3: sliding, full, sliding, full
NUM_DOCUMENTS = 32
OUTPUT_TOKENS = 256
VOCAB = 1024

# Every scheduler-side method vLLM 0.32's and 0.33's Scheduler call on their connector
# (grep `connector.` in vllm/v1/core/sched/scheduler.py); properties excluded.
SCHEDULER_METHODS = (
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "update_state_after_free",
    "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups",
    "register_finished_partial_tail", "has_pending_block_frees", "has_pending_push_work",
    "get_kv_connector_stats", "take_events",
)


# The trace.

class Trace:
    """An endless, seeded stream of requests, the same for every connector.

    A prompt is the head of one of a few shared documents plus a short tail
    of its own, so prefixes repeat across requests; each request's sampled
    tokens are fixed in advance, so its tokens do not depend on which
    connector ran it or when.
    """

    def __init__(self, seed: int, prompt_tokens: tuple[int, int] = (1024, 8192)) -> None:
        self._rng = random.Random(seed)
        self._lengths = prompt_tokens
        self._documents = [[self._rng.randrange(4, VOCAB) for _ in range(prompt_tokens[1])]
                           for _ in range(NUM_DOCUMENTS)]
        self._specs: list[tuple[list[int], list[int]]] = []

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        """(prompt token ids, output token ids) of request `index`."""
        rng = self._rng
        while len(self._specs) <= index:
            length = rng.randint(*self._lengths)
            tail = rng.randint(16, 256)
            prompt = self._documents[rng.randrange(NUM_DOCUMENTS)][: length - tail]
            prompt = prompt + [rng.randrange(4, VOCAB) for _ in range(tail)]
            self._specs.append((prompt, [rng.randrange(4, VOCAB) for _ in range(OUTPUT_TOKENS)]))
        return self._specs[index]


# vLLM, built as its engine core builds it, without model or workers.

def vllm_config(model: Path, kv_transfer: dict, *, device_blocks: int, concurrency: int,
                retention_interval: int | None, async_scheduling: bool = False, max_prompt_tokens: int = 8192):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=str(model), dtype="float32", skip_tokenizer_init=True, seed=0,
        # tiny-gemma3's shape with a 1024-token window and room for the longest prompt.
        hf_overrides={"max_position_embeddings": max(16384, 2 * max_prompt_tokens), "sliding_window": WINDOW_TOKENS},
        max_model_len=max_prompt_tokens + OUTPUT_TOKENS + BLOCK_TOKENS, block_size=BLOCK_TOKENS,
        enable_prefix_caching=True, num_gpu_blocks_override=device_blocks,
        prefix_cache_retention_interval=retention_interval,
        max_num_seqs=concurrency, max_num_batched_tokens=8192, kv_transfer_config=kv_transfer,
    ).create_engine_config()
    # vLLM's CPU platform turns async scheduling off; a GPU server has it on by default.
    config.scheduler_config.async_scheduling = async_scheduling
    return config


def layer_specs() -> dict:
    """tiny-gemma3's layers (sliding, full, sliding, full) with a 1024-token window."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    shape = dict(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowSpec(sliding_window=WINDOW_TOKENS, **shape) if i % 2 == 0 else FullAttentionSpec(**shape))
        for i in range(NUM_LAYERS)}


def tier_bytes(num_blocks: int) -> int:
    """Bytes of `num_blocks` offloaded blocks: one block of one group holds
    every layer of that group (half the layers here)."""
    return num_blocks * sum(spec.page_size_bytes for spec in layer_specs().values()) // 2


def kv_cache_config(config):
    """Two KV groups (full attention, sliding window), resolved as
    `EngineCore._initialize_kv_caches` resolves them."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )

    specs = layer_specs()
    # What a GPU worker's attention backends support; the connector's preference wins among them.
    resolve_kv_cache_layout(config, [["LBHNC", "LBNHC"]], specs.values())
    configs = worker_kv_cache_configs(config, [specs], [1 << 40])
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    scheduler_config.kv_cache_layout = config.cache_config.kv_cache_layout
    config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    config.validate_block_size()
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, config)
    scheduler_config.hash_block_size = hash_block_size
    scheduler_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        scheduler_config, config, block_size, hash_block_size)
    return scheduler_config, block_size, hash_block_size


def worker_kv_cache_configs(config, specs: list[dict], memory: list[int]) -> list:
    """`get_kv_cache_configs` as the installed vLLM's `EngineCore` calls it: 0.33
    moved it to `kv_cache_planning` and has it take the model's global KV groups."""
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(config, specs, memory)
    groups = get_global_kv_cache_groups(config, specs)
    config.adjust_dcp_kv_cache_interleave_size(groups)
    return get_kv_cache_configs(config, specs, memory, groups)


def build_scheduler(model: Path, kv_transfer: dict, **options):
    """vLLM's scheduler with the connector `kv_transfer` names (the class its
    engine core picks: `AsyncScheduler` under async scheduling), and the block
    hasher vLLM's engine gives each request (connectors key blocks by it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.structured_output import StructuredOutputManager

    config = vllm_config(model, kv_transfer, **options)
    kv_config, block_size, hash_block_size = kv_cache_config(config)
    scheduler_cls = config.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(vllm_config=config, kv_cache_config=kv_config,
                              structured_output_manager=StructuredOutputManager(config),
                              block_size=block_size, hash_block_size=hash_block_size)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return scheduler, get_request_block_hasher(hash_block_size, hash_fn)


# Timing the connector.

class ConnectorClock:
    """Wraps the connector's scheduler-side methods on the instance with
    timers. Only the outermost call is timed, so a method that calls
    another through `self` is counted once."""

    def __init__(self, connector: Any) -> None:
        self.seconds = 0.0
        self.method_seconds: Counter[str] = Counter()
        self.method_calls: Counter[str] = Counter()
        self.depth = 0  # calls under way (only the outermost is timed)
        for name in SCHEDULER_METHODS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._timed(name, method))

    def _timed(self, name: str, method):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            if self.depth:
                return method(*args, **kwargs)
            self.depth += 1
            start = clock()
            try:
                result = method(*args, **kwargs)
                # A generator does its work while vLLM drains it: drain it here, on the clock.
                return list(result) if isinstance(result, GeneratorType) else result
            finally:
                elapsed = clock() - start
                self.depth -= 1
                self.seconds += elapsed
                self.method_seconds[name] += elapsed
                self.method_calls[name] += 1

        return timed


class CollectorClock:
    """The cyclic garbage collector's runs, charged to the run whose step was
    going on, and whether one of its connector's calls was. A collection starts
    wherever the process's count of new container objects crosses the
    collector's threshold, and walks vLLM's young objects too: a connector that
    leaves many objects alive between calls pays for collections in its own
    calls and makes vLLM's code around them pay for more."""

    def __init__(self) -> None:
        self.run: Run | None = None
        self.started = 0.0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        run = self.run
        if run is None:
            return
        if phase == "start":
            self.started = time.perf_counter()
            return
        seconds = time.perf_counter() - self.started
        run.collections["step"] += 1
        run.collections["step_ms"] += seconds * 1e3
        if run.clock.depth:
            run.collections["in_calls"] += 1
            run.collections["in_calls_ms"] += seconds * 1e3
            run.collected_ms[run.step_index] = run.collected_ms.get(run.step_index, 0.0) + seconds * 1e3


# Workers, simulated alike for every connector.

class SimulatedWorker:
    """Reports every transfer a step's metadata starts as done `delay`
    steps later, or in the same step when the metadata asks the worker to
    wait for it (a flush). Subclasses read and write each connector's own
    formats: what its metadata starts, and how its worker reports back."""

    def __init__(self, delay: int) -> None:
        self.delay = delay
        self.pending: list[tuple[int, tuple]] = []  # (due step, job)
        self.jobs_started = Counter()

    def output(self, step: int, meta: Any):
        """The connector output of step `step`, whose metadata is `meta`."""
        from vllm.v1.outputs import KVConnectorOutput

        flushed = self.flushed(meta)
        for job in self.started(meta):
            self.jobs_started[job[0]] += 1
            self.pending.append((step + self.delay, job))
        ends = [due <= step or flushed(job) for due, job in self.pending]
        done = [job for (_, job), end in zip(self.pending, ends) if end]
        self.pending = [entry for entry, end in zip(self.pending, ends) if not end]
        finished_recving = {rid for kind, _, rids in done if kind == "load" for rid in rids}
        return KVConnectorOutput(finished_recving=finished_recving, kv_connector_worker_meta=self.worker_meta(done))

    def started(self, meta: Any) -> list[tuple[str, int, tuple[str, ...]]]:
        """(kind, job id, request ids a load ends) per transfer the metadata starts."""
        raise NotImplementedError

    def flushed(self, meta: Any):
        """A predicate: must the worker wait for this job in this step?"""
        raise NotImplementedError

    def worker_meta(self, done: list[tuple]):
        raise NotImplementedError


class LedgerWorker(SimulatedWorker):
    """kvledger: each outcome is an event in `KVLedgerWorkerMetadata`; a
    finished load also names its request in `finished_recving`."""

    def started(self, meta):
        # Stores and spills to a lower tier end with a StoreCompleted; a DropTierKeys needs no report.
        return ([("store", s.job_id, ()) for s in meta.after_forward if hasattr(s, "job_id")]
                + [("load", load.job_id, (load.request_id,)) for load in meta.loads])

    def flushed(self, meta):
        flush = {job_id for effect in meta.before_step for job_id in effect.job_ids}
        return lambda job: job[0] == "store" and job[1] in flush

    def worker_meta(self, done):
        from kvledger.adapters.vllm.metadata import KVLedgerWorkerMetadata
        from kvledger.events.types import transfer_report

        if not done:
            return None
        return KVLedgerWorkerMetadata(events=tuple(transfer_report(job_id, 0, load=kind == "load")
                                                   for kind, job_id, _ in done))


class OffloadingWorker(SimulatedWorker):
    """vLLM's `OffloadingConnector`: `completed_jobs` counts every job,
    loads also go to `finished_recving` (offloading/worker.py)."""

    def started(self, meta):
        return ([("store", job_id, ()) for job_id in meta.store_jobs]
                + [("load", job_id, (job.req_id,)) for job_id, job in meta.load_jobs.items()])

    def flushed(self, meta):
        flush = set(meta.jobs_to_flush or ())
        return lambda job: job[1] in flush

    def worker_meta(self, done):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        if not done:
            return None
        return OffloadingWorkerMetadata(completed_jobs={job_id: 1 for _, job_id, _ in done})


class SimpleWorker(SimulatedWorker):
    """vLLM's `SimpleCPUOffloadConnector`: one store and one load event per
    step; stores are reported in `completed_store_events`, loads through
    `finished_recving`; a preemption makes its worker wait for everything."""

    def started(self, meta):
        jobs = []
        if meta.store_event >= 0:
            jobs.append(("store", meta.store_event, ()))
        if meta.load_event >= 0:
            jobs.append(("load", meta.load_event, tuple(meta.load_event_to_reqs.get(meta.load_event, ()))))
        return jobs

    def flushed(self, meta):
        return lambda job: bool(meta.need_flush)

    def worker_meta(self, done):
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        stores = {job_id: 1 for kind, job_id, _ in done if kind == "store"}
        return SimpleCPUOffloadWorkerMetadata(completed_store_events=stores) if stores else None


class ViolationCounter:
    """Counts the protocol violations kvledger's scheduler logs (events its
    engine rejected: its view of vLLM's blocks went wrong), showing the
    first few. It replaces the module's logger, which is called only when
    something is logged, so it costs the timed calls nothing otherwise."""

    def __init__(self, module, shown: int = 3) -> None:
        self.count = 0
        self.codes: Counter[str] = Counter()
        self._log = module._log
        self._shown = shown
        module._log = self

    def error(self, event: str, /, **fields) -> None:
        if event == "protocol_violation":
            self.count += 1
            self.codes[fields.get("code", "?")] += 1
            if self.count > self._shown:
                return
        self._log.error(event, **fields)

    def __getattr__(self, name: str):
        return getattr(self._log, name)


# One connector's run.

class Run:
    """A vLLM scheduler with one connector, stepped through the trace.

    Each step schedules a batch and runs it (the simulated forward and
    worker), then hands vLLM the output of the oldest batch in flight once
    `depth` are: at depth 1 the batch just scheduled, as vLLM's engine core
    steps without a batch queue; at depth 2, under async scheduling, the
    previous one, as `EngineCore.step_with_batch_queue` does."""

    def __init__(self, name: str, scheduler, hasher, worker: SimulatedWorker, trace: Trace,
                 concurrency: int, depth: int = 1, early_stops: bool = False) -> None:
        self.name = name
        self.scheduler = scheduler
        self.hasher = hasher
        self.worker = worker
        self.trace = trace
        self.concurrency = concurrency
        self.clock = ConnectorClock(scheduler.connector)
        self.violations: ViolationCounter | None = None
        self._count_hits(scheduler.connector)
        self.outputs: dict[str, list[int]] = {}
        self.next_request = 0
        self.step_index = 0
        self.depth = depth
        self.early_stops = early_stops
        self.in_flight: deque[tuple[Any, Any]] = deque()  # (scheduler output, model output), newest first
        self.connector_ms: list[float] = []
        self.collections: Counter[str] = Counter()  # the cyclic collector's runs in this run's steps
        self.collected_ms: dict[int, float] = {}  # per step, the collector's time inside the connector's calls
        self.scheduler_ms: list[float] = []
        self.stats = Counter()
        self.hit_tokens_by_step: Counter[int] = Counter()  # what vLLM admitted as external hits, by step
        # kvledger's live miss counter, when on (`_settle_counter`), and its fold's wall time per step
        self.counter = getattr(getattr(scheduler.connector, "scheduler", None), "_misses", None)
        self.settle_counter = True
        self.fold_ms: list[float] = []

    def _count_hits(self, connector) -> None:
        """Tokens vLLM admitted as external hits: the `num_external_tokens`
        it passes after allocating (it may shrink what the lookup offered);
        and, beside them, the local prefix-cache hit vLLM passed to that
        request's last lookup. Counted outside the timers."""
        timed_lookup, timed_alloc = connector.get_num_new_matched_tokens, connector.update_state_after_alloc
        local: dict[str, int] = {}

        def looked_up(request, num_computed_tokens, *args, **kwargs):
            local[request.request_id] = num_computed_tokens
            return timed_lookup(request, num_computed_tokens, *args, **kwargs)

        def allocated(request, blocks, num_external_tokens):
            self.stats["hit_tokens"] += num_external_tokens
            self.hit_tokens_by_step[self.step_index] += num_external_tokens
            self.stats["local_hit_tokens"] += local.pop(request.request_id, 0)
            self.stats["loads_admitted"] += num_external_tokens > 0
            return timed_alloc(request, blocks, num_external_tokens)

        connector.get_num_new_matched_tokens = looked_up
        connector.update_state_after_alloc = allocated

    def _add_requests(self) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        while len(self.scheduler.requests) < self.concurrency:
            prompt, output = self.trace[self.next_request]
            rid = f"req-{self.next_request}"
            self.next_request += 1
            self.outputs[rid] = output
            # Every other request stops at a token of its output (about halfway): vLLM
            # learns it from that step's output, which async scheduling processes late.
            stop = [output[len(output) // 2]] if self.early_stops and self.next_request % 2 else None
            params = SamplingParams(max_tokens=len(output), ignore_eos=True, stop_token_ids=stop)
            self.scheduler.add_request(Request(rid, list(prompt), params, None, block_hasher=self.hasher))
            self.stats["requests_added"] += 1

    def _model_output(self, out):
        """A forward that samples the trace's next token for every request
        whose prompt is computed by this step (a chunk short of it samples
        nothing, as vLLM's runner discards it)."""
        from vllm.v1.outputs import ModelRunnerOutput

        requests = self.scheduler.requests
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = requests[rid]
            done = request.num_computed_tokens >= request.num_tokens
            # Under async scheduling this step's token is the last placeholder; past
            # max_tokens (a step scheduled before the finishing one's output), vLLM drops it.
            index = min(request.num_output_tokens + max(request.num_output_placeholders - 1, 0),
                        len(self.outputs[rid]) - 1)
            sampled.append([self.outputs[rid][index]] if done else [])
        self.stats["tokens_computed"] += out.total_num_scheduled_tokens
        self.stats["running_request_steps"] += len(out.num_scheduled_tokens)
        self.stats["preemptions"] += len(out.preempted_req_ids or ())
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=self.worker.output(self.step_index, out.kv_connector_metadata))

    def step(self) -> None:
        clock = time.perf_counter
        before = self.clock.seconds
        start = clock()
        self._add_requests()
        out = self.scheduler.schedule()
        scheduled = clock() - start
        self.in_flight.appendleft((out, self._model_output(out)))  # the simulated forward and worker: not timed
        fold = self._settle_counter()  # where a server runs its model
        updated = 0.0
        if len(self.in_flight) >= self.depth:
            start = clock()
            self.scheduler.update_from_output(*self.in_flight.pop())
            updated = clock() - start
        self.connector_ms.append((self.clock.seconds - before) * 1e3)
        self.scheduler_ms.append((scheduled + updated) * 1e3)
        fold += self._settle_counter()  # the next forward's share, here so that it lands in no other run's step
        if self.counter is not None and self.settle_counter:
            self.fold_ms.append(fold * 1e3)
        self.step_index += 1
        self.stats["requests_finished"] = self.stats["requests_added"] - len(self.scheduler.requests)

    def _settle_counter(self) -> float:
        """kvledger's live miss counter folds each step's events on a thread of its own, in the
        time the scheduler's thread waits for the model; here, where the model would run, the
        benchmark waits for it (untimed), so its work lands in no connector's calls, this run's or
        another's. Its wall time is reported beside the steps. With `--counter-contends`, the
        thread folds whenever it gets the interpreter, as on a server whose every step is CPU-bound."""
        if self.counter is None or not self.settle_counter:
            return 0.0
        start = time.perf_counter()
        self.counter.settle()
        return time.perf_counter() - start

    def _slowest_steps(self) -> list[int]:
        """The steps past the 99th percentile (the slowest 1%)."""
        ranked = sorted(range(len(self.connector_ms)), key=self.connector_ms.__getitem__)
        return ranked[len(ranked) - max(1, len(ranked) // 100):]

    def _slowest_admissions(self) -> dict:
        """What the slowest 1% of steps admitted: a connector whose hits are longer
        lets vLLM admit more requests in one step (less of each is computed), and
        planning their loads is work in proportion to the tokens they restore."""
        slowest = self._slowest_steps()
        tokens = [self.hit_tokens_by_step[step] for step in slowest]
        ms = sum(self.connector_ms[step] for step in slowest)
        total = sum(tokens)
        return {"slowest_hit_tokens_per_step": {"median": statistics.median(tokens), "max": max(tokens)},
                "slowest_us_per_hit_token": ms * 1e3 / total if total else None}

    def summary(self) -> dict:
        ms = sorted(self.connector_ms)
        return {
            "steps": len(ms),
            "connector_ms_per_step": {"median": statistics.median(ms), "p99": percentile(ms, 0.99),
                                      "mean": statistics.fmean(ms), "max": ms[-1]},
            "scheduler_ms_per_step": {"median": statistics.median(self.scheduler_ms),
                                      "mean": statistics.fmean(self.scheduler_ms)},
            **({"miss_fold_ms_per_step": {"median": statistics.median(self.fold_ms),
                                          "p99": percentile(sorted(self.fold_ms), 0.99),
                                          "mean": statistics.fmean(self.fold_ms)}} if self.fold_ms else {}),
            "running_per_step_mean": self.stats["running_request_steps"] / len(ms),
            **dict(self.stats),
            "jobs_started": dict(self.worker.jobs_started),
            **({"protocol_violations": self.violations.count, "violation_codes": dict(self.violations.codes)}
               if self.violations is not None else {}),
            "method_ms_per_step": {k: v * 1e3 / len(ms) for k, v in self.clock.method_seconds.most_common()},
            "method_calls": dict(self.clock.method_calls),
            "collections": dict(self.collections),
            "connector_ms": self.connector_ms,
            # The tail with the collector's time inside the connector's calls taken out, and how many of
            # the steps past the p99 had a collection inside them: how much of the tail is the collector's.
            "without_collector_ms_per_step": {"p99": percentile(sorted(
                ms - self.collected_ms.get(step, 0.0) for step, ms in enumerate(self.connector_ms)), 0.99)},
            "slowest_with_collection": sum(1 for step in self._slowest_steps() if step in self.collected_ms),
            **self._slowest_admissions(),
            "collected_ms_by_step": {str(k): round(v, 3) for k, v in sorted(self.collected_ms.items())},
        }


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# The three connectors.

def connector_configs(capacity_bytes: int, event_log: str, disk: Path,
                      disk_bytes: int) -> dict[str, tuple[dict, type]]:
    """Each connector's kv_transfer_config and simulated worker. The `-fs` rows add
    a file-system tier below host memory, each in its own folder under `disk`."""
    from kvledger.adapters.settings import kv_transfer_config

    ledger = {"capacity_bytes": capacity_bytes, "log_level": "warning"}
    ledger_fs = {"type": "fs", "path": str(disk / "kvledger"), "capacity_bytes": disk_bytes}
    # vLLM 0.33's tiering: its fs tier keeps every file (no capacity); 4 I/O threads of each kind
    # instead of 16 + 16, as its threads share these 2 cores with the scheduler they serve.
    tiering_fs = {"type": "fs", "root_dir": str(disk / "vllm"), "n_read_threads": 4, "n_write_threads": 4}
    return {
        "kvledger": (kv_transfer_config(**ledger), LedgerWorker),
        "kvledger-fs": (kv_transfer_config(**ledger, secondary_tiers=[ledger_fs]), LedgerWorker),
        "vllm-tiering-fs": ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": capacity_bytes,
                                                           "spec_name": "TieringOffloadingSpec",
                                                           "secondary_tiers": [tiering_fs]}}, OffloadingWorker),
        "kvledger-logged": (kv_transfer_config(**ledger, event_log=event_log), LedgerWorker),
        "kvledger-uncounted": (kv_transfer_config(**ledger, miss_metrics=False), LedgerWorker),
        # The same again: two rows with nothing between them show the trace's spread (an A/A).
        "kvledger-uncounted-twin": (kv_transfer_config(**ledger, miss_metrics=False), LedgerWorker),
        "vllm-offloading": ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": capacity_bytes}}, OffloadingWorker),
        "vllm-simple-cpu": ({"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": capacity_bytes}}, SimpleWorker),
    }


def thread_cpu_seconds(name: str, prefix: bool = False) -> float | None:
    """CPU time so far of this process's thread `name` (Linux), or summed over the
    live threads whose names start with it; None when there is none."""
    import threading

    total, found = 0.0, False
    for thread in threading.enumerate():
        if (thread.name.startswith(name) if prefix else thread.name == name) and thread.native_id is not None:
            try:
                stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # from field 3 (state) on
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            found = True
    return total if found else None


# The threads each connector's lower tier runs in the scheduler's process.
TIER_THREADS = {"kvledger-fs": ("kvledger-lookups",), "vllm-tiering-fs": ("vllm_kv_py_fs", "vllm_offloading_lookup")}


def tier_slots(name: str, connector) -> int | None:
    """How many blocks each connector's tier holds, to check they match."""
    if name.startswith("kvledger"):
        return connector.scheduler.config.num_tier_slots
    if name == "vllm-offloading":
        return getattr(connector.scheduler.manager, "_num_chunks", None)
    if name == "vllm-tiering-fs":
        return getattr(connector.scheduler.manager.primary_tier, "_num_chunks", None)
    manager = getattr(connector, "scheduler_manager", None)
    return manager.num_cpu_blocks if manager is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256, help="requests kept in flight")
    parser.add_argument("--steps", type=int, default=1000, help="scheduler steps per connector")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device-blocks", type=int, default=48_000,
                        help="vLLM's device block pool: small enough that vLLM preempts")
    parser.add_argument("--tier-blocks", type=int, default=None, help="tier capacity in blocks (default 4x device)")
    parser.add_argument("--delay-steps", type=int, default=1, help="steps until a transfer is reported done")
    parser.add_argument("--retention-interval", default="0",
                        help="vLLM's prefix_cache_retention_interval: which sliding-window blocks vLLM keeps "
                             "cached and its OffloadingConnector stores; 0 (vLLM's default) keeps the last "
                             "window of a prompt, N every N tokens, 'dense' all")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="vLLM's AsyncScheduler, stepped as its engine core's batch queue steps it: the "
                             "next batch is scheduled before the last one's output is processed")
    parser.add_argument("--early-stops", action="store_true",
                        help="every other request ends on a stop token vLLM sees only in a step's output, "
                             "not at max_tokens, which vLLM's scheduler sees coming")
    parser.add_argument("--counter-contends", action="store_true",
                        help="let kvledger's miss counter fold whenever its thread gets the interpreter, not in "
                             "the simulated forward: every step CPU-bound, its work may land in any run's calls")
    parser.add_argument("--prompt-tokens", default="1024-8192", help="prompt lengths, drawn uniformly: LO-HI")
    parser.add_argument("--connectors", default="kvledger,vllm-offloading,vllm-simple-cpu")
    parser.add_argument("--event-log", default=str(HERE / "out" / "scheduler_overhead.kvlog"),
                        help="where kvledger-logged writes its event log (replaced if there)")
    parser.add_argument("--disk-dir", default=str(HERE / "out"),
                        help="where the -fs connectors' file-system tiers go (a fresh folder in it, removed after)")
    parser.add_argument("--disk-blocks", type=int, default=None,
                        help="kvledger-fs's disk tier in blocks (default 8x device); vLLM's fs tier has no bound")
    parser.add_argument("--out", default=str(HERE / "out" / "scheduler_overhead.json"))
    args = parser.parse_args()
    low, _, high = args.prompt_tokens.partition("-")
    if not (low.isdigit() and high.isdigit() and 256 < int(low) <= int(high)):
        parser.error(f"--prompt-tokens wants LO-HI with 256 < LO <= HI, not {args.prompt_tokens!r}")
    prompt_tokens = (int(low), int(high))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from kvledger.adapters.testing.tiny_models import build_model

    model = build_model("tiny-gemma3", HERE / "out" / "models")
    capacity_bytes = tier_bytes(args.tier_blocks or 4 * args.device_blocks)
    trace = Trace(args.seed, prompt_tokens)
    if "kvledger-logged" in args.connectors.split(","):
        Path(args.event_log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.event_log).unlink(missing_ok=True)
    Path(args.disk_dir).mkdir(parents=True, exist_ok=True)
    disk = Path(tempfile.mkdtemp(prefix="scheduler-overhead-tiers-", dir=args.disk_dir))
    try:
        measure(args, model, capacity_bytes, trace, disk, prompt_tokens)
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def measure(args, model: Path, capacity_bytes: int, trace: Trace, disk: Path, prompt_tokens: tuple[int, int]) -> None:
    runs: list[Run] = []
    failed: dict[str, str] = {}
    disk_bytes = tier_bytes(args.disk_blocks or 8 * args.device_blocks)
    configs = connector_configs(capacity_bytes, args.event_log, disk, disk_bytes)
    for name, (kv_transfer, worker_cls) in configs.items():
        if name not in args.connectors.split(","):
            continue
        try:
            scheduler, hasher = build_scheduler(
                model, kv_transfer, device_blocks=args.device_blocks, concurrency=args.requests,
                retention_interval=None if args.retention_interval == "dense" else int(args.retention_interval),
                async_scheduling=args.async_scheduling, max_prompt_tokens=prompt_tokens[1])
        except Exception as error:  # reported, not hidden: the benchmark says why a connector is missing
            failed[name] = f"{type(error).__name__}: {error}"
            print(f"{name}: cannot be built: {failed[name]}", file=sys.stderr)
            continue
        run = Run(name, scheduler, hasher, worker_cls(args.delay_steps), trace, args.requests,
                  depth=scheduler.vllm_config.max_concurrent_batches, early_stops=args.early_stops)
        if name.startswith("kvledger"):
            from kvledger.adapters.vllm import scheduler_side

            if not isinstance(scheduler_side._log, ViolationCounter):
                ViolationCounter(scheduler_side)
            run.violations = scheduler_side._log  # one count for every kvledger run
        run.settle_counter = not args.counter_contends
        runs.append(run)
        print(f"{name}: {type(scheduler.connector).__name__}, tier {tier_slots(name, scheduler.connector)} blocks, "
              f"device pool {scheduler.kv_cache_config.num_blocks} blocks", flush=True)

    if not runs:
        sys.exit("no connector could be built")
    gc.collect()
    gc.freeze()
    collector = CollectorClock()
    start = time.perf_counter()
    for step in range(args.steps):
        shift = step % len(runs)
        for run in runs[shift:] + runs[:shift]:  # a rotating order: no connector always runs first
            collector.run = run
            run.step()
            collector.run = None
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}: " + ", ".join(
                f"{r.name} {statistics.median(r.connector_ms):.2f} ms" for r in runs), flush=True)
    elapsed = time.perf_counter() - start

    summaries = {run.name: run.summary() for run in runs}
    for name, prefixes in TIER_THREADS.items():
        if name in summaries:
            seconds = [thread_cpu_seconds(prefix, prefix=True) for prefix in prefixes]
            summaries[name]["tier_threads_cpu_ms_per_step"] = sum(s or 0.0 for s in seconds) * 1e3 / args.steps
    for run in runs:  # vLLM 0.33's tiering removes its shared-memory region and stops its threads here
        run.scheduler.shutdown()
    base = summaries.get("vllm-offloading")
    if base is not None:
        for summary in summaries.values():
            summary["ratio_to_vllm_offloading"] = {
                k: summary["connector_ms_per_step"][k] / base["connector_ms_per_step"][k]
                for k in ("median", "p99", "mean")}
    writer_s = thread_cpu_seconds("kvledger-log")
    if "kvledger" in summaries and "kvledger-logged" in summaries:
        plain, logged = (summaries[n]["connector_ms_per_step"] for n in ("kvledger", "kvledger-logged"))
        logged_run = summaries["kvledger-logged"]
        logged_run["log_cost"] = {k: logged[k] / plain[k] - 1 for k in ("median", "p99", "mean")}
        if writer_s is not None:
            logged_run["log_writer_cpu_ms_per_step"] = writer_s * 1e3 / args.steps
            logged_run["log_cost"]["mean_with_writer_cpu"] = (
                (logged["mean"] + writer_s * 1e3 / args.steps) / plain["mean"] - 1)
    for run in runs:
        misses = getattr(getattr(run.scheduler.connector, "scheduler", None), "_misses", None)
        if misses is not None:
            misses.settle()
            summaries[run.name]["miss_counter_stopped"] = misses.stopped
            summaries[run.name]["miss_counter_cpu_ms_per_step"] = misses.cpu_seconds * 1e3 / args.steps
            if misses.stopped:
                print(f"{run.name}: its miss counter stopped: {misses.stopped}")
    if "kvledger" in summaries and "kvledger-uncounted" in summaries:
        counted, uncounted = (summaries[n]["connector_ms_per_step"] for n in ("kvledger", "kvledger-uncounted"))
        cost = {k: counted[k] / uncounted[k] - 1 for k in ("median", "p99", "mean")}
        counted_step, uncounted_step = (summaries[n]["scheduler_ms_per_step"]
                                        for n in ("kvledger", "kvledger-uncounted"))
        cost["whole_step_mean"] = counted_step["mean"] / uncounted_step["mean"] - 1
        summaries["kvledger"]["miss_counter_cost"] = cost
    report = {
        "args": vars(args), "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(), "wall_seconds": elapsed, "not_built": failed,
        "connectors": summaries,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_table(summaries)
    for name, why in failed.items():
        print(f"{name}: not run: {why}")
    for name, s in summaries.items():
        if s.get("protocol_violations"):
            print(f"{name}: {s['protocol_violations']} protocol violations {s['violation_codes']}: its engine "
                  "rejected those events, so its numbers come from a run that went wrong")
    cost = summaries.get("kvledger-logged", {}).get("log_cost")
    if cost:
        print(f"event log cost (kvledger-logged / kvledger - 1): median {cost['median']:+.1%}, "
              f"p99 {cost['p99']:+.1%}, mean {cost['mean']:+.1%} (target <= 5%)")
        if "mean_with_writer_cpu" in cost:
            print(f"  the log writer's thread used {summaries['kvledger-logged']['log_writer_cpu_ms_per_step']:.3f} "
                  f"ms CPU per step: mean {cost['mean_with_writer_cpu']:+.1%} counting it too")
    if "kvledger-uncounted" in summaries and "kvledger-uncounted-twin" in summaries:
        a, b = (summaries[n]["connector_ms_per_step"] for n in ("kvledger-uncounted", "kvledger-uncounted-twin"))
        spread = {k: b[k] / a[k] - 1 for k in ("median", "p99", "mean")}
        summaries["kvledger-uncounted-twin"]["spread_to_uncounted"] = spread
        print(f"two identical rows (kvledger-uncounted-twin / kvledger-uncounted - 1): median {spread['median']:+.1%}, "
              f"p99 {spread['p99']:+.1%}, mean {spread['mean']:+.1%}: the spread a difference must clear")
    cost = summaries.get("kvledger", {}).get("miss_counter_cost")
    if cost:
        print(f"miss counter cost (kvledger / kvledger-uncounted - 1): median {cost['median']:+.1%}, "
              f"p99 {cost['p99']:+.1%}, mean {cost['mean']:+.1%} (target <= 3% of the median); the whole "
              f"scheduler step's mean {cost['whole_step_mean']:+.1%}; the counter's thread used "
              f"{summaries['kvledger']['miss_counter_cpu_ms_per_step']:.3f} ms CPU per step")
        fold = summaries["kvledger"].get("miss_fold_ms_per_step")
        if fold:
            print(f"  its fold, waited for where the model runs: {fold['median']:.3f} ms median, {fold['p99']:.3f} "
                  f"p99, {fold['mean']:.3f} mean a step (a forward of the model must take longer to hide it)")
    if "kvledger-fs" in summaries and "vllm-tiering-fs" in summaries:
        ours, theirs = (summaries[n]["connector_ms_per_step"] for n in ("kvledger-fs", "vllm-tiering-fs"))
        print(f"with a disk tier, kvledger-fs / vllm-tiering-fs: median {ours['median'] / theirs['median']:.2f}x, "
              f"mean {ours['mean'] / theirs['mean']:.2f}x (target <= 0.5x)")
    for name in TIER_THREADS:
        if name in summaries:
            print(f"  {name}: its tier's threads in the scheduler's process used "
                  f"{summaries[name]['tier_threads_cpu_ms_per_step']:.3f} ms CPU per step")
    print(f"wall {elapsed:.0f} s; raw numbers in {out}")


def print_table(summaries: dict) -> None:
    print(f"{'connector':<18}{'median ms':>10}{'p99 ms':>9}{'max ms':>9}{'mean ms':>9}{'ratio med':>10}{'hit tokens':>12}"
          f"{'local hit':>12}{'computed':>11}{'preempt':>8}{'finished':>9}{'sched ms':>9}")
    for name, s in summaries.items():
        c = s["connector_ms_per_step"]
        ratio = s.get("ratio_to_vllm_offloading", {}).get("median", float("nan"))
        print(f"{name:<18}{c['median']:>10.3f}{c['p99']:>9.3f}{c['max']:>9.3f}{c['mean']:>9.3f}{ratio:>10.2f}"
              f"{s.get('hit_tokens', 0):>12,}{s.get('local_hit_tokens', 0):>12,}{s.get('tokens_computed', 0):>11,}"
              f"{s.get('preemptions', 0):>8}"
              f"{s.get('requests_finished', 0):>9}{s['scheduler_ms_per_step']['median']:>9.2f}")
    for name, s in summaries.items():
        top = ", ".join(f"{k} {v:.3f}" for k, v in list(s["method_ms_per_step"].items())[:4])
        print(f"  {name}: ms per step by method: {top}")
    for name, s in summaries.items():
        c = s["collections"]
        print(f"  {name}: cyclic collector: {c.get('step', 0)} collections in its steps "
              f"({c.get('step_ms', 0.0):.0f} ms), {c.get('in_calls', 0)} inside its calls ({c.get('in_calls_ms', 0.0):.0f} ms); "
              f"{s['slowest_with_collection']} of the slowest 1% of steps had one inside its calls; p99 without "
              f"them {s['without_collector_ms_per_step']['p99']:.3f} ms")
    for name, s in summaries.items():
        per_token = s["slowest_us_per_hit_token"]
        print(f"  {name}: the slowest 1% of steps admitted {s['slowest_hit_tokens_per_step']['median']:,.0f} hit "
              f"tokens a step (median; most {s['slowest_hit_tokens_per_step']['max']:,}), "
              + (f"{per_token:.2f} us of the connector's time a hit token" if per_token else "no hit"))


if __name__ == "__main__":
    main()
