"""The file-system tier's I/O: host slots to block files and back, on threads.

Every block is one file (`block_file`), so a job's blocks go to a pool of
threads: each waits on the disk for one block, and the disk is kept busy
only with many in flight. Errors are per block and end as failed positions
of the job's outcome, never as exceptions: the caller drops a key that
failed to read and recomputes it.

Numbers from `bench/fs_tier_io.py` on this project's VM (ext4 on a virtio
disk, 2 cores): 1 GiB per measurement, writes timed to the end of
`os.sync()`, reads from a dropped page cache, median of 3, two runs (GB/s):

- Writes use O_DIRECT. 2 MiB blocks: 1.3-1.5 against 0.5-0.9 through the
  page cache (raw sequential 1.1-1.2); 256 KiB: 0.4-0.6 against 0.4. Through
  the page cache a job ends sooner, but the work only moves to writeback,
  where ext4's delayed allocation takes the files one by one. Host rows are
  only 64-byte aligned (torch's allocator), so each thread stages header and
  payload in a page-aligned bounce buffer (one memcpy, small against the
  disk); a payload that is not a multiple of 4096 bytes is written padded and
  truncated back. A file system that refuses O_DIRECT (EINVAL: ramfs, some
  FUSE) turns it off for the tier.
- Reads stay buffered (`read_block_into` straight into the host row, no
  copy): 2 MiB blocks 2.0-2.2 against 1.0-1.3 with O_DIRECT (readahead keeps
  more requests in flight), raw sequential 1.9-2.0; 256 KiB 0.9-1.2 either way.
- 16 threads: reads 2.2 against 2.0 with 8 (32 adds nothing), writes the same.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import structlog
import torch

from kvledger.engine.effects import IdsByGroup, KeysByGroup
from kvledger.transfers.lower_tiers.block_file import (
    ASIDE_SUFFIX,
    PROBE_PREFIX,
    SUFFIX,
    aside_path,
    block_path,
    create_aside,
    key_tail,
    read_block_into,
    write_block,
)
from kvledger.transfers.lower_tiers.block_header import (
    HEADER_BYTES,
    NAMESPACE_BYTES,
    BlockFileError,
    seal_block,
)
from kvledger.transfers.lower_tiers.block_seal import BlockSeal
from kvledger.transfers.lower_tiers.tier_io import Block, ThreadedTierIO, TierIoOutcome, TierJob

DIRECT_ALIGN = 4096
"""Address, offset and length alignment that O_DIRECT accepts on any common device."""
LEFTOVER_GRACE_S = 600.0
"""How long an aside or probe file is left to its writer: one on another host
sharing the directory may still be writing it (a write takes milliseconds)."""

_log = structlog.get_logger("kvledger.transfers.fs_tier")
_KEY_FILE = re.compile(r"(?:[0-9a-f]{2})+" + re.escape(SUFFIX))


__all__ = ["FsTierIO", "IdsByGroup", "KeysByGroup", "TierIoOutcome", "files_present", "remove_leftovers",
           "scan_keys"]




def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _DirectUnsupported(Exception):
    """This file system refuses O_DIRECT (EINVAL on open or an aligned write)."""


class FsTierIO(ThreadedTierIO):
    """Moves blocks between `rows[slot, :payload_bytes[g]]` and block files under
    `root/<namespace hex>/`. `direct_writes=False` writes through the page cache."""

    what = "the file-system tier"

    def __init__(self, *, root: str, namespace: bytes, rows: torch.Tensor, payload_bytes: tuple[int, ...],
                 threads: int = 16, direct_writes: bool = True, seal: BlockSeal | None = None,
                 gid: int | None = None) -> None:
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"a namespace is {NAMESPACE_BYTES} bytes, not {len(namespace)}")
        self.root = os.fspath(root)
        self.namespace = namespace
        self.direct_writes = direct_writes
        self.seal = seal
        self.gid = gid  # the tier's group (`block_file.file_mode`), None: this user's alone
        self._bounce_bytes = _round_up(HEADER_BYTES + max(payload_bytes, default=0), DIRECT_ALIGN)
        # Removals not yet carried out, per key. A write of a key first carries out the removals
        # queued before it, so a removal that a slower thread reaches later never deletes the new
        # file; removals and those writes' first step hold `_removing`, so they cannot interleave.
        self._removals: dict[bytes, int] = {}
        self._removing = threading.Lock()
        super().__init__(rows=rows, payload_bytes=payload_bytes, threads=threads, name="fs")

    def _items(self, job: TierJob, blocks: list[Block]) -> list:
        return [(job, g, i, k, s) for g, i, k, s in blocks]

    def _cancel(self, item) -> None:
        if item[0] != "delete":  # queued deletes are dropped
            job, g, i, key, _slot = item
            self._settle(job, g, i, "cancelled", block_path(self.root, self.namespace, key), 0, None)

    def delete(self, keys: Iterable[bytes]) -> None:
        """Best effort, after the work already queued; ignored once shut down."""
        with self._cond:
            if self._closed:
                return
            before = len(self._queue)
            for key in keys:
                key = bytes(key)
                self._removals[key] = self._removals.get(key, 0) + 1
                self._queue.append(("delete", key))
            self._cond.notify(len(self._queue) - before)

    # -- the threads' side -------------------------------------------------------------------------

    def _thread_context(self) -> list[mmap.mmap]:
        return []  # this thread's page-aligned staging buffer, made on first use

    def _run(self, item, bounce: list[mmap.mmap]) -> None:
        if item[0] == "delete":
            self._delete(item[1])
        else:
            self._run_block(*item, bounce)

    def _run_block(self, job: TierJob, g: int, i: int, key: bytes, slot: int, bounce: list[mmap.mmap]) -> None:
        started = time.perf_counter()
        reason: str | None = None
        nbytes = 0
        path = block_path(self.root, self.namespace, key)
        try:
            payload = self._array[slot, : self.payload_bytes[g]]
            if job.kind == "read":
                read_block_into(path, self.namespace, key, payload, self.seal)
            else:
                self._remove_before_write(key, path)
                self._write(path, key, payload, bounce)
            nbytes = payload.nbytes
        except BlockFileError as error:
            reason = error.reason
        except Exception as exc:  # a bug: it fails the block, never kills the thread or hangs a waiter
            reason = "unreadable" if job.kind == "read" else "unwritable"
            _log.error("tier_block_crashed", job_id=job.job_id, path=str(path), error=repr(exc))
        self._settle(job, g, i, reason, path, nbytes, (started, time.perf_counter()))

    def _write(self, path: Path, key: bytes, payload, bounce: list[mmap.mmap]) -> None:
        if self.direct_writes:
            if not bounce:
                bounce.append(mmap.mmap(-1, self._bounce_bytes))
            try:
                _write_direct(path, self.namespace, key, memoryview(payload).cast("B"), bounce[0], self.seal,
                              gid=self.gid)
                return
            except _DirectUnsupported as exc:
                with self._cond:
                    was, self.direct_writes = self.direct_writes, False
                if was:
                    _log.info("tier_direct_io_off", root=self.root, error=str(exc))
        write_block(path, self.namespace, key, payload, self.seal, gid=self.gid)

    def remove_leftovers(self, grace_s: float = LEFTOVER_GRACE_S) -> int:
        """`remove_leftovers` in this tier's namespace: for the worker opening it."""
        return remove_leftovers(self.root, self.namespace, grace_s=grace_s)

    def _delete(self, key: bytes) -> None:
        with self._removing:
            with self._cond:
                pending = self._removals.get(key, 0)
                if not pending:
                    return  # a later write of the key carried it out first
                if pending == 1:
                    del self._removals[key]
                else:
                    self._removals[key] = pending - 1
            self._unlink(block_path(self.root, self.namespace, key))

    def _remove_before_write(self, key: bytes, path: Path) -> None:
        with self._removing:
            with self._cond:
                pending = self._removals.pop(key, 0)
            if pending:
                self._unlink(path)

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except Exception as exc:
            _log.warning("tier_delete_failed", path=str(path), error=repr(exc))

    def _settle(self, job: TierJob, g: int, i: int, reason: str | None, path: Path, nbytes: int,
                span: tuple[float, float] | None) -> None:
        with self._cond:
            outcome = job.settle([(g, i, reason, str(path))] if reason else [], 0 if reason else 1, nbytes, span)
            if not self._settled(job, outcome):
                return
        job.finished(outcome)


