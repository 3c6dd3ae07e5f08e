"""The Valkey tier's I/O (`ValkeyTierIO`) against plain pipelined SET/GET of the
same bytes with the same client (valkey-py with libvalkey), on one local server.

For each block size, N blocks (about `--total-mib` in all) of a host-tier-like int8 tensor:

  raw set    the blocks as values, pipelined SETs of 32 on `--threads` connections (one thread each)
  tier write `ValkeyTierIO.write` of the N blocks as `--jobs` jobs (header, checksum, batches of 32)
  raw get    pipelined GETs of 32 on as many connections, into bytes (no copy into the rows)
  tier read  `ValkeyTierIO.read` of the N blocks into their rows (checked, copied)

Each measurement is repeated `--rounds` times, alternating, the store flushed between, and the
median reported in GB/s (1e9 bytes) with the tier's ratio to raw. `valkey-benchmark` runs the
same value sizes for context (where the server has it beside it). The server runs here, on loopback: its own CPU time competes with
the client's on a small machine, as it would on a host that runs both. The last line is JSON.

`--cluster` runs the same against a cluster of three masters with a replica each (six servers
here): raw is valkey-py's cluster pipeline, which kvledger's cluster reads went through before
they were read node by node with its own framing (`cluster_store`); `valkey-benchmark` is skipped.

`--busy-threads N` runs N Python threads that never wait, as vLLM's engine loop holds the GIL in
the process the tier's threads share with it: every socket call then returns to a wait for the
GIL of up to a switch interval (5 ms).

    python bench/valkey_tier_io.py [--total-mib 512] [--block-kib 256 2048] [--threads 8] [--jobs 4]
                                   [--rounds 3] [--busy-threads 0] [--cluster]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import structlog
import torch
import valkey
import valkey.cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.support

from kvledger.transfers.lower_tiers.valkey.store import ValkeyServer  # noqa: E402
from kvledger.transfers.lower_tiers.valkey.tier import ValkeyTierIO  # noqa: E402
from tests.support.valkey_servers import ClusterProcesses, ServerProcess, server_binary  # noqa: E402

NAMESPACE = bytes(range(16))
PIPELINE = 32


def key(n: int) -> bytes:
    return n.to_bytes(16, "big") + b"\0\0\0\0"


def split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


def on_threads(work, shares: list) -> float:
    threads = [threading.Thread(target=work, args=(share,)) for share in shares]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


class Servers:
    """One server, or a cluster's three masters (and their replicas)."""

    def __init__(self, cluster: bool, maxmemory_mib: int) -> None:
        self.cluster = cluster
        if cluster:
            self.processes = ClusterProcesses(maxmemory=f"{maxmemory_mib // 3 + 256}mb")
            self.masters = self.processes.servers[:3]
        else:
            self.processes = ServerProcess(maxmemory=f"{maxmemory_mib}mb", policy="noeviction")
            self.masters = [self.processes]

    def client(self) -> valkey.Valkey | valkey.ValkeyCluster:
        if self.cluster:
            return valkey.ValkeyCluster(startup_nodes=[valkey.cluster.ClusterNode("127.0.0.1", m.port)
                                                       for m in self.masters])
        return valkey.Valkey(port=self.masters[0].port)

    def tier_server(self) -> ValkeyServer:
        return ValkeyServer(nodes=tuple(("127.0.0.1", m.port) for m in self.masters), cluster=self.cluster,
                            timeout_s=30)

    def flush(self) -> None:
        for master in self.masters:
            master.cli("FLUSHALL")
        if self.cluster:  # the replicas too, before the next round's writes
            time.sleep(0.5)

    def close(self) -> None:
        self.processes.close()


def raw(servers: Servers, values: list[bytes], threads: int, kind: str) -> float:
    clients = [servers.client() for _ in range(threads)]
    names = [b"raw:%d" % n for n in range(len(values))]
    shares = split(list(range(len(values))), threads)

    def work(share: list[int]) -> None:
        client = clients[shares.index(share)]
        for start in range(0, len(share), PIPELINE):
            pipe = client.pipeline(transaction=False)
            for n in share[start:start + PIPELINE]:
                pipe.set(names[n], values[n]) if kind == "set" else pipe.get(names[n])
            answers = pipe.execute()
            assert kind == "set" or all(a is not None for a in answers), "a raw GET missed"

    seconds = on_threads(work, shares)
    for client in clients:
        client.close()
    return seconds


