"""The file-system tier's I/O: host slots to block files and back, on threads.

A write job's consecutive blocks go into packs of up to `PACK_BYTES`
(`block_pack`: one file, each key's name a hard link to it), a lone block
or one of 2 MiB into a file of its own (`block_file`); packs and files go
to a pool of threads, so the disk has many in flight. A read job is shared
out in runs over the threads; a run opens its first key's file and reads
the run's other blocks that file holds through the same descriptor. Errors
are per block and end as failed positions of the job's outcome, never as
exceptions: the caller drops a key that failed to read and recomputes it.
Every file is reached from the directories held open since start
(`tier_dir`), never through a link.

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
- Packs (2026-11-29, one run, cold): reads of 64 KiB blocks 0.81x of raw
  sequential reads against 0.17x a file each, 256 KiB 1.07x against 0.56x.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import structlog
import torch

from kvledger.engine.effects import IdsByGroup, KeysByGroup
from kvledger.transfers.lower_tiers.block_errors import BlockFileError, write_error
from kvledger.transfers.lower_tiers.block_header import (
    FORMAT_VERSION,
    HEADER_BYTES,
    NAMESPACE_BYTES,
    seal_block,
)
from kvledger.transfers.lower_tiers.block_seal import BlockSeal
from kvledger.transfers.lower_tiers.fs.block_file import (
    ASIDE_SUFFIX,
    PROBE_PREFIX,
    SUFFIX,
    aside_path,
    block_path,
    check_block,
    create_aside,
    key_tail,
    open_block,
    read_open_block,
    write_block,
)
from kvledger.transfers.lower_tiers.fs.block_pack import (
    ALIGN,
    BLOCKS_MAX,
    encode_table,
    pack_table,
    punch_block,
    round_up,
)
from kvledger.transfers.lower_tiers.fs.tier_dir import NotTheTiers, TierDir, gone, open_dir, usable_dir
from kvledger.transfers.lower_tiers.tier_io import Block, ThreadedTierIO, TierIoOutcome, TierJob

DIRECT_ALIGN = ALIGN
"""Address, offset and length alignment that O_DIRECT accepts on any common device."""
PACK_BYTES = 2 << 20
"""Payload bytes a pack (`block_pack`) gathers from a write job's consecutive blocks: 2 MiB
blocks already read and write at the disk's speed one file each, smaller ones do in packs."""
LEFTOVER_GRACE_S = 600.0
"""How long an aside or probe file is left to its writer: one on another host
sharing the directory may still be writing it (a write takes milliseconds)."""

_log = structlog.get_logger("kvledger.transfers.fs_tier")
_KEY_FILE = re.compile(r"(?:[0-9a-f]{2})+" + re.escape(SUFFIX))


__all__ = ["FileLookup", "FsTierIO", "IdsByGroup", "KeysByGroup", "TierIoOutcome", "files_present", "remove_leftovers",
           "scan_keys"]




class _DirectUnsupported(Exception):
    """This file system refuses O_DIRECT (EINVAL on open or an aligned write)."""


