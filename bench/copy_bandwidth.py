"""Block copy bandwidth: the transfer backends' gather/scatter vs one contiguous copy_.

On CPU, for each page size, N blocks move between a "device" int8 tensor
(host memory, as vLLM-CPU keeps its KV cache) and the host tier, through
the real backend (CpuBackend). Beside each
it times a single contiguous `copy_` of the same number of bytes, interleaved
repetition by repetition so both see the same machine, and prints the ratio.

Id patterns: "scattered" draws random device blocks and random slots, each
from twice as many rows as are copied (no block and slot both continue the
previous pair); "slot runs" keeps random device blocks but consecutive slots,
as a store into a fresh stretch of the tier sees.

On CPU the copies are timed in the calling thread, like the baseline, with
the backend's own copy routine (`CpuBackend.copy_now`), each after a pause
(`--settle-ms`) in which the OpenMP workers of the op before it stop
spinning: libgomp keeps them spinning for some milliseconds after every
parallel op, and a copy that uses threads of its own shares their cores
meanwhile. The column "after a parallel op" times the scattered store right
after one, as a copy right after a forward pass runs in vLLM-CPU. The column
"via worker" goes through submit/wait on the backend's thread, which copies
with one thread. The column "others" says how many cores other processes
used meanwhile (a shared machine slows every column, and the copies that use
threads of their own most); `--max-others` measures a page size again until
that stays below a bound.

On CUDA (`--device cuda`) the layouts are real ones instead: per layer a
FlashAttention tensor `(2, num_blocks, block_size, kv_heads, head_size)`,
so a block is two spans (K and V) per layer, 2 x layers spans in all, as a
vLLM GPU worker registers them (`--layouts`, as layers x kv_heads x
head_size x block_size, bf16). Each copy is timed on the device by the
backend's own CUDA events (start recorded on the copy stream once it has
waited for the compute stream, end after the last copy): the GB/s are
device time. The host's submit time (descriptor building, launches) is a
column of its own. Every copy path runs where it can: kvledger's torch path
(staging), vLLM's `swap_blocks_batch` (when the installed vLLM ships it), the
driver's `cuMemcpyBatchAsync`, and the Triton kernel (a column set for each
`--programs`). The baseline is one contiguous `copy_` of the same bytes,
timed with CUDA events too. The "both" columns run a store and a load at
once, on the backend's two streams, against two contiguous `copy_`s on two
streams: bytes of both directions over the wall time.

    python bench/copy_bandwidth.py [--device cpu|cuda] [--total-mib 256] [--repeats 7] [--settle-ms 30]
                                   [--max-others 0.1] [--layouts 32x8x128x16 ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time

import structlog
import torch

from kvledger.transfers.copies.backend import CopyJob, Direction
from kvledger.transfers.copies.driver_copy import driver_batch_copy
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import CanonicalKVCaches, CanonicalRef, CanonicalTensor, CopySpan
from kvledger.transfers.copies.triton_copy import PROGRAMS, triton_batch_copy

PAGES_KIB = (16, 64, 256, 1024, 2048)


def single_span_layout(rows: torch.Tensor) -> CanonicalKVCaches:
    """One canonical tensor, one group, whole rows: the copy path with nothing else around it."""
    page = rows.shape[1]
    return CanonicalKVCaches(
        num_blocks=rows.shape[0],
        tensors=(CanonicalTensor(tensor=rows, page_size_bytes=page, block_stride_bytes=page),),
        group_refs=((CanonicalRef(layer_name="bench", tensor_index=0, offset_bytes=0, page_size_bytes=page,
                                  payload_bytes=page),),),
        group_spans=((CopySpan(tensor_index=0, row_offset=0, slot_offset=0, nbytes=page),),),
    )


def make_backend(layout: CanonicalKVCaches, tier: HostTier):
    from kvledger.transfers.copies.cpu_backend import CpuBackend

    return CpuBackend(layout, tier)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved(cases: dict, repeats: int, device: torch.device, settle_s: float = 0.0) -> dict[str, list]:
    """Round after round, each case once, so drifts in machine speed hit all alike.
    A case is a function, or (untimed function run just before, timed function)."""
    cases = {name: case if isinstance(case, tuple) else (None, case) for name, case in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _, fn in cases.values():  # warm up
        fn()
    for _ in range(repeats):
        for name, (before, fn) in cases.items():
            time.sleep(settle_s)
            if before is not None:
                before()
            samples[name].append(timed(fn, device))
    return samples


def others_cpu_seconds() -> float | None:
    """CPU seconds all other processes have used so far (Linux), to tell a shared machine."""
    try:
        with open("/proc/stat") as stat:
            user, nice, system, _, _, irq, softirq, steal = (int(x) for x in stat.readline().split()[1:9])
        with open("/proc/self/stat") as own:
            utime, stime = (int(x) for x in own.read().rsplit(")", 1)[1].split()[11:13])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal - utime - stime) / os.sysconf("SC_CLK_TCK")


def measure(device: torch.device, page: int, total: int, repeats: int, settle_s: float) -> dict[str, float]:
    n = max(1, total // page)
    pool = 2 * n + 1
    rows = torch.empty((pool, page), dtype=torch.int8, device=device).random_(-128, 127)
    tier = HostTier(capacity_bytes=pool * page, slot_bytes=page)
    tier.rows.random_(-128, 127)
    backend = make_backend(single_span_layout(rows), tier)
    g = torch.Generator().manual_seed(page)
    scattered_blocks = (torch.randperm(pool - 1, generator=g)[:n] + 1).tolist()
    scattered_slots = torch.randperm(tier.num_slots, generator=g)[:n].tolist()
    first = int(torch.randint(0, tier.num_slots - n + 1, (), generator=g))
    run_slots = list(range(first, first + n))
    contiguous_src, contiguous_dst = rows[:n], tier.rows[:n]
    contiguous_back = rows[n : 2 * n]
    job_ids = iter(range(1, 1 << 30))

    def job(direction: Direction, blocks, slots, *, threaded: bool = False):
        def run() -> None:
            copy = CopyJob(job_id=next(job_ids), direction=direction, block_ids=[blocks], slot_ids=[slots])
            if device.type == "cpu" and not threaded:
                backend.copy_now(copy)
                return
            backend.submit(copy)
            backend.wait([copy.job_id], 600)
            outcomes = backend.poll()
            assert outcomes and all(o.ok for o in outcomes), outcomes
        return run

    cases = {
        "copy_ to host": lambda: contiguous_dst.copy_(contiguous_src, non_blocking=True),
        "copy_ to device": lambda: contiguous_back.copy_(contiguous_dst, non_blocking=True),
        "store scattered": job(Direction.STORE, scattered_blocks, scattered_slots),
        "store slot runs": job(Direction.STORE, scattered_blocks, run_slots),
        "load scattered": job(Direction.LOAD, scattered_blocks, scattered_slots),
    }
    spin = torch.ones(1 << 20)
    cases["store scattered after a parallel op"] = (lambda: spin.add_(1), cases["store scattered"])
    nbytes = n * page
    gbps = lambda times: nbytes / statistics.median(times) / 1e9  # noqa: E731
    samples = interleaved(cases, repeats, device, settle_s)
    results = {"blocks": n, **{name: gbps(t) for name, t in samples.items()}}
    ratios = {
        name: results[name] / results["copy_ to device" if name.startswith("load") else "copy_ to host"]
        for name in samples
        if not name.startswith("copy_")
    }
    if device.type == "cpu":
        # A phase of its own: the worker's OpenMP team would slow what runs after it.
        worker = interleaved(
            {
                "copy_ to host": cases["copy_ to host"],
                "via worker": job(Direction.STORE, scattered_blocks, scattered_slots, threaded=True),
            },
            repeats,
            device,
            settle_s,
        )
        results["store scattered via worker"] = gbps(worker["via worker"])
        ratios["store scattered via worker"] = gbps(worker["via worker"]) / gbps(worker["copy_ to host"])
    backend.shutdown(drain=True, timeout_s=60)
    tier.close()
    return {"results": results, "ratios": ratios}


def describe(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} intra-op threads)")
    if device.type == "cuda":
        text += f", GPU {torch.cuda.get_device_name(device)}"
    return text


CUDA_LAYOUTS = ("32x8x128x16", "32x8x128x64", "4x8x128x16")
"""layers x kv_heads x head_size x block_size: Llama-3-8B's KV with vLLM's default block of 16
tokens (64 spans of 32 KiB), the same with 64-token blocks (64 spans of 128 KiB), a 4-layer model."""


def flash_layout(spec: str, num_blocks: int, device: torch.device) -> CanonicalKVCaches:
    """A FlashAttention KV cache as a vLLM GPU worker registers it: one tensor per layer."""
    from kvledger.transfers.copies.kv_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from kvledger.transfers.copies.layout import canonicalize

    layers, heads, head, block = (int(x) for x in spec.split("x"))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    kv_caches = {name: torch.empty((2, num_blocks, block, heads, head), dtype=torch.bfloat16, device=device)
                 for name in names}
    for tensor in kv_caches.values():
        tensor.view(torch.int16).random_(-(1 << 15), 1 << 15)
    attention = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=num_blocks,
                           kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=attention)])
    return canonicalize(kv_caches, config)


def batch_copy_of_installed_vllm():
    """vLLM's `swap_blocks_batch`, as the connector finds it, or None."""
    try:
        from kvledger.adapters.vllm.batch_copy import vllm_batch_copy
    except Exception:  # no vLLM, or one kvledger refuses
        return None
    probe = {"probe": torch.empty(1, device="cuda")}
    return vllm_batch_copy(probe)


