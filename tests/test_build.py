"""Both builds of the engine, tested: the compiled one (what the suite imports)
and the pure source (KVLEDGER_PURE=1, in a subprocess).

Each mode checks which build it really loaded, from the modules themselves, so
a "compiled" run that silently fell back to source fails here, and so does a
pure run that still loaded extension modules."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvledger
from kvledger import _build

ROOT = Path(__file__).resolve().parents[1]
PURE = os.environ.get(_build.PURE_ENV) == "1"

_LOADED = """
import importlib, json
import kvledger
from kvledger.engine import reducer
origins = [importlib.import_module(name).__spec__.origin for name in kvledger.BUILD.modules]
print(json.dumps({"compiled": kvledger.BUILD.compiled, "reason": kvledger.BUILD.reason, "origins": origins,
                  "reduce": type(reducer.reduce).__name__}))
"""


def _loaded(env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, "-c", _LOADED], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _env(pure: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != _build.PURE_ENV}
    if pure:
        env[_build.PURE_ENV] = "1"
    return env


def test_this_run_loaded_the_build_it_asked_for() -> None:
    from kvledger.engine import reducer, state

    assert kvledger.BUILD.modules and "kvledger.engine.reducer" in kvledger.BUILD.modules
    if PURE:
        assert not kvledger.BUILD.compiled, kvledger.BUILD
        assert reducer.__spec__.origin.endswith(".py") and state.__spec__.origin.endswith(".py")
        assert type(reducer.reduce).__name__ == "function"
    else:
        # The suite's default: the compiled engine, built from this very source.
        assert kvledger.BUILD.compiled, f"the suite expects the compiled engine; {kvledger.BUILD.reason}"
        suffix = ".cpython-" if sys.implementation.name == "cpython" else ".so"
        assert suffix in reducer.__spec__.origin and suffix in state.__spec__.origin
        assert type(reducer.reduce).__name__ == "builtin_function_or_method"


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
def test_every_compiled_module_loads_from_the_build_chosen(pure: bool) -> None:
    loaded = _loaded(_env(pure))
    if pure:
        assert not loaded["compiled"] and loaded["reason"] == "KVLEDGER_PURE=1"
        assert all(origin.endswith(".py") for origin in loaded["origins"]), loaded["origins"]
        assert loaded["reduce"] == "function"
    else:
        assert loaded["compiled"], loaded["reason"]
        assert not any(origin.endswith(".py") for origin in loaded["origins"]), loaded["origins"]
        assert loaded["reduce"] == "builtin_function_or_method"


def test_the_compiled_modules_are_all_of_engine_but_replay_and_the_miss_ledger() -> None:
    names = {path.stem for path in (ROOT / "engine").glob("*.py")} - {"__init__", "replay"}
    assert set(kvledger.BUILD.modules) == {f"kvledger.engine.{name}" for name in names} | {
        "kvledger.adapters.log_tools.misses"}


def test_compiled_modules_built_from_other_source_are_not_used() -> None:
    current = _build.fingerprint()
    assert _build.decide(None, dict(current), current).compiled
    edited = dict(current, **{"engine/reducer.py": "0" * 64})
    stale = _build.decide(None, edited, current)
    assert not stale.compiled and "stale" in stale.reason and "engine/reducer.py" in stale.reason
    fewer = {source: digest for source, digest in current.items() if source != "engine/slots.py"}
    assert not _build.decide(None, fewer, current).compiled  # a module added since the build
    assert not _build.decide(None, None, current).compiled
    assert not _build.decide("1", dict(current), current).compiled


_STATEFUL = "tests/engine/test_stateful.py"


@pytest.mark.slow
@pytest.mark.parametrize("part", ["stateful", "the rest"])
def test_the_engine_properties_and_golden_replays_hold_on_the_pure_build(tmp_path: Path, part: str) -> None:
    """The engine's unit, property and stateful tests, the golden replays and the
    tests marked pure (which patch engine functions), on the source itself; in two
    parts, the stateful machine apart, so that two workers share them. Hypothesis's
    `dev` profile (30 examples, 30 steps): the compiled build, the one that serves,
    runs the same properties with `ci`'s 200 in this suite, and the golden replays
    here are whole; the deeper search ran twice over one source for 45 s of the suite."""
    decorator = re.compile(r"^@pytest\.mark\.pure$", re.MULTILINE)
    marked = sorted({str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                     if decorator.search(path.read_text())} - {_STATEFUL})
    paths = [_STATEFUL] if part == "stateful" else [
        "tests/engine", f"--ignore={_STATEFUL}", "tests/test_golden.py",
        "tests/test_build.py::test_this_run_loaded_the_build_it_asked_for", *marked]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *paths],
        cwd=ROOT, env={**_env(pure=True), "HYPOTHESIS_PROFILE": "dev"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "deselected" not in summary, summary


def test_compiled_modules_never_call_getattr_with_a_default():
    """Compiled, `getattr(obj, name, default)` makes and clears an AttributeError
    whenever the attribute is missing: for a transfer outcome's per-event check that
    was three times the cost of the check itself. The engine reads optional fields
    by the event's type instead (`invariants._FOOTPRINT`)."""
    offenders = []
    for source in _build.sources(str(ROOT)):
        for node in ast.walk(ast.parse((ROOT / source).read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3):
                offenders.append(f"{source}:{node.lineno}")
    assert not offenders, offenders
