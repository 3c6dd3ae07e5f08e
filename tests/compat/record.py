"""Record the compat corpus: real vLLM-CPU event logs written by one build of kvledger.

Usage: python tests/compat/record.py --tree TREE --build NAME --out tests/compat/logs/NAME [--only SCENARIO ...]

TREE is a checkout of the build to record (`git worktree add /tmp/kvledger-<commit> <commit>`). Every
engine runs TREE's own `tests/on_vllm/engine_run.py` with TREE's kvledger (`run_with_tree.py`, engine
from source), one engine at a time; the tiny models come from this checkout's `tiny_models` (built once
into --models), the Valkey servers from this checkout's `tests/support/valkey_servers.py`. Each scenario's
folder gets its logs (`<name>.kvlog`, the bytes the connector wrote) and, made by TREE's CLI, each log's
`<name>.replay.json` (`replay LOG --check --json`), `<name>.replay.txt` (`replay LOG --check`), its
stderr when there is any (`<name>.replay.stderr.txt`), and `<name>.explain.json` where that build has an
`explain` command; plus `meta.json`: the build, the versions, the specs, the commands, their exit codes,
what the scenario shows, and what it could not show. A scenario folder that exists is never
overwritten: the corpus is only added to.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WRAPPER = HERE / "run_with_tree.py"
LOG_EVENTS = HERE / "log_events.py"
PY = sys.executable
ENGINE_TIMEOUT_S = 900

LLAMA, GEMMA = "tiny-llama", "tiny-gemma3"


class Recorder:
    def __init__(self, tree: Path, build: str, out: Path, models: Path, scratch: Path) -> None:
        self.tree, self.build, self.out, self.scratch = tree, build, out, scratch
        self.commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                                     text=True, check=True).stdout.strip()
        spec = importlib.util.spec_from_file_location("kvledger_compat_valkey_servers",
                                                      REPO / "tests" / "support" / "valkey_servers.py")
        assert spec is not None and spec.loader is not None
        self.valkey = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.valkey)
        from kvledger.adapters.testing.tiny_models import build_model

        self.models = {name: build_model(name, models) for name in (LLAMA, GEMMA)}
        self.vllm_version = self._old_python("import vllm; print(vllm.__version__)").strip()
        version = self._wrapped(["-m", "kvledger.adapters.cli.main", "--version"], cwd=self.scratch)
        self.version_output = (version.stdout + version.stderr).strip().splitlines()
        self.version_output = [line for line in self.version_output if not line.startswith("run_with_tree: ")]
        self.has_reset_phase = 'phase == "reset"' in (tree / "tests" / "on_vllm" / "engine_run.py").read_text()
        self.has_explain = self._wrapped(["-m", "kvledger.adapters.cli.main", "explain", "--help"],
                                         cwd=self.scratch).returncode == 0

    # --- processes -------------------------------------------------------------------------------
    def _env(self, hash_seed: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONHASHSEED", "KVLEDGER_COMPAT_STRAY", "KVLEDGER_COMPAT_PROCS")}
        env["KVLEDGER_PURE"] = "1"
        if hash_seed is not None:
            env["PYTHONHASHSEED"] = hash_seed
        return env

    def _wrapped(self, args: list[str], *, cwd: Path, timeout: float = 300,
                 hash_seed: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([PY, str(WRAPPER), str(self.tree), *args], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, env=self._env(hash_seed))

    def _old_python(self, code: str) -> str:
        with tempfile.NamedTemporaryFile("w", suffix=".py", dir=self.scratch, delete=False) as script:
            script.write(code)
        done = self._wrapped([script.name], cwd=self.scratch)
        os.unlink(script.name)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    def engine(self, spec: dict, *, hash_seed: str | None = None,
               kill_when: tuple[str, int] | None = None) -> dict:
        """TREE's engine_run.py on `spec` (its `log` a path in the scenario folder); with `kill_when`
        (event kind, count), the whole process group is SIGKILLed once the log's whole steps hold that
        many. What happened: the RESULT line, the exit status, the command line, the output's tail."""
        script = self.tree / "tests" / "on_vllm" / "engine_run.py"
        argv = [PY, str(WRAPPER), str(self.tree), str(script), json.dumps(spec)]
        output = self.scratch / f"engine-{Path(spec['log']).stem}-{time.monotonic_ns()}.out"
        procs = output.with_suffix(".procs")
        env = {**self._env(hash_seed), "KVLEDGER_COMPAT_PROCS": str(procs)}
        started = time.monotonic()
        with open(output, "wb") as out:
            proc = subprocess.Popen(argv, cwd=self.tree, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            killed_at = None
            try:
                if kill_when is not None:
                    kind, count = kill_when
                    watch = self._wrapped([str(LOG_EVENTS), "wait", spec["log"], kind, str(count),
                                           str(ENGINE_TIMEOUT_S)], cwd=self.scratch, timeout=ENGINE_TIMEOUT_S + 60)
                    if watch.returncode != 0 or proc.poll() is not None:
                        raise RuntimeError(f"kill point {kill_when} not reached (watch exit {watch.returncode}, "
                                           f"engine exit {proc.poll()}):\n{watch.stderr[-2000:]}\n{_tail(output)}")
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_at = json.loads(watch.stdout.strip().splitlines()[-1])["kinds"]
                code = proc.wait(timeout=ENGINE_TIMEOUT_S)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        text = output.read_text(errors="replace")
        result = None
        for line in text.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        if kill_when is None and (code != 0 or result is None):
            raise RuntimeError(f"engine run failed (exit {code}):\n{_tail(output)}")
        if "run_with_tree: kvledger NOT only from" in text:
            raise RuntimeError(f"a kvledger module came from outside {self.tree}:\n{_tail(output)}")
        return {"exit_code": code, "seconds": round(time.monotonic() - started, 1), "result": result,
                "killed_when_log_held": killed_at,
                "processes_that_loaded_the_tree": [_short(" ".join(line.split(" ")[1:4]), self)
                                                   for line in procs.read_text().splitlines()],
                "command": [_short(a, self) for a in argv[:4]] + ["SPEC_JSON (meta.json: spec)"],
                "env": {"KVLEDGER_PURE": "1", **({"PYTHONHASHSEED": hash_seed} if hash_seed else {})}}

    def old_cli(self, folder: Path, log: Path) -> dict:
        """TREE's CLI on `log`, run in its folder: each output file, and every command's exit status."""
        stem = log.stem
        runs = {"replay.json": ["replay", log.name, "--check", "--json"], "replay.txt": ["replay", log.name, "--check"]}
        if self.has_explain:
            runs["explain.json"] = ["explain", log.name, "--json"]
        done: dict = {}
        for suffix, args in runs.items():
            proc = self._wrapped(["-m", "kvledger.adapters.cli.main", *args], cwd=folder)
            (folder / f"{stem}.{suffix}").write_text(proc.stdout)
            stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("run_with_tree: "))
            if stderr and suffix == "replay.txt":
                (folder / f"{stem}.replay.stderr.txt").write_text(stderr + "\n")
            if "run_with_tree: kvledger NOT only from" in proc.stderr:
                raise RuntimeError(f"the old CLI loaded kvledger from outside {self.tree}: {proc.stderr[-2000:]}")
            done[suffix] = {"command": ["kvledger", *args], "exit_code": proc.returncode}
        counts = self._wrapped([str(LOG_EVENTS), "count", log.name], cwd=folder)
        assert counts.returncode == 0, counts.stderr[-2000:]
        done["log"] = json.loads(counts.stdout)
        done["bytes"] = log.stat().st_size
        summary = json.loads((folder / f"{stem}.replay.json").read_text() or "null")
        done["summary"] = _brief(summary)
        return done

    # --- scenarios -------------------------------------------------------------------------------
    def spec(self, model: str, log: Path, phases: list[str], extra: dict | None = None, **more) -> dict:
        return {"model": str(self.models[model]), "log": str(log), "phases": phases, "extra": extra or {}, **more}

    def fs(self, path: Path, capacity: int = 256 << 20) -> list[dict]:
        return [{"type": "fs", "path": str(path), "capacity_bytes": capacity}]

    def server(self, scratch: Path):
        """A real valkey-server on a free loopback port, its files in `scratch`."""
        (scratch / "valkey").mkdir()
        return self.valkey.ServerProcess(folder=scratch / "valkey")

    def valkey_tier(self, server) -> list[dict]:
        return [{"type": "valkey", "url": server.url, "capacity_bytes": 256 << 20, "timeout_s": 0.5}]

    def record(self, name: str, about: str, runs: Callable[[Path, Path], list[tuple[str, dict, dict]]],
               shows: Callable[[dict], tuple[dict, list[str]]]) -> dict:
        """One scenario: `runs(folder, scratch)` records its logs and returns (log name, spec, run)
        for each; `shows(logs)` says what they show and what falls short (each a problem)."""
        folder = self.out / name
        if folder.exists():
            raise SystemExit(f"{folder} exists: the corpus is only added to, never recorded again")
        work = self.out / f".{name}.partial"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))
        print(f"== {name}", flush=True)
        logs: dict = {}
        entries = runs(work, scratch)
        for log_name, spec, run in entries:
            log = work / log_name
            if not log.exists():
                raise RuntimeError(f"{name}: {log_name} was not written")
            logs[log_name] = {"spec": _redact(spec, self, work, scratch), "run": run, **self.old_cli(work, log)}
            print(f"   {log_name}: {logs[log_name]['bytes']} bytes, {logs[log_name]['log']['events']} events, "
                  f"replay exit {logs[log_name]['replay.txt']['exit_code']}, {run['seconds']} s", flush=True)
        shown, problems = shows(logs)
        meta = {
            "scenario": name, "about": about, "build": self.build, "commit": self.commit,
            "engine_version": sorted({entry["log"]["engine_version"] for entry in logs.values()}),
            "vllm_version": self.vllm_version, "python": sys.version.split()[0],
            "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "recorder": "tests/compat/record.py --tree TREE --build "
                        f"{self.build} --out tests/compat/logs/{self.build} --only {name}",
            "paths": {"<tree>": "the build's checkout (engine_run.py is its tests/on_vllm/engine_run.py)",
                      "<models>": "tiny models built by this checkout's kvledger.adapters.testing.tiny_models",
                      "<scratch>": "a scratch folder (tier directories), removed after recording",
                      "<here>": "this scenario's folder"},
            "build_version_output": self.version_output,
            "cli": "each `kvledger ARGS` here ran as `python tests/compat/run_with_tree.py <tree> -m "
                   "kvledger.adapters.cli.main ARGS` (the build's `kvledger` entry point, its kvledger imported "
                   "from <tree>, KVLEDGER_PURE=1) in this folder; <name>.replay.txt is its stdout, "
                   "<name>.replay.stderr.txt its stderr when it wrote any",
            "explain": "recorded" if self.has_explain else "this build has no `explain` command",
            "shows": shown, "problems": problems, "logs": logs,
        }
        (work / "meta.json").write_text(_dump(meta))
        work.rename(folder)
        shutil.rmtree(scratch, ignore_errors=True)
        for problem in problems:
            print(f"   PROBLEM: {problem}", flush=True)
        return meta