def tier(io: ValkeyTierIO, kind: str, count: int, jobs: int, first_job: int) -> float:
    ids = []
    started = time.perf_counter()
    for j, share in enumerate(split(list(range(count)), jobs)):
        ids.append(first_job + j)
        getattr(io, kind)(first_job + j, (tuple(key(n) for n in share),), (tuple(share),))
    io.wait(ids, 600)
    seconds = time.perf_counter() - started
    outcomes = io.poll()
    assert all(o.ok for o in outcomes), [o.reasons[:3] for o in outcomes if not o.ok]
    return seconds


def spin(done: threading.Event) -> None:
    """Python that holds the GIL until `done`, as an engine loop does."""
    while not done.is_set():
        sum(range(1000))


def valkey_benchmark(port: int, size: int, count: int) -> dict:
    binary = Path(server_binary())
    found = [path for name in ("valkey-benchmark", "redis-benchmark") if (path := binary.with_name(name)).exists()]
    if not found:
        return {}
    out = subprocess.run([str(found[0]), "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(count),
                          "-P", "16", "-q"], capture_output=True, text=True, timeout=300).stdout
    rates = dict(re.findall(r"(SET|GET): ([\d.]+) requests per second", out.replace("\r", "\n")))
    return {op.lower(): round(float(rate) * size / 1e9, 2) for op, rate in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--block-kib", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy-threads", type=int, default=0)
    parser.add_argument("--cluster", action="store_true")
    args = parser.parse_args()
    busy = threading.Event()
    for _ in range(args.busy_threads):
        threading.Thread(target=spin, args=(busy,), daemon=True).start()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    server = Servers(args.cluster, 3 * args.total_mib + 512)
    results = []
    try:
        for kib in args.block_kib:
            size = kib << 10
            count = max(args.jobs * 4, (args.total_mib << 20) // size)
            rows = torch.randint(-128, 127, (count, size), dtype=torch.int8)
            values = [bytes(rows[n].numpy()) for n in range(count)]
            io = ValkeyTierIO(server=server.tier_server(), name="1:valkey",
                              namespace=NAMESPACE, rows=rows, payload_bytes=(size,), connections=args.threads)
            nbytes = count * size
            times: dict[str, list[float]] = {"raw set": [], "tier write": [], "raw get": [], "tier read": []}
            job = 0
            for _ in range(args.rounds):
                server.flush()
                times["raw set"].append(raw(server, values, args.threads, "set"))
                times["tier write"].append(tier(io, "write", count, args.jobs, job))
                times["raw get"].append(raw(server, values, args.threads, "get"))
                times["tier read"].append(tier(io, "read", count, args.jobs, job + args.jobs))
                job += 2 * args.jobs
            io.shutdown()
            rates = {name: round(nbytes / statistics.median(t) / 1e9, 2) for name, t in times.items()}
            server.flush()
            context = {} if args.cluster else valkey_benchmark(server.masters[0].port, size,
                                                                max(100, (256 << 20) // size))
            row = {"block_kib": kib, "blocks": count, **rates,
                   "write_ratio": round(rates["tier write"] / rates["raw set"], 2),
                   "read_ratio": round(rates["tier read"] / rates["raw get"], 2),
                   "valkey_benchmark": context}
            results.append(row)
            print(f"{kib:>5} KiB x {count}: raw set {rates['raw set']} tier write {rates['tier write']} "
                  f"({row['write_ratio']}x) | raw get {rates['raw get']} tier read {rates['tier read']} "
                  f"({row['read_ratio']}x) | valkey-benchmark set {context.get('set')} get {context.get('get')} GB/s",
                  flush=True)
    finally:
        busy.set()
        server.close()
    print(json.dumps({"cluster": args.cluster, "threads": args.threads, "jobs": args.jobs, "rounds": args.rounds,
                      "busy_threads": args.busy_threads, "results": results}))


if __name__ == "__main__":
    main()
