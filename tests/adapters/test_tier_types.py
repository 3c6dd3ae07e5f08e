"""The tier types as one table: every settings class has exactly one row, a
table that lacks one (or has one too many) is refused, and nothing outside
the table picks a tier's behaviour by its class."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import attrs
import pytest

from kvledger.transfers.lower_tiers.block_header import HEADER_BYTES, KEY_BYTES_MAX, compact_header_bytes
from kvledger.transfers.lower_tiers.fs.settings import FsTierSettings
from kvledger.transfers.lower_tiers.tier_types import (
    TIER_SETTINGS_TYPES,
    TIER_TYPES,
    TierSettings,
    check_tier_types,
    tier_type,
)
from kvledger.transfers.lower_tiers.valkey.settings import ValkeyTierSettings
from kvledger.transfers.lower_tiers.valkey.store import ValkeyServer

ROOT = Path(__file__).resolve().parents[2]


def test_every_settings_class_of_the_union_has_exactly_one_row_under_its_kind():
    assert set(TIER_SETTINGS_TYPES) == set(typing.get_args(TierSettings)) == {FsTierSettings, ValkeyTierSettings}
    assert sorted(row.settings.__name__ for row in TIER_TYPES.values()) == sorted(
        cls.__name__ for cls in TIER_SETTINGS_TYPES)
    assert all(kind == row.settings.kind for kind, row in TIER_TYPES.items())
    check_tier_types(TIER_TYPES, TIER_SETTINGS_TYPES)  # what the module ran at import


def test_a_table_lacking_a_row_is_refused():
    lacking = {kind: row for kind, row in TIER_TYPES.items() if kind != "valkey"}
    with pytest.raises(AssertionError, match="ValkeyTierSettings has 0 rows"):
        check_tier_types(lacking, TIER_SETTINGS_TYPES)


@attrs.frozen(kw_only=True)
class _S3TierSettings:
    bucket: str
    kind: typing.ClassVar[str] = "s3"


def test_a_row_for_a_class_outside_the_union_is_refused():
    extra = {**TIER_TYPES, "s3": attrs.evolve(TIER_TYPES["fs"], settings=_S3TierSettings)}
    with pytest.raises(AssertionError, match="_S3TierSettings names no member of TierSettings"):
        check_tier_types(extra, TIER_SETTINGS_TYPES)
    # ... and a union member without its row: the same table, checked against a union that has it
    with pytest.raises(AssertionError, match="_S3TierSettings has 0 rows"):
        check_tier_types(TIER_TYPES, (*TIER_SETTINGS_TYPES, _S3TierSettings))


def test_a_row_under_another_kind_or_a_class_with_two_rows_is_refused():
    swapped = {"fs": TIER_TYPES["valkey"], "valkey": TIER_TYPES["fs"]}
    with pytest.raises(AssertionError, match="row 'fs' holds ValkeyTierSettings, whose kind is 'valkey'"):
        check_tier_types(swapped, TIER_SETTINGS_TYPES)
    twice = {**TIER_TYPES, "disk": TIER_TYPES["fs"]}
    with pytest.raises(AssertionError, match="FsTierSettings has 2 rows, not one"):
        check_tier_types(twice, TIER_SETTINGS_TYPES)


def test_each_rows_fields_say_what_its_type_does(tmp_path):
    fs = FsTierSettings(path=str(tmp_path), capacity_bytes=1 << 20)
    valkey = ValkeyTierSettings(server=ValkeyServer(nodes=(("127.0.0.1", 6379),)), capacity_bytes=1 << 20)
    assert tier_type(fs) is TIER_TYPES["fs"] and tier_type(valkey) is TIER_TYPES["valkey"]
    # the file-system tier: scanned at start, removes its files (so tombstones), a file header per block
    assert TIER_TYPES["fs"].scan is not None and TIER_TYPES["fs"].tombstones
    assert TIER_TYPES["fs"].header_bytes(fs) == HEADER_BYTES
    assert TIER_TYPES["fs"].where(fs) == {"path": str(tmp_path)}
    assert TIER_TYPES["fs"].scan(fs, bytes(16)) == []
    # the Valkey tier: a shared store, looked up and never scanned, deletes nothing; a value's header per block
    assert TIER_TYPES["valkey"].scan is None and not TIER_TYPES["valkey"].tombstones
    assert TIER_TYPES["valkey"].header_bytes(valkey) == compact_header_bytes(bytes(KEY_BYTES_MAX), sealed=False)
    assert TIER_TYPES["valkey"].where(valkey) == {"server": valkey.server.where}


def test_the_fs_rows_lookup_finds_nothing_in_an_empty_directory(tmp_path):
    lookup = TIER_TYPES["fs"].lookup(FsTierSettings(path=str(tmp_path), capacity_bytes=1 << 20), "1:fs",
                                     (bytes(16),))
    assert lookup.find((b"a" * 20,)) == () and lookup.health is None
    lookup.close()  # the directories it holds open (`tier_dir`)


@pytest.mark.parametrize("path", ["adapters/settings.py", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "adapters" / "vllm").glob("*.py"))])
def test_no_module_outside_the_table_picks_a_tier_by_its_settings_class(path):
    source = (ROOT / path).read_text()
    assert not re.search(r"isinstance\([^)]*TierSettings", source), path



def test_a_shared_tier_without_a_secret_and_a_password_in_clear_are_warned_of_at_start(
        tmp_path: Path, valkey_server, monkeypatch) -> None:
    """Whoever can write a shared tier can serve its readers unchecked, and AUTH over plain
    redis:// shows the password to the path: each says so once, at start. A private directory,
    or one with a secret, says nothing."""
    import structlog

    from kvledger.transfers.lower_tiers.tier_types import check_tiers, parse_tiers

    monkeypatch.setenv("KVLEDGER_TEST_SECRET", "0123456789abcdef0123456789abcdef")
    monkeypatch.setenv("KVLEDGER_TEST_PASSWORD", "hunter2")
    server = valkey_server()
    tiers = parse_tiers([
        {"type": "fs", "path": str(tmp_path / "shared"), "capacity_bytes": 1 << 20},
        {"type": "fs", "path": str(tmp_path / "private"), "capacity_bytes": 1 << 20, "shared": False},
        {"type": "fs", "path": str(tmp_path / "sealed"), "capacity_bytes": 1 << 20, "secret_env": "KVLEDGER_TEST_SECRET"},
        {"type": "valkey", "url": server.url, "capacity_bytes": 1 << 20, "password_env": "KVLEDGER_TEST_PASSWORD",
         "on_unreachable": "warn", "secret_env": "KVLEDGER_TEST_SECRET"},
    ])
    with structlog.testing.capture_logs() as logs:
        check_tiers(tiers)
    unsealed = [line["tier"] for line in logs if line["event"] == "shared_tier_without_secret"]
    in_clear = [line["where"] for line in logs if line["event"] == "tier_password_in_clear"]
    assert unsealed == ["secondary_tiers[0]"] and in_clear == ["secondary_tiers[3]"]
    assert "hunter2" not in repr(logs)
