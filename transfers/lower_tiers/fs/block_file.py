"""One KV block as a file: the on-disk form of a tier below host memory.

A file is the block's header (`block_header`), padded to 4096 bytes so that
the payload starts on a boundary direct I/O accepts, then the block's bytes.
A file that was torn, truncated, overwritten with other bytes, renamed, or
written by another model or layout fails its header or checksum check, and
the caller counts it as a failed load (recomputed), never serves it.

A writer writes aside and renames into place (`os.replace` is atomic on POSIX
file systems, NFS included), so readers of a key never see a half-written
file from a live writer, and two writers of the same key leave one whole
file. Nothing is fsynced: after a crash a file may be short or empty, which
its header and checksum reveal.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import xxhash

from kvledger.transfers.lower_tiers.block_errors import BlockFileError, write_error
from kvledger.transfers.lower_tiers.block_header import (
    HEADER_BYTES,
    check_header,
    payload_checksum,
    seal_block,
)
from kvledger.transfers.lower_tiers.block_seal import BlockSeal, checked_before_seal

SUFFIX = ".kvb"


def block_path(root: str | os.PathLike, namespace: bytes, key: bytes) -> Path:
    """`root/<namespace hex>/<key hex[:2]>/<key hex>.kvb`: a namespace per
    directory, keys fanned out over 256 subdirectories."""
    return Path(root) / namespace.hex() / key_tail(key)


def key_tail(key: bytes) -> str:
    """A block file's path below its namespace's directory, as a string: the
    lookup builds thousands a step, where pathlib took most of its time."""
    text = key.hex()
    return text[:2] + os.sep + text + SUFFIX


def write_block(path: str | os.PathLike, namespace: bytes, key: bytes, payload: object,
                seal: BlockSeal | None = None, *, gid: int | None = None, dir_fd: int | None = None,
                shown: str | os.PathLike | None = None) -> int:
    """Write aside, then rename into place; the bytes written. An error (a full
    disk, a directory that vanished) leaves no file behind and raises
    `BlockFileError("unwritable", ...)`. `gid`: the tier's group (`file_mode`).
    With `dir_fd`, `path` is a name in that directory (`tier_dir`), and
    `shown` the path errors name."""
    data = memoryview(payload).cast("B")  # type: ignore[arg-type]
    header, data = seal_block(namespace, key, data, seal)
    final = Path(path)
    aside = aside_path(final)
    try:
        fd = create_aside(aside, gid, dir_fd=dir_fd)
        try:
            _write_all(fd, (memoryview(header), data))
        finally:
            os.close(fd)
        os.replace(aside, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        try:
            os.unlink(aside, dir_fd=dir_fd)
        except OSError:
            pass
        raise write_error(shown or final, exc) from exc
    return HEADER_BYTES + data.nbytes


def _write_all(fd: int, buffers: tuple[memoryview, ...]) -> None:
    pending = [b for b in buffers if b.nbytes]
    while pending:
        written = os.writev(fd, pending)
        while pending and written >= pending[0].nbytes:
            written -= pending[0].nbytes
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]


# -- opening files and making directories ---------------------------------------------------------
# A tier's directory may be shared with other processes (the tier's group), so a name in it can be
# anything by the time it is opened: files are created only new (O_EXCL) under unpredictable names,
# and no open follows a link or waits on a FIFO.

PROBE_PREFIX = ".kvledger-probe-"
"""The start of the names of the files that prove a tier's directory takes a file (`tier_settings`)."""
ASIDE_SUFFIX = ".tmp"
"""The end of the names files are written under before their rename: `.<name>.<random>.tmp`."""


def file_mode(gid: int | None) -> int:
    """A tier file's mode: its user's alone, or with a service group, the group's too."""
    return 0o600 if gid is None else 0o660


def dir_mode(gid: int | None) -> int:
    """A tier directory's mode; with a group, setgid, so what is made in it is the group's."""
    return 0o700 if gid is None else 0o2770


def aside_path(final: Path) -> Path:
    """Where `final` is written before the rename into place. Random, so no one
    can plant a link, a file or a FIFO at it beforehand."""
    return final.with_name(f".{final.name}.{secrets.token_hex(8)}{ASIDE_SUFFIX}")


