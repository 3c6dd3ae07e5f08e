"""The connector's settings: `kv_connector_extra_config`, checked once at start.

A typo in a deployment's JSON must stop vLLM with a message that names the
key, not run with a default nobody chose. Both roles parse the same dict, so
the scheduler and the worker agree on the tier size and the fault plan.

`secondary_tiers`, the tiers below host memory, is parsed in `tier_settings`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import attrs

from kvledger.adapters.backpressure import BackpressureSettings
from kvledger.adapters.engine_host import SNAPSHOT_INTERVAL_EVENTS
from kvledger.events.config import ConfigError, PolicyName, Protection, StoreMode
from kvledger.transfers.lower_tiers.fs.settings import FsTierSettings, block_file_bytes
from kvledger.transfers.lower_tiers.tier_types import TierSettings
from kvledger.transfers.lower_tiers.valkey.settings import ValkeyTierSettings

__all__ = ["ConnectorSettings", "FaultSettings", "FsTierSettings", "TierSettings", "ValkeyTierSettings",
           "block_file_bytes", "kv_transfer_config", "parse_settings"]

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("binary", "jsonl")

# vLLM's own offloading connectors name the tier size `cpu_bytes_to_use`;
# accepting it lets a deployment switch connectors without renaming keys.
_CAPACITY_ALIASES = ("capacity_bytes", "cpu_bytes_to_use")


@attrs.frozen(kw_only=True)
class FaultSettings:
    """Injected transfer failures, for end-to-end tests of recovery."""

    load_rate: float = 0.0  # fraction of load jobs that fail whole
    store_rate: float = 0.0  # fraction of store jobs that fail whole
    load_block_rate: float = 0.0  # fraction of loaded blocks that fail
    seed: int = 0
    corrupt: bool = False  # a failed load still writes garbage into its blocks, and reports success
    store_hold_steps: int = 0  # each store starts this many steps late (unless flushed): a slow transfer
    ranks: tuple[int, ...] = ()  # the tensor-parallel workers that inject these faults; empty: every worker
    tier_read_delay_s: float = 0.0  # every read of a tier below host memory starts this late: a slow disk

    def applies_to(self, worker_index: int) -> bool:
        return not self.ranks or worker_index in self.ranks


@attrs.frozen(kw_only=True)
class ConnectorSettings:
    capacity_bytes: int
    eviction_policy: PolicyName = PolicyName.LRU
    protection: Protection = Protection.FLUSH
    store_mode: StoreMode = StoreMode.EAGER
    lazy_target_blocks: int = 64
    load_timeout_s: float = 30.0
    event_log: str | None = None
    event_log_format: str = "binary"
    event_log_on_error: str = "continue"  # or "stop": a log that cannot be written stops vLLM
    digest_interval: int = 64
    snapshot_interval_events: int = SNAPSHOT_INTERVAL_EVENTS
    log_level: str = "warning"
    log_json: bool = False
    faults: FaultSettings = FaultSettings()
    secondary_tiers: tuple[TierSettings, ...] = ()  # below host memory, in order
    weights_version: str | None = None  # names the weights in the tiers' namespace (lower tiers)
    key_generations: str = "private"  # or "counted" or "kept": see `_FIELDS`
    miss_metrics: bool = True  # count missed tokens by cause live (`adapters.miss_counter`)
    miss_memory_keys: int | None = None  # None: four times what the tiers hold (`miss_counter.default_keys`)
    store_threshold: int = 1  # vLLM's: store a block once this many requests offered it
    max_tracker_size: int = 64_000  # vLLM's: keys whose offers are counted
    offload_prompt_only: bool = False  # vLLM's (its default is on): store prompt blocks alone
    self_describing_kv_events: bool = False  # vLLM's: KV events carry vLLM's hashes, tokens and locality
    restore_budget: str = "load"  # or "auto": load a hit only where it is estimated faster than computing it
    # vLLM 0.33's `backpressure`, per lower tier in order (None: never dropped): `adapters.backpressure`
    backpressure: tuple[BackpressureSettings | None, ...] = ()


_FIELDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "capacity_bytes": (int, "tier capacity in bytes"),
    "cpu_bytes_to_use": (int, "tier capacity in bytes (vLLM's name)"),
    "eviction_policy": (str, "'lru' or 'arc'"),
    "protection": (str, "'flush' or 'pin': how a store's source blocks are kept intact"),
    "store_mode": (str, "'eager' or 'lazy': store every full block, or only blocks about to be reused"),
    "lazy_target_blocks": (int, "lazy mode: how far from the eviction end of the free queue to store"),
    "load_timeout_s": ((int, float), "a load not finished after this many seconds fails and is recomputed (0: "
                                     "never)"),
    "event_log": (str, "path of the event log the scheduler writes"),
    "event_log_format": (str, "'binary' or 'jsonl'"),
    "event_log_on_error": (str, "'continue' (stop the log, keep serving) or 'stop' (stop vLLM)"),
    "digest_interval": (int, "a state digest every this many steps"),
    "snapshot_interval_events": (int, "binary logs: a snapshot of the whole state after this many events"),
    "log_level": (str, "one of " + ", ".join(LOG_LEVELS)),
    "log_json": (bool, "structured logs as JSON lines"),
    "fault_injection": (dict, "injected transfer failures, for tests"),
    "secondary_tiers": ((list, tuple), "tiers below host memory, in order: a dict each, with a 'type'"),
    "weights_version": (str, "names the model's weights, for tiers that outlive the process: change it when "
                             "the weights under the same model name change"),
    "key_generations": (str, "'private' (each cache reset starts block keys no other process shares), "
                             "'counted' (every replica's Nth reset shares keys: only for a fleet that loads the "
                             "same new weights through one reset each) or 'kept' (a reset empties host memory "
                             "alone; the tiers below it keep their blocks and keys, as vLLM 0.33's secondary "
                             "tiers do: only where the weights never change under a reset)"),
    "miss_metrics": (bool, "count missed prompt tokens by cause (vllm:kvledger_missed_tokens), folding the "
                           "engine's notifications on a thread of its own"),
    "miss_memory_keys": (int, "keys whose history the miss counter remembers (the oldest-named are forgotten; "
                              "by default four times the blocks every tier holds, 16384 to 262144)"),
    "store_threshold": (int, "vLLM's: store a block only once this many requests have offered it (1: at once)"),
    "max_tracker_size": (int, "vLLM's: keys whose offers store_threshold counts (the least recently offered "
                              "are forgotten)"),
    "offload_prompt_only": (bool, "vLLM's: store only blocks whole within the prompt, none of the generated "
                                  "tokens' (vLLM's default is true; kvledger's false)"),
    "backpressure": (dict, "vLLM 0.33's: every lower tier's spills dropped while its writes run slow (a tier's "
                           "own 'backpressure' entry overrides it); backpressure_cls, policy_cls, high_water_s, ..."),
    "restore_budget": (str, "'load' (every hit loaded) or 'auto' (a hit loaded only where loading it is estimated "
                            "faster than computing it, by the measured load and prefill times)"),
    "self_describing_kv_events": (bool, "vLLM's: KV events announce each stored block with vLLM's block "
                                        "hashes, its parent, its tokens and its tier's locality"),
}

_FAULT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "load_rate": (int, float),
    "store_rate": (int, float),
    "load_block_rate": (int, float),
    "seed": int,
    "corrupt": bool,
    "store_hold_steps": int,
    "ranks": (list, tuple),
    "tier_read_delay_s": (int, float),
}


def _typed(name: str, value: Any, expected: type | tuple[type, ...]) -> Any:
    types = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        names = " or ".join(t.__name__ for t in types)
        if int in types and isinstance(value, float) and value.is_integer():
            raise ConfigError(f"kv_connector_extra_config[{name!r}] must be an integer, got {value!r}: "
                              f"write {int(value)} (JSON reads 64e9 as a float)")
        raise ConfigError(f"kv_connector_extra_config[{name!r}] must be {names}, got {value!r}")
    return value


def kv_transfer_config(**extra: Any) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for kvledger, with `extra` as its
    `kv_connector_extra_config`. Failed loads are recomputed (vLLM's default
    policy, "fail", would return an error for the request instead)."""
    return {"kv_connector": "KVLedgerConnector", "kv_connector_module_path": "kvledger.adapters.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def parse_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """Validate vLLM's `kv_connector_extra_config` for kvledger."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {', '.join(map(repr, unknown))}; "
            f"kvledger knows: {', '.join(sorted(_FIELDS))}")
    for name, (expected, _) in _FIELDS.items():
        if name in extra:
            _typed(name, extra[name], expected)

    given = [k for k in _CAPACITY_ALIASES if k in extra]
    if not given:
        raise ConfigError("kv_connector_extra_config needs the tier size: 'capacity_bytes' (bytes of host "
                          "memory for offloaded KV; vLLM's name 'cpu_bytes_to_use' also works)")
    if len(given) == 2 and extra["capacity_bytes"] != extra["cpu_bytes_to_use"]:
        raise ConfigError("'capacity_bytes' and 'cpu_bytes_to_use' are the same setting and disagree")
    capacity = extra[given[0]]
    if capacity <= 0:
        raise ConfigError(f"{given[0]} must be positive, got {capacity}")

    policy = extra.get("eviction_policy", "lru")
    if policy not in {p.value for p in PolicyName}:
        raise ConfigError(f"eviction_policy must be 'lru' or 'arc', got {policy!r}")
    protection = extra.get("protection", "flush")
    if protection not in {p.value for p in Protection}:
        raise ConfigError(f"protection must be 'flush' or 'pin', got {protection!r}")
    store_mode = extra.get("store_mode", "eager")
    if store_mode not in {m.value for m in StoreMode}:
        raise ConfigError(f"store_mode must be 'eager' or 'lazy', got {store_mode!r}")
    if store_mode == "lazy" and protection != "flush":
        raise ConfigError("store_mode 'lazy' needs protection 'flush': pinning free blocks would reorder "
                          "vLLM's LRU")
    target = extra.get("lazy_target_blocks", 64)
    if target <= 0:
        raise ConfigError(f"lazy_target_blocks must be positive, got {target}")
    load_timeout = extra.get("load_timeout_s", 30.0)
    if not math.isfinite(load_timeout) or load_timeout < 0:
        raise ConfigError(f"load_timeout_s must be a finite number of seconds >= 0 (0: no timeout), "
                          f"got {load_timeout}")
    fmt = extra.get("event_log_format", "binary")
    if fmt not in LOG_FORMATS:
        raise ConfigError(f"event_log_format must be 'binary' or 'jsonl', got {fmt!r}")
    on_error = extra.get("event_log_on_error", "continue")
    if on_error not in ("continue", "stop"):
        raise ConfigError(f"event_log_on_error must be 'continue' or 'stop', got {on_error!r}")
    level = extra.get("log_level", "warning")
    if level not in LOG_LEVELS:
        raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    interval = extra.get("digest_interval", 64)
    if interval < 0:
        raise ConfigError(f"digest_interval must be >= 0 (0: no digests), got {interval}")
    snapshots = extra.get("snapshot_interval_events", SNAPSHOT_INTERVAL_EVENTS)
    if snapshots < 0:
        raise ConfigError(f"snapshot_interval_events must be >= 0 (0: no snapshots), got {snapshots}")
    event_log = extra.get("event_log") or None
    if event_log is not None and os.path.isdir(event_log):
        raise ConfigError(f"event_log {event_log!r} is a directory: name the log file in it, such as "
                          f"{os.path.join(event_log, 'kvledger-events.log')!r}")
    weights_version = extra.get("weights_version")
    if weights_version is not None and not weights_version:
        raise ConfigError("weights_version must be a non-empty string (leave it out for none)")
    generations = extra.get("key_generations", "private")
    if generations not in ("private", "counted", "kept"):
        raise ConfigError(f"key_generations must be 'private', 'counted' or 'kept', got {generations!r}")
    memory_keys = extra.get("miss_memory_keys")
    if memory_keys is not None and memory_keys < 1:
        raise ConfigError(f"miss_memory_keys must be >= 1, got {memory_keys}")
    tier_entries, pressures = _backpressure(extra.get("backpressure"), extra.get("secondary_tiers", ()))
    budget = extra.get("restore_budget", "load")
    if budget not in ("load", "auto"):
        raise ConfigError(f"restore_budget must be 'load' or 'auto', got {budget!r}")
    threshold = extra.get("store_threshold", 1)
    if threshold < 1:
        raise ConfigError(f"store_threshold must be >= 1 (1: store every block at once), got {threshold}")
    tracker = extra.get("max_tracker_size", 64_000)
    if tracker < 1:
        raise ConfigError(f"max_tracker_size must be >= 1, got {tracker}")

    return ConnectorSettings(
        capacity_bytes=capacity,
        eviction_policy=PolicyName(policy),
        protection=Protection(protection),
        store_mode=StoreMode(store_mode),
        lazy_target_blocks=target,
        load_timeout_s=float(load_timeout),
        event_log=event_log,
        event_log_format=fmt,
        event_log_on_error=on_error,
        digest_interval=interval,
        snapshot_interval_events=snapshots,
        log_level=level,
        log_json=extra.get("log_json", False),
        faults=_parse_faults(extra.get("fault_injection", {})),
        secondary_tiers=_parse_tiers(tier_entries),
        backpressure=pressures,
        weights_version=weights_version,
        key_generations=generations,
        miss_metrics=extra.get("miss_metrics", True),
        miss_memory_keys=memory_keys,
        store_threshold=threshold,
        max_tracker_size=tracker,
        offload_prompt_only=extra.get("offload_prompt_only", False),
        self_describing_kv_events=extra.get("self_describing_kv_events", False),
        restore_budget=budget,
    )


