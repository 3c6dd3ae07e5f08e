"""Tiers below host memory, as vLLM's two kinds of process see them.

Both roles derive the same things from the settings and vLLM's config: the
engine's view of each tier (`engine_tiers`: its name, `"1:fs"` as vLLM 0.33
labels it, and its size in blocks) and the namespace of every tensor-parallel
rank (`tier_namespace`), so the scheduler can tell which blocks every rank
holds, and each worker writes only its own.

Ranks with byte-identical KV (an MLA model's, `tier_namespace.tp_replicas`)
share a namespace: the first of them writes and removes its blocks, the
others read them and finish their part of a spill at once, having nothing to
add (`ReplicaTierIO`). The engine still waits for every rank's report, so a
block is held once the writer's write succeeded. Host memory stays per rank:
each worker process loads from its own copy.

The scheduler learns what a tier holds at start (a scan, entered in the log
as `tier_keys_found`) and, when other processes share the directory, by an
asynchronous lookup of the keys a new request would need
(`get_num_new_matched_tokens` answers None until the lookup does, for at
most `LOOKUP_TIMEOUT_S`). The worker moves the bytes (`FsTierIO`).

What differs between tier types (the scan, the lookups, the worker's I/O)
is their row in `transfers/lower_tiers/tier_types.py:TIER_TYPES`; nothing here branches
on a tier's type.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from kvledger.adapters.key_lookups import KeyLookups
from kvledger.adapters.settings import ConnectorSettings, TierSettings
from kvledger.adapters.vllm.chain_keys import CRYPTOGRAPHIC, FAST, KEYED
from kvledger.adapters.vllm.tier_namespace import identity, key_root, namespace, tp_replicas, write_identity
from kvledger.events import types as ev
from kvledger.events.config import LowerTierSpec
from kvledger.transfers.lower_tiers.block_header import FORMAT_VERSION as BLOCK_FORMAT
from kvledger.transfers.lower_tiers.block_seal import derive
from kvledger.transfers.lower_tiers.contract import Find, WorkerSite
from kvledger.transfers.lower_tiers.health import Health
from kvledger.transfers.lower_tiers.replica_tier import ReplicaTierIO
from kvledger.transfers.lower_tiers.slowed_tier import SlowedTierIO
from kvledger.transfers.lower_tiers.tier_jobs import TierIO
from kvledger.transfers.lower_tiers.tier_types import tier_blocks, tier_type

_log = structlog.get_logger("kvledger.adapters.vllm.lower_tiers")

LOOKUP_TIMEOUT_S = 5.0
"""A lookup not answered by then counts as finding nothing (a hung network file system)."""
LOOKUP_WAIT_S = 0.002
"""How long lookups may hold the scheduler's calls in one step, all requests together, so a
fast disk answers at once: past it a request's ask is sent and answered at a later step (with
64 requests arriving together, a wait per request held one step for 128 ms)."""
LOOKUP_KEYS_MAX = 4096
TOMBSTONE_S = 30.0
"""How long a key this process removed is remembered, so a lookup that raced the removal cannot
bring it back: past a lookup's life (`LOOKUP_TIMEOUT_S`) after the worker removed the file, with
room for a slow step. A lookup that still finds a key removed later only costs a failed
promotion, which is recomputed. Remembered for ever, they were 11 MB after 65,536 evictions."""
TOMBSTONES_MAX = 1 << 16
"""A bound on them all the same, should a tier evict faster than 2,000 keys a second."""


def chain_secret(tiers: Sequence[TierSettings]) -> bytes | None:
    """The key the block-key chain is hashed with when any tier has a secret:
    then key names (file names, store keys) tell nothing about prompts to
    whoever lacks the secrets, and replicas with other secrets share no key.
    It derives from the shared tiers' secrets alone where one has a secret: a
    replica's own disk (`shared: false`) under a secret of its own must not keep
    it from the names the fleet shares on Valkey. With no shared tier's secret,
    from the private ones'."""
    secret_of = [(getattr(tier, "shared", False), tier.secret.naming) for tier in tiers
                 if tier.secret.naming is not None]
    named = [naming for shared, naming in secret_of if shared] or [naming for _, naming in secret_of]
    if not named:
        return None
    return derive(b"".join(len(n).to_bytes(4, "little") + n for n in named), "names")