def create_file(path: str | os.PathLike, gid: int | None = None, flags: int = 0, *, dir_fd: int | None = None) -> int:
    """A new file at `path`, open for writing: never one already there nor
    through a link (O_EXCL|O_NOFOLLOW), its mode `file_mode(gid)` whatever the umask."""
    mode = file_mode(gid)
    fd = os.open(path, flags | os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it (0o660 under 022)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_aside(aside: Path, gid: int | None = None, flags: int = 0, *, dir_fd: int | None = None) -> int:
    """`create_file` at `aside`, making the directories above it that a block's
    path has (fan-out, namespace, the tier's own) where missing; in `dir_fd`,
    a name in a directory `tier_dir` opened (and made)."""
    try:
        return create_file(aside, gid, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        if dir_fd is not None:
            raise
        make_dirs(aside.parent, gid, levels=3)
        return create_file(aside, gid, flags)


def make_dir(path: str | os.PathLike, gid: int | None = None, *, dir_fd: int | None = None) -> None:
    """Make one directory with `dir_mode(gid)` and group `gid`, whatever the
    umask (mkdir's mode is narrowed by it, and takes no setgid bit); a directory
    already there is left as it is, anything else there raises FileExistsError."""
    mode = dir_mode(gid)
    try:
        os.mkdir(path, mode & 0o777, dir_fd=dir_fd)
    except FileExistsError:
        if stat.S_ISDIR(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return
        raise
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)  # before the mode: a change of group may clear the setgid bit
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_dirs(path: Path, gid: int | None, levels: int) -> None:
    """`make_dir` of `path`, and of up to `levels - 1` missing directories above it."""
    try:
        make_dir(path, gid)
    except FileNotFoundError:
        if levels <= 1:
            raise
        make_dirs(path.parent, gid, levels - 1)
        make_dir(path, gid)


def open_block(path: str | os.PathLike, *, dir_fd: int | None = None, shown: str | os.PathLike | None = None) -> int:
    """`path` open for reading, if it is a regular file. O_NOFOLLOW: a link at a
    block's path is not followed; O_NONBLOCK: a FIFO there cannot hang the
    reader. Anything but a regular file fails as "unreadable", saying what it is.
    With `dir_fd`, `path` is a name in that directory, and `shown` the path errors name."""
    shown = shown or path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise BlockFileError("missing", shown, "no such file") from None
    except OSError as exc:  # ELOOP for a link, ENXIO for a socket
        try:
            mode = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            mode = stat.S_IFREG
        detail = f"{exc.strerror or exc} (errno {exc.errno})" if stat.S_ISREG(mode) else _not_a_file(mode)
        raise BlockFileError("unreadable", shown, detail) from exc
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise BlockFileError("unreadable", shown, f"{exc.strerror or exc} (errno {exc.errno})") from exc
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BlockFileError("unreadable", shown, _not_a_file(mode))
    return fd


def _not_a_file(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link (not followed)"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"{what}, not a regular file"
    return f"not a regular file (mode {mode:#o})"


def read_block_into(path: str | os.PathLike, namespace: bytes, key: bytes, out: object,
                    seal: BlockSeal | None = None) -> None:
    """Fill `out` (a writable buffer of the block's size) from the file, or
    raise `BlockFileError` naming why the file cannot be served."""
    fd = open_block(path)
    try:
        read_open_block(fd, path, namespace, key, out, seal)
    finally:
        os.close(fd)


def read_open_block(fd: int, path: str | os.PathLike, namespace: bytes, key: bytes, out: object,
                    seal: BlockSeal | None = None) -> None:
    """`read_block_into` of a block file already open at `fd`."""
    target = memoryview(out).cast("B")  # type: ignore[arg-type]
    header = bytearray(HEADER_BYTES)
    try:
        got = os.preadv(fd, [header, target], 0)
        check_block(path, header, namespace, key, target, seal, got=got)
        if os.pread(fd, 1, got):
            with checked_before_seal(seal, header):
                raise BlockFileError("corrupt", path, "bytes after the payload")
    except OSError as exc:
        raise BlockFileError("unreadable", path, f"{exc.strerror or exc} (errno {exc.errno})") from exc


def check_block(path: str | os.PathLike, header: bytes | bytearray, namespace: bytes, key: bytes,
                target: memoryview, seal: BlockSeal | None = None, *, got: int) -> None:
    """Raise `BlockFileError` unless the `got` bytes read into `header` and then
    `target` are this key's block, whole; decrypt a sealed one in place."""
    with checked_before_seal(seal, header):
        fields = check_header(path, bytes(header[:max(0, got)]), namespace, key, target.nbytes,
                              sealed=seal is not None)
        if got < HEADER_BYTES + target.nbytes:
            raise BlockFileError("truncated", path, f"{max(0, got - HEADER_BYTES)} of {target.nbytes} payload bytes")
        if xxhash.xxh3_64_intdigest(target) != payload_checksum(header):
            raise BlockFileError("corrupt", path, "payload checksum mismatch")
    if seal is not None:
        assert fields is not None
        seal.open(os.fspath(path), namespace, key, fields, target)