def _parse_faults(raw: Mapping[str, Any]) -> FaultSettings:
    unknown = sorted(set(raw) - set(_FAULT_FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown fault_injection key(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(_FAULT_FIELDS))}")
    values = {}
    for name, expected in _FAULT_FIELDS.items():
        if name in raw:
            values[name] = _typed(f"fault_injection.{name}", raw[name], expected)
    for name in ("load_rate", "store_rate", "load_block_rate"):
        rate = values.get(name, 0.0)
        if not 0.0 <= rate <= 1.0:
            raise ConfigError(f"fault_injection.{name} must be within [0, 1], got {rate}")
    if "ranks" in values:
        ranks = values["ranks"]
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise ConfigError(f"fault_injection.ranks must be worker indices (ints >= 0), got {ranks!r}")
        values["ranks"] = tuple(sorted(set(ranks)))
    delay = values.get("tier_read_delay_s", 0.0)
    if not 0.0 <= delay <= 60.0:
        raise ConfigError(f"fault_injection.tier_read_delay_s must be within [0, 60] seconds, got {delay}")
    if values.get("store_hold_steps", 0) < 0:
        raise ConfigError(f"fault_injection.store_hold_steps must be >= 0, got {values['store_hold_steps']}")
    return FaultSettings(**values)


_DETECTORS = ("EMABackpressureDetector",)
_POLICIES = {"ThrottledDropPolicy": True, "DropStorePolicy": False}
_PRESSURE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "high_water_s": (int, float), "low_water_s": (int, float), "alpha": (int, float), "warmup_completions": int,
    "decay_half_life_s": (int, float), "cooldown_s": (int, float), "failure_threshold": int,
    "ramp_factor": (int, float)}


