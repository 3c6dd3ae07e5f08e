"""The Valkey tier's I/O: host slots to values in a shared Valkey and back, on
threads, each with its own connection.

A job's blocks go out in pipelined batches (one round trip for many blocks,
the way the store is fastest), spread over the threads. The store is shared
and may evict or lose any key, so a read is checked (`block_value`) and a
key that is missing, cut short or foreign fails its position: the engine
drops it and the request recomputes it. A server that is down or paused
fails a batch after one timeout; the tier is then down for `RETRY_S`, when
jobs fail at once, without waiting, until a batch gets through again.

Evicted keys are not deleted: another instance may be about to read them,
and the server's `maxmemory` and eviction policy bound the store.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Sequence

import structlog
import torch

from kvledger.engine.effects import IdsByGroup, KeysByGroup
from kvledger.transfers.backend import BackendClosed, TransferTimeout
from kvledger.transfers.block_file import KEY_BYTES_MAX, BlockFileError
from kvledger.transfers.block_value import decode_value_into, encode_value, store_key
from kvledger.transfers.tier_io import TierIoOutcome, TierJob
from kvledger.transfers.valkey_store import StoreDown, ValkeyServer, ValkeyStore

_log = structlog.get_logger("kvledger.transfers.valkey_tier")

RETRY_S = 1.0
"""After a failure, how long the tier stays down before a batch tries the server again."""
BATCH_BLOCKS = 32
BATCH_BYTES = 16 << 20

_Block = tuple[int, int, bytes, int]  # group, index, key, slot
_Batch = tuple[TierJob, list[_Block]]


class Health:
    """Whether the server is up, shared by a tier's threads: one failure marks it
    down for `RETRY_S`, so a dead server costs each job nothing, not a timeout."""

    def __init__(self, name: str, where: str) -> None:
        self.name = name
        self.where = where
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.up = True
        self.downs = 0  # times it went down, for metrics

    def usable(self) -> bool:
        return self.up or time.monotonic() >= self._down_until

    def failed(self, error: str) -> None:
        with self._lock:
            self._down_until = time.monotonic() + RETRY_S
            was, self.up = self.up, False
            if was:
                self.downs += 1
        if was:
            _log.error("valkey_tier_down", tier=self.name, server=self.where, error=error, retry_s=RETRY_S)

    def worked(self) -> None:
        with self._lock:
            was, self.up = self.up, True
        if not was:
            _log.warning("valkey_tier_up", tier=self.name, server=self.where)


class ValkeyTierIO:
    """Moves blocks between `rows[slot, :payload_bytes[g]]` and values under
    `store_key(namespace, key)`."""

    def __init__(self, *, server: ValkeyServer, name: str, namespace: bytes, rows: torch.Tensor,
                 payload_bytes: tuple[int, ...], connections: int = 4) -> None:
        if rows.dim() != 2 or rows.dtype != torch.int8 or rows.device.type != "cpu" or not rows.is_contiguous():
            raise ValueError(f"rows must be a contiguous 2-D int8 CPU tensor, got {rows.dtype} {tuple(rows.shape)} "
                             f"on {rows.device}")
        if not payload_bytes or any(not 0 < n <= rows.shape[1] for n in payload_bytes):
            raise ValueError(f"payload_bytes {payload_bytes} must each be in [1, {rows.shape[1]}]")
        self.server = server
        self.namespace = namespace
        self.payload_bytes = tuple(int(n) for n in payload_bytes)
        self.rows = rows
        self._array = rows.numpy()
        self.health = Health(name, server.where)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Batch | None] = collections.deque()
        self._pending: dict[int, TierJob] = {}
        self._finished: list[TierIoOutcome] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"kvledger-valkey-{n}", daemon=True)
                         for n in range(connections)]
        for thread in self._threads:
            thread.start()

    # -- the caller's side -------------------------------------------------------------------------

    def write(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._submit(job_id, "write", keys, slot_ids)

    def read(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._submit(job_id, "read", keys, slot_ids)

    def _submit(self, job_id: int, kind: str, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._check(keys, slot_ids)
        blocks = [(g, i, bytes(k), int(s)) for g, (ks, ss) in enumerate(zip(keys, slot_ids))
                  for i, (k, s) in enumerate(zip(ks, ss))]
        job = TierJob(job_id, kind, len(blocks))
        with self._cond:
            if self._closed:
                raise BackendClosed("the Valkey tier was shut down")
            if job_id in self._pending:
                raise ValueError(f"job {job_id} is already in flight")
            if not blocks:
                self._finished.append(TierIoOutcome(job_id, kind, (), (), 0.0, 0))
                return
            self._pending[job_id] = job
            batches = list(self._batches(job, blocks))
            self._queue.extend(batches)
            self._cond.notify(len(batches))

    def _batches(self, job: TierJob, blocks: list[_Block]) -> Iterable[_Batch]:
        batch: list[_Block] = []
        size = 0
        for block in blocks:
            nbytes = self.payload_bytes[block[0]]
            if batch and (len(batch) == BATCH_BLOCKS or size + nbytes > BATCH_BYTES):
                yield job, batch
                batch, size = [], 0
            batch.append(block)
            size += nbytes
        if batch:
            yield job, batch

    def _check(self, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        """A malformed job is the caller's bug: refused whole, before any I/O."""
        if len(keys) != len(self.payload_bytes) or len(slot_ids) != len(self.payload_bytes):
            raise ValueError(f"a job names {len(keys)} key groups and {len(slot_ids)} slot groups; "
                             f"this tier has {len(self.payload_bytes)} groups")
        num_slots = self._array.shape[0]
        for g, (ks, ss) in enumerate(zip(keys, slot_ids)):
            if len(ks) != len(ss):
                raise ValueError(f"group {g}: {len(ks)} keys for {len(ss)} slots")
            if any(not 0 < len(k) <= KEY_BYTES_MAX for k in ks):
                raise ValueError(f"group {g}: a key is 1 to {KEY_BYTES_MAX} bytes")
            if any(not 0 <= s < num_slots for s in ss):
                raise ValueError(f"group {g}: a slot is outside [0, {num_slots})")

    def delete(self, keys: Iterable[bytes]) -> None:
        """Nothing: the store is shared (see the module's docstring)."""

    def poll(self) -> list[TierIoOutcome]:
        with self._cond:
            outcomes, self._finished = self._finished, []
        return outcomes

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """Unknown or finished ids count as finished."""
        deadline = time.monotonic() + timeout_s
        for job_id in job_ids:
            with self._cond:
                job = self._pending.get(job_id)
            if job is not None and not job.done.wait(max(0.0, deadline - time.monotonic())):
                raise TransferTimeout(f"tier job {job_id} did not finish within {timeout_s:.3g} s")

    def shutdown(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Without `drain`, batches not yet started fail as "cancelled"."""
        cancelled: list[_Batch] = []
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if not drain:
                cancelled = [item for item in self._queue if item is not None]
                self._queue.clear()
            self._queue.extend([None] * len(self._threads))
            self._cond.notify_all()
        for job, blocks in cancelled:
            self._settle(job, [(g, i, key, "cancelled") for g, i, key, _ in blocks], 0, None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise TransferTimeout(f"tier thread {thread.name} did not stop within {timeout_s:.3g} s")

    # -- the threads' side -------------------------------------------------------------------------

    def _work(self) -> None:
        store = ValkeyStore(self.server)
        try:
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    item = self._queue.popleft()
                if item is None:
                    return
                self._run_batch(store, *item)
        finally:
            store.close()

    def _run_batch(self, store: ValkeyStore, job: TierJob, blocks: list[_Block]) -> None:
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
                self.health.failed(str(exc))
                failed = [(g, i, key, "unreachable") for g, i, key, _ in blocks]
            except Exception as exc:  # a bug: it fails the batch, never kills the thread or hangs a waiter
                _log.error("tier_batch_crashed", job_id=job.job_id, error=repr(exc))
                failed = [(g, i, key, "unreadable" if job.kind == "read" else "unwritable")
                          for g, i, key, _ in blocks]
        self._settle(job, failed, nbytes, (started, time.perf_counter()), len(blocks))

    def _write(self, store: ValkeyStore, blocks: Sequence[_Block]) -> tuple[int, list]:
        items = [(store_key(self.namespace, key), encode_value(self.namespace, key,
                                                                self._array[slot, : self.payload_bytes[g]]))
                 for g, _, key, slot in blocks]
        refused = store.set_many(items)
        failed = [(g, i, key, "unwritable") for (g, i, key, _), why in zip(blocks, refused) if why is not None]
        if failed:
            _log.warning("valkey_set_refused", tier=self.health.name, count=len(failed),
                         error=next(why for why in refused if why is not None))
        return sum(self.payload_bytes[g] for g, _, _, _ in blocks) - sum(
            self.payload_bytes[g] for g, _, _, _ in failed), failed

    def _read(self, store: ValkeyStore, blocks: Sequence[_Block]) -> tuple[int, list]:
        values = store.get_many([store_key(self.namespace, key) for _, _, key, _ in blocks])
        failed = []
        nbytes = 0
        for (g, i, key, slot), value in zip(blocks, values):
            try:
                if isinstance(value, Exception):
                    raise BlockFileError("unreadable", store_key(self.namespace, key).decode(), str(value))
                decode_value_into(value, self.namespace, key, self._array[slot, : self.payload_bytes[g]])
                nbytes += self.payload_bytes[g]
            except BlockFileError as error:
                failed.append((g, i, key, error.reason))
        return nbytes, failed

    def _settle(self, job: TierJob, failed: list[tuple[int, int, bytes, str]], nbytes: int,
                span: tuple[float, float] | None, count: int | None = None) -> None:
        """Settle a batch: its failed positions, then the rest as done (`nbytes` between them)."""
        failed_at = {(g, i) for g, i, _, _ in failed}
        total = len(failed) if count is None else count
        with self._cond:
            outcome = None
            for g, i, key, reason in failed:
                outcome = job.settle(g, i, reason, store_key(self.namespace, key).decode(), 0, span) or outcome
            for n in range(total - len(failed_at)):
                outcome = job.settle(-1, -1, None, "", nbytes if n == 0 else 0, span) or outcome
            if outcome is None:
                return
            self._finished.append(outcome)
            del self._pending[job.job_id]
        job.finished(outcome)


def keys_present(store: ValkeyStore, health: Health, namespaces: tuple[bytes, ...],
                 keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """The keys with a value in every namespace (one per tensor-parallel rank);
    while the server is down, none, at once."""
    if not health.usable():
        return ()
    try:
        here = store.exists_each([store_key(space, key) for key in keys for space in namespaces])
    except StoreDown as exc:
        health.failed(str(exc))
        return ()
    health.worked()
    width = len(namespaces)
    return tuple(key for n, key in enumerate(keys) if all(here[n * width:(n + 1) * width]))
