"""The file-system tier's I/O (`FsTierIO`) against raw sequential I/O of the same bytes on the same disk.

For each block size, N blocks (about `--total-mib` in all) of a host-tier-like int8 tensor:

  raw write   the same bytes into one file, 16 MiB writes, then `os.sync()`
  raw direct write  the same, with O_DIRECT (the bytes are page-aligned), then `fsync`: the disk's own
              sequential speed, steadier than the page cache's writeback, and what the tier's direct
              writes are compared with (its buffered writes with the raw write)
  tier write  `FsTierIO.write` of the N blocks as `--jobs` jobs, then `os.sync()`; per thread count,
              with O_DIRECT writes and through the page cache (`direct_writes=False`), and per
              layout (`--pack-kib`): a file per block ("files", 0) or a job's blocks in packs
              of up to that many KiB (`block_pack`)
  raw read    the one file, 16 MiB reads, from a dropped page cache
  tier read   `FsTierIO.read` of the N blocks into their rows, from a dropped page cache
  direct read the same block files read with O_DIRECT (each thread its page-aligned bounce buffer,
              header and XXH3 checked, then copied into the row), on as many threads: the tier does
              not read this way, this is the measurement that says why

Every measurement is repeated `--rounds` times, alternating, and the median reported, in GB/s
(1e9 bytes), with the ratio to the raw side. The page cache is dropped (`/proc/sys/vm/drop_caches`,
as root) before each read; where that fails the output says the reads were warm. The last line is
JSON. Other processes' CPU use is sampled for 2 s before and after (I/O of our own would count as
theirs while we run: kernel writeback), to tell a shared machine. tmpfs and ramfs are refused: the
numbers would be memory's.

    python bench/fs_tier_io.py [--dir DIR] [--total-mib 1024] [--block-kib 256 2048] [--threads 4 8 16]
                               [--jobs 4] [--rounds 3] [--pack-kib 0 2048]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import structlog
import torch
import xxhash
from fs_block_io import drop_caches  # the sibling script (bench/ is on sys.path when run)

from kvledger.transfers.lower_tiers.block_header import _FIXED, HEADER_BYTES, check_header
from kvledger.transfers.lower_tiers.fs.block_file import block_path
from kvledger.transfers.lower_tiers.fs.tier import DIRECT_ALIGN, FsTierIO

NAMESPACE = bytes(range(16))
CHUNK = 16 << 20


def file_system(path: str) -> str:
    """The type of the mount holding `path` (longest mount point that prefixes it)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            point, fstype = fields[4], fields[fields.index("-") + 1]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fstype
    return kind


def others_busy(window_s: float = 2.0) -> float | None:
    """Cores other processes kept busy over `window_s` (Linux)."""

    def sample() -> float:
        with open("/proc/stat") as stat:
            user, nice, system, _, _, irq, softirq, steal = (int(x) for x in stat.readline().split()[1:9])
        with open("/proc/self/stat") as own:
            utime, stime = (int(x) for x in own.read().rsplit(")", 1)[1].split()[11:13])
        return (user + nice + system + irq + softirq + steal - utime - stime) / os.sysconf("SC_CLK_TCK")

    try:
        before = sample()
        time.sleep(window_s)
        return round((sample() - before) / window_s, 2)
    except (OSError, ValueError):
        return None


def raw_write(path: str, flat: memoryview, *, direct: bool = False) -> float:
    """Through the page cache, then `os.sync()`; `direct`: with O_DIRECT (`flat` page-aligned), then `fsync`."""
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for offset in range(0, flat.nbytes, CHUNK):
            chunk = flat[offset : offset + CHUNK]
            while chunk.nbytes:
                chunk = chunk[os.write(fd, chunk):]
        if direct:
            os.fsync(fd)
    finally:
        os.close(fd)
    if not direct:
        os.sync()
    return time.perf_counter() - started


def raw_read(path: str, flat: memoryview) -> float:
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        offset = 0
        while offset < flat.nbytes:
            count = file.readinto(flat[offset : offset + CHUNK])
            assert count, "the raw file is short"
            offset += count
    return time.perf_counter() - started


