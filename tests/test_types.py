"""engine/ and events/ type-check clean under mypy.

mypyc compiles the engine from these annotations (setup.py), and a compiled
module enforces them at run time, so a type error there is a bug in waiting.
The repository root is the `kvledger` package, so mypy reads it through a
`kvledger` link in a scratch folder; that works from any checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.slow  # mypy runs in a subprocess: seconds each


def _mypy(tmp_path: Path, *paths: str) -> subprocess.CompletedProcess:
    (tmp_path / "kvledger").symlink_to(ROOT, target_is_directory=True)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), *paths],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_engine_and_events_type_check(tmp_path: Path) -> None:
    result = _mypy(tmp_path, "-p", "kvledger.engine", "-p", "kvledger.events")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues found in" in result.stdout


def test_the_check_rejects_a_type_error(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from kvledger.engine.state import Stats\n\nStats().stores = 'many'\n")
    result = _mypy(tmp_path, str(probe))
    assert result.returncode == 1 and "Incompatible types in assignment" in result.stdout, result.stdout