def event_seconds(fn) -> float:
    """Device time of what `fn` queues on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure_cuda(spec: str, total: int, repeats: int, device: torch.device | None = None,
                 programs: tuple[int, ...] = (PROGRAMS,)) -> dict:
    from kvledger.transfers.copies.cuda_backend import CudaBackend

    device = device or torch.device("cuda")
    block_bytes = flash_layout(spec, 1, device).slot_bytes
    n = max(1, total // block_bytes)
    pool = 2 * n + 1
    layout = flash_layout(spec, pool, device)
    spans = len(layout.group_spans[0])
    tier = HostTier(capacity_bytes=pool * -(-layout.slot_bytes // 64) * 64, slot_bytes=layout.slot_bytes)
    tier.rows.random_(-128, 127)
    paths = {"torch": CudaBackend(layout, tier)}
    batch = batch_copy_of_installed_vllm()
    if batch is not None:
        paths["vLLM batch"] = CudaBackend(layout, tier, batch_copy=batch)
    driver = driver_batch_copy()
    if driver is not None:
        paths["driver batch"] = CudaBackend(layout, tier, batch_copy=driver)
    for grid in programs:
        kernel = triton_batch_copy(programs=grid)
        if kernel is not None:
            paths[f"triton x{grid}"] = CudaBackend(layout, tier, batch_copy=kernel)
    g = torch.Generator().manual_seed(n)
    blocks = (torch.randperm(pool - 1, generator=g)[:n] + 1).tolist()
    slots = torch.randperm(tier.num_slots, generator=g)[:n].tolist()
    first = int(torch.randint(0, tier.num_slots - n + 1, (), generator=g))
    runs = list(range(first, first + n))
    others = sorted(set(range(1, pool)) - set(blocks))  # the load beside a store writes other blocks
    nbytes = n * sum(span.nbytes for span in layout.group_spans[0])
    flat_device = torch.empty(nbytes, dtype=torch.int8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.int8).pin_memory()
    back_device = torch.empty(nbytes, dtype=torch.int8, device=device)
    back_host = torch.empty(nbytes, dtype=torch.int8).pin_memory()
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    job_ids = iter(range(1, 1 << 30))

    def job(backend, direction: Direction, slot_ids):
        def run() -> tuple[float, float]:
            copy = CopyJob(job_id=next(job_ids), direction=direction, block_ids=[blocks], slot_ids=[slot_ids])
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            backend.submit(copy)
            submitted = time.perf_counter() - started
            torch.cuda.synchronize(device)
            (outcome,) = backend.poll()
            assert outcome.ok, outcome
            return outcome.seconds, submitted
        return run

    def both(backend):
        """A store and a load at once, on the backend's two streams: wall time from the first
        submit to both done (the load reads slots the store may be writing; timing only)."""
        def run() -> tuple[float, float]:
            store = CopyJob(job_id=next(job_ids), direction=Direction.STORE, block_ids=[blocks], slot_ids=[runs])
            load = CopyJob(job_id=next(job_ids), direction=Direction.LOAD, block_ids=[others], slot_ids=[slots])
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            backend.submit(store)
            backend.submit(load)
            submitted = time.perf_counter() - started
            torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - started
            outcomes = backend.poll()
            assert len(outcomes) == 2 and all(o.ok for o in outcomes), outcomes
            return elapsed, submitted
        return run

    def both_copy_() -> tuple[float, float]:
        """The baseline of `both`: one contiguous copy_ each way, on two streams, timed alike."""
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            flat_host.copy_(flat_device, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            back_device.copy_(back_host, non_blocking=True)
        torch.cuda.synchronize(device)
        return time.perf_counter() - started, 0.0

    cases = {
        "copy_ to host": lambda: (event_seconds(lambda: flat_host.copy_(flat_device, non_blocking=True)), 0.0),
        "copy_ to device": lambda: (event_seconds(lambda: flat_device.copy_(flat_host, non_blocking=True)), 0.0),
        "copy_ both": both_copy_,
    }
    for path, backend in paths.items():
        cases[f"store scattered, {path}"] = job(backend, Direction.STORE, slots)
        cases[f"store slot runs, {path}"] = job(backend, Direction.STORE, runs)
        cases[f"load scattered, {path}"] = job(backend, Direction.LOAD, slots)
        cases[f"both, {path}"] = both(backend)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for fn in cases.values():  # warm up
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            samples[name].append(fn())
    moved = {name: 2 * nbytes if "both" in name else nbytes for name in cases}
    results = {name: moved[name] / statistics.median(t for t, _ in s) / 1e9 for name, s in samples.items()}
    submit_us = {name: statistics.median(h for _, h in s) * 1e6 for name, s in samples.items()}
    for backend in paths.values():
        backend.shutdown(drain=True, timeout_s=60)
    tier.close()
    return {"layout": spec, "spans": spans, "span_bytes": layout.group_spans[0][0].nbytes, "blocks": n,
            "results": results, "submit_us": submit_us}


def main_cuda(args) -> None:
    print(f"machine: {describe(torch.device('cuda'))}")
    print(f"device: cuda; {args.total_mib} MiB per copy and direction; median of {args.repeats}; GB/s = 1e9 "
          f"bytes/s of device time (CUDA events), except 'both': bytes of both directions over the wall time "
          f"from the first submit to both done; submit: host time of the backend's submit, median")
    rows = [measure_cuda(spec, args.total_mib << 20, args.repeats, programs=tuple(args.programs))
            for spec in args.layouts]
    names = list(rows[0]["results"])
    header = ["layout", "spans x bytes", "blocks", *names]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        results, submit = row["results"], row["submit_us"]
        cells = [row["layout"], f"{row['spans']} x {row['span_bytes']}", str(row["blocks"])]
        for name in names:
            if name.startswith("copy_"):
                cells.append(f"{results[name]:.1f}")
                continue
            base = results["copy_ both" if name.startswith("both") else
                           "copy_ to device" if name.startswith("load") else "copy_ to host"]
            cells.append(f"{results[name]:.1f} ({results[name] / base:.2f}x; submit {submit[name]:.0f} us)")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per timed copy")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pages-kib", type=int, nargs="*", default=list(PAGES_KIB))
    parser.add_argument("--settle-ms", type=float, default=30.0,
                        help="CPU: pause before each timed copy, for the last op's OpenMP threads to stop")
    parser.add_argument("--max-others", type=float, default=None,
                        help="measure a page size again (up to --tries times) while other processes "
                             "used more than this many cores meanwhile")
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--layouts", nargs="*", default=list(CUDA_LAYOUTS),
                        help="CUDA: layers x kv_heads x head_size x block_size, one table row each")
    parser.add_argument("--programs", type=int, nargs="*", default=[PROGRAMS],
                        help="CUDA: grid sizes of the Triton copy path, one column set each")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    device = torch.device(args.device)
    if device.type == "cuda":
        main_cuda(args)
        return
    print(f"machine: {describe(device)}")
    print(f"device: {device}; {args.total_mib} MiB per copy; median of {args.repeats}; GB/s = 1e9 bytes/s")
    rows = []
    for page_kib in args.pages_kib:
        for _ in range(args.tries):
            others, started, busy = others_cpu_seconds(), time.perf_counter(), None
            result = measure(device, page_kib << 10, args.total_mib << 20, args.repeats, args.settle_ms / 1e3)
            if others is not None:
                busy = max(0.0, others_cpu_seconds() - others) / (time.perf_counter() - started)
            if args.max_others is None or busy is None or busy <= args.max_others:
                break
            print(f"{page_kib} KiB: other processes used {busy:.2f} cores meanwhile; again", flush=True)
        rows.append((page_kib, busy, result))
    names = [k for k in rows[0][2]["results"] if k != "blocks"]
    header = ["page", "blocks", *(n if n.startswith("copy_") else f"{n} (ratio)" for n in names), "others"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for page_kib, busy, measured in rows:
        results, ratios = measured["results"], measured["ratios"]
        cells = [f"{page_kib} KiB", str(results["blocks"])]
        for name in names:
            cell = f"{results[name]:.1f}"
            cells.append(cell if name not in ratios else f"{cell} ({ratios[name]:.2f}x)")
        cells.append("?" if busy is None else f"{busy:.2f}")
        print("| " + " | ".join(cells) + " |")
    print(f"others: cores that other processes used meanwhile, of {os.cpu_count()}")


if __name__ == "__main__":
    main()