def tier_job(io: FsTierIO, kind: str, count: int, jobs: int, first_job: int) -> float:
    keys = [index.to_bytes(32, "big") for index in range(count)]
    bounds = [count * j // jobs for j in range(jobs + 1)]
    started = time.perf_counter()
    for j in range(jobs):
        ids = range(bounds[j], bounds[j + 1])
        getattr(io, kind)(first_job + j, (tuple(keys[i] for i in ids),), (tuple(ids),))
    io.wait(range(first_job, first_job + jobs), 600)
    if kind == "write":
        os.sync()
    seconds = time.perf_counter() - started
    failed = [o for o in io.poll() if not o.ok]
    assert not failed, f"tier {kind} failed: {failed[0].reasons[:3]} ..."
    return seconds


def direct_read(root: str, rows: torch.Tensor, threads: int) -> float:
    array, size = rows.numpy(), rows.shape[1]
    padded = -(-(HEADER_BYTES + size) // DIRECT_ALIGN) * DIRECT_ALIGN
    local = threading.local()

    def read_one(index: int) -> None:
        if not hasattr(local, "bounce"):
            local.bounce = mmap.mmap(-1, padded)
        key = index.to_bytes(32, "big")
        path = block_path(root, NAMESPACE, key)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = os.readv(fd, [local.bounce])
        finally:
            os.close(fd)
        staged = memoryview(local.bounce)
        assert got == HEADER_BYTES + size, f"{path}: {got} bytes"
        header = bytes(staged[:HEADER_BYTES])
        check_header(path, header, NAMESPACE, key, size)
        target = memoryview(array[index]).cast("B")
        target[:] = staged[HEADER_BYTES : HEADER_BYTES + size]
        assert xxhash.xxh3_64_intdigest(target) == _FIXED.unpack_from(header)[6], f"{path}: checksum"

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_one, range(rows.shape[0])))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                        help="a folder on the disk to measure (default: bench/out); a temporary folder goes in it")
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--block-kib", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--threads", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--jobs", type=int, default=4, help="the tier's N blocks go as this many jobs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pack-kib", type=int, nargs="+", default=[0, 2048],
                        help="the tier's layouts: 0 a file per block, else packs of up to this many KiB")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    os.makedirs(args.dir, exist_ok=True)
    fstype = file_system(args.dir)
    if fstype in ("tmpfs", "ramfs"):
        parser.error(f"{args.dir} is on {fstype}: that measures memory, not a disk")
    base = tempfile.mkdtemp(prefix="kvledger-fs-tier-bench-", dir=args.dir)
    busy_before = others_busy()
    cold = drop_caches()
    print(f"dir {base} ({fstype}), {args.total_mib} MiB per measurement, {args.jobs} jobs per tier pass, "
          f"median of {args.rounds}; "
          f"{'cold reads (page cache dropped)' if cold else 'WARM reads: cannot drop the page cache (not root?)'}; "
          f"other processes used {busy_before} cores before the run, of {os.cpu_count()}")
    total = args.total_mib << 20
    backing = mmap.mmap(-1, total)  # page-aligned, so the raw direct write takes it as it is
    flat_array = np.frombuffer(backing, dtype=np.int8)
    flat_array[:] = np.random.default_rng(0).integers(-128, 128, total, dtype=np.int8)
    flat = memoryview(backing)
    results = []
    try:
        for block_kib in args.block_kib:
            size = block_kib << 10
            count = total // size
            rows = torch.from_numpy(flat_array[: count * size]).view(count, size)
            samples = {i: xxhash.xxh3_64_intdigest(flat_array[i * size : (i + 1) * size])
                       for i in range(0, count, max(1, count // 64))}
            layouts = {kib: "files" if kib == 0 else f"packs{kib}k" for kib in args.pack_kib}
            names = (["raw write", "raw direct write"] + [f"tier write {t}t {m} {lay}" for lay in layouts.values() for t in args.threads
                                      for m in ("direct", "buffered")]
                     + ["raw read"] + [f"tier read {t}t {lay}" for lay in layouts.values() for t in args.threads]
                     + ([f"direct read {t}t files" for t in args.threads] if 0 in layouts else []))
            runs: dict[str, list[float]] = {name: [] for name in names}
            raw_path, root = os.path.join(base, "raw.bin"), os.path.join(base, "tier")
            job_id = 0
            for _ in range(args.rounds):
                runs["raw write"].append(raw_write(raw_path, flat[: count * size]))
                runs["raw direct write"].append(raw_write(raw_path, flat[: count * size], direct=True))
                drop_caches()
                runs["raw read"].append(raw_read(raw_path, flat[: count * size]))
                for kib, lay in layouts.items():
                    for threads in args.threads:
                        for mode in ("direct", "buffered"):
                            shutil.rmtree(root, ignore_errors=True)
                            os.sync()
                            io = FsTierIO(root=root, namespace=NAMESPACE, rows=rows, payload_bytes=(size,),
                                          threads=threads, direct_writes=mode == "direct", pack_bytes=kib << 10)
                            runs[f"tier write {threads}t {mode} {lay}"].append(
                                tier_job(io, "write", count, args.jobs, job_id))
                            assert io.direct_writes == (mode == "direct"), "O_DIRECT was refused here"
                            io.shutdown()
                            job_id += args.jobs
                    for threads in args.threads:
                        io = FsTierIO(root=root, namespace=NAMESPACE, rows=rows, payload_bytes=(size,),
                                      threads=threads, pack_bytes=kib << 10)
                        rows.zero_()
                        drop_caches()
                        runs[f"tier read {threads}t {lay}"].append(tier_job(io, "read", count, args.jobs, job_id))
                        io.shutdown()
                        job_id += args.jobs
                        assert all(xxhash.xxh3_64_intdigest(flat_array[i * size : (i + 1) * size]) == digest
                                   for i, digest in samples.items()), "a tier read returned other bytes"
                    if kib == 0:
                        for threads in args.threads:
                            rows.zero_()
                            drop_caches()
                            runs[f"direct read {threads}t files"].append(direct_read(root, rows, threads))
                            assert all(xxhash.xxh3_64_intdigest(flat_array[i * size : (i + 1) * size]) == digest
                                       for i, digest in samples.items()), "a direct read returned other bytes"
                os.unlink(raw_path)
                shutil.rmtree(root)
            nbytes = count * size
            gbps = {name: [nbytes / s / 1e9 for s in seconds] for name, seconds in runs.items()}
            median = {name: statistics.median(values) for name, values in gbps.items()}
            print(f"\n{block_kib} KiB blocks x {count}")
            print(f"  {'measurement':<36} {'GB/s':>6}  {'vs raw':>6}   runs")
            for name in names:
                parts = name.split()
                op, direct = ("write" if "write" in parts else "read"), "direct" in parts
                # Each against the raw side of its kind: direct writes against the raw direct write.
                raw = median[name if parts[0] == "raw" else f"raw {'direct ' if direct and op == 'write' else ''}{op}"]
                ratio = median[name] / raw
                print(f"  {name:<36} {median[name]:6.2f}  {ratio:5.2f}x   "
                      + ", ".join(f"{x:.2f}" for x in gbps[name]))
                results.append({
                    "block_bytes": size, "blocks": count, "op": op, "side": parts[0],
                    "threads": int(parts[2][:-1]) if parts[0] != "raw" else None,
                    "direct": direct,
                    "pack_kib": None if parts[0] == "raw" else next(
                        (kib for kib, lay in layouts.items() if lay == parts[-1]), None),
                    "gbps_median": round(median[name], 3), "ratio_to_raw": round(ratio, 3),
                    "gbps_runs": [round(x, 3) for x in gbps[name]],
                })
    finally:
        shutil.rmtree(base, ignore_errors=True)
    busy_after = others_busy()
    print(f"\nother processes used {busy_after} cores after the run")
    print(json.dumps({"bench": "fs_tier_io", "dir": args.dir, "fs": fstype, "total_bytes": total,
                      "jobs": args.jobs, "rounds": args.rounds, "cold_reads": cold,
                      "others_cores_before": busy_before, "others_cores_after": busy_after,
                      "cpus": os.cpu_count(), "results": results}))


if __name__ == "__main__":
    main()
