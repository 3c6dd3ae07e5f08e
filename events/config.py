"""The engine's configuration: KV groups, tier size and policy.

It lives beside the events because every log header carries it: a log is only
meaningful together with the configuration it was recorded under.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from functools import reduce as _fold
from typing import Any, Final

import attrs


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or impossible."""


RULES: Final = 2
"""The engine's decision rules this build writes into a log's header: which
stores a step admits, which hit a lookup gives, which slots and jobs they take.
A change to any decision is a new number, and the old behaviour stays behind
the old one (`EngineConfig.rules`), so a log replays under the rules it was
written under with every later build (docs/architecture.md, "The log across builds").

1: builds to 2026-11-28 (9d5f430): with tiers below host memory, a store host
   memory cannot take in its step is dropped, and a hit whose promotions do not
   fit in the slots free or evictable now is cut short.
2: builds from 2026-11-28 (b6b5af1) on: such stores wait for host slots, such
   hits wait for slots transfers hold, and a hit read in place waits while the
   step's earlier hits promote more than the free slots."""

RULES_UNRESOLVED: Final = 0
"""A log header without `rules` (kvledger 0.1.0) where they matter: with tiers
below host memory, rules 1 and 2 decide differently (without, they decide
alike, and such a log reads as this build's rules). The log reader resolves
it from the log's own records (`adapters/log_rules.py`); no engine runs under it."""


class RestoreBudget(enum.Enum):
    """Whether a hit is loaded whatever it costs (LOAD) or only where loading is
    estimated faster than computing (AUTO: `RestoreCostsMeasured`)."""

    LOAD = "load"
    AUTO = "auto"


class GroupKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    MAMBA = "mamba"


class Protection(enum.Enum):
    """How a store's device source blocks are kept intact until the copy ends.

    FLUSH: vLLM may reallocate the block; the engine then asks the worker to
    wait for exactly the stores that read it, before that step's forward.
    PIN: the connector holds a block-pool reference until the store ends, so
    vLLM cannot reallocate the block at all.
    """

    FLUSH = "flush"
    PIN = "pin"


class StoreMode(enum.Enum):
    """When blocks are copied to the tier.

    EAGER: every full block, in the step that completes it.
    LAZY: only free blocks that reach the eviction end of vLLM's free queue,
    so a workload that fits in device memory moves no bytes.
    """

    EAGER = "eager"
    LAZY = "lazy"


class StoreJobs(enum.Enum):
    """How a step's stores are grouped into jobs (each ends with one event per worker).

    STEP: one job per scheduler step, every request's new blocks together: one
    effect, one copy and one completion per worker, whatever the batch size.
    REQUEST: one job per request per step. Logs recorded before this option
    were made so, and replay so (a config without the key reads as REQUEST).
    """

    STEP = "step"
    REQUEST = "request"


class PolicyName(enum.Enum):
    LRU = "lru"
    ARC = "arc"


# Upper bounds, so a damaged or hostile log header cannot ask for an impossible
# engine (10^30 slots overflow; 2^31 device blocks take 100 GB; 10^9 workers run
# for minutes). Each is far beyond any real deployment (an H200 holds under 2^20
# blocks of a small model; 2 TB of host memory, 2^25 slots of 64 KiB), and at
# the limits the engine's tables take about 3 GB.
LIMITS = {
    "block_size": 1 << 20, "window": 1 << 30, "hash_block_size": 1 << 20, "group_id": 1 << 10,
    "num_device_blocks": 1 << 24, "num_tier_slots": 1 << 28, "num_blocks": 1 << 40, "world_size": 1 << 12,
    "slot_bytes": 1 << 40, "tier_copies": 1 << 12, "store_threshold": 1 << 20, "max_tracker_size": 1 << 28,
}


