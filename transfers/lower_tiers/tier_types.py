"""The tier types below host memory, as one table: everything kvledger does differently
for each type is a field of its row (`contract.TierType`), and each row lives in its
type's package (`fs/row.py`, `valkey/row.py`). Adding a built-in type is its package and
one line of `TIER_TYPES`; a type kept elsewhere registers its row (`register_tier_type`).

`parse_tiers` is the one parser of `secondary_tiers` (serving's and `kvledger whatif`'s),
touching nothing outside; `check_tiers` runs each type's start-up checks; `tier_blocks` is
the one rule for a tier's size in blocks. The table is checked at import
(`check_tier_types`): every member of the `TierSettings` union has exactly one row.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping

import attrs
import structlog

from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers import fs, valkey
from kvledger.transfers.lower_tiers.contract import TierType
from kvledger.transfers.lower_tiers.fs.settings import FsTierSettings, check_distinct_dirs
from kvledger.transfers.lower_tiers.tier_settings import SECRET_KEYS, parse_secret
from kvledger.transfers.lower_tiers.valkey.settings import ValkeyTierSettings

TierSettings = FsTierSettings | ValkeyTierSettings  # each has its row in `TIER_TYPES`

TIER_TYPES: dict[str, TierType] = {
    FsTierSettings.kind: fs.ROW,
    ValkeyTierSettings.kind: valkey.ROW,
}
"""Each tier type's row, by the `type` a config names it with, in the order error messages list them."""


def check_tier_types(table: Mapping[str, TierType], settings_types: tuple[type, ...]) -> None:
    """Every settings class has exactly one row, under its `kind`, and every row's class is one of them."""
    problems = []
    for kind, row in table.items():
        if getattr(row.settings, "kind", None) != kind:
            problems.append(f"row {kind!r} holds {row.settings.__name__}, whose kind is "
                            f"{getattr(row.settings, 'kind', None)!r}")
    named = [row.settings for row in table.values()]
    for cls in settings_types:
        if named.count(cls) != 1:
            problems.append(f"{cls.__name__} has {named.count(cls)} rows, not one")
    for cls in dict.fromkeys(named):
        if cls not in settings_types:
            problems.append(f"the row of {cls.__name__} names no member of TierSettings")
    if problems:
        raise AssertionError("every tier type needs one row in TIER_TYPES: " + "; ".join(problems))

_log = structlog.get_logger("kvledger.transfers.tier_types")

TIER_SETTINGS_TYPES: tuple[type, ...] = typing.get_args(TierSettings)

check_tier_types(TIER_TYPES, TIER_SETTINGS_TYPES)


def parse_tiers(raw: list | tuple, *, located: bool = True) -> tuple[TierSettings, ...]:
    """Each entry of `secondary_tiers`, by its type's row: its keys checked, its secret
    parsed (every type takes the same secret keys), its own keys by the row's parser.
    Nothing outside is touched (`check_tiers` does that, at start). The one parser of
    the setting: serving's, and `kvledger whatif`'s (`located` False: tiers described
    to be sized, which need not name a directory or a server)."""
    tiers = []
    for index, entry in enumerate(raw):
        where = f"secondary_tiers[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} must be a dict, got {entry!r}")
        supported = ", ".join(map(repr, TIER_TYPES))
        if "type" not in entry:
            raise ConfigError(f"{where} needs a 'type': one of {supported}")
        kind = entry["type"]
        if kind not in TIER_TYPES:
            raise ConfigError(f"{where}.type {kind!r} is not supported; supported types: {supported}")
        keys, parse = TIER_TYPES[kind].keys, TIER_TYPES[kind].parse
        unknown = sorted(set(entry) - set(keys) - set(SECRET_KEYS) - {"type"})
        if unknown:
            raise ConfigError(
                f"unknown {where} key(s) {', '.join(map(repr, unknown))}; a {kind!r} tier knows: "
                f"{', '.join(sorted({'type', *keys, *SECRET_KEYS}))}")
        secret = parse_secret(where, entry)
        tier = parse(where, {k: v for k, v in entry.items() if k not in SECRET_KEYS}, located=located)
        tiers.append(attrs.evolve(tier, secret=secret))
    return tuple(tiers)


def check_tiers(tiers: tuple[TierSettings, ...]) -> None:
    """At start, the checks that touch the world: each tier's (its directory made and
    probed, its server asked), then that no two tiers share a directory. Each tier that
    passes says so in the log."""
    for index, tier in enumerate(tiers):
        where = f"secondary_tiers[{index}]"
        row = tier_type(tier)
        row.check(where, tier)
        _log.info("tier_checked", tier=where, type=tier.kind, **row.where(tier))
        secret = getattr(tier, "secret", None)
        if secret is not None and secret.stretched:
            _log.warning("tier_secret_stretched", tier=where, keys=list(secret.stretched),
                         why="not 32 random bytes in hex or base64: stretched with scrypt at each start; "
                             "prefer `openssl rand -hex 32` (README: the trust model)")
        if getattr(tier, "shared", False) and (secret is None or secret.current is None):
            _log.warning("shared_tier_without_secret", tier=where, type=tier.kind, **row.where(tier),
                         why="whoever can write this tier can serve blocks to this process unchecked: set "
                             "secret_env (README: the trust model)")
    check_distinct_dirs(list(tiers))


def tier_blocks(tier: TierSettings, slot_bytes: int, copies: int = 1, where: str = "secondary_tiers[0]") -> int:
    """The one rule for a tier's size in blocks, serving's and `kvledger whatif`'s: a block
    is `copies` files or values (one per distinct shard of the ranks' KV), each its header
    and at most a slot's bytes; `capacity_bytes` bounds them all. A size that holds no
    block is refused, naming the tier at `where`."""
    each = tier_type(tier).header_bytes(tier) + slot_bytes
    blocks = tier.capacity_bytes // (copies * each)
    if blocks < 1:
        raise ConfigError(f"{where}.capacity_bytes={tier.capacity_bytes} holds no block: {copies} part(s) of "
                          f"{each} bytes each")
    return blocks


def register_tier_type(row: TierType) -> Callable[[], None]:
    """Add a tier type from outside this table (a plugin, or a test's): its row, under its
    settings class's `kind`. A kind taken already is refused. The returned function takes
    the row back out. The built-in types are the table's own lines above."""
    kind = getattr(row.settings, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"{row.settings.__name__} names no kind (a `kind: ClassVar[str]`)")
    if kind in TIER_TYPES:
        raise ValueError(f"tier type {kind!r} is taken (by {TIER_TYPES[kind].settings.__name__})")
    TIER_TYPES[kind] = row

    def unregister() -> None:
        if TIER_TYPES.get(kind) is row:
            del TIER_TYPES[kind]

    return unregister


def tier_type(tier: TierSettings) -> TierType:
    """The row of a tier's type."""
    return TIER_TYPES[tier.kind]
