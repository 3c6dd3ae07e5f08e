"""What a tier's secret costs: both lower tiers' I/O with blocks sealed by a
keyed MAC, and encrypted, against the same tier without a secret, side by side.

First the candidates for sealing, on one core, in GB/s: keyed BLAKE3 (the
MAC kvledger uses), HMAC-SHA-256, keyed BLAKE2b, and AES-256-GCM.

Then for each block size, N blocks (about `--total-mib` in all) of a
host-tier-like int8 tensor, per tier, in alternating rounds:

  fs write      `FsTierIO.write` of the N blocks as `--jobs` jobs, then `os.sync()` (fs_tier_io.py's)
  fs read       `FsTierIO.read` of them into their rows, from a dropped page cache
  valkey write  `ValkeyTierIO.write`, on a local valkey-server (valkey_tier_io.py's)
  valkey read   `ValkeyTierIO.read`

each with no secret ("plain"), a MAC ("mac") and encryption ("encrypted"). The
median of `--rounds` is reported in GB/s (1e9 bytes) with each mode's ratio to
plain. Other processes' CPU use is sampled before the run. The last line is JSON.

    python bench/sealed_tier_io.py [--dir DIR] [--total-mib 256] [--block-kib 256 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import blake3
import structlog
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from fs_block_io import drop_caches  # the sibling script (bench/ is on sys.path when run)
from fs_tier_io import file_system, others_busy, tier_job
from valkey_tier_io import tier as valkey_job

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.support

from kvledger.transfers.lower_tiers.block_seal import BlockSeal  # noqa: E402
from kvledger.transfers.lower_tiers.fs.tier import FsTierIO  # noqa: E402
from kvledger.transfers.lower_tiers.valkey.store import ValkeyServer  # noqa: E402
from kvledger.transfers.lower_tiers.valkey.tier import ValkeyTierIO  # noqa: E402
from tests.support.valkey_servers import ServerProcess  # noqa: E402

NAMESPACE = bytes(range(16))
SECRET = b"bench-secret-0123456789abcdef0123"
MODES = {"plain": None, "mac": BlockSeal(SECRET), "encrypted": BlockSeal(SECRET, encrypt=True)}


def candidates(size: int, rounds: int) -> dict[str, float]:
    """One core's GB/s for each way of sealing a block of `size` bytes."""
    data, key = os.urandom(size), os.urandom(32)
    aes = AESGCM(key)
    ways = {
        "blake3 keyed": lambda: blake3.blake3(data, key=key).digest(),
        "hmac-sha256": lambda: hmac.digest(key, data, "sha256"),
        "blake2b keyed": lambda: hashlib.blake2b(data, key=key).digest(),
        "aes-256-gcm": lambda: aes.encrypt(bytes(12), data, None),
    }
    count = max(8, (256 << 20) // size)
    out = {}
    for name, run in ways.items():
        best = float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(count):
                run()
            best = min(best, time.perf_counter() - started)
        out[name] = round(count * size / best / 1e9, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--block-kib", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="kvledger-sealed-bench-", dir=args.dir)
    print(f"dir {base} ({file_system(args.dir)}), {args.total_mib} MiB per measurement, median of {args.rounds}; "
          f"other processes used {others_busy()} cores before the run, of {os.cpu_count()}; "
          f"{'cold' if drop_caches() else 'WARM'} fs reads")
    server = ServerProcess(maxmemory=f"{3 * args.total_mib + 512}mb", policy="noeviction")
    results: dict = {"candidates": {}, "tiers": []}
    try:
        for kib in args.block_kib:
            size = kib << 10
            results["candidates"][kib] = candidates(size, args.rounds)
            print(f"{kib} KiB, one core, GB/s: {results['candidates'][kib]}", flush=True)
            count = max(args.jobs * 4, (args.total_mib << 20) // size)
            rows = torch.randint(-128, 127, (count, size), dtype=torch.int8)
            original = rows.clone()
            times: dict[str, list[float]] = {}
            first_job = 0
            valkey = ValkeyServer(nodes=(("127.0.0.1", server.port),), timeout_s=30)
            for _ in range(args.rounds):
                for mode, seal in MODES.items():
                    root = os.path.join(base, "tier")
                    shutil.rmtree(root, ignore_errors=True)
                    fs = FsTierIO(root=root, namespace=NAMESPACE, rows=rows, payload_bytes=(size,), threads=16,
                                  seal=seal)
                    times.setdefault(f"fs write {mode}", []).append(tier_job(fs, "write", count, args.jobs, first_job))
                    rows.zero_()
                    drop_caches()
                    times.setdefault(f"fs read {mode}", []).append(tier_job(fs, "read", count, args.jobs,
                                                                            first_job + args.jobs))
                    fs.shutdown()
                    assert torch.equal(rows, original), f"fs {mode}: other bytes came back"
                    server.cli("FLUSHALL")
                    store = ValkeyTierIO(server=valkey, name="1:valkey", namespace=NAMESPACE, rows=rows,
                                         payload_bytes=(size,), connections=8, seal=seal)
                    times.setdefault(f"valkey write {mode}", []).append(
                        valkey_job(store, "write", count, args.jobs, first_job + 2 * args.jobs))
                    rows.zero_()
                    times.setdefault(f"valkey read {mode}", []).append(
                        valkey_job(store, "read", count, args.jobs, first_job + 3 * args.jobs))
                    store.shutdown()
                    assert torch.equal(rows, original), f"valkey {mode}: other bytes came back"
                    first_job += 4 * args.jobs
            rates = {name: count * size / statistics.median(t) / 1e9 for name, t in times.items()}
            print(f"{kib} KiB blocks x {count}")
            for tier in ("fs", "valkey"):
                for op in ("write", "read"):
                    plain = rates[f"{tier} {op} plain"]
                    row = {"block_kib": kib, "tier": tier, "op": op, "plain_gbps": round(plain, 3)}
                    for mode in ("mac", "encrypted"):
                        row[f"{mode}_gbps"] = round(rates[f"{tier} {op} {mode}"], 3)
                        row[f"{mode}_ratio"] = round(rates[f"{tier} {op} {mode}"] / plain, 2)
                    row["runs"] = {mode: [round(count * size / t / 1e9, 2) for t in times[f"{tier} {op} {mode}"]]
                                   for mode in MODES}
                    results["tiers"].append(row)
                    print(f"  {tier:>6} {op:<5} plain {plain:5.2f}  mac {row['mac_gbps']:5.2f} "
                          f"({row['mac_ratio']}x)  encrypted {row['encrypted_gbps']:5.2f} ({row['encrypted_ratio']}x)"
                          f"   runs {row['runs']}", flush=True)
    finally:
        server.close()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
