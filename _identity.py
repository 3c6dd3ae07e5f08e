"""Which build of kvledger this is, as its logs record it: the version and the
commit the source came from.

A log outlives the build that wrote it, and a log a later build cannot replay
names the build that can (`adapters/log_rules.py`), so the commit travels with
the version. A wheel carries it in `_commit.txt`, written by setup.py from the
checkout it was built in; a checkout asks git. `+dirty` marks a source with
changes no commit holds. Standard library only: setup.py loads this file by path.
"""

from __future__ import annotations

import functools
import os
import subprocess

ROOT = os.path.dirname(os.path.abspath(__file__))
COMMIT_FILE = "_commit.txt"
UNKNOWN = "unknown"


def from_git(root: str = ROOT) -> str | None:
    """The checkout's commit (`+dirty` if tracked files differ from it), or None outside git."""
    if not os.path.exists(os.path.join(root, ".git")):
        return None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


@functools.cache
def commit(root: str = ROOT) -> str:
    """This build's commit: a wheel's recorded one, else git's, else `unknown`."""
    try:
        with open(os.path.join(root, COMMIT_FILE)) as file:
            recorded = file.read().strip()
        if recorded:
            return recorded
    except OSError:
        pass
    return from_git(root) or UNKNOWN