def _write_direct(path: Path, namespace: bytes, key: bytes, payload: memoryview, bounce: mmap.mmap,
                  seal: BlockSeal | None = None, *, gid: int | None = None) -> None:
    """`block_file.write_block`'s file (written aside under an unpredictable
    name, renamed into place), with O_DIRECT from the page-aligned `bounce`."""
    total = HEADER_BYTES + payload.nbytes
    padded = _round_up(total, DIRECT_ALIGN)
    staged = memoryview(bounce)
    header, stored = seal_block(namespace, key, payload, seal, out=staged[HEADER_BYTES:total])
    staged[:HEADER_BYTES] = header
    if seal is None or not seal.encrypt:  # else the seal wrote its ciphertext there
        staged[HEADER_BYTES:total] = stored
    staged[total:padded] = bytes(padded - total)
    aside = aside_path(path)
    try:
        try:
            fd = create_aside(aside, gid, os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # ramfs, some FUSE: and ramfs creates the file first
                raise _DirectUnsupported(f"open: {exc}") from exc
            raise
        try:
            done = 0
            while done < padded:
                try:
                    done += os.write(fd, staged[done:padded])  # after a short write (a full disk) the next raises
                except OSError as exc:
                    if exc.errno == errno.EINVAL and done == 0:
                        raise _DirectUnsupported(f"write: {exc}") from exc
                    raise
            if padded != total:
                os.ftruncate(fd, total)
        finally:
            os.close(fd)
        os.replace(aside, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(aside)
        if isinstance(exc, OSError):
            raise BlockFileError("unwritable", path, f"{exc.strerror or exc} (errno {exc.errno})") from exc
        raise


def remove_leftovers(root: str, namespace: bytes, *, grace_s: float = LEFTOVER_GRACE_S) -> int:
    """Remove what crashed writers left, unchanged for over `grace_s`: aside files
    (`.*.tmp`) in the namespace's directory and its fan-out directories, and
    write probes in `root`. Nothing else is touched; the number removed. Else
    they would stay forever, taking room no capacity counts."""
    cutoff = time.time() - grace_s
    root = os.fspath(root)
    top = os.path.join(root, namespace.hex())
    folders = [(root, _is_probe), (top, _is_aside)]
    with contextlib.suppress(OSError):  # no namespace directory yet: nothing left there
        folders += [(entry.path, _is_aside) for entry in os.scandir(top) if entry.is_dir(follow_symlinks=False)]
    removed = 0
    for folder, wanted in folders:
        try:
            entries = [entry for entry in os.scandir(folder) if wanted(entry.name)]
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode) or info.st_mtime >= cutoff:
                    continue
                os.unlink(entry.path)  # a link is removed, never followed
            except FileNotFoundError:  # another process removed or renamed it meanwhile
                continue
            except OSError as exc:
                _log.warning("tier_leftover_not_removed", path=entry.path, error=repr(exc))
                continue
            removed += 1
    _log.info("tier_leftovers_removed", root=root, namespace=namespace.hex(), removed=removed, grace_s=grace_s)
    return removed


def _is_aside(name: str) -> bool:
    return name.startswith(".") and name.endswith(ASIDE_SUFFIX)


def _is_probe(name: str) -> bool:
    return name.startswith(PROBE_PREFIX)


# -- the scheduler's side ----------------------------------------------------------------------------


def scan_keys(root: str, namespace: bytes) -> list[bytes]:
    """Keys with a block file under `root/<namespace hex>/`, oldest first, so the
    engine's eviction order resumes where it was. Files shorter than a header
    (a crash's leftovers) and names `block_path` would not give are skipped."""
    found: list[tuple[int, bytes]] = []
    top = os.path.join(os.fspath(root), namespace.hex())
    try:
        subdirs = [entry for entry in os.scandir(top) if entry.is_dir(follow_symlinks=False)]
    except OSError:  # missing, or not a directory: nothing there
        return []
    for subdir in subdirs:
        try:
            entries = list(os.scandir(subdir.path))
        except OSError:
            continue
        for entry in entries:
            name = entry.name
            if not _KEY_FILE.fullmatch(name) or name[:2] != subdir.name:
                continue
            try:
                if not entry.is_file(follow_symlinks=False):  # a link, a FIFO, a directory: no block
                    continue
                info = entry.stat(follow_symlinks=False)
            except OSError:  # removed since the listing
                continue
            if info.st_size >= HEADER_BYTES:
                found.append((info.st_mtime_ns, bytes.fromhex(name[: -len(SUFFIX)])))
    found.sort()
    return [key for _, key in found]


def files_present(root: str, namespaces: tuple[bytes, ...], keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """The keys with a block file in every namespace (one per tensor-parallel rank)."""
    tops = [os.path.join(os.fspath(root), space.hex()) + os.sep for space in namespaces]
    found = []
    for key in keys:
        tail = key_tail(key)
        if all(_present(top + tail) for top in tops):
            found.append(key)
    return tuple(found)


def _present(path: str) -> bool:
    """A regular file long enough to hold a block: a link or a FIFO is no block
    (a read of it fails), so finding one would offer a load that cannot happen."""
    try:
        info = os.lstat(path)
    except Exception:  # missing, unreadable: absent
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size >= HEADER_BYTES