def _bounded(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    limit = LIMITS[attribute.name]
    if isinstance(value, int) and value > limit:
        raise ConfigError(f"{attribute.name} must be at most {limit}, got {value}")


def _rules(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if type(value) is not int or not RULES_UNRESOLVED <= value <= RULES:
        raise ConfigError(f"rules must be an int from 1 to {RULES} (this build's), got {value!r}")


def _positive(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")
    _bounded(_inst, attribute, value)


def _bool(_inst: object, attribute: attrs.Attribute, value: bool) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be true or false, got {value!r}")


def _not_negative(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{attribute.name} must be an int of 0 or more, got {value!r}")
    _bounded(_inst, attribute, value)


@attrs.frozen(kw_only=True)
class GroupSpec:
    """One KV cache group, as vLLM's KVCacheConfig describes it."""

    group_id: int
    kind: GroupKind = attrs.field(converter=GroupKind)
    block_size: int = attrs.field(validator=_positive)
    window: int = 0  # tokens; SLIDING only

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.group_id <= LIMITS["group_id"]:
            raise ConfigError(f"group_id must be in [0, {LIMITS['group_id']}], got {self.group_id}")
        if self.window > LIMITS["window"]:
            raise ConfigError(f"window must be at most {LIMITS['window']}, got {self.window}")
        if self.kind is GroupKind.SLIDING and self.window <= 0:
            raise ConfigError(f"group {self.group_id}: a sliding group needs window > 0")
        if self.kind is not GroupKind.SLIDING and self.window != 0:
            raise ConfigError(f"group {self.group_id}: only sliding groups take a window")


@attrs.frozen(kw_only=True)
class LowerTierSpec:
    """A tier below host memory (a file system, a shared store), sized in blocks.

    `name` is vLLM 0.33's tier label ("1:fs"): metrics, logs and reports use it.
    """

    name: str
    num_blocks: int = attrs.field(validator=_positive)

    def to_dict(self) -> dict:
        return {"name": self.name, "num_blocks": self.num_blocks}


def _lower_tiers(value: Iterable[LowerTierSpec | dict[str, Any]]) -> tuple[LowerTierSpec, ...]:
    return tuple(t if isinstance(t, LowerTierSpec) else LowerTierSpec(**t) for t in value)


@attrs.frozen(kw_only=True)
class EngineConfig:
    groups: tuple[GroupSpec, ...] = attrs.field(converter=tuple)
    hash_block_size: int = attrs.field(validator=_positive)
    num_device_blocks: int = attrs.field(validator=_positive)
    num_tier_slots: int = attrs.field(validator=_positive)
    policy: PolicyName = attrs.field(default=PolicyName.LRU, converter=PolicyName)
    protection: Protection = attrs.field(default=Protection.FLUSH, converter=Protection)
    world_size: int = attrs.field(default=1, validator=_positive)
    store_mode: StoreMode = attrs.field(default=StoreMode.EAGER, converter=StoreMode)
    lower_tiers: tuple[LowerTierSpec, ...] = attrs.field(default=(), converter=_lower_tiers)
    store_jobs: StoreJobs = attrs.field(default=StoreJobs.STEP, converter=StoreJobs)
    # Bytes of one tier slot (a block of every layer of a KV group), for reading a
    # log in bytes (`kvledger whatif --capacity-bytes`); 0 where not known.
    slot_bytes: int = attrs.field(default=0, validator=_not_negative)
    # Files (or values) a block takes in a tier below host memory: one per distinct shard of the
    # ranks' KV, for reading a tier's capacity in blocks (`kvledger whatif`); 0 where not known.
    tier_copies: int = attrs.field(default=0, validator=_not_negative)
    # The decision rules the engine follows (`RULES`): a log's own, from its header.
    rules: int = attrs.field(default=RULES, validator=_rules)
    # vLLM's `store_threshold` and `max_tracker_size`: a block is stored once this many
    # requests have offered it (1: at once), the offers counted for the `max_tracker_size`
    # most recently offered keys.
    store_threshold: int = attrs.field(default=1, validator=_positive)
    max_tracker_size: int = attrs.field(default=64_000, validator=_positive)
    # vLLM's `offload_prompt_only`: only blocks whole within the prompt are stored.
    offload_prompt_only: bool = attrs.field(default=False, validator=_bool)
    restore_budget: RestoreBudget = attrs.field(default=RestoreBudget.LOAD, converter=RestoreBudget)

    def __attrs_post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("at least one KV group is required")
        if self.store_mode is StoreMode.LAZY and self.protection is not Protection.FLUSH:
            # Pinning a free block takes it out of vLLM's free queue and puts it
            # back at the most recent end: lazy stores would reorder vLLM's LRU.
            raise ConfigError("lazy store mode needs flush protection")
        names = [t.name for t in self.lower_tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"lower tier names repeat: {names}")
        for index, group in enumerate(self.groups):
            if group.group_id != index:
                raise ConfigError(f"groups must be numbered 0..n-1 in order; got {group.group_id} at {index}")
            if group.block_size % self.hash_block_size:
                raise ConfigError(
                    f"group {index}: block_size {group.block_size} is not a multiple of "
                    f"hash_block_size {self.hash_block_size}"
                )

    @property
    def alignment_tokens(self) -> int:
        """A hit must end on a boundary that is a whole block in every group."""
        return _fold(math.lcm, (g.block_size for g in self.groups))

    def to_dict(self) -> dict:
        data = {
            "groups": [
                {"group_id": g.group_id, "kind": g.kind.value, "block_size": g.block_size, "window": g.window}
                for g in self.groups
            ],
            "hash_block_size": self.hash_block_size,
            "num_device_blocks": self.num_device_blocks,
            "num_tier_slots": self.num_tier_slots,
            "policy": self.policy.value,
            "protection": self.protection.value,
            "world_size": self.world_size,
        }
        if self.store_mode is not StoreMode.EAGER:  # only when set: older logs keep their digests
            data["store_mode"] = self.store_mode.value
        if self.lower_tiers:  # likewise
            data["lower_tiers"] = [t.to_dict() for t in self.lower_tiers]
        if self.store_jobs is not StoreJobs.REQUEST:  # absent means REQUEST: older logs keep their digests
            data["store_jobs"] = self.store_jobs.value
        if self.slot_bytes:  # absent means not known
            data["slot_bytes"] = self.slot_bytes
        if self.tier_copies:  # likewise (logs before 0.2.0)
            data["tier_copies"] = self.tier_copies
        if self.store_threshold != 1:  # only when set: logs without them keep their digests
            data["store_threshold"] = self.store_threshold
            data["max_tracker_size"] = self.max_tracker_size
        if self.offload_prompt_only:
            data["offload_prompt_only"] = True
        if self.restore_budget is not RestoreBudget.LOAD:
            data["restore_budget"] = self.restore_budget.value
        data["rules"] = self.rules  # always, from 0.2.0 on (absent: see `from_dict`)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> EngineConfig:
        """The config `to_dict` wrote. Keys added since default to what a log
        written before them meant: no `store_jobs` is one store job per request;
        no `rules` is this build's (a log's header reader decides what a 0.1.0
        log's missing rules mean: `log_records.header_from_dict`)."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)}")
        try:
            groups = tuple(GroupSpec(**g) for g in data["groups"])
            return cls(**{"store_jobs": StoreJobs.REQUEST, **data, "groups": groups})
        except KeyError as exc:
            raise ConfigError(f"missing config key: {exc.args[0]}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"bad config: {exc}") from None
