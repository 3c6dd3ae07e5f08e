"""The scheduler's view of a shared disk tier: the start-up scan, lookups of
keys other processes wrote, and keys this process removed staying removed."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")
import torch

from kvledger.adapters.settings import parse_settings
from kvledger.adapters.vllm.lower_tiers import SchedulerTiers
from kvledger.transfers.block_file import block_path, write_block
from tests.adapters.test_tier_namespace import kv_cache_config, vllm_config

pytestmark = pytest.mark.vllm


def _tiers(tmp_path) -> SchedulerTiers:
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
        {"type": "fs", "path": str(tmp_path), "capacity_bytes": 1 << 20}]})
    return SchedulerTiers(settings, vllm_config(), kv_cache_config(), world_size=1)


def _store(tiers: SchedulerTiers, root, key: bytes) -> None:
    write_block(block_path(root, tiers.namespaces[0], key), tiers.namespaces[0], key, torch.zeros(64, dtype=torch.int8).numpy())


def _ask_until_answered(tiers: SchedulerTiers, request_id: str, keys) -> list:
    deadline = time.monotonic() + 5
    while tiers.ask(request_id, keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    return tiers.answers()


def test_the_scan_finds_what_is_there_and_lookups_what_came_later(tmp_path) -> None:
    tiers = _tiers(tmp_path)
    try:
        _store(tiers, tmp_path, b"a" * 20)
        (found,) = tiers.startup_events()
        assert found.tier == 1 and found.keys == (b"a" * 20,)
        _store(tiers, tmp_path, b"b" * 20)  # another process, after the start
        (answer,) = _ask_until_answered(tiers, "r1", [b"b" * 20, b"c" * 20])
        assert answer.keys == (b"b" * 20,)
        assert not tiers.ask("r1", [b"b" * 20])  # asked once per request
    finally:
        tiers.close()


def test_a_key_this_process_removed_is_not_found_again(tmp_path) -> None:
    """A lookup can run before the worker's removal: the file is still there, the block is not."""
    tiers = _tiers(tmp_path)
    try:
        _store(tiers, tmp_path, b"d" * 20)
        tiers.removed(1, [b"d" * 20])
        assert _ask_until_answered(tiers, "r2", [b"d" * 20]) == []
    finally:
        tiers.close()