def _backpressure(top: Any, tiers: Any) -> tuple[Any, tuple[BackpressureSettings | None, ...]]:
    """vLLM 0.33's `backpressure`: the top level's, each tier's own over it; the tiers'
    entries without theirs (their types' parsers know nothing of it)."""
    if top is not None and not isinstance(top, dict):
        raise ConfigError(f"backpressure must be a mapping, got {top!r}")
    if not isinstance(tiers, (list, tuple)):
        return tiers, ()  # the tiers' own parser names the problem
    entries, pressures = [], []
    for index, entry in enumerate(tiers):
        if not isinstance(entry, dict):
            entries.append(entry)
            pressures.append(None)
            continue
        own = entry.get("backpressure")
        entries.append({k: v for k, v in entry.items() if k != "backpressure"})
        if own is not None and not isinstance(own, dict):
            raise ConfigError(f"secondary_tiers[{index}].backpressure must be a mapping, got {own!r}")
        if top is None and own is None:
            pressures.append(None)
            continue
        pressures.append(_pressure(f"secondary_tiers[{index}].backpressure", {**(top or {}), **(own or {})},
                                   remote=entry.get("type") == "valkey"))
    return entries, tuple(pressures)


def _pressure(where: str, raw: dict, *, remote: bool) -> BackpressureSettings:
    """One tier's; a remote store (Valkey) takes vLLM's network water marks, a disk its local ones."""
    detector = raw.get("backpressure_cls")
    if not isinstance(detector, str) or detector.rsplit(".", 1)[-1] not in _DETECTORS:
        raise ConfigError(f"{where} needs backpressure_cls 'EMABackpressureDetector' (the one kvledger measures "
                          f"as vLLM does), got {detector!r}")
    policy = raw.get("policy_cls", "ThrottledDropPolicy")
    if not isinstance(policy, str) or policy.rsplit(".", 1)[-1] not in _POLICIES:
        raise ConfigError(f"{where}.policy_cls must be 'ThrottledDropPolicy' or 'DropStorePolicy', got {policy!r}")
    unknown = sorted(set(raw) - set(_PRESSURE_FIELDS) - {"backpressure_cls", "policy_cls"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                          f"backpressure_cls, policy_cls, {', '.join(_PRESSURE_FIELDS)}")
    values: dict[str, Any] = {"high_water_s": 0.050 if remote else 0.010, "low_water_s": 0.010 if remote else 0.002}
    for name, expected in _PRESSURE_FIELDS.items():
        if name in raw:
            values[name] = _typed(f"{where}.{name}", raw[name], expected)
    if not 0 <= values["low_water_s"] <= values["high_water_s"]:
        raise ConfigError(f"{where}: low_water_s must be from 0 to high_water_s")
    if not 0 < values.get("alpha", 0.15) <= 1 or values.get("failure_threshold", 3) < 1:
        raise ConfigError(f"{where}: alpha must be in (0, 1] and failure_threshold at least 1")
    return BackpressureSettings(throttled=_POLICIES[policy.rsplit(".", 1)[-1]], **values)


def _parse_tiers(raw: Any) -> tuple[TierSettings, ...]:
    """Parsed, then checked against the world: settings are parsed at start, so that is when."""
    # At parse time only: the tier types' table loads their I/O and torch (0.9 s here), which
    # a process reading settings without tiers (the CLI, a benchmark's config) never needs.
    from kvledger.transfers.lower_tiers.tier_types import check_tiers, parse_tiers

    tiers = parse_tiers(raw)
    check_tiers(tiers)
    return tiers
