"""Valkey client throughput: valkey-glide, valkey-py + libvalkey, redis-py + hiredis.

Starts a private valkey-server on a free loopback port (no persistence,
4 GB maxmemory), then for each client and value size writes `--total-mib`
of distinct keys as pipelined SET batches of 32 values and reads them back
as pipelined GET batches of 32, timing SET and GET separately. Values are
prepared before timing. Each repetition also times

- SET with memoryview slices of one large buffer instead of bytes objects
  (the shape of KV blocks sliced out of a host tensor), and
- for glide's sync client, GET straight into caller buffers
  (`mget(keys, buffers=...)`), the only client here with such an API.

Concurrency modes: one thread; four threads each with its own client, the
keys split four ways; four threads sharing one client (glide multiplexes one
connection, valkey-py and redis-py hand each thread a pooled connection).
glide's async client runs single-threaded only: all its clients in a process
get their replies through one pipe that the event loop of the first client
reads, so clients driven by other threads' loops wait for ever.

Figures are GB/s (1e9 bytes per second), the median of `--repeats` passes,
with a FLUSHALL before each SET. The passes of one value size run case by
case in turn, so that every client sees the same phases of a shared machine.
For context it also runs valkey-benchmark (SET/GET, 50 clients, pipeline 16)
at 256 KiB and 2 MiB.

Needs valkey-server and valkey-benchmark on PATH (a system package such as Debian's valkey-tools;
`make valkey` alone may put only a server into the venv), and the
clients: valkey-py and libvalkey are kvledger's (the Valkey tier's client,
chosen on these numbers); the others are not among its dependencies:

    .venv/bin/pip install valkey-glide valkey-glide-sync redis hiredis
    .venv/bin/python bench/valkey_clients.py [--total-mib 256] [--repeats 3]
                                              [--clients glide-sync,...] [--sizes-kib 64,256,1024,2048]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

HOST = "127.0.0.1"
BATCH = 32
GB = 1e9
GLIDE_REQUEST_TIMEOUT_MS = 30_000  # glide's default is 250 ms: too short for a 64 MiB batch
SOCKET_TIMEOUT_S = 30.0
PACKAGES = ("valkey-glide", "valkey-glide-sync", "valkey", "libvalkey", "redis", "hiredis")


# --- server -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ping(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def valkey_server():
    """Yield the port of a fresh valkey-server, killed on exit."""
    port = free_port()
    proc = subprocess.Popen(
        ["valkey-server", "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
         "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("valkey-server did not answer PING")
            time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait()


# --- clients ----------------------------------------------------------------
# Each client exposes set_batch(keys, values), get_batch(keys) -> values,
# flushall() and close(); glide-sync also get_into(keys, views).


class GlideSync:
    name = "glide-sync"
    threaded = True

    def __init__(self, port: int):
        from glide_sync import Batch, GlideClient, GlideClientConfiguration, NodeAddress

        self.batch_cls = Batch
        config = GlideClientConfiguration([NodeAddress(HOST, port)], request_timeout=GLIDE_REQUEST_TIMEOUT_MS)
        self.client = GlideClient.create(config)

    def set_batch(self, keys, values):
        batch = self.batch_cls(is_atomic=False)
        for key, value in zip(keys, values):
            batch.set(key, value)
        self.client.exec(batch, raise_on_error=True)

    def get_batch(self, keys):
        batch = self.batch_cls(is_atomic=False)
        for key in keys:
            batch.get(key)
        return self.client.exec(batch, raise_on_error=True)

    def get_into(self, keys, views):
        self.client.mget(keys, buffers=views)

    def flushall(self):
        self.client.flushall()

    def close(self):
        self.client.close()


class GlideAsync:
    """glide's asyncio client, driven by an event loop private to the instance."""

    name = "glide-async"
    threaded = False  # see the module docstring

    def __init__(self, port: int):
        from glide import Batch, GlideClient, GlideClientConfiguration, NodeAddress

        self.batch_cls = Batch
        config = GlideClientConfiguration([NodeAddress(HOST, port)], request_timeout=GLIDE_REQUEST_TIMEOUT_MS)
        self.loop = asyncio.new_event_loop()
        self.client = self.loop.run_until_complete(GlideClient.create(config))

    def _exec(self, batch):
        return self.loop.run_until_complete(self.client.exec(batch, raise_on_error=True))

    def set_batch(self, keys, values):
        batch = self.batch_cls(is_atomic=False)
        for key, value in zip(keys, values):
            batch.set(key, value)
        self._exec(batch)

    def get_batch(self, keys):
        batch = self.batch_cls(is_atomic=False)
        for key in keys:
            batch.get(key)
        return self._exec(batch)

    def flushall(self):
        self.loop.run_until_complete(self.client.flushall())

    def close(self):
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


