"""The Valkey tier's row: a store shared by many instances, looked up, never scanned; it
deletes nothing (the store is shared), so it needs no tombstones.
"""

from __future__ import annotations

import functools

from kvledger.transfers.lower_tiers.block_header import KEY_BYTES_MAX, compact_header_bytes
from kvledger.transfers.lower_tiers.contract import Lookup, TierType, WorkerSite
from kvledger.transfers.lower_tiers.health import Health
from kvledger.transfers.lower_tiers.tier_jobs import TierIO
from kvledger.transfers.lower_tiers.valkey.cluster_store import open_store
from kvledger.transfers.lower_tiers.valkey.settings import (
    ValkeyTierSettings,
    check_valkey_tier,
    parse_valkey_tier,
)
from kvledger.transfers.lower_tiers.valkey.store import StoreDown
from kvledger.transfers.lower_tiers.valkey.tier import (
    ValkeyTierIO,
    keys_present,
    other_formats,
    register_format,
)


def _valkey_header_bytes(tier: ValkeyTierSettings) -> int:
    return compact_header_bytes(bytes(KEY_BYTES_MAX), sealed=tier.secret.current is not None)


def _valkey_lookup(tier: ValkeyTierSettings, name: str, namespaces: tuple[bytes, ...]) -> Lookup:
    store = open_store(tier.server)  # used by the lookups' thread alone
    health = Health(name, tier.server.where, tier.server.timeout_s)
    return Lookup(find=functools.partial(keys_present, store, health, namespaces, key_prefix=tier.key_prefix),
                  health=health, close=store.close)


def _valkey_other_formats(tier: ValkeyTierSettings) -> list[tuple[str, object, int]]:
    store = open_store(tier.server)
    try:
        return other_formats(store, tier.key_prefix)
    finally:
        store.close()


def _valkey_open(tier: ValkeyTierSettings, site: WorkerSite) -> TierIO:
    if site.writes:  # says which block format the namespace's blocks are in, for builds of another
        store = open_store(tier.server)
        try:
            register_format(store, site.namespace, tier.key_prefix)
        except StoreDown:
            pass  # a server down at start: the tier's health says so; a later writer registers it
        finally:
            store.close()
    return ValkeyTierIO(server=tier.server, name=site.name, namespace=site.namespace, rows=site.rows,
                        payload_bytes=site.payload_bytes, connections=tier.connections, seal=tier.secret.seal(),
                        key_prefix=tier.key_prefix)


ROW = TierType(
        settings=ValkeyTierSettings, keys=("url", "urls", "cluster", "password_env", "capacity_bytes", "timeout_s",
                                           "connections", "on_unreachable", "tls_ca_file", "key_prefix"),
        parse=parse_valkey_tier, check=check_valkey_tier, header_bytes=_valkey_header_bytes, where=lambda tier: {"server": tier.server.where},
        lookup=_valkey_lookup, scan=None, open_io=_valkey_open, tombstones=False,
        other_formats=_valkey_other_formats)
