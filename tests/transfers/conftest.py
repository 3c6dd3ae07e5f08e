"""Fixtures the transfer tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def small_tmpfs(mount):
    """A real 1 MiB tmpfs: a disk that fills."""
    return mount("tmpfs", "size=1m")