class _PyClient:
    """redis-py and its fork valkey-py share this API."""

    threaded = True

    def __init__(self, port: int):
        self.client = self.module_client()(host=HOST, port=port, socket_timeout=SOCKET_TIMEOUT_S)

    def set_batch(self, keys, values):
        pipe = self.client.pipeline(transaction=False)
        for key, value in zip(keys, values):
            pipe.set(key, value)
        pipe.execute()

    def get_batch(self, keys):
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    def flushall(self):
        self.client.flushall()

    def close(self):
        self.client.close()


class ValkeyPy(_PyClient):
    name = "valkey-py"

    @staticmethod
    def module_client():
        import valkey
        from valkey.utils import LIBVALKEY_AVAILABLE

        assert LIBVALKEY_AVAILABLE, "valkey-py is not using libvalkey"
        return valkey.Valkey


class RedisPy(_PyClient):
    name = "redis-py"

    @staticmethod
    def module_client():
        import redis
        from redis.utils import HIREDIS_AVAILABLE

        assert HIREDIS_AVAILABLE, "redis-py is not using hiredis"
        return redis.Redis


CLIENTS = {cls.name: cls for cls in (GlideSync, GlideAsync, ValkeyPy, RedisPy)}


# --- workload ---------------------------------------------------------------


@dataclass
class Workload:
    size: int
    keys: list[bytes]
    values: list[bytes]
    views: list[memoryview]
    sinks: list[memoryview]  # writable destinations for get_into

    @classmethod
    def make(cls, total: int, size: int, data: bytes, sink: bytearray) -> Workload:
        n = total // size
        spans = [(i * size, (i + 1) * size) for i in range(n)]
        return cls(
            size=size,
            keys=[f"kv:{size}:{i}".encode() for i in range(n)],
            values=[data[a:b] for a, b in spans],
            views=[memoryview(data)[a:b] for a, b in spans],
            sinks=[memoryview(sink)[a:b] for a, b in spans],
        )

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.size


def batches(indices: range):
    for start in range(indices.start, indices.stop, BATCH):
        yield slice(start, min(start + BATCH, indices.stop))


