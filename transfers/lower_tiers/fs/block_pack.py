"""Several KV blocks in one file, each reachable by its own key's name.

A small block as a file of its own reads at a fraction of the disk's speed:
each file costs an open, an inode and a directory entry scattered over the
fan-out directories, and on a dropped page cache each is a seek (64 KiB
blocks read at 0.27x of raw sequential I/O, 256 KiB at 0.5-0.7x). A pack
lays a write job's consecutive blocks out in one file, written once,
sequentially; every key's usual path (`block_file.block_path`) is a hard
link to it, so lookups, the start-up scan and other processes see keys as
before, and a reader that opened one key's path reads the pack's other
blocks it wants through the same descriptor.

Layout: a table (`TABLE_MAGIC`, the namespace, then per block its key,
offset and payload size, then an XXH3 of it all), padded to 4096 bytes; then
each block as a block file holds it (`block_header`'s 4096-byte header, its
payload, padded to 4096 bytes, so O_DIRECT takes the whole file at once).
The table only says where to look: each block keeps its own header and
checksum (and seal), checked on every read, so a pack torn by a crash, or a
table that lies, fails as that block's load (recomputed), never served.

A pack is never changed once linked: a key written again gets a new file
under its name (`os.replace` of a fresh link). Removing a key unlinks its
name and punches its block's extent out of the pack (`punch_block`), so the
space the engine counts as freed is freed, though the pack lives on while
other keys name it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct

import xxhash

from kvledger.transfers.lower_tiers.block_errors import BlockFileError
from kvledger.transfers.lower_tiers.block_header import (
    HEADER_BYTES,
    KEY_BYTES_MAX,
    NAMESPACE_BYTES,
)

TABLE_MAGIC = b"KVLBPACK"
PACK_VERSION = 1
ALIGN = 4096
BLOCKS_MAX = 255
"""A pack's blocks at most: a table of 36-byte keys then fits in four pages."""

# magic, version, table bytes, block count, namespace
_TABLE_HEAD = struct.Struct("<8sHIH16s")
# per block: offset of its header, payload bytes, key length; the key follows
_ENTRY = struct.Struct("<QQH")
_CHECKSUM = struct.Struct("<Q")


def round_up(value: int, multiple: int = ALIGN) -> int:
    return -(-value // multiple) * multiple


def is_pack(first_page: bytes) -> bool:
    """Whether a file starting with these bytes is a pack (else a single block file)."""
    return first_page[: len(TABLE_MAGIC)] == TABLE_MAGIC


def table_bytes(keys: list[bytes]) -> int:
    """The table's size, padded, for these keys."""
    return round_up(_TABLE_HEAD.size + sum(_ENTRY.size + len(k) for k in keys) + _CHECKSUM.size)


def encode_table(namespace: bytes, keys: list[bytes], payload_bytes: list[int]) -> tuple[bytes, list[int], int]:
    """The padded table, each block's header offset, and the pack's size."""
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"a namespace is {NAMESPACE_BYTES} bytes, not {len(namespace)}")
    if not 0 < len(keys) <= BLOCKS_MAX or len(keys) != len(payload_bytes):
        raise ValueError(f"a pack holds 1 to {BLOCKS_MAX} blocks, each with its size; got {len(keys)} keys "
                         f"and {len(payload_bytes)} sizes")
    if any(not 0 < len(k) <= KEY_BYTES_MAX for k in keys):
        raise ValueError(f"a key is 1 to {KEY_BYTES_MAX} bytes")
    size = offset = table_bytes(keys)
    parts = [_TABLE_HEAD.pack(TABLE_MAGIC, PACK_VERSION, size, len(keys), namespace)]
    offsets = []
    for key, nbytes in zip(keys, payload_bytes):
        parts.append(_ENTRY.pack(offset, nbytes, len(key)) + key)
        offsets.append(offset)
        offset += HEADER_BYTES + round_up(nbytes)
    body = b"".join(parts)
    return (body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))).ljust(size, b"\0"), offsets, offset


def decode_table(path: str | os.PathLike, data: bytes, namespace: bytes) -> dict[bytes, tuple[int, int]]:
    """key -> (header offset, payload bytes) from a pack's first bytes (at least its
    table's); `BlockFileError` names what is wrong with a table that is not this
    namespace's or not whole."""
    if len(data) < _TABLE_HEAD.size:
        raise BlockFileError("truncated", path, f"{len(data)} bytes of a pack's table")
    magic, version, size, count, their_namespace = _TABLE_HEAD.unpack_from(data)
    if magic != TABLE_MAGIC:
        raise BlockFileError("foreign", path, "not a kvledger pack")
    if version != PACK_VERSION:
        raise BlockFileError("foreign", path, f"pack format {version}, expected {PACK_VERSION}")
    if their_namespace != namespace:
        raise BlockFileError("foreign", path, f"namespace {their_namespace.hex()}, expected {namespace.hex()}")
    if size > len(data):
        raise BlockFileError("truncated", path, f"a {size}-byte table, {len(data)} bytes read")
    entries: dict[bytes, tuple[int, int]] = {}
    at = _TABLE_HEAD.size
    try:
        for _ in range(count):
            offset, nbytes, key_length = _ENTRY.unpack_from(data, at)
            at += _ENTRY.size
            if not size <= offset < 1 << 62 or nbytes >= 1 << 40:
                raise BlockFileError("corrupt", path, f"a pack entry at {offset} of {nbytes} bytes")
            entries[bytes(data[at:at + key_length])] = (offset, nbytes)
            at += key_length
        (checksum,) = _CHECKSUM.unpack_from(data, at)
    except struct.error:
        raise BlockFileError("corrupt", path, "pack table runs past its size") from None
    if at + _CHECKSUM.size > size or checksum != xxhash.xxh3_64_intdigest(bytes(data[:at])):
        raise BlockFileError("corrupt", path, "pack table checksum mismatch")
    return entries


TABLE_BYTES_MAX = round_up(_TABLE_HEAD.size + BLOCKS_MAX * (_ENTRY.size + KEY_BYTES_MAX) + _CHECKSUM.size)
"""The largest table a pack can have: a bigger size in a first page is a lie, never read."""


def pack_table(fd: int, path: str | os.PathLike, namespace: bytes) -> dict[bytes, tuple[int, int]] | None:
    """`decode_table` of the file open at `fd`, or None when it is a single block file."""
    first = os.pread(fd, ALIGN, 0)
    if not is_pack(first):
        return None
    size = _TABLE_HEAD.unpack_from(first)[2] if len(first) >= _TABLE_HEAD.size else 0
    if size > TABLE_BYTES_MAX:
        raise BlockFileError("corrupt", path, f"a pack table of {size} bytes, more than any pack has")
    data = first if size <= len(first) else first + os.pread(fd, size - len(first), len(first))
    return decode_table(path, data, namespace)


# -- punching a removed block out ------------------------------------------------------------------

_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    _fallocate.restype = ctypes.c_int


def punch_block(fd: int, offset: int, payload_bytes: int) -> bool:
    """Free a block's extent (header and padded payload) inside an open pack;
    the file's size stays. False where the file system cannot (no fallocate,
    EOPNOTSUPP): the space then returns when the pack's last name goes."""
    if _fallocate is None:
        return False
    length = HEADER_BYTES + round_up(payload_bytes)
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))
