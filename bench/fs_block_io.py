"""Block files against raw sequential I/O of the same bytes on the same disk.

The file-system tier writes each block as its own file (`transfers/lower_tiers/fs/block_file.py`:
a 4 KiB header, written aside and renamed, checksummed) and reads it back with
its header and checksum checked. Its ceiling is the disk: one large file
written and read sequentially. Both sides move the same blocks, in one run,
alternating; each write ends with its data on disk (`fsync` of the one file,
`syncfs` for the block files), and each read starts from a cold page cache
(`/proc/sys/vm/drop_caches`, as root; without it the reads are from memory and
the output says so).

    python bench/fs_block_io.py [--dir DIR] [--total-mib 512] [--threads 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvledger.transfers.lower_tiers.fs.block_file import block_path, read_block_into, write_block

NAMESPACE = bytes(16)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as file:
            file.write("3\n")
        return True
    except OSError:
        return False


def raw_write(path: str, blocks: list[np.ndarray]) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for block in blocks:
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def raw_read(path: str, blocks: list[np.ndarray], out: np.ndarray) -> float:
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        view = memoryview(out)
        for _ in blocks:
            file.readinto(view)
    return time.perf_counter() - start


def keys(count: int) -> list[bytes]:
    return [index.to_bytes(32, "big") + bytes(4) for index in range(count)]


def files_write(root: str, blocks: list[np.ndarray], pool: ThreadPoolExecutor) -> float:
    start = time.perf_counter()
    list(pool.map(lambda kb: write_block(block_path(root, NAMESPACE, kb[0]), NAMESPACE, kb[0], kb[1]),
                  zip(keys(len(blocks)), blocks)))
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd) if not hasattr(os, "syncfs") else os.syncfs(fd)  # type: ignore[attr-defined]
    finally:
        os.close(fd)
    return time.perf_counter() - start


def files_read(root: str, blocks: list[np.ndarray], pool: ThreadPoolExecutor, outs: list[np.ndarray]) -> float:
    start = time.perf_counter()
    list(pool.map(lambda ko: read_block_into(block_path(root, NAMESPACE, ko[0]), NAMESPACE, ko[0], ko[1]),
                  zip(keys(len(blocks)), outs)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a temporary one)")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-kib", type=int, nargs="+", default=[64, 2048])
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="kvledger-fs-bench-", dir=args.dir)
    cold = drop_caches()
    print(f"dir {base}, {args.total_mib} MiB per run, {args.threads} threads, "
          f"{'cold reads (page cache dropped)' if cold else 'WARM reads: cannot drop the page cache'}")
    rng = np.random.default_rng(0)
    try:
        with ThreadPoolExecutor(args.threads) as pool:
            for block_kib in args.block_kib:
                size = block_kib << 10
                count = (args.total_mib << 20) // size
                blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]
                outs = [np.empty(size, dtype=np.uint8) for _ in range(count)]
                out = np.empty(size, dtype=np.uint8)
                nbytes = count * size
                results: dict[str, list[float]] = {k: [] for k in ("raw write", "file write", "raw read", "file read")}
                for _ in range(args.rounds):
                    raw_path, root = os.path.join(base, "raw.bin"), os.path.join(base, "blocks")
                    results["raw write"].append(nbytes / raw_write(raw_path, blocks) / 1e9)
                    results["file write"].append(nbytes / files_write(root, blocks, pool) / 1e9)
                    drop_caches()
                    results["raw read"].append(nbytes / raw_read(raw_path, blocks, out) / 1e9)
                    drop_caches()
                    results["file read"].append(nbytes / files_read(root, blocks, pool, outs) / 1e9)
                    assert all(np.array_equal(a, b) for a, b in zip(blocks[:8], outs[:8]))
                    os.unlink(raw_path)
                    shutil.rmtree(root)
                median = {k: statistics.median(v) for k, v in results.items()}
                print(f"{block_kib:>5} KiB blocks x {count}: "
                      f"write {median['file write']:.2f} GB/s vs raw {median['raw write']:.2f} "
                      f"({median['file write'] / median['raw write']:.2f}x); "
                      f"read {median['file read']:.2f} GB/s vs raw {median['raw read']:.2f} "
                      f"({median['file read'] / median['raw read']:.2f}x)  "
                      f"[runs: " + "; ".join(f"{k} " + ", ".join(f"{x:.2f}" for x in v) for k, v in results.items())
                      + "]")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