def split(n: int, parts: int) -> list[range]:
    bounds = [n * p // parts for p in range(parts + 1)]
    return [range(bounds[p], bounds[p + 1]) for p in range(parts)]


def timed(clients, work: Workload, op) -> float:
    """Seconds for `op(client, work, batch_slice)` over all keys, split across clients' threads."""

    def run(client, part):
        for sl in batches(part):
            op(client, work, sl)

    parts = split(len(work.keys), len(clients))
    start = time.perf_counter()
    if len(clients) == 1:
        run(clients[0], parts[0])
    else:
        with ThreadPoolExecutor(len(clients)) as pool:
            for future in [pool.submit(run, c, p) for c, p in zip(clients, parts)]:
                future.result()
    return time.perf_counter() - start


def op_set(client, work, sl):
    client.set_batch(work.keys[sl], work.values[sl])


def op_set_view(client, work, sl):
    client.set_batch(work.keys[sl], work.views[sl])


def op_get(client, work, sl):
    client.get_batch(work.keys[sl])


def op_get_into(client, work, sl):
    client.get_into(work.keys[sl], work.sinks[sl])


def check_roundtrip(client, work: Workload) -> None:
    last = slice(len(work.keys) - 1, len(work.keys))
    if client.get_batch(work.keys[last]) != work.values[last]:
        raise AssertionError(f"{client.name}: GET returned other bytes than were SET")


def one_pass(cls, port: int, work: Workload, threads: int, shared: bool) -> dict[str, float]:
    """Seconds of each operation over all keys for one client and concurrency mode."""
    first = cls(port)
    clients = [first] * threads if shared else [first] + [cls(port) for _ in range(threads - 1)]
    seconds = {}
    try:
        first.flushall()
        seconds["set"] = timed(clients, work, op_set)
        check_roundtrip(first, work)
        seconds["get"] = timed(clients, work, op_get)
        if hasattr(cls, "get_into"):
            work.sinks[-1][:] = bytes(work.size)  # so a stale sink cannot pass the check below
            seconds["get_into"] = timed(clients, work, op_get_into)
            if work.sinks[-1] != work.views[-1]:
                raise AssertionError(f"{cls.name}: get_into landed other bytes than were SET")
        first.flushall()
        seconds["set_view"] = timed(clients, work, op_set_view)
        check_roundtrip(first, work)
        first.flushall()
    finally:
        for client in set(clients):
            client.close()
    return seconds


def summarize(work: Workload, passes: list[dict[str, float]]) -> tuple[dict[str, float], float]:
    """Median GB/s of each operation, and the widest (max - min) / median of their times."""
    rates, spread = {}, 0.0
    for op in passes[0]:
        times = [p[op] for p in passes]
        median = statistics.median(times)
        rates[op] = work.nbytes / median / GB
        spread = max(spread, (max(times) - min(times)) / median)
    return rates, spread


# --- valkey-benchmark -------------------------------------------------------


def valkey_benchmark(port: int, size: int, requests: int) -> dict[str, float]:
    """GB/s of valkey-benchmark's SET and GET (50 clients, pipeline 16)."""
    out = subprocess.run(
        ["valkey-benchmark", "-h", HOST, "-p", str(port), "-t", "set,get", "-d", str(size),
         "-n", str(requests), "-P", "16", "-q"],
        capture_output=True, text=True, check=True,
    ).stdout
    rates = dict(re.findall(r"(SET|GET): ([\d.]+) requests per second", out.replace("\r", "\n")))
    return {op.lower(): float(rps) * size / GB for op, rps in rates.items()}


# --- report -----------------------------------------------------------------


def versions() -> str:
    server = subprocess.run(["valkey-server", "--version"], capture_output=True, text=True).stdout.split()
    found = [f"valkey-server {server[2].removeprefix('v=')}"]
    found += [f"{p} {importlib.metadata.version(p)}" for p in PACKAGES]
    return ", ".join(found)


def fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so valkey_server() kills the server
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--sizes-kib", default="64,256,1024,2048")
    args = parser.parse_args()
    total = args.total_mib << 20
    sizes = [int(s) << 10 for s in args.sizes_kib.split(",")]
    modes = [(1, False, "1"), (4, False, "4 own"), (4, True, "4 shared")]
    cases = [(CLIENTS[name], threads, shared, label)
             for name in args.clients.split(",")
             for threads, shared, label in modes
             if threads == 1 or CLIENTS[name].threaded]

    print(versions())
    print(f"{os.cpu_count()} CPUs; {args.total_mib} MiB per pass, batches of {BATCH}, median of {args.repeats} "
          f"passes taken case by case in turn; GB/s = 1e9 B/s; spread = widest (max - min) / median")
    data = os.urandom(total)
    sink = bytearray(total)
    with valkey_server() as port:
        print(f"{'client':<12} {'threads':<9} {'value':>7} {'SET':>6} {'SET mv':>7} {'GET':>6} {'GET buf':>8} {'spread':>7}")
        for size in sizes:
            work = Workload.make(total, size, data, sink)
            passes = [[] for _ in cases]
            for _ in range(args.repeats):
                for (cls, threads, shared, _label), done in zip(cases, passes):
                    done.append(one_pass(cls, port, work, threads, shared))
            for (cls, _threads, _shared, label), done in zip(cases, passes):
                r, spread = summarize(work, done)
                print(f"{cls.name:<12} {label:<9} {size >> 10:>4}KiB {fmt(r['set']):>6} {fmt(r['set_view']):>7} "
                      f"{fmt(r['get']):>6} {fmt(r.get('get_into')):>8} {spread:>6.0%}", flush=True)
        for size, requests in ((256 << 10, 2000), (2 << 20, 300)):
            r = valkey_benchmark(port, size, requests)
            print(f"{'v-benchmark':<12} {'50 conns':<9} {size >> 10:>4}KiB {fmt(r.get('set')):>6} {'':>7} "
                  f"{fmt(r.get('get')):>6}", flush=True)


if __name__ == "__main__":
    main()
