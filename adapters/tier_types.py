"""The tier types below host memory, as one table: everything kvledger does
differently for each type is a field of its row in `TIER_TYPES`.

A row names its settings class and parser (`tier_settings`), what a block
costs it besides the block's bytes, where its blocks are (for logs), how the
scheduler looks up keys other processes wrote, whether and how the
scheduler scans it at start, how a worker opens its I/O, and whether the
scheduler keeps tombstones of keys it removed. `parse_tiers` (here) and
`adapters/vllm/lower_tiers.py` read the row of each tier and branch on
nothing else.

The table is checked at import (`check_tier_types`): every member of the
`TierSettings` union has exactly one row, under its `kind`, and no row names
anything else, so a type without a row, or a row without a union member,
fails at start rather than at its first spill.

Importing this module loads the tiers' I/O (and torch): `adapters.settings`
imports it only when it parses tiers, so the settings stay light to import.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import structlog

from kvledger.adapters.key_lookups import Find
from kvledger.adapters.tier_settings import (
    SECRET_KEYS,
    FsTierSettings,
    TierSettings,
    ValkeyTierSettings,
    check_distinct_dirs,
    check_fs_tier,
    check_valkey_tier,
    parse_fs_tier,
    parse_secret,
    parse_valkey_tier,
)
from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.block_header import HEADER_BYTES, KEY_BYTES_MAX, compact_header_bytes
from kvledger.transfers.lower_tiers.fs_tier import FsTierIO, files_present, scan_keys
from kvledger.transfers.lower_tiers.fs_tier import other_formats as other_fs_formats
from kvledger.transfers.lower_tiers.tier_jobs import TierIO
from kvledger.transfers.lower_tiers.valkey_store import StoreDown, ValkeyStore
from kvledger.transfers.lower_tiers.valkey_tier import Health, ValkeyTierIO, keys_present, register_format
from kvledger.transfers.lower_tiers.valkey_tier import other_formats as other_valkey_formats


@attrs.frozen(kw_only=True)
class Lookup:
    """How the scheduler's lookups find keys on one tier."""

    find: Find  # the keys (of those asked) held in every namespace; runs on the lookups' thread
    health: Health | None = None  # a server's, as the lookups see it: reported as a metric
    close: Callable[[], None] | None = None  # releases what `find` holds, when the scheduler closes


@attrs.frozen(kw_only=True)
class WorkerSite:
    """What a worker opens its I/O on a tier with."""

    name: str  # the tier's, "1:fs" (`lower_tiers.tier_name`)
    namespace: bytes  # this worker's shard's (`tier_namespace.namespace`)
    identity: Mapping[str, Any]  # what the namespace digests
    # `adapters/vllm/tier_namespace.write_identity`, passed in: that package imports this module, not the reverse
    write_identity: Callable[..., None]  # leaves the identity beside the blocks, for operators
    rows: Any  # the host tier's slots (a 2-D int8 CPU tensor), which the I/O reads and writes
    payload_bytes: tuple[int, ...]  # per KV cache group, the bytes of a slot a block fills
    writes: bool  # this rank writes the namespace's blocks (else it reads another rank's: identical KV)


@attrs.frozen(kw_only=True)
class TierType:
    """One tier type. Its functions take that type's settings."""

    settings: type  # its settings class, a member of `TierSettings`; the class's `kind` is its config `type`
    keys: tuple[str, ...]  # what its dict takes besides 'type' and `tier_settings.SECRET_KEYS` (README's table)
    # The dict (less the secret) into settings, touching nothing (`located` False: sizing only, no place named).
    parse: Callable[..., TierSettings]
    check: Callable[[str, Any], None]  # at start: the settings against the world (a directory, a server)
    header_bytes: Callable[[Any], int]  # what a block costs the tier besides its bytes (at most)
    where: Callable[[Any], dict[str, str]]  # where its blocks are, as log fields
    lookup: Callable[[Any, str, tuple[bytes, ...]], Lookup]  # (tier, name, every shard's namespace), scheduler's
    scan: Callable[[Any, bytes], list[bytes]] | None  # keys a namespace holds, oldest first; None: not scanned
    open_io: Callable[[Any, WorkerSite], TierIO]  # a worker's I/O on the tier
    tombstones: bool  # the scheduler remembers keys it removed, so a lookup racing the removal cannot find them
    # Blocks it holds in a format this build cannot read, as (namespace hex, format, blocks), where the store
    # can be listed cheaply: the scheduler says why they are not found. None: not listed.
    other_formats: Callable[[Any], list[tuple[str, object, int]]] | None = None