# --- the scenarios ----------------------------------------------------------------------------------

def host_evictions(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        spec = r.spec(LLAMA, folder / "events.kvlog", ["first", "again", "shifted"], {"capacity_bytes": 192 << 10})
        return [("events.kvlog", spec, r.engine(spec))]

    def shows(logs):
        stats = logs["events.kvlog"]["summary"]["stats"]
        return {"evictions": stats.get("evictions"), "hit_tokens": stats.get("hit_tokens")}, \
            [] if (stats.get("evictions") or 0) > 0 else ["no eviction in the host tier"]

    return r.record("host-evictions", "plain Llama, host tier only, 192 KiB (six slots): the tier evicts; "
                    "phases first, again, shifted", runs, shows)


def _disk_spec(r: Recorder, log: Path, tier: Path, phases: list[str]) -> dict:
    return r.spec(GEMMA, log, phases, {"capacity_bytes": 8 << 20, "secondary_tiers": r.fs(tier)})


def disk_small_host(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        spec = _disk_spec(r, folder / "events.kvlog", scratch / "tier", ["first", "again", "shifted"])
        return [("events.kvlog", spec, r.engine(spec))]

    def shows(logs):
        entry = logs["events.kvlog"]
        lower = (entry["summary"].get("lower_tiers") or [{}])[0]
        shown = {"stats": entry["summary"]["stats"], "lower_tier": lower}
        return shown, [] if lower.get("keys_written") else ["nothing written to the disk tier"]

    return r.record("disk-small-host", "hybrid Gemma3 (sliding + full attention), 8 MiB host memory over a "
                    "file-system tier; phases first, again, shifted", runs, shows)


def disk_new_process(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        tier = scratch / "tier"
        one = _disk_spec(r, folder / "process1.kvlog", tier, ["first", "again", "shifted"])
        first = r.engine(one)
        two = _disk_spec(r, folder / "process2.kvlog", tier, ["first", "again"])
        return [("process1.kvlog", one, first), ("process2.kvlog", two, r.engine(two, hash_seed="4242"))]

    def shows(logs):
        two = logs["process2.kvlog"]
        lower = (two["summary"].get("lower_tiers") or [{}])[0]
        cached = (two["run"]["result"] or {}).get("first", {}).get("cached")
        shown = {"process2_tier_keys_found_events": two["log"]["kinds"].get("tier_keys_found", 0),
                 "process2_lower_tier": lower, "process2_first_cached_tokens": cached,
                 "process2_stats": two["summary"]["stats"]}
        problems = []
        if not lower.get("keys_found"):
            problems.append("the second process found no key on disk")
        if not lower.get("keys_read"):
            problems.append("the second process read nothing from disk")
        return shown, problems

    return r.record("disk-new-process", "two engine processes, one after the other, on one disk directory "
                    "(disk-small-host's settings): process1 (phases first, again, shifted) writes it; process2 "
                    "(phases first, again; PYTHONHASHSEED=4242, so vLLM's block hashes differ) finds its keys at "
                    "start (tier_keys_found) and restores its first phase from disk", runs, shows)


def disk_tiny_host(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        spec = r.spec(GEMMA, folder / "events.kvlog", ["first", "again", "shifted"],
                      {"capacity_bytes": 192 << 10, "secondary_tiers": r.fs(scratch / "tier")})
        return [("events.kvlog", spec, r.engine(spec))]

    def shows(logs):
        entry = logs["events.kvlog"]
        lower = (entry["summary"].get("lower_tiers") or [{}])[0]
        stats = entry["summary"]["stats"]
        problems = [] if lower.get("keys_read") else ["nothing promoted from disk"]
        if not stats.get("evictions"):
            problems.append("no host eviction")
        return {"stats": stats, "lower_tier": lower}, problems

    return r.record("disk-tiny-host", "(beyond the brief's list) hybrid Gemma3, 192 KiB host memory (a few slots) "
                    "over a file-system tier, as this repo's test of a host tier smaller than the working set: "
                    "the host evicts and hits promote blocks from disk; phases first, again, shifted", runs, shows)


def valkey(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        server = r.server(scratch)
        try:
            spec = r.spec(LLAMA, folder / "events.kvlog", ["first", "again", "shifted"],
                          {"capacity_bytes": 192 << 10, "secondary_tiers": r.valkey_tier(server), "log_json": True})
            run = r.engine(spec)
            run["valkey_dbsize_after"] = int(server.cli("DBSIZE"))
        finally:
            server.close()
        return [("events.kvlog", spec, run)]

    def shows(logs):
        entry = logs["events.kvlog"]
        lower = (entry["summary"].get("lower_tiers") or [{}])[0]
        shown = {"stats": entry["summary"]["stats"], "lower_tier": lower}
        return shown, [] if lower.get("keys_written") else ["nothing written to Valkey"]

    return r.record("valkey", "plain Llama, 192 KiB host memory over a Valkey tier on a real valkey-server; "
                    "phases first, again, shifted", runs, shows)


def valkey_down_at_start(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        server = r.server(scratch)
        tier = [{**r.valkey_tier(server)[0], "on_unreachable": "warn"}]
        try:
            first = r.spec(LLAMA, folder / "process1.kvlog", ["first"],
                           {"capacity_bytes": 192 << 10, "secondary_tiers": tier, "log_json": True})
            entries = [("process1.kvlog", first, r.engine(first))]
            server.kill()
            second = r.spec(LLAMA, folder / "process2.kvlog", ["first", "again"],
                            {"capacity_bytes": 192 << 10, "secondary_tiers": tier, "log_json": True})
            entries.append(("process2.kvlog", second, r.engine(second, hash_seed="4242")))
        finally:
            server.close()
        return entries

    def shows(logs):
        kinds = logs["process2.kvlog"]["log"]["kinds"]
        shown = {"tier_lookup_failed_events": kinds.get("tier_lookup_failed", 0),
                 "process1_lower_tier": (logs["process1.kvlog"]["summary"].get("lower_tiers") or [{}])[0]}
        return shown, [] if shown["tier_lookup_failed_events"] else ["no tier_lookup_failed event"]

    return r.record("valkey-down-at-start", "plain Llama over a Valkey tier (on_unreachable: warn): "
                    "process1.kvlog writes to a real valkey-server (phase first); the server is SIGKILLed; "
                    "process2.kvlog, a new process (another PYTHONHASHSEED), starts with it down and runs first, "
                    "again: its lookups fail (tier_lookup_failed, from 9fb1517 on)", runs, shows)


def failed_loads(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        tier = scratch / "tier"
        removed = r.spec(LLAMA, folder / "fs-removed.kvlog", ["first", "again"],
                         {"capacity_bytes": 160 << 10, "secondary_tiers": r.fs(tier), "log_json": True},
                         remove_after_first=str(tier))
        entries = [("fs-removed.kvlog", removed, r.engine(removed))]
        server = r.server(scratch)
        try:
            killed = r.spec(LLAMA, folder / "valkey-killed.kvlog", ["first", "again", "shifted"],
                            {"capacity_bytes": 192 << 10, "secondary_tiers": r.valkey_tier(server), "log_json": True},
                            kill_after_first=server.process.pid)
            entries.append(("valkey-killed.kvlog", killed, r.engine(killed)))
        finally:
            server.close()
        return entries

    def shows(logs):
        shown = {name: {"load_failed_events": e["log"]["kinds"].get("load_failed", 0),
                        "load_failures": e["summary"]["stats"].get("load_failures"),
                        "lower_tier": (e["summary"].get("lower_tiers") or [{}])[0]} for name, e in logs.items()}
        problems = [f"{name}: no load_failed event" for name, s in shown.items() if not s["load_failed_events"]]
        if len(problems) == len(shown):
            return shown, problems
        return shown, [f"{p} (the other log has them)" for p in problems]

    return r.record("failed-loads", "loads that fail for real: fs-removed.kvlog, plain Llama over a disk tier "
                    "whose directory is removed after the first phase (remove_after_first), so `again` promotes "
                    "from files that are gone; valkey-killed.kvlog, the Valkey server SIGKILLed after the first "
                    "phase (kill_after_first), then again and shifted", runs, shows)


def reset(r: Recorder) -> dict:
    # A build whose engine_run.py has a `reset` phase (reset_prefix_cache(reset_connector=True) alone)
    # runs first, reset, again; an older one (9d5f430) has only `recomputed`: the reset, then the
    # first prompts again.
    phases = ["first", "reset", "again"] if r.has_reset_phase else ["first", "recomputed", "again"]

    def runs(folder: Path, scratch: Path):
        spec = r.spec(LLAMA, folder / "events.kvlog", phases)
        return [("events.kvlog", spec, r.engine(spec))]

    def shows(logs):
        entry = logs["events.kvlog"]
        resets = entry["log"]["kinds"].get("cache_reset", 0)
        return {"cache_reset_events": resets, "stats": entry["summary"]["stats"]}, \
            [] if resets else ["no cache_reset event"]

    about = "plain Llama: phases first, reset (reset_prefix_cache(reset_connector=True): a cache_reset), again"
    if not r.has_reset_phase:
        about += ("; this build's engine_run.py has no `reset` phase, so its `recomputed` phase stands in: the "
                  "reset, then the first prompts again (phases first, recomputed, again)")
    return r.record("reset", about, runs, shows)


def disk_reset_kept(r: Recorder) -> dict:
    """From 8c47984 on (`key_generations: "kept"`): the reset empties host memory alone."""
    def runs(folder: Path, scratch: Path):
        spec = r.spec(GEMMA, folder / "events.kvlog", ["first", "reset", "again"],
                      {"capacity_bytes": 8 << 20, "secondary_tiers": r.fs(scratch / "tier"), "key_generations": "kept"})
        return [("events.kvlog", spec, r.engine(spec))]

    def shows(logs):
        entry = logs["events.kvlog"]
        resets = entry["log"]["kinds"].get("cache_reset", 0)
        lower = (entry["summary"].get("lower_tiers") or [{}])[0]
        shown = {"cache_reset_events": resets, "stats": entry["summary"]["stats"], "lower_tier": lower}
        return shown, ([] if resets else ["no cache_reset event"]) + (
            [] if lower.get("keys_read") else ["nothing read from the disk tier after the reset"])

    return r.record("disk-reset-kept", "hybrid Gemma3, 8 MiB host memory over a file-system tier with "
                    "key_generations 'kept'; phases first, reset (the tier keeps its blocks: cache_reset v3 with "
                    "keep_lower), again (restored from the disk)", runs, shows)


def tp2(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        spec = r.spec(LLAMA, folder / "events.kvlog", ["first", "again"], engine={"tensor_parallel_size": 2})
        return [("events.kvlog", spec, r.engine(spec))]

    def shows(logs):
        entry = logs["events.kvlog"]
        stats = entry["summary"]["stats"]
        reports = {kind: entry["log"]["kinds"].get(kind, 0) for kind in ("store_completed", "load_completed")}
        shown = {"stats": stats, "worker_reports": reports,
                 "processes_that_loaded_the_tree": entry["run"]["processes_that_loaded_the_tree"]}
        problems = [] if stats.get("loads") else ["no load in the again phase"]
        if reports["load_completed"] != 2 * (stats.get("loads") or 0):
            problems.append("not one load_completed per rank and load")
        return shown, problems

    return r.record("tp2", "plain Llama with tensor_parallel_size 2: one worker process per rank (each "
                    "reports each transfer); phases first, again", runs, shows)


def crash(r: Recorder) -> dict:
    def runs(folder: Path, scratch: Path):
        spec = r.spec(LLAMA, folder / "events.kvlog", ["first", "again", "shifted"], {"digest_interval": 4},
                      count=8, max_tokens=24)
        return [("events.kvlog", spec, r.engine(spec, kill_when=("load_completed", 1)))]

    def shows(logs):
        entry = logs["events.kvlog"]
        summary = entry["summary"]
        shown = {"killed_when_log_held": entry["run"]["killed_when_log_held"], "closed": summary.get("closed"),
                 "steps": summary.get("steps"), "tear": entry["log"]["tear"],
                 "replay_exit_code": entry["replay.txt"]["exit_code"]}
        problems = []
        if summary.get("closed") is not False:
            problems.append("the killed engine's log reads as closed")
        if not summary.get("ok"):
            problems.append(f"the old build's replay is not ok: {summary.get('first_problem')}")
        return shown, problems

    return r.record("crash", "plain Llama, in-process engine SIGKILLed (whole process group) once the log "
                    "held a load_completed, as this build's tests/on_vllm/test_crash.py does: the log ends "
                    "without its close and may end in a torn step", runs, shows)


SCENARIOS: dict[str, Callable[[Recorder], dict]] = {
    "host-evictions": host_evictions, "disk-small-host": disk_small_host, "disk-new-process": disk_new_process,
    "disk-tiny-host": disk_tiny_host,
    "valkey": valkey, "valkey-down-at-start": valkey_down_at_start, "failed-loads": failed_loads, "reset": reset, "tp2": tp2, "crash": crash,
    "disk-reset-kept": disk_reset_kept,
}


# --- helpers -------------------------------------------------------------------------------------------

def _dump(value) -> str:
    """JSON, indented, with each list of numbers on one line."""
    text = json.dumps(value, indent=2)
    return re.sub(r"\[\s*(-?[\d.]+(?:,\s*-?[\d.]+)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _short(arg: str, r: Recorder) -> str:
    return arg.replace(str(r.tree), "<tree>").replace(str(REPO), "<kvledger>").replace(PY, "python")


def _redact(value, r: Recorder, folder: Path, scratch: Path):
    if isinstance(value, dict):
        return {k: _redact(v, r, folder, scratch) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, r, folder, scratch) for v in value]
    if isinstance(value, str):
        value = value.replace(str(folder), "<here>").replace(str(scratch), "<scratch>")
        for name, path in r.models.items():
            value = value.replace(str(path), f"<models>/{name}")
        if value.startswith("redis://127.0.0.1:"):
            value = "redis://127.0.0.1:<port>"
    return value


def _brief(summary: dict | None) -> dict:
    """The replay summary's scalars and stats, not its long lists."""
    if not isinstance(summary, dict):
        return {}
    keep = {}
    for key, value in summary.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            keep[key] = value
        elif key in ("stats", "lower_tiers", "workers", "event_counts", "violations_by_kind"):
            keep[key] = value
    keep.setdefault("stats", {})
    return keep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", required=True, type=Path, help="a checkout of the build to record")
    parser.add_argument("--build", required=True, help="the corpus entry's name (the commit, short)")
    parser.add_argument("--out", required=True, type=Path, help="tests/compat/logs/NAME")
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="these scenarios only")
    parser.add_argument("--models", type=Path, default=Path("/tmp/kvledger-models"), help="tiny models' folder")
    args = parser.parse_args()
    tree = args.tree.resolve()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvledger-compat-"))
    recorder = Recorder(tree, args.build, out, args.models.resolve(), scratch)
    print(f"recording {args.build} ({recorder.commit}) from {tree}, vLLM {recorder.vllm_version}, into {out}",
          flush=True)
    failed = []
    for name in args.only or list(SCENARIOS):
        if (out / name).exists():
            print(f"== {name}: already recorded, kept as it is", flush=True)
            continue
        try:
            meta = SCENARIOS[name](recorder)
        except Exception as exc:  # one scenario's failure does not stop the others
            print(f"== {name} FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
            continue
        if meta["problems"]:
            failed.append(name)
    shutil.rmtree(scratch, ignore_errors=True)
    if failed:
        print(f"scenarios with problems: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
