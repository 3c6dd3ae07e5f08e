"""The layering, checked rather than hoped for.

engine/ and events/ stay pure: ruff's banned-api rule rejects imports of the
outside world there. Between kvledger's own packages, import-linter's
contracts (pyproject.toml) keep the direction events <- engine <- transfers
<- adapters, keep the testing wing and the CLI out of the connector, keep
the tests' support (tests/support/) out of everything installed, and vLLM
inside the adapters."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "TID251", *args],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60)


def test_engine_and_events_import_nothing_impure() -> None:
    result = _ruff("engine", "events")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_rejects_an_impure_import() -> None:
    for module in ("torch", "vllm", "structlog", "time", "random", "os", "threading"):
        for folder in ("engine", "events"):
            result = _ruff("--stdin-filename", f"{folder}/probe.py", "-", stdin=f"import {module}\n")
            assert result.returncode == 1 and "TID251" in result.stdout, (folder, module, result.stdout)


def test_the_outer_layers_may_import_them() -> None:
    result = _ruff("--stdin-filename", "transfers/probe.py", "-", stdin="import torch\nimport threading\n")
    assert result.returncode == 0, result.stdout


# Between kvledger's own packages: import-linter's contracts in pyproject.toml.


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the sources, as package `kvledger`: the probes below are written
    into it, never into the tree other tests (and the compiled engine's
    fingerprint) read at the same time."""
    import os
    import shutil

    root = tmp_path_factory.mktemp("layering") / "kvledger"
    shutil.copytree(ROOT, root, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache", "*.so",
        "bench", "docs"))
    assert os.path.isfile(root / "pyproject.toml")
    return root


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, PYTHONPATH=str(root.parent))  # `kvledger` is the copy
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, timeout=120, env=env)


def test_the_package_layers_are_kept(package_copy: Path) -> None:
    result = _lint_imports(package_copy)
    assert result.returncode == 0 and "0 broken" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("folder, line, contract", [
    ("engine", "from kvledger.adapters import settings", "events <- engine <- transfers <- adapters"),
    ("events", "from kvledger.engine import state", "events <- engine <- transfers <- adapters"),
    ("transfers", "from kvledger.adapters.testing import simulator", "never imports the testing wing"),
    ("adapters/vllm", "from kvledger.adapters.cli import main", "never imports the testing wing"),
    ("adapters/cli", "from tests.support import fake_vllm", "Nothing installed imports the tests' support"),
    ("transfers", "import vllm", "Only the adapters import vLLM"),
])
def test_a_wrong_way_import_breaks_a_contract(package_copy: Path, folder: str, line: str, contract: str) -> None:
    probe = package_copy / folder / "_layering_probe.py"
    probe.write_text(line + "\n")
    try:
        result = _lint_imports(package_copy)
    finally:
        probe.unlink()
    assert result.returncode == 1, result.stdout
    broken = result.stdout.split("Broken contracts")[-1]
    assert contract in broken and "_layering_probe" in broken, result.stdout


@pytest.mark.slow
def test_the_fast_subset_collects_and_runs_where_vllm_is_absent(tmp_path) -> None:
    """`pytest -m fast` is the inner loop on any machine: nothing in it may need vLLM."""
    script = ("import sys; sys.modules['vllm'] = None  # `import vllm` now raises ImportError\n"
              "import pytest; sys.exit(pytest.main(['-q', '-m', 'fast', '-p', 'no:cacheprovider', "
              "'--co', 'tests']))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith("ERROR")], result.stdout[-3000:]
    collected = int(next(line for line in lines if " tests collected" in line).split("/")[0].split()[0])
    assert collected > 500, lines[-1]  # the fast subset, not a handful


# The engine's state is read outside engine/ through `engine/queries.py` alone:
# its `core` is the engine's own layout, free to change. The simulator
# (adapters/testing/) is the property tests' reference model, which checks the
# core field by field, and is exempt.
_CORE_READERS_ALLOWED = ("engine/", "adapters/testing/")


def _core_reads(path: Path, root: Path = ROOT) -> list[str]:
    import ast

    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(root)}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "core"]


def test_nothing_outside_the_engine_reads_its_core() -> None:
    offenders = []
    for folder in ("adapters", "transfers", "events"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not str(path.relative_to(ROOT)).startswith(_CORE_READERS_ALLOWED):
                offenders += _core_reads(path)
    assert not offenders, f"read the state through engine/queries.py: {offenders}"


def test_the_core_check_finds_a_read(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def used(state):\n    return state.core.lower\n")
    assert _core_reads(probe, tmp_path) == ["probe.py:2"]


# Imports inside functions: each hides a module from the import graph (import-linter does
# not see a circle through one), so each must say why it is there: on its line, or in a
# comment line just above the imports it begins.
_PRODUCT = ("_build.py", "_identity.py", "__init__.py", "engine", "events", "transfers", "adapters")


def _unexplained_inner_imports(path: Path, root: Path = ROOT) -> list[str]:

    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if not isinstance(inner, (ast.Import, ast.ImportFrom)):
                continue
            number = inner.lineno - 1
            while number > 0 and lines[number - 1].lstrip().startswith(("import ", "from ")):
                number -= 1  # the first of the imports this one is grouped with
            said = "#" in lines[inner.lineno - 1] or (number > 0 and lines[number - 1].lstrip().startswith("#"))
            if not said:
                found.append(f"{path.relative_to(root)}:{inner.lineno}")
    return sorted(set(found))


def test_every_import_inside_a_function_says_why() -> None:
    offenders = []
    for entry in _PRODUCT:
        paths = [ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).rglob("*.py"))
        for path in paths:
            offenders += _unexplained_inner_imports(path)
    assert not offenders, f"an import inside a function hides it from the import graph; say why in a comment: " \
                          f"{offenders}"


def test_the_inner_import_check_finds_one_without_a_reason(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def used():\n    import json\n    # heavy: only here\n    import torch\n    import numpy\n"
                     "    import os  # stdlib, said here\n    return json\n")
    assert _unexplained_inner_imports(probe, tmp_path) == ["probe.py:2"]
