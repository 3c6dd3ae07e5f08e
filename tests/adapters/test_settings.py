"""kv_connector_extra_config: every mistake is named, nothing is guessed."""

from __future__ import annotations

import pytest

from kvledger.adapters.settings import FaultSettings, parse_settings
from kvledger.adapters.vllm_version import UnsupportedVLLMVersion, check_vllm_version
from kvledger.events.config import ConfigError, PolicyName, Protection, StoreMode


def test_defaults_and_the_vllm_alias_for_capacity():
    settings = parse_settings({"cpu_bytes_to_use": 1 << 30})
    assert settings.capacity_bytes == 1 << 30
    assert settings.eviction_policy is PolicyName.LRU
    assert settings.event_log is None
    assert settings.faults == FaultSettings()  # no injected faults unless asked


def test_the_transfer_config_builder_gives_settings_the_connector_accepts():
    from kvledger.adapters.settings import kv_transfer_config

    config = kv_transfer_config(capacity_bytes=4096, store_mode="lazy")
    assert config["kv_connector_module_path"] == "kvledger.adapters.vllm"
    assert config["kv_load_failure_policy"] == "recompute"
    assert parse_settings(config["kv_connector_extra_config"]).store_mode.value == "lazy"


def test_every_key_is_read():
    settings = parse_settings({
        "capacity_bytes": 4096, "eviction_policy": "arc", "protection": "pin", "event_log": "/tmp/x.log", "event_log_format": "jsonl",
        "digest_interval": 8, "log_level": "debug", "log_json": True,
        "fault_injection": {"load_rate": 0.5, "store_rate": 0.25, "load_block_rate": 0.1, "seed": 7,
                            "corrupt": True},
    })
    assert (settings.eviction_policy, settings.event_log, settings.event_log_format) == (
        PolicyName.ARC, "/tmp/x.log", "jsonl")
    assert settings.protection is Protection.PIN
    lazy = parse_settings({"capacity_bytes": 1, "store_mode": "lazy", "lazy_target_blocks": 8})
    assert (lazy.store_mode, lazy.lazy_target_blocks) == (StoreMode.LAZY, 8)
    assert (settings.digest_interval, settings.log_level, settings.log_json) == (8, "debug", True)
    faults = settings.faults
    assert (faults.load_rate, faults.store_rate, faults.load_block_rate, faults.seed, faults.corrupt) == (
        0.5, 0.25, 0.1, 7, True)


@pytest.mark.parametrize("extra, words", [
    ({}, "capacity_bytes"),
    ({"capacity_bytes": 1, "capacity": 2}, "'capacity'"),
    ({"capacity_bytes": "1GB"}, "must be int"),
    ({"capacity_bytes": True}, "must be int"),
    ({"capacity_bytes": 0}, "positive"),
    ({"capacity_bytes": 1, "cpu_bytes_to_use": 2}, "disagree"),
    ({"capacity_bytes": 1, "eviction_policy": "fifo"}, "'lru' or 'arc'"),
    ({"capacity_bytes": 1, "event_log_format": "csv"}, "event_log_format"),
    ({"capacity_bytes": 1, "protection": "lock"}, "'flush' or 'pin'"),
    ({"capacity_bytes": 1, "store_mode": "never"}, "'eager' or 'lazy'"),
    ({"capacity_bytes": 1, "store_mode": "lazy", "protection": "pin"}, "needs protection 'flush'"),
    ({"capacity_bytes": 1, "lazy_target_blocks": 0}, "lazy_target_blocks"),
    ({"capacity_bytes": 1, "fault_injection": {"store_hold_steps": -1}}, "store_hold_steps"),
    ({"capacity_bytes": 1, "log_level": "loud"}, "log_level"),
    ({"capacity_bytes": 1, "digest_interval": -1}, "digest_interval"),
    ({"capacity_bytes": 1, "fault_injection": {"load_rate": 2}}, "within [0, 1]"),
    ({"capacity_bytes": 1, "fault_injection": {"rate": 0.1}}, "'rate'"),
    ({"capacity_bytes": 1, "fault_injection": {"seed": 0.5}}, "fault_injection.seed"),
    ({"capacity_bytes": 1, "fault_injection": []}, "fault_injection"),
])
def test_bad_settings_name_the_problem(extra, words):
    with pytest.raises(ConfigError) as info:
        parse_settings(extra)
    assert words in str(info.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0"])
def test_supported_vllm_versions(version):
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_other_vllm_versions_are_refused_by_name(version):
    with pytest.raises(UnsupportedVLLMVersion, match=f"0.32.x or 0.33.x; the installed vLLM is {version}"):
        check_vllm_version(version)


def test_an_unreadable_version_is_refused():
    with pytest.raises(UnsupportedVLLMVersion, match="cannot read the vLLM version 'dev'"):
        check_vllm_version("dev")