# The file-system tier: block files in a directory, scanned at start; other processes' files are looked up.


def _fs_lookup(tier: FsTierSettings, name: str, namespaces: tuple[bytes, ...]) -> Lookup:
    return Lookup(find=functools.partial(files_present, tier.path, namespaces))


def _fs_scan(tier: FsTierSettings, namespace: bytes) -> list[bytes]:
    return scan_keys(tier.path, namespace)


def _fs_open(tier: FsTierSettings, site: WorkerSite) -> TierIO:
    site.write_identity(tier.path, site.namespace, site.identity, gid=tier.gid)
    io = FsTierIO(root=tier.path, namespace=site.namespace, rows=site.rows, payload_bytes=site.payload_bytes,
                  threads=tier.threads, seal=tier.secret.seal(), gid=tier.gid, pack_bytes=tier.pack_bytes)
    if site.writes:  # the namespace's writer clears what its crashed predecessors left
        io.remove_leftovers()
    return io


# The Valkey tier: a store shared by many instances, looked up, never scanned; it deletes nothing
# (the store is shared), so it needs no tombstones.


def _valkey_header_bytes(tier: ValkeyTierSettings) -> int:
    return compact_header_bytes(bytes(KEY_BYTES_MAX), sealed=tier.secret.current is not None)


def _valkey_lookup(tier: ValkeyTierSettings, name: str, namespaces: tuple[bytes, ...]) -> Lookup:
    store = ValkeyStore(tier.server)  # used by the lookups' thread alone
    health = Health(name, tier.server.where, tier.server.timeout_s)
    return Lookup(find=functools.partial(keys_present, store, health, namespaces, key_prefix=tier.key_prefix),
                  health=health, close=store.close)


def _valkey_other_formats(tier: ValkeyTierSettings) -> list[tuple[str, object, int]]:
    store = ValkeyStore(tier.server)
    try:
        return other_valkey_formats(store, tier.key_prefix)
    finally:
        store.close()


def _valkey_open(tier: ValkeyTierSettings, site: WorkerSite) -> TierIO:
    if site.writes:  # says which block format the namespace's blocks are in, for builds of another
        store = ValkeyStore(tier.server)
        try:
            register_format(store, site.namespace, tier.key_prefix)
        except StoreDown:
            pass  # a server down at start: the tier's health says so; a later writer registers it
        finally:
            store.close()
    return ValkeyTierIO(server=tier.server, name=site.name, namespace=site.namespace, rows=site.rows,
                        payload_bytes=site.payload_bytes, connections=tier.connections, seal=tier.secret.seal(),
                        key_prefix=tier.key_prefix)


TIER_TYPES: dict[str, TierType] = {
    FsTierSettings.kind: TierType(
        settings=FsTierSettings, keys=("path", "root_dir", "capacity_bytes", "threads", "pack_bytes", "shared", "group"),
        parse=parse_fs_tier, check=check_fs_tier, header_bytes=lambda tier: HEADER_BYTES, where=lambda tier: {"path": tier.path},
        lookup=_fs_lookup, scan=_fs_scan, open_io=_fs_open, tombstones=True,
        other_formats=lambda tier: other_fs_formats(tier.path)),
    ValkeyTierSettings.kind: TierType(
        settings=ValkeyTierSettings, keys=("url", "urls", "cluster", "password_env", "capacity_bytes", "timeout_s",
                                           "connections", "on_unreachable", "tls_ca_file", "key_prefix"),
        parse=parse_valkey_tier, check=check_valkey_tier, header_bytes=_valkey_header_bytes, where=lambda tier: {"server": tier.server.where},
        lookup=_valkey_lookup, scan=None, open_io=_valkey_open, tombstones=False,
        other_formats=_valkey_other_formats),
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


_log = structlog.get_logger("kvledger.adapters.tier_types")

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
    check_distinct_dirs(list(tiers))


def tier_blocks(tier: TierSettings, slot_bytes: int, copies: int = 1) -> int:
    """The one rule for a tier's size in blocks, serving's and `kvledger whatif`'s: a block
    is `copies` files or values (one per distinct shard of the ranks' KV), each its header
    and at most a slot's bytes; `capacity_bytes` bounds them all."""
    each = tier_type(tier).header_bytes(tier) + slot_bytes
    return tier.capacity_bytes // (copies * each)


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
