"""Why a stored block cannot be served: one error for every tier and format.

A module of its own because the block header and the seal both raise it,
and the header uses the seal: neither need import the other for it.
"""

from __future__ import annotations

import os


class BlockFileError(Exception):
    """A stored block (a file, or a store's value) cannot be served. `reason` is one of `REASONS`."""

    # "forged": a tier with a secret got a block its key did not seal (written by someone else).
    REASONS = ("missing", "truncated", "foreign", "corrupt", "forged", "unreadable", "unwritable")

    def __init__(self, reason: str, path: str | os.PathLike, detail: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(f"{reason}: {os.fspath(path)}: {detail}")
        self.reason = reason
        self.path = os.fspath(path)
        self.detail = detail
