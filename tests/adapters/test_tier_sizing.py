"""One rule for a tier's size in blocks: serving (`engine_tiers`) and `kvledger whatif
--secondary-tiers` give the same number for the same setting, for every tier type and
world size, a block's header and its copies (one per shard of the ranks' KV) counted."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")

from kvledger.adapters.cli.whatif import _other_config
from kvledger.adapters.settings import parse_settings
from kvledger.adapters.vllm.lower_tiers import engine_tiers
from kvledger.events.config import EngineConfig
from kvledger.transfers.lower_tiers.tier_types import TIER_TYPES

pytestmark = pytest.mark.fast
SLOT_BYTES = 64 << 10
CAPACITY = 10 << 30


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entries(tmp_path, secret: bool) -> dict[str, dict]:
    keys = {"secret_env": "KVLEDGER_TEST_SIZING_SECRET"} if secret else {}
    return {
        "fs": {"type": "fs", "path": str(tmp_path / "tier"), "capacity_bytes": CAPACITY, **keys},
        "valkey": {"type": "valkey", "url": f"redis://127.0.0.1:{_closed_port()}", "capacity_bytes": CAPACITY,
                   "on_unreachable": "warn", **keys},
    }


def _whatif(entry: dict, world_size: int, copies: int) -> int:
    config = EngineConfig.from_dict({"groups": [{"group_id": 0, "kind": "full", "block_size": 16}],
                                     "hash_block_size": 16, "num_device_blocks": 64, "num_tier_slots": 32,
                                     "world_size": world_size, "slot_bytes": SLOT_BYTES, "tier_copies": copies})
    located = {k: v for k, v in entry.items() if k not in ("path", "url", "on_unreachable")}  # whatif need not say where
    args = argparse.Namespace(capacity_bytes=None, capacity_blocks=None, policy=None, store_threshold=None,
                              max_tracker_size=None, offload_prompt_only=None, secondary_tiers=json.dumps([located]))
    (spec,) = _other_config(args, config).lower_tiers
    return spec.num_blocks


def test_every_tier_type_is_sized() -> None:
    assert set(TIER_TYPES) == {"fs", "valkey"}  # a new type: add it to `_entries`


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("world_size,copies", [(1, 1), (2, 2), (2, 1), (4, 4), (8, 2)])
@pytest.mark.parametrize("kind", ["fs", "valkey"])
def test_serving_and_whatif_size_a_tier_alike(tmp_path, monkeypatch, kind: str, world_size: int, copies: int,
                                              secret: bool) -> None:
    monkeypatch.setenv("KVLEDGER_TEST_SIZING_SECRET", "s" * 32)
    entry = _entries(tmp_path, secret)[kind]
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [entry]})
    (serving,) = engine_tiers(settings, SLOT_BYTES, copies)
    assert _whatif(entry, world_size, copies) == serving.num_blocks
    header = TIER_TYPES[kind].header_bytes(settings.secondary_tiers[0])
    assert serving.num_blocks == CAPACITY // (copies * (header + SLOT_BYTES)) < CAPACITY // (copies * SLOT_BYTES)


def test_a_log_before_its_copies_were_recorded_is_sized_one_file_per_rank(tmp_path) -> None:
    entry = _entries(tmp_path, False)["fs"]
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [entry]})
    assert _whatif(entry, 2, 0) == engine_tiers(settings, SLOT_BYTES, 2)[0].num_blocks


@pytest.mark.parametrize("kind", ["fs", "valkey"])
def test_a_tier_too_small_for_one_block_is_refused_alike_naming_it(tmp_path, kind: str) -> None:
    from kvledger.adapters.cli.log_commands import BadArgument
    from kvledger.events.config import ConfigError

    entry = {**_entries(tmp_path, False)[kind], "capacity_bytes": SLOT_BYTES}  # the header does not fit beside it
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [entry]})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.capacity_bytes=65536 holds no block"):
        engine_tiers(settings, SLOT_BYTES, 1)
    with pytest.raises(BadArgument, match=r"secondary_tiers\[0\]\.capacity_bytes=65536 holds no block"):
        _whatif(entry, 1, 1)
