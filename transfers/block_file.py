"""One KV block as a file: the on-disk form of a tier below host memory.

A file is a fixed 4096-byte header, then the block's bytes. The header names
the format version, the namespace (model, dtype, KV layout, parallelism: a
digest its caller computes), the block's key, the payload's length and its
checksum, and carries a checksum of its own. So a file that was torn,
truncated, overwritten with other bytes, renamed, or written by another
model or layout is told apart from a good one, and the caller can count it
as a failed load (recomputed), never serve it.

The header is a multiple of 4096 bytes so that the payload starts on a
boundary direct I/O accepts. A writer writes aside and renames into place
(`os.replace` is atomic on POSIX file systems, NFS included), so readers of
a key never see a half-written file from a live writer, and two writers of
the same key leave one whole file. Nothing is fsynced: after a crash a file
may be short or empty, which its header and checksum reveal.

Checksums are XXH3-64 (python-xxhash): measured on this project's machine
it runs at 63 GB/s on 64 KiB-2 MiB blocks, against 27 GB/s for CRC32C,
4.3 GB/s for zlib's CRC32 and 0.9 GB/s for BLAKE2b (bench/RESULTS.md), so
checking a block costs a small fraction of reading it.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from pathlib import Path

import xxhash

MAGIC = b"KVLBLOCK"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
KEY_BYTES_MAX = 256
NAMESPACE_BYTES = 16
SUFFIX = ".kvb"

# magic, version, header bytes, flags, namespace, payload bytes, payload checksum, key length
_FIXED = struct.Struct("<8sHHI16sQQH")
_HEADER_CHECKSUM = struct.Struct("<Q")
_names = itertools.count()


class BlockFileError(Exception):
    """A block file cannot be served. `reason` is one of `REASONS`."""

    REASONS = ("missing", "truncated", "foreign", "corrupt", "unreadable", "unwritable")

    def __init__(self, reason: str, path: str | os.PathLike, detail: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(f"{reason}: {os.fspath(path)}: {detail}")
        self.reason = reason
        self.path = os.fspath(path)
        self.detail = detail


def block_path(root: str | os.PathLike, namespace: bytes, key: bytes) -> Path:
    """`root/<namespace hex>/<key hex[:2]>/<key hex>.kvb`: a namespace per
    directory, keys fanned out over 256 subdirectories."""
    text = key.hex()
    return Path(root) / namespace.hex() / text[:2] / (text + SUFFIX)


def compact_header_bytes(key: bytes) -> int:
    """The unpadded header's size: what a value in a key-value store carries."""
    return _FIXED.size + len(key) + _HEADER_CHECKSUM.size


def encode_header(namespace: bytes, key: bytes, payload: memoryview, size: int = HEADER_BYTES) -> bytes:
    """The header, padded to `size` bytes (a file's 4096, or a value's
    `compact_header_bytes`); `size` is recorded in it and checked on read."""
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"a namespace is {NAMESPACE_BYTES} bytes, not {len(namespace)}")
    if not 0 < len(key) <= KEY_BYTES_MAX:
        raise ValueError(f"a key is 1 to {KEY_BYTES_MAX} bytes, not {len(key)}")
    if size < compact_header_bytes(key):
        raise ValueError(f"a header with a {len(key)}-byte key takes {compact_header_bytes(key)} bytes, not {size}")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, size, 0, namespace, payload.nbytes,
                        xxhash.xxh3_64_intdigest(payload), len(key)) + key
    header = fixed + _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(fixed))
    return header.ljust(size, b"\0")


def payload_checksum(header: bytes) -> int:
    return _FIXED.unpack_from(header)[6]


def write_block(path: str | os.PathLike, namespace: bytes, key: bytes, payload: object) -> int:
    """Write aside, then rename into place; the bytes written. An error (a full
    disk, a directory that vanished) leaves no file behind and raises
    `BlockFileError("unwritable", ...)`."""
    data = memoryview(payload).cast("B")  # type: ignore[arg-type]
    header = encode_header(namespace, key, data)
    final = Path(path)
    aside = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.{next(_names)}.tmp")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, (memoryview(header), data))
        finally:
            os.close(fd)
        os.replace(aside, final)
    except OSError as exc:
        try:
            os.unlink(aside)
        except OSError:
            pass
        raise BlockFileError("unwritable", final, f"{exc.strerror or exc} (errno {exc.errno})") from exc
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


def read_block_into(path: str | os.PathLike, namespace: bytes, key: bytes, out: object) -> None:
    """Fill `out` (a writable buffer of the block's size) from the file, or
    raise `BlockFileError` naming why the file cannot be served."""
    target = memoryview(out).cast("B")  # type: ignore[arg-type]
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise BlockFileError("missing", path, "no such file") from None
    except OSError as exc:
        raise BlockFileError("unreadable", path, f"{exc.strerror or exc} (errno {exc.errno})") from exc
    try:
        with os.fdopen(fd, "rb", buffering=0, closefd=True) as file:
            header = file.read(HEADER_BYTES)
            check_header(path, header, namespace, key, target.nbytes)
            got = 0
            while got < target.nbytes:
                count = file.readinto(target[got:])
                if not count:
                    break
                got += count
            if got != target.nbytes:
                raise BlockFileError("truncated", path, f"{got} of {target.nbytes} payload bytes")
            if file.read(1):
                raise BlockFileError("corrupt", path, "bytes after the payload")
    except OSError as exc:
        raise BlockFileError("unreadable", path, f"{exc.strerror or exc} (errno {exc.errno})") from exc
    if xxhash.xxh3_64_intdigest(target) != payload_checksum(header):
        raise BlockFileError("corrupt", path, "payload checksum mismatch")


def check_header(path: str | os.PathLike, header: bytes, namespace: bytes, key: bytes, size: int,
                  expected_bytes: int = HEADER_BYTES) -> None:
    if len(header) < _FIXED.size:
        raise BlockFileError("truncated", path, f"{len(header)} header bytes")
    magic, version, header_bytes, _flags, their_namespace, payload_bytes, _checksum, key_length = (
        _FIXED.unpack_from(header))
    if magic != MAGIC:
        raise BlockFileError("foreign", path, "not a kvledger block file")
    if version != FORMAT_VERSION or header_bytes != expected_bytes:
        raise BlockFileError("foreign", path, f"format {version} with a {header_bytes}-byte header, "
                             f"expected format {FORMAT_VERSION} with {expected_bytes}")
    if len(header) < expected_bytes:
        raise BlockFileError("truncated", path, f"{len(header)} of {expected_bytes} header bytes")
    end = _FIXED.size + key_length
    if key_length > KEY_BYTES_MAX or (
            _HEADER_CHECKSUM.unpack_from(header, end)[0] != xxhash.xxh3_64_intdigest(header[:end])):
        raise BlockFileError("corrupt", path, "header checksum mismatch")
    if their_namespace != namespace:
        raise BlockFileError("foreign", path, f"namespace {their_namespace.hex()}, expected {namespace.hex()}")
    if header[_FIXED.size:end] != key:
        raise BlockFileError("foreign", path, f"holds key {header[_FIXED.size:end].hex()}, expected {key.hex()}")
    if payload_bytes != size:
        raise BlockFileError("foreign", path, f"a {payload_bytes}-byte block, expected {size}")
