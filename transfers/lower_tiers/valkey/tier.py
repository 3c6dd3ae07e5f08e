"""The Valkey tier's I/O: host slots to values in a shared Valkey and back, on
threads, each with its own connection.

A job's blocks go out in pipelined batches (one round trip for many blocks,
the way the store is fastest), spread over the threads. The store is shared
and may evict or lose any key, so a read is checked (`block_value`) and a
key that is missing, cut short or foreign fails its position: the engine
drops it and the request recomputes it. A server that is down or paused
fails a batch after one timeout; the tier is then down, and jobs fail at once,
without waiting, until a batch gets through again: tried after
`FIRST_RETRY_S`, then twice as long each time it fails, up to `RETRY_S`.

Evicted keys are not deleted: another instance may be about to read them,
and the server's `maxmemory` and eviction policy bound the store.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import structlog
import torch

from kvledger.transfers.lower_tiers.block_errors import BlockFileError
from kvledger.transfers.lower_tiers.block_header import FORMAT_VERSION, compact_header_bytes
from kvledger.transfers.lower_tiers.block_seal import BlockSeal
from kvledger.transfers.lower_tiers.health import RETRY_S, Health
from kvledger.transfers.lower_tiers.tier_io import Block, ThreadedTierIO, TierJob
from kvledger.transfers.lower_tiers.valkey.block_value import (
    KEY_PREFIX,
    check_in_place,
    decode_value_into,
    store_key,
    value_header,
)
from kvledger.transfers.lower_tiers.valkey.cluster_store import ClusterStore, open_store
from kvledger.transfers.lower_tiers.valkey.store import (
    Landed,
    StoreDown,
    ValkeyServer,
    ValkeyStore,
    ValueTooLarge,
)

Store = ValkeyStore | ClusterStore

_log = structlog.get_logger("kvledger.transfers.valkey_tier")

BATCH_BLOCKS = 32
BATCH_BYTES = 16 << 20

_Batch = tuple[TierJob, list[Block]]


class ValkeyTierIO(ThreadedTierIO):
    """Moves blocks between `rows[slot, :payload_bytes[g]]` and values under
    `store_key(namespace, key)`, on `connections` threads."""

    what = "the Valkey tier"

    def __init__(self, *, server: ValkeyServer, name: str, namespace: bytes, rows: torch.Tensor,
                 payload_bytes: tuple[int, ...], connections: int = 8, seal: BlockSeal | None = None,
                 key_prefix: bytes = KEY_PREFIX) -> None:
        self.server = server
        self.namespace = namespace
        self.seal = seal
        self.key_prefix = key_prefix
        self.health = Health(name, server.where, server.timeout_s)
        self.connections = connections
        super().__init__(rows=rows, payload_bytes=payload_bytes, threads=connections, name="valkey")

    def _items(self, job: TierJob, blocks: list[Block]) -> list[_Batch]:
        """Pipelined batches, one per connection where the job is small (every
        connection busy), and up to `BATCH_BLOCKS` blocks or `BATCH_BYTES` each."""
        most = min(BATCH_BLOCKS, -(-len(blocks) // self.connections))
        batches: list[_Batch] = []
        batch: list[Block] = []
        size = 0
        for block in blocks:
            nbytes = self.payload_bytes[block[0]]
            if batch and (len(batch) == most or size + nbytes > BATCH_BYTES):
                batches.append((job, batch))
                batch, size = [], 0
            batch.append(block)
            size += nbytes
        if batch:
            batches.append((job, batch))
        return batches

    def delete(self, keys: Iterable[bytes]) -> None:
        """Nothing: the store is shared (see the module's docstring)."""

    def _cancel(self, item: _Batch) -> None:
        job, blocks = item
        self._settle(job, [(g, i, key, "cancelled") for g, i, key, _ in blocks], 0, 0, None)

    # -- the threads' side -------------------------------------------------------------------------

    def _thread_context(self) -> Store:
        return open_store(self.server)  # connections of this thread's own

    def _thread_done(self, store: Store) -> None:
        store.close()

    def _run(self, item: _Batch, store: Store) -> None:
        self._run_batch(store, *item)

    def _run_batch(self, store: Store, job: TierJob, blocks: list[Block]) -> None:
        started = time.perf_counter()
        failed: list[tuple[int, int, bytes, str]] = []
        nbytes = 0
        if not self.health.usable():
            failed = [(g, i, key, "unreachable") for g, i, key, _ in blocks]
        else:
            try:
                if job.kind == "read":
                    nbytes, failed = self._read(store, blocks)
                else:
                    nbytes, failed = self._write(store, blocks)
                self.health.worked()
            except StoreDown as exc:
                self.health.failed(str(exc), started)
                failed = [(g, i, key, "unreachable") for g, i, key, _ in blocks]
            except Exception as exc:  # a bug: it fails the batch, never kills the thread or hangs a waiter
                _log.error("tier_batch_crashed", job_id=job.job_id, error=repr(exc))
                failed = [(g, i, key, "unreadable" if job.kind == "read" else "unwritable")
                          for g, i, key, _ in blocks]
        self._settle(job, failed, len(blocks) - len(failed), nbytes, (started, time.perf_counter()))

    def _key(self, key: bytes) -> bytes:
        return store_key(self.namespace, key, self.key_prefix)

    def _write(self, store: Store, blocks: Sequence[Block]) -> tuple[int, list]:
        items = []
        for g, _, key, slot in blocks:
            payload = memoryview(self._array[slot, : self.payload_bytes[g]]).cast("B")
            header, stored = value_header(self.namespace, key, payload, self.seal)
            items.append((self._key(key), header, stored))
        refused = store.set_many(items)
        failed = [(g, i, key, "unwritable") for (g, i, key, _), why in zip(blocks, refused) if why is not None]
        if failed:
            _log.warning("valkey_set_refused", tier=self.health.name, count=len(failed),
                         error=next(why for why in refused if why is not None))
        return sum(self.payload_bytes[g] for (g, _, _, _), why in zip(blocks, refused) if why is None), failed

    def _read(self, store: Store, blocks: Sequence[Block]) -> tuple[int, list]:
        targets = [memoryview(self._array[slot, : self.payload_bytes[g]]).cast("B") for g, _, _, slot in blocks]
        sealed = self.seal is not None
        names = [self._key(key) for _, _, key, _ in blocks]
        values = store.get_into(names, [compact_header_bytes(key, sealed) for _, _, key, _ in blocks], targets)
        failed = []
        nbytes = 0
        for (g, i, key, _), name, value, target in zip(blocks, names, values, targets):
            try:
                if isinstance(value, ValueTooLarge):  # not a block of this size: another writer's
                    raise BlockFileError("foreign", name.decode(), str(value))
                if isinstance(value, Exception):
                    raise BlockFileError("unreadable", name.decode(), str(value))
                if isinstance(value, Landed):
                    check_in_place(value, self.namespace, key, target, self.seal, name.decode())
                else:
                    decode_value_into(value, self.namespace, key, target, self.seal, name.decode())
                nbytes += self.payload_bytes[g]
            except BlockFileError as error:
                target[:] = bytes(target.nbytes)  # refused bytes (or a forged block decrypted) stay nowhere
                failed.append((g, i, key, error.reason))
        return nbytes, failed

    def _settle(self, job: TierJob, failed: list[tuple[int, int, bytes, str]], done: int, nbytes: int,
                span: tuple[float, float] | None) -> None:
        where = [(g, i, reason, self._key(key).decode()) for g, i, key, reason in failed]
        with self._cond:
            outcome = job.settle(where, done, nbytes, span)
            if not self._settled(job, outcome):
                return
        job.finished(outcome)


def keys_present(store: Store, health: Health, namespaces: tuple[bytes, ...],
                 keys: tuple[bytes, ...], key_prefix: bytes = KEY_PREFIX) -> tuple[bytes, ...]:
    """The keys with a value in every namespace (one per tensor-parallel rank).
    While the server is down it raises `StoreDown`, at once: the lookup finds
    nothing, and counts as no query answered (`KeyLookups`)."""
    if not health.usable():
        raise StoreDown(f"{health.where} is down; tried again within {RETRY_S} s")
    began = time.perf_counter()
    try:
        here = store.exists_each([store_key(space, key, key_prefix) for key in keys for space in namespaces])
    except StoreDown as exc:
        health.failed(str(exc), began)
        raise
    health.worked()
    width = len(namespaces)
    return tuple(key for n, key in enumerate(keys) if all(here[n * width:(n + 1) * width]))


FORMATS_KEY = b"formats"
"""`<key prefix>formats`: a hash from each namespace (hex) to the block format its blocks are in, set
by the namespace's writers. The format is part of the namespace, so a build of another format never
finds these blocks; the hash lets it say so at start, rather than start cold in silence."""
FORMATS_MOST = 1024  # namespaces read from the hash at most
COUNT_BUDGET_S = 1.0  # the most time spent counting other formats' blocks at start, all namespaces together


def register_format(store: Store, namespace: bytes, key_prefix: bytes = KEY_PREFIX) -> None:
    store.hset(key_prefix + FORMATS_KEY, namespace.hex(), str(FORMAT_VERSION))


def other_formats(store: Store, key_prefix: bytes = KEY_PREFIX) -> list[tuple[str, object, int]]:
    """The namespaces whose writers registered a block format other than this build's, as
    (namespace hex, their format, their blocks counted; at least that many where the count ran
    out of time), from `FORMATS_KEY`. Nothing where the server cannot be asked."""
    deadline = time.monotonic() + COUNT_BUDGET_S
    try:
        registered = store.hash_fields(key_prefix + FORMATS_KEY, FORMATS_MOST)
        found = []
        for space, version in sorted(registered.items()):
            text = version.decode(errors="replace")[:16]
            if text == str(FORMAT_VERSION):
                continue
            budget = max(0.0, deadline - time.monotonic())
            blocks, _ = store.count_keys(key_prefix + space + b":*", budget) if budget else (0, False)
            found.append((space.decode(errors="replace")[:64], int(text) if text.isdigit() else text, blocks))
        return found
    except StoreDown:
        return []
