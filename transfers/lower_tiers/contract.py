"""What a tier type is, to kvledger: one row (`TierType`) of functions over its settings,
with what the scheduler's lookups take (`Lookup`) and what a worker opens its I/O with
(`WorkerSite`). Each type's package holds its row (`fs/row.py`, `valkey/row.py`); the
table of them is `tier_types.TIER_TYPES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvledger.transfers.lower_tiers.health import Health
from kvledger.transfers.lower_tiers.tier_jobs import TierIO

Find = Callable[[tuple[bytes, ...]], tuple[bytes, ...]]
"""Given keys, those the tier holds; it may raise (a store that is down): nothing found."""


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
    parse: Callable[..., Any]  # returns the type's settings (a member of `tier_types.TierSettings`)
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