def naming_fingerprint(secret: bytes | None) -> str | None:
    """What a namespace carries of the naming key: 8 bytes derived from it (a key id, telling
    nothing of the key), so deployments under other secrets never share a directory."""
    return None if secret is None else derive(secret, "namespace", 8).hex()


def block_keys(vllm_config: Any, secret: bytes | None) -> str:
    """How block keys are hashed: keyed with the tiers' secret; else as strong
    as vLLM's own prefix-cache hash (`prefix_caching_hash_algo`): a collision
    of xxh3 can be searched for, one of BLAKE2b cannot."""
    if secret is not None:
        return KEYED
    algorithm = str(getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", "") or "")
    return FAST if algorithm.startswith("xxhash") else CRYPTOGRAPHIC


def tier_name(index: int, tier: TierSettings) -> str:
    return f"{index}:{tier.kind}"


def tier_copies(vllm_config: Any, kv_cache_config: Any, world_size: int) -> int:
    """How many files (or values) make one block: one per shard of the KV."""
    return world_size // tp_replicas(vllm_config, kv_cache_config, world_size)


def engine_tiers(settings: ConnectorSettings, slot_bytes: int, copies: int = 1) -> tuple[LowerTierSpec, ...]:
    """Each tier's size in blocks, by the one rule (`tier_types.tier_blocks`)."""
    return tuple(LowerTierSpec(name=tier_name(index, tier),
                               num_blocks=tier_blocks(tier, slot_bytes, copies, f"secondary_tiers[{index - 1}]"))
                 for index, tier in enumerate(settings.secondary_tiers, start=1))


class SchedulerTiers:
    """The scheduler's side: what each tier holds, learned as events."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_cache_config: Any, *,
                 world_size: int) -> None:
        self.tiers = settings.secondary_tiers
        weights = settings.weights_version
        self.chain_secret = chain_secret(self.tiers)
        self.block_keys = block_keys(vllm_config, self.chain_secret)
        naming = naming_fingerprint(self.chain_secret)
        base = identity(vllm_config, kv_cache_config, rank=0, world_size=world_size, weights_version=weights,
                        block_keys=self.block_keys, naming=naming)
        self.key_root = key_root(base)
        self.namespaces = tuple(dict.fromkeys(  # one per distinct shard, in rank order
            namespace(identity(vllm_config, kv_cache_config, rank=rank, world_size=world_size, weights_version=weights,
                               block_keys=self.block_keys, naming=naming))
            for rank in range(world_size)))
        if naming is not None:  # which deployment this is, without the secret: compare it across replicas
            _log.info("tier_naming_key", fingerprint=naming, namespaces=[space.hex() for space in self.namespaces])
        self.health: dict[int, Health] = {}  # per tier on a server, as the scheduler's lookups see the server
        self._closes: list[Callable[[], None]] = []
        self._lookups = {index: KeyLookups(self._finder(index, tier), tier_name(index, tier))
                         for index, tier in enumerate(self.tiers, start=1) if tier.shared}
        self._asked: dict[str, float] = {}  # request -> when its lookup was sent (answered ones are dropped)
        self.counts: dict[int, dict[str, int]] = {  # per shared tier, for metrics
            index: {"lookup_keys": 0, "lookup_timeouts": 0} for index, tier in enumerate(self.tiers, start=1)
            if tier.shared}
        self._answered: set[str] = set()
        self._found: list[ev.TierKeysFound | ev.TierLookupFailed] = []  # lookups' outcomes, to apply
        self._wait_left = LOOKUP_WAIT_S  # of this step's
        self.clock = time.monotonic  # for tombstones' age; a test's own clock in tests
        # Per tier, keys this process asked its workers to remove, oldest first. A lookup can see
        # such a file before the worker has removed it: finding it would offer a block that is gone.
        # A Valkey tier deletes nothing (the store is shared), so it needs none (`TierType.tombstones`).
        self._tombstones: dict[int, dict[bytes, float]] = {  # key -> when removed
            index: {} for index in self._lookups if tier_type(self.tiers[index - 1]).tombstones}

    def _finder(self, index: int, tier: TierSettings) -> Find:
        lookup = tier_type(tier).lookup(tier, tier_name(index, tier), self.namespaces)
        if lookup.health is not None:
            self.health[index] = lookup.health
        if lookup.close is not None:
            self._closes.append(lookup.close)
        return lookup.find

    def startup_events(self) -> list[ev.TierKeysFound]:
        """What each tier holds now: blocks every rank has, oldest first."""
        events = []
        for index, tier in enumerate(self.tiers, start=1):
            row = tier_type(tier)
            self._say_other_formats(index, tier)
            if row.scan is None:
                continue  # a store shared by many instances is not scanned: lookups find what requests need
            started = time.perf_counter()
            keys = row.scan(tier, self.namespaces[0])
            for other in self.namespaces[1:]:
                theirs = set(row.scan(tier, other))
                keys = [k for k in keys if k in theirs]
            _log.info("tier_scanned", tier=tier_name(index, tier), **row.where(tier), keys=len(keys),
                      seconds=round(time.perf_counter() - started, 3))
            if keys:
                events.append(ev.TierKeysFound(tier=index, keys=tuple(keys)))
        return events

    def _say_other_formats(self, index: int, tier: TierSettings) -> None:
        """One warning per namespace of blocks in a format this build cannot read: they are never found."""
        row = tier_type(tier)
        for space, version, blocks in row.other_formats(tier) if row.other_formats else ():
            _log.warning("tier_format_skipped", tier=tier_name(index, tier), **row.where(tier),
                         namespace=space, format_version=version, blocks=blocks,
                         why=f"written in block format {version} by another kvledger build; this build reads "
                             f"format {BLOCK_FORMAT}: its blocks are not served (recomputed)")

    @property
    def shared(self) -> bool:
        return bool(self._lookups)

    def ask(self, request_id: str, keys: Sequence[bytes]) -> bool:
        """Look up keys this process does not know for a request, once per request.
        True while the request should wait for the answer (call `answers`)."""
        if request_id in self._answered:
            return False
        if request_id not in self._asked:
            if not keys:
                self._answered.add(request_id)
                return False
            self._asked[request_id] = time.monotonic()
            for index, lookups in self._lookups.items():
                lookups.submit(request_id, tuple(keys[:LOOKUP_KEYS_MAX]))
                self.counts[index]["lookup_keys"] += min(len(keys), LOOKUP_KEYS_MAX)
        self._collect()
        deadline = time.monotonic() + self._wait_left
        while request_id in self._asked and time.monotonic() < deadline:
            time.sleep(0.0002)
            self._collect()
        self._wait_left = max(0.0, deadline - time.monotonic())
        if request_id in self._asked and time.monotonic() - self._asked[request_id] > LOOKUP_TIMEOUT_S:
            _log.warning("tier_lookup_timed_out", request_id=request_id, timeout_s=LOOKUP_TIMEOUT_S)
            for index, counts in self.counts.items():
                counts["lookup_timeouts"] += 1
                self._found.append(ev.TierLookupFailed(tier=index, request_id=request_id, reason="timed_out"))
            self._done(request_id)
            for lookups in self._lookups.values():
                lookups.cancel(request_id)
        return request_id in self._asked

    def new_step(self) -> None:
        """The scheduler's step ended: the next one may wait `LOOKUP_WAIT_S` again."""
        self._wait_left = LOOKUP_WAIT_S

    def answered(self) -> dict[int, tuple[int, int]]:
        """Per shared tier: (keys asked, keys found) over the lookups it answered."""
        return {index: lookups.answered() for index, lookups in self._lookups.items()}

    def removed(self, tier: int, keys: Sequence[bytes]) -> None:
        """These keys left a tier, or failed to be written there (the engine's `KeysUnloadable`
        and `TransferFailed`): lookups must not find them."""
        tombstones = self._tombstones.get(tier)
        if tombstones is None:
            return
        now = self.clock()
        for key in keys:
            tombstones.pop(key, None)
            tombstones[key] = now
        _expire(tombstones, now - TOMBSTONE_S)

    def _collect(self) -> None:
        for index, lookups in self._lookups.items():
            tombstones = self._tombstones.get(index, {})
            if tombstones:
                _expire(tombstones, self.clock() - TOMBSTONE_S)
            for request_id, found, outcome in lookups.poll():
                found = tuple(k for k in found if k not in tombstones)
                if found:
                    self._found.append(ev.TierKeysFound(tier=index, keys=found))
                if outcome != "answered" and request_id in self._asked:  # the request goes on without it
                    self._found.append(ev.TierLookupFailed(tier=index, request_id=request_id, reason=outcome))
                self._done(request_id)  # with several shared tiers, the first answer releases the request

    def _done(self, request_id: object) -> None:
        if self._asked.pop(request_id, None) is not None:  # type: ignore[call-overload]
            self._answered.add(request_id)  # type: ignore[arg-type]

    def answers(self) -> list[ev.TierKeysFound | ev.TierLookupFailed]:
        """Keys lookups found, and lookups that went unanswered, since the last call: to apply
        before the next lookup."""
        self._collect()
        found, self._found = self._found, []
        return found

    def forget(self, request_id: str) -> None:
        if self._asked.pop(request_id, None) is not None:
            for lookups in self._lookups.values():
                lookups.cancel(request_id)
        self._answered.discard(request_id)

    def new_generation(self) -> None:
        """After a cache reset every request's keys are new: each is asked about
        again, and what earlier lookups found is not offered (a late answer only
        names keys of the old generation, which no request asks for)."""
        self._asked.clear()
        self._answered.clear()
        self._found.clear()

    def close(self) -> None:
        for lookups in self._lookups.values():
            lookups.close()
        for close in self._closes:
            close()


def _expire(tombstones: dict[bytes, float], before: float, most: int = TOMBSTONES_MAX) -> None:
    """Forget the oldest tombstones: those removed before `before`, and any past the bound.
    In one pass: a dict finds its first key past every entry deleted before it, so taking
    them one first key at a time cost a disk tier evicting 6,400 keys a second 0.8 ms of
    the scheduler's step (p99 4 ms)."""
    excess = len(tombstones) - most
    gone: list[bytes] = []
    for key, when in tombstones.items():  # oldest first: a key removed again moved to the end
        if when >= before and len(gone) >= excess:
            break
        gone.append(key)
    for key in gone:
        del tombstones[key]


def open_worker_tiers(settings: ConnectorSettings, vllm_config: Any, kv_cache_config: Any, *, rank: int,
                      world_size: int, rows: Any, payload_bytes: tuple[int, ...]) -> Mapping[int, TierIO]:
    """This worker's I/O on each tier, in its own shard's namespace: read-only
    where another rank writes the same bytes."""
    secret = chain_secret(settings.secondary_tiers)
    ident = identity(vllm_config, kv_cache_config, rank=rank, world_size=world_size,
                     weights_version=settings.weights_version, block_keys=block_keys(vllm_config, secret),
                     naming=naming_fingerprint(secret))
    space = namespace(ident)
    writes = rank % tp_replicas(vllm_config, kv_cache_config, world_size) == 0
    ios: dict[int, TierIO] = {}
    for index, tier in enumerate(settings.secondary_tiers, start=1):
        name = tier_name(index, tier)
        row = tier_type(tier)
        io = row.open_io(tier, WorkerSite(name=name, namespace=space, identity=ident, write_identity=write_identity,
                                           rows=rows, payload_bytes=payload_bytes, writes=writes))
        io = io if writes else ReplicaTierIO(io)
        faults = settings.faults
        if faults.tier_read_delay_s and faults.applies_to(rank):  # a slow disk or a far store, on purpose
            io = SlowedTierIO(io, faults.tier_read_delay_s)
        ios[index] = io
        _log.info("tier_opened", tier=name, **row.where(tier), namespace=space.hex(), rank=rank, writes=writes,
                  sealed=tier.secret.current is not None, encrypted=tier.secret.encrypt,
                  **({"trusted_key_ids": seal.trusted()} if (seal := tier.secret.seal()) is not None else {}))
    return ios
