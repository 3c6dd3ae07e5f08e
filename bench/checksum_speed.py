"""Checksum candidates for block files, side by side in one run.

Every block a lower tier stores or loads is checksummed, so the checksum must
cost a small fraction of moving the block. GB/s over 256 MiB of random
blocks per size, best of 5, with a bytearray copy of the same block for
scale. CRC32C is measured when `google-crc32c` is installed (it is not a
dependency: `pip install google-crc32c`).

    python bench/checksum_speed.py
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from collections.abc import Callable

import xxhash

SIZES = (64 << 10, 256 << 10, 2 << 20)
TOTAL = 256 << 20


def candidates() -> dict[str, Callable[[bytes], object]]:
    found: dict[str, Callable[[bytes], object]] = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "xxh3_128": xxhash.xxh3_128_intdigest,
        "zlib.crc32": zlib.crc32,
        "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "copy (scale)": bytearray,
    }
    try:
        import google_crc32c

        found["crc32c"] = google_crc32c.value
    except ImportError:
        pass
    return found


def main() -> None:
    found = candidates()
    print("block   | " + " | ".join(f"{name:>12}" for name in found))
    for size in SIZES:
        block = os.urandom(size)
        count = TOTAL // size
        row = []
        for function in found.values():
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(count):
                    function(block)
                best = min(best, time.perf_counter() - start)
            row.append(f"{TOTAL / best / 1e9:>7.1f} GB/s")
        print(f"{size >> 10:>4} KiB | " + " | ".join(row))


if __name__ == "__main__":
    main()
