"""Why a stored block cannot be served: one error for every tier and format.

A module of its own because the block header and the seal both raise it,
and the header uses the seal: neither need import the other for it.
"""

from __future__ import annotations

import collections
import errno
import os
from collections.abc import Iterable

from kvledger.events.types import FAILURE_REASONS


class BlockFileError(Exception):
    """A stored block (a file, or a store's value) cannot be served. `reason` is one of `REASONS`."""

    # "forged": a tier with a secret got a block its key did not seal (written by someone else).
    REASONS = ("missing", "truncated", "foreign", "corrupt", "forged", "unreadable", "unwritable", "disk_full")

    def __init__(self, reason: str, path: str | os.PathLike, detail: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(f"{reason}: {os.fspath(path)}: {detail}")
        self.reason = reason
        self.path = os.fspath(path)
        self.detail = detail


def write_error(path: str | os.PathLike, exc: OSError) -> BlockFileError:
    """A failed write, named for what an operator does about it: a file system out of room
    (or over quota) is `disk_full`, anything else `unwritable`."""
    reason = "disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "unwritable"
    return BlockFileError(reason, path, f"{exc.strerror or exc} (errno {exc.errno})")


def report_reason(reasons: Iterable[str]) -> str:
    """The most common of block failures' reasons, as a worker's report names it
    (`events.types.FAILURE_REASONS`; the first met wins a tie; a cancelled block
    was refused)."""
    counted = collections.Counter("rejected" if reason == "cancelled" else reason for reason in reasons)
    return counted.most_common(1)[0][0] if counted else ""


# Every word a tier's block failure can carry into a worker's report is one the log knows.
assert {*BlockFileError.REASONS, "unreachable", "rejected"} <= set(FAILURE_REASONS), \
    "a tier's failure reason missing from events.types.FAILURE_REASONS"
