"""engine/ and events/ stay pure: ruff's banned-api rule, configured in
pyproject.toml, rejects imports of the outside world there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
