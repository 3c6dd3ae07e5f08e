"""Which build wrote a log: `_identity` names the commit from a wheel's `_commit.txt`,
or a checkout's git (`+dirty` when tracked files differ), or says it does not know."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvledger import _identity

pytestmark = pytest.mark.fast


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_a_checkout_names_its_commit_and_whether_it_is_dirty(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert _identity.from_git(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert _identity.from_git(str(tmp_path)) == head + "+dirty"


def test_a_wheels_recorded_commit_wins_and_without_either_it_is_unknown(tmp_path: Path) -> None:
    assert _identity.from_git(str(tmp_path)) is None
    assert _identity.commit.__wrapped__(str(tmp_path)) == _identity.UNKNOWN
    (tmp_path / _identity.COMMIT_FILE).write_text("0123abcd\n")
    assert _identity.commit.__wrapped__(str(tmp_path)) == "0123abcd"