class FsTierIO(ThreadedTierIO):
    """Moves blocks between `rows[slot, :payload_bytes[g]]` and block files under
    `root/<namespace hex>/`. `direct_writes=False` writes through the page cache."""

    what = "the file-system tier"

    def __init__(self, *, root: str, namespace: bytes, rows: torch.Tensor, payload_bytes: tuple[int, ...],
                 threads: int = 16, direct_writes: bool = True, seal: BlockSeal | None = None,
                 gid: int | None = None, pack_bytes: int = PACK_BYTES) -> None:
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"a namespace is {NAMESPACE_BYTES} bytes, not {len(namespace)}")
        self.root = os.fspath(root)
        self.namespace = namespace
        self.direct_writes = direct_writes
        self.seal = seal
        self.gid = gid  # the tier's group (`block_file.file_mode`), None: this user's alone
        self.pack_bytes = pack_bytes  # 0: a file per block; turned off where hard links are refused
        self._bounce_bytes = round_up(HEADER_BYTES + max(payload_bytes, default=0), DIRECT_ALIGN)
        # Removals not yet carried out, per key. A write of a key first carries out the removals
        # queued before it, so a removal that a slower thread reaches later never deletes the new
        # file; removals, and the first step of a write with a removal of its keys queued or under
        # way, hold `_removing`, so they cannot interleave.
        self._removals: dict[bytes, int] = {}
        self._removing = threading.Lock()
        # The key a removal is unlinking now (one at a time, under `_removing`), read and written
        # under `_cond`: a write of any other key, with none queued for it, need not wait for it.
        self._unlinking: bytes | None = None
        self._item = threading.local()  # per thread: the positions its current item settled
        self.dir = TierDir(self.root, gid, create=True)  # made where missing, as its blocks' directories are
        self.dir.hold(namespace)  # 2 + 256 descriptors from the start, none grown into while serving
        super().__init__(rows=rows, payload_bytes=payload_bytes, threads=threads, name="fs")

    def shutdown(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        super().shutdown(drain=drain, timeout_s=timeout_s)
        if not any(thread.is_alive() for thread in self._threads):  # else a thread may still use them
            self.dir.close()

    def _items(self, job: TierJob, blocks: list[Block]) -> list:
        """A write job's consecutive blocks go in packs of up to `pack_bytes`; a read
        job's blocks are shared out in runs over the threads, so that a run whose
        blocks one pack holds opens it once."""
        if job.kind == "write":
            return [("write", job, run) for run in self._packs(blocks)]
        step = max(1, -(-len(blocks) // len(self._threads)), self.pack_bytes // max(self.payload_bytes))
        return [("read", job, blocks[n:n + step]) for n in range(0, len(blocks), step)]

    def _packs(self, blocks: list[Block]) -> list[list[Block]]:
        runs: list[list[Block]] = []
        size = self.pack_bytes
        for block in blocks:
            nbytes = self.payload_bytes[block[0]]
            if runs and size + nbytes <= self.pack_bytes and len(runs[-1]) < BLOCKS_MAX:
                runs[-1].append(block)
                size += nbytes
            else:
                runs.append([block])
                size = nbytes
        return runs

    def _cancel(self, item) -> None:
        if item[0] != "delete":  # queued deletes are dropped
            _kind, job, blocks = item
            for g, i, key, _slot in blocks:
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
        kind = item[0]
        if kind == "delete":
            self._delete(item[1])
            return
        _kind, job, blocks = item
        self._item.settled = settled = set()
        try:
            if kind == "read":
                self._read_run(job, blocks)
            elif len(blocks) == 1 or not self.pack_bytes:
                for block in blocks:
                    self._write_one(job, *block, bounce)
            else:
                self._write_pack(job, blocks, bounce)
        except Exception as exc:  # a bug: it fails the blocks left, never kills the thread or hangs a waiter
            _log.error("tier_block_crashed", job_id=job.job_id, root=self.root, error=repr(exc))
            for g, i, key, _slot in blocks:
                if (g, i) not in settled:
                    self._settle(job, g, i, "unreadable" if kind == "read" else "unwritable",
                                 block_path(self.root, self.namespace, key), 0, None)

    # Reads.

    def _read_run(self, job: TierJob, blocks: list[Block]) -> None:
        """Each block from its key's file; where that file is a pack, the run's other
        blocks the pack holds are read through the same descriptor."""
        left = list(blocks)
        while left:
            g, i, key, slot = left.pop(0)
            started = time.perf_counter()
            path = block_path(self.root, self.namespace, key)
            try:
                fd = self._open(key, path)
            except BlockFileError as error:
                self._settle(job, g, i, error.reason, path, 0, (started, time.perf_counter()))
                continue
            try:
                try:
                    entries = pack_table(fd, path, self.namespace)
                except OSError as exc:
                    raise BlockFileError("unreadable", path, f"{exc.strerror or exc} (errno {exc.errno})") from exc
                if entries is None:
                    self._read_file(job, (g, i, key, slot), fd, path, started)
                    continue
                if key not in entries:
                    raise BlockFileError("foreign", path, f"the pack at its name holds no key {key.hex()}")
                mine = [(g, i, key, slot)] + [block for block in left if block[2] in entries]
                left = [block for block in left if block[2] not in entries]
                for segment in self._segments(mine, entries):
                    self._read_segment(job, segment, entries, fd, path, started)
                    started = time.perf_counter()
            except BlockFileError as error:
                self._settle(job, g, i, error.reason, path, 0, (started, time.perf_counter()))
            finally:
                os.close(fd)

    def _open(self, key: bytes, path: Path) -> int:
        """The key's file, open for reading (`block_file.open_block`). Where it is
        missing, a held directory removed meanwhile is let go and the file looked
        for once more (another process may have made the directory anew)."""
        try:
            fan = self.dir.fan_out(self.namespace, key)
        except FileNotFoundError:
            raise BlockFileError("missing", path, "no such file (its directory is missing)") from None
        except OSError as exc:  # a link or a file where the directory should be, or someone else's
            raise BlockFileError("unreadable", path, _directory_error(exc)) from exc
        try:
            return open_block(_name(key), dir_fd=fan, shown=path)
        except BlockFileError as error:
            if error.reason != "missing" or not self.dir.refresh(self.namespace, key, fan):
                raise
        return self._open_again(key, path)

    def _open_again(self, key: bytes, path: Path) -> int:
        """`_open` once more, after a held directory was let go (`TierDir.refresh`)."""
        try:
            return open_block(_name(key), dir_fd=self.dir.fan_out(self.namespace, key), shown=path)
        except FileNotFoundError:
            raise BlockFileError("missing", path, "no such file (its directory is missing)") from None
        except OSError as exc:
            raise BlockFileError("unreadable", path, _directory_error(exc)) from exc

    def _segments(self, blocks: list[Block], entries: dict[bytes, tuple[int, int]]) -> list[list[Block]]:
        """The blocks in the pack's order, cut where one does not follow the last
        (or its size in the table is not the size this tier reads)."""
        segments: list[list[Block]] = []
        end = -1
        for block in sorted(blocks, key=lambda block: entries[block[2]][0]):
            offset, nbytes = entries[block[2]]
            if nbytes != self.payload_bytes[block[0]]:  # read alone: it fails its header's size check
                segments.append([block])
                end = -1
                continue
            if offset == end:
                segments[-1].append(block)
            else:
                segments.append([block])
            end = offset + HEADER_BYTES + round_up(nbytes)
        return segments

    def _read_segment(self, job: TierJob, blocks: list[Block], entries: dict[bytes, tuple[int, int]], fd: int,
                      path: Path, started: float) -> None:
        """Consecutive blocks of a pack in one read; then each block checked alone."""
        buffers: list = []
        parts: list[tuple[bytearray, memoryview]] = []
        for g, _i, _key, slot in blocks:
            header, target = bytearray(HEADER_BYTES), memoryview(self._array[slot, : self.payload_bytes[g]]).cast("B")
            pad = round_up(target.nbytes) - target.nbytes
            buffers += [header, target, bytearray(pad)] if pad else [header, target]
            parts.append((header, target))
        start = entries[blocks[0][2]][0]
        try:
            got = os.preadv(fd, buffers, start)
        except OSError as exc:
            for (g, i, _key, _slot), (_header, target) in zip(blocks, parts):
                target[:] = bytes(target.nbytes)  # whatever the read left: never a block's
                self._settle(job, g, i, "unreadable", path, 0, (started, time.perf_counter()))
            _log.debug("tier_read_failed", path=str(path), error=repr(exc))
            return
        ended = time.perf_counter()
        at = 0
        for (g, i, key, _slot), (header, target) in zip(blocks, parts):
            reason: str | None = None
            try:
                check_block(path, header, self.namespace, key, target, self.seal, got=got - at)
            except BlockFileError as error:
                # A header of zeros in a pack: the key was removed, its extent punched out.
                reason = "missing" if error.reason == "foreign" and not any(header[:64]) else error.reason
                target[:] = bytes(target.nbytes)  # refused bytes (or a forged block decrypted) stay nowhere
            self._settle(job, g, i, reason, path, 0 if reason else target.nbytes, (started, ended))
            at += HEADER_BYTES + round_up(target.nbytes)

    def _read_file(self, job: TierJob, block: Block, fd: int, path: Path, started: float) -> None:
        """A block file of one block (not a pack), open at `fd`."""
        g, i, key, slot = block
        payload = self._array[slot, : self.payload_bytes[g]]
        reason: str | None = None
        try:
            read_open_block(fd, path, self.namespace, key, payload, self.seal)
        except BlockFileError as error:
            reason = error.reason
            payload[:] = 0  # refused bytes (or a forged block decrypted) stay nowhere
        self._settle(job, g, i, reason, path, 0 if reason else payload.nbytes, (started, time.perf_counter()))

    # Writes.

    def _write_one(self, job: TierJob, g: int, i: int, key: bytes, slot: int, bounce: list[mmap.mmap]) -> None:
        started = time.perf_counter()
        reason: str | None = None
        path = block_path(self.root, self.namespace, key)
        payload = self._array[slot, : self.payload_bytes[g]]
        try:
            self._remove_before_write(key, path)
            self._write(path, key, payload, bounce)
        except BlockFileError as error:
            reason = error.reason
        self._settle(job, g, i, reason, path, 0 if reason else payload.nbytes, (started, time.perf_counter()))

    def _write_pack(self, job: TierJob, blocks: list[Block], bounce: list[mmap.mmap]) -> None:
        """The blocks into one file written aside, then each key's name linked to it."""
        started = time.perf_counter()
        keys = [key for _g, _i, key, _slot in blocks]
        sizes = [self.payload_bytes[g] for g, _i, _key, _slot in blocks]
        paths = [block_path(self.root, self.namespace, key) for key in keys]
        self._remove_before_writes(keys, paths)
        table, offsets, total = encode_table(self.namespace, keys, sizes)
        try:
            aside = _At(self._fan_out(keys[0], paths[0]), _aside_name(_name(keys[0])), paths[0])
            self._write_pack_file(aside, table, offsets, total, blocks, bounce)
        except BlockFileError as error:  # a full disk, mostly: what fits may still go, a file each
            _log.debug("tier_pack_unwritable", path=error.path, error=error.detail, blocks=len(blocks))
            for block in blocks:
                self._write_one(job, *block, bounce)
            return
        reasons: list[str | None] = []
        try:
            for key, path in zip(keys, paths):
                try:
                    _link_into_place(aside, _At(self._fan_out(key, path), _name(key), path))
                    reasons.append(None)
                except _LinksUnsupported as exc:
                    with self._cond:
                        was, self.pack_bytes = self.pack_bytes, 0
                    if was:
                        _log.info("tier_packs_off", root=self.root, error=str(exc))
                    break
                except (OSError, BlockFileError) as exc:
                    reasons.append("unwritable")
                    _log.debug("tier_link_failed", path=str(path), error=repr(exc))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(aside.name, dir_fd=aside.fd)  # before the job ends: its blocks' files hold nothing else
        self._settle_all(job, [(g, i, reason, path, 0 if reason else size)
                               for (g, i, _key, _slot), path, size, reason in zip(blocks, paths, sizes, reasons)],
                         (started, time.perf_counter()))
        for block in blocks[len(reasons):]:  # links refused: one file per block from here on
            self._write_one(job, *block, bounce)

    def _write_pack_file(self, aside: _At, table: bytes, offsets: list[int], total: int,
                         blocks: list[Block], bounce: list[mmap.mmap]) -> None:
        """The pack at `aside`, from the page-aligned bounce buffer (O_DIRECT), or
        through the page cache where direct I/O is off or refused."""
        if len(bounce) and len(bounce[0]) < total:
            bounce.pop().close()
        if not bounce:
            bounce.append(mmap.mmap(-1, max(total, self._bounce_bytes)))
        staged = memoryview(bounce[0])
        staged[: len(table)] = table
        for (g, _i, key, slot), offset in zip(blocks, offsets):
            payload = memoryview(self._array[slot, : self.payload_bytes[g]]).cast("B")
            _stage_block(staged, offset, self.namespace, key, payload, self.seal)
        if self.direct_writes:
            try:
                _write_file(aside, staged[:total], self.gid, direct=True)
                return
            except _DirectUnsupported as exc:
                self._direct_off(exc)
        _write_file(aside, staged[:total], self.gid, direct=False)

    def _write(self, path: Path, key: bytes, payload, bounce: list[mmap.mmap]) -> None:
        """The block's file; where the write fails because a held directory was
        removed meanwhile, once more after it is made again."""
        fan = self._fan_out(key, path)
        try:
            self._write_at(fan, path, key, payload, bounce)
        except BlockFileError:
            if not self.dir.refresh(self.namespace, key, fan):
                raise
            self._write_at(self._fan_out(key, path), path, key, payload, bounce)

    def _write_at(self, fan: int, path: Path, key: bytes, payload, bounce: list[mmap.mmap]) -> None:
        if self.direct_writes:
            if not bounce:
                bounce.append(mmap.mmap(-1, self._bounce_bytes))
            try:
                _write_direct(_At(fan, _name(key), path), self.namespace, key, memoryview(payload).cast("B"),
                              bounce[0], self.seal, gid=self.gid)
                return
            except _DirectUnsupported as exc:
                self._direct_off(exc)
        write_block(_name(key), self.namespace, key, payload, self.seal, gid=self.gid, dir_fd=fan, shown=path)

    def _fan_out(self, key: bytes, path: Path) -> int:
        """`TierDir.fan_out`, made where missing; its failure a `BlockFileError` naming the block."""
        try:
            return self.dir.fan_out(self.namespace, key, create=True)
        except (NotTheTiers, FileNotFoundError, NotADirectoryError) as exc:
            raise BlockFileError("unwritable", path, _directory_error(exc)) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP or isinstance(exc, PermissionError):
                raise BlockFileError("unwritable", path, _directory_error(exc)) from exc
            raise write_error(path, exc) from exc

    def _direct_off(self, refusal: Exception) -> None:
        """This file system refused O_DIRECT: the tier writes through the page cache from now on."""
        with self._cond:
            was, self.direct_writes = self.direct_writes, False
        if was:
            _log.info("tier_direct_io_off", root=self.root, error=str(refusal))

    def remove_leftovers(self, grace_s: float = LEFTOVER_GRACE_S) -> int:
        """`remove_leftovers` in this tier's namespace: for the worker opening it."""
        return _remove_leftovers(self.dir, self.namespace, grace_s)

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
                self._unlinking = key
            try:
                self._remove(key, block_path(self.root, self.namespace, key))
            finally:
                with self._cond:
                    self._unlinking = None

    def _remove_before_writes(self, keys: list[bytes], paths: list[Path]) -> None:
        """`_remove_before_write` of a pack's keys, those with nothing queued found under one
        hold of the lock: a write waits on no other thread's removal but its own keys'."""
        with self._cond:
            removals, unlinking = self._removals, self._unlinking
            busy = [(key, path) for key, path in zip(keys, paths) if key in removals or key == unlinking]
        for key, path in busy:
            self._remove_before_write(key, path)

    def _remove_before_write(self, key: bytes, path: Path) -> None:
        with self._removing:
            with self._cond:
                pending = self._removals.pop(key, 0)
            if pending:
                self._remove(key, path)

    def _remove(self, key: bytes, path: Path) -> None:
        """Unlink the key's name; where it names a pack, punch the key's block out of it
        first, so its space is free though other keys keep the pack."""
        for retry in (True, False):
            try:
                fan = self.dir.fan_out(self.namespace, key)
            except FileNotFoundError:  # no such directory: nothing to remove
                return
            except OSError as exc:
                _log.warning("tier_delete_failed", path=str(path), error=_directory_error(exc))
                return
            try:
                self._punch(key, path, fan)
            except FileNotFoundError:
                if retry and self.dir.refresh(self.namespace, key, fan):
                    continue
                return
            except Exception as exc:
                _log.warning("tier_punch_failed", path=str(path), error=repr(exc))
            try:
                os.unlink(_name(key), dir_fd=fan)
            except FileNotFoundError:
                pass
            except Exception as exc:
                _log.warning("tier_delete_failed", path=str(path), error=repr(exc))
            return

    def _punch(self, key: bytes, path: Path, fan: int) -> None:
        fd = os.open(_name(key), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fan)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            entry = (pack_table(fd, path, self.namespace) or {}).get(key)
            if entry is not None:
                punch_block(fd, *entry)
        finally:
            os.close(fd)

    def _settle(self, job: TierJob, g: int, i: int, reason: str | None, path: Path, nbytes: int,
                span: tuple[float, float] | None) -> None:
        self._settle_all(job, [(g, i, reason, path, nbytes)], span)

    def _settle_all(self, job: TierJob, blocks: list[tuple[int, int, str | None, Path, int]],
                    span: tuple[float, float] | None) -> None:
        """Blocks of `job` ended, each (group, index, failure reason or None, path, payload
        bytes), under one hold of the lock (a pack's blocks: one, not one a block)."""
        settled = getattr(self._item, "settled", None)
        if settled is not None:
            settled.update((g, i) for g, i, _reason, _path, _nbytes in blocks)
        failed = [(g, i, reason, str(path)) for g, i, reason, path, _nbytes in blocks if reason]
        nbytes = sum(n for _g, _i, _reason, _path, n in blocks)
        with self._cond:
            outcome = job.settle(failed, len(blocks) - len(failed), nbytes, span)
            if not self._settled(job, outcome):
                return
        job.finished(outcome)


class _LinksUnsupported(Exception):
    """This file system refuses hard links (EPERM, EOPNOTSUPP): no packs on it."""


class _At(NamedTuple):
    """A name in a directory held open (`tier_dir`), and the path messages show for it."""

    fd: int
    name: str
    shown: Path


def _name(key: bytes) -> str:
    """A key's file's name in its fan-out directory."""
    return key.hex() + SUFFIX


def _aside_name(name: str) -> str:
    return aside_path(Path(name)).name


def _directory_error(exc: OSError) -> str:
    if isinstance(exc, NotTheTiers):
        return f"a directory on its path is not the tier's: {exc}"
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return f"a directory on its path is a link or not a directory (not followed): {exc.strerror} (errno {exc.errno})"
    return f"{exc.strerror or exc} (errno {exc.errno})"


def _link_into_place(aside: _At, at: _At) -> None:
    """`at` becomes a name of the file at `aside`, replacing whatever was there:
    linked straight to its name where that is free (a new key: one operation on
    its directory, where a rename made two), else under an unpredictable name,
    then renamed (a link cannot replace). A link never follows nor replaces what
    it finds at its name."""
    try:
        _link(aside, at.fd, at.name)
        return
    except FileExistsError:
        pass  # a block written before under this key, or anything else there: replaced below
    link = _aside_name(at.name)
    _link(aside, at.fd, link)
    try:
        os.replace(link, at.name, src_dir_fd=at.fd, dst_dir_fd=at.fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(link, dir_fd=at.fd)
        raise


def _link(aside: _At, dir_fd: int, name: str) -> None:
    """A new name for the file at `aside`; `FileExistsError` where the name is taken."""
    try:
        os.link(aside.name, name, src_dir_fd=aside.fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise _LinksUnsupported(f"link: {exc}") from exc
        raise


def _write_file(aside: _At, data: memoryview, gid: int | None, *, direct: bool, size: int | None = None,
                where: Path | None = None) -> None:
    """A new file at `aside` holding `data` (page-aligned and padded where
    `direct`), cut to `size` bytes if given; `BlockFileError("unwritable")`
    naming `where` (default `aside`'s path) on an error, leaving no file."""
    try:
        try:
            fd = create_aside(Path(aside.name), gid, os.O_DIRECT if direct else 0, dir_fd=aside.fd)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:  # ramfs, some FUSE: and ramfs creates the file first
                raise _DirectUnsupported(f"open: {exc}") from exc
            raise
        try:
            done = 0
            while done < data.nbytes:
                try:
                    done += os.write(fd, data[done:])  # after a short write (a full disk) the next raises
                except OSError as exc:
                    if direct and exc.errno == errno.EINVAL and done == 0:
                        raise _DirectUnsupported(f"write: {exc}") from exc
                    raise
            if size is not None and size != data.nbytes:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(aside.name, dir_fd=aside.fd)
        if isinstance(exc, OSError):
            raise write_error(where or aside.shown.with_name(aside.name), exc) from exc
        raise


def _stage_block(staged: memoryview, offset: int, namespace: bytes, key: bytes, payload: memoryview,
                 seal: BlockSeal | None) -> int:
    """A block as a file holds it (header, sealed payload, zeros to the next page)
    laid into `staged` at `offset`; where it ends."""
    start, end = offset + HEADER_BYTES, offset + HEADER_BYTES + payload.nbytes
    padded = offset + HEADER_BYTES + round_up(payload.nbytes)
    header, stored = seal_block(namespace, key, payload, seal, out=staged[start:end])
    staged[offset:start] = header
    if seal is None or not seal.encrypt:  # else the seal wrote its ciphertext there
        staged[start:end] = stored
    staged[end:padded] = bytes(padded - end)
    return padded


def _write_direct(at: _At, namespace: bytes, key: bytes, payload: memoryview, bounce: mmap.mmap,
                  seal: BlockSeal | None = None, *, gid: int | None = None) -> None:
    """`block_file.write_block`'s file (written aside under an unpredictable
    name, renamed into place), with O_DIRECT from the page-aligned `bounce`."""
    staged = memoryview(bounce)
    padded = _stage_block(staged, 0, namespace, key, payload, seal)
    aside = _At(at.fd, _aside_name(at.name), at.shown)
    _write_file(aside, staged[:padded], gid, direct=True, size=HEADER_BYTES + payload.nbytes, where=at.shown)
    try:
        os.replace(aside.name, at.name, src_dir_fd=at.fd, dst_dir_fd=at.fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(aside.name, dir_fd=at.fd)
        raise write_error(at.shown, exc) from exc


def remove_leftovers(root: str, namespace: bytes, *, grace_s: float = LEFTOVER_GRACE_S) -> int:
    """Remove what crashed writers left, unchanged for over `grace_s`: aside files
    (`.*.tmp`) in the namespace's directory and its fan-out directories, and
    write probes in `root`. Nothing else is touched; the number removed. Else
    they would stay forever, taking room no capacity counts."""
    try:
        held = TierDir(root)
    except OSError:  # no tier there yet: nothing left
        return 0
    try:
        return _remove_leftovers(held, namespace, grace_s)
    finally:
        held.close()


def _remove_leftovers(held: TierDir, namespace: bytes, grace_s: float) -> int:
    """`remove_leftovers` through the tier's held directories (`TierDir.fan_out`):
    a directory that is a link or someone else's is not entered."""
    cutoff = time.time() - grace_s
    top = os.path.join(held.root, namespace.hex())
    folders = [(held.fd, held.root, _is_probe)]
    with contextlib.suppress(OSError):  # no namespace directory yet: nothing left there
        folders.append((held.space(namespace), top, _is_aside))
    for first in range(256):
        with contextlib.suppress(OSError):  # missing, or not the tier's
            folders.append((held.fan_out(namespace, bytes([first])), os.path.join(top, f"{first:02x}"), _is_aside))
    removed = 0
    for fd, shown, wanted in folders:
        try:
            entries = [entry for entry in os.scandir(fd) if wanted(entry.name)]
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode) or info.st_mtime >= cutoff:
                    continue
                os.unlink(entry.name, dir_fd=fd)  # a link is removed, never followed
            except FileNotFoundError:  # another process removed or renamed it meanwhile
                continue
            except OSError as exc:
                _log.warning("tier_leftover_not_removed", path=os.path.join(shown, entry.name), error=repr(exc))
                continue
            removed += 1
    _log.info("tier_leftovers_removed", root=held.root, namespace=namespace.hex(), removed=removed, grace_s=grace_s)
    return removed


def _is_aside(name: str) -> bool:
    return name.startswith(".") and name.endswith(ASIDE_SUFFIX)


def _is_probe(name: str) -> bool:
    return name.startswith(PROBE_PREFIX)


# -- the scheduler's side ----------------------------------------------------------------------------


def scan_keys(root: str, namespace: bytes, gid: int | None = None) -> list[bytes]:
    """Keys with a block file under `root/<namespace hex>/`, oldest first, so the
    engine's eviction order resumes where it was. Files shorter than a header
    (a crash's leftovers) and names `block_path` would not give are skipped, and
    so are fan-out directories that are links or not the tier's (`tier_dir`)."""
    found: list[tuple[int, bytes]] = []
    try:
        held = TierDir(root, gid)
    except OSError:  # missing, or not a directory: nothing there
        return []
    try:
        top = held.space(namespace)
        subdirs = [entry.name for entry in os.scandir(top) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        held.close()
        return []
    try:
        for subdir in subdirs:
            try:
                fan = open_dir(subdir, top, gid)
            except NotTheTiers as refused:
                _log.warning("tier_directory_refused", root=held.root, namespace=namespace.hex(), error=str(refused))
                continue
            except OSError:
                continue
            try:
                entries = list(os.scandir(fan))
                for entry in entries:
                    name = entry.name
                    if not _KEY_FILE.fullmatch(name) or name[:2] != subdir:
                        continue
                    try:
                        if not entry.is_file(follow_symlinks=False):  # a link, a FIFO, a directory: no block
                            continue
                        info = entry.stat(follow_symlinks=False)
                    except OSError:  # removed since the listing
                        continue
                    if info.st_size >= HEADER_BYTES:
                        found.append((info.st_mtime_ns, bytes.fromhex(name[: -len(SUFFIX)])))
            except OSError:
                continue
            finally:
                os.close(fan)
    finally:
        held.close()
    found.sort()
    return [key for _, key in found]


IDENTITY_FILE = "NAMESPACE.json"  # `root/<namespace hex>/`: what the namespace digests (tier_namespace.write_identity)
_NAMESPACE_DIR = re.compile(f"[0-9a-f]{{{2 * NAMESPACE_BYTES}}}")
_IDENTITY_BYTES_MAX = 1 << 16


def other_formats(root: str, gid: int | None = None) -> list[tuple[str, object, int]]:
    """The namespaces under `root` whose identity names a block format other than
    the one this build reads, as (namespace hex, their format, block files). The
    format is part of the namespace, so their blocks are never found, let alone
    served; this is what lets the tier say why, not start cold in silence. Read
    from the directory held by descriptor (`tier_dir`): a namespace's directory
    that is a link, or not the tier's, is passed over."""
    try:
        held = TierDir(root, gid)
    except OSError:
        return []
    found = []
    try:
        names = sorted(entry.name for entry in os.scandir(held.fd)
                       if _NAMESPACE_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False))
        for name in names:
            try:
                space = open_dir(name, held.fd, gid)
            except OSError:
                continue
            try:
                fd = os.open(IDENTITY_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=space)
            except OSError:
                continue
            finally:
                os.close(space)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                identity = json.loads(os.read(fd, _IDENTITY_BYTES_MAX))
            except (OSError, ValueError):
                continue
            finally:
                os.close(fd)
            version = identity.get("format_version") if isinstance(identity, dict) else None
            if version != FORMAT_VERSION:
                found.append((name, version, len(scan_keys(root, bytes.fromhex(name), gid))))
    except OSError:
        return found
    finally:
        held.close()
    return found


class FileLookup:
    """Which keys have a block file in every namespace (one per tensor-parallel
    rank), looked up from the namespaces' directories held open (`tier_dir`). A
    hint, on the lookups' thread: each fan-out directory asked about is checked
    once a lookup (a directory, not a link, the tier's), without opening it, and
    its files found by name from the namespace's; the load that follows reaches
    the file per component. Opened at the first lookup; the lookups' thread's alone."""

    def __init__(self, root: str, namespaces: tuple[bytes, ...], gid: int | None = None) -> None:
        self.root, self.namespaces, self.gid = os.fspath(root), namespaces, gid
        self._held: TierDir | None = None

    def __call__(self, keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
        if self._held is None:
            try:
                self._held = TierDir(self.root, self.gid)
            except OSError:  # not there (yet): nothing found
                return ()
        present = keys
        for space in self.namespaces:
            try:
                top = self._held.space(space)
                if gone(top) and self._held.refresh(space):  # removed, perhaps made anew
                    top = self._held.space(space)
            except OSError:  # not there (yet)
                return ()
            fans: dict[str, bool] = {}
            found = []
            for key in present:
                tail = key_tail(key)
                fan = tail[:2]
                usable = fans.get(fan)
                if usable is None:
                    usable = fans[fan] = usable_dir(fan, top, self.gid)
                if usable and _present(tail, top):
                    found.append(key)
            present = tuple(found)
        return present

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None


def files_present(root: str, namespaces: tuple[bytes, ...], keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """The keys with a block file in every namespace (`FileLookup`, once)."""
    lookup = FileLookup(root, namespaces)
    try:
        return lookup(keys)
    finally:
        lookup.close()


def _present(name: str, directory: int) -> bool:
    """A regular file long enough to hold a block: a link or a FIFO is no block
    (a read of it fails), so finding one would offer a load that cannot happen."""
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except Exception:  # missing, unreadable: absent
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size >= HEADER_BYTES
