"""One KV block as a value in a key-value store (Valkey, Redis).

A value is the block's header (`block_header`) without the padding a file
gives it (about 100 bytes, not 4096), then the block's bytes. The store is
shared and may evict, lose or overwrite any key, so a value is checked the
way a file is: one that was cut short, flipped, or written by another model
or layout under the same key is told apart from a good one, and the caller
fails the load (recomputed).
Keys are `<key_prefix><namespace hex>:<key hex>` (`kvledger:` unless the tier
sets `key_prefix`), so an operator can find a deployment's blocks with
`SCAN MATCH kvledger:<namespace hex>:*` and bind an ACL to the prefix. With a
tier secret the block keys are keyed hashes (`chain_keys`): their names tell
nothing about the prompts, and values are sealed (`block_seal`).
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvledger.transfers.lower_tiers.block_errors import BlockFileError
from kvledger.transfers.lower_tiers.block_header import (
    check_header,
    compact_header_bytes,
    payload_checksum,
    seal_block,
)
from kvledger.transfers.lower_tiers.block_seal import BlockSeal, checked_before_seal

KEY_PREFIX = b"kvledger:"


def store_key(namespace: bytes, key: bytes, prefix: bytes = KEY_PREFIX) -> bytes:
    return b"%s%s:%s" % (prefix, namespace.hex().encode(), key.hex().encode())


def value_header(namespace: bytes, key: bytes, payload: memoryview, seal: BlockSeal | None = None,
                 out: memoryview | None = None) -> tuple[bytes, memoryview]:
    """What goes before the payload in the value, and the payload to store
    after it (its ciphertext, in `out` or a new buffer, when `seal` encrypts)."""
    return seal_block(namespace, key, payload, seal, compact_header_bytes(key, seal is not None), out)


def encode_value(namespace: bytes, key: bytes, payload: object, seal: BlockSeal | None = None) -> bytes:
    """Header and payload as one value: what the tier's two-part write stores
    (`value_header`, then the payload from its row), in one piece."""
    data = memoryview(payload).cast("B")  # type: ignore[arg-type]
    return b"".join(value_header(namespace, key, data, seal))


def check_in_place(head: bytes, namespace: bytes, key: bytes, payload: object, seal: BlockSeal | None = None,
                   source: str | None = None) -> None:
    """A value read in two parts, its head and (already in place) its payload:
    raise `BlockFileError` unless they make a good block of this key."""
    source = source or store_key(namespace, key).decode()
    data = memoryview(payload).cast("B")  # type: ignore[arg-type]
    with checked_before_seal(seal, head):
        fields = check_header(source, head, namespace, key, data.nbytes, compact_header_bytes(key, seal is not None),
                              sealed=seal is not None)
        if xxhash.xxh3_64_intdigest(data) != payload_checksum(head):
            raise BlockFileError("corrupt", source, "payload checksum mismatch")
    if seal is not None:
        assert fields is not None
        seal.open(source, namespace, key, fields, data)


def decode_value_into(value: bytes | None, namespace: bytes, key: bytes, out: object, seal: BlockSeal | None = None,
                      source: str | None = None) -> None:
    """Fill `out` (a writable buffer of the block's size) from `value`, or raise
    `BlockFileError` naming why the value cannot be served (None: "missing")."""
    source = source or store_key(namespace, key).decode()
    if value is None:
        raise BlockFileError("missing", source, "no such key (evicted, expired, or never written)")
    target = memoryview(out).cast("B")  # type: ignore[arg-type]
    size = compact_header_bytes(key, seal is not None)
    payload = memoryview(value)[size:]
    with checked_before_seal(seal, value[:size]):
        fields = check_header(source, value[:size], namespace, key, target.nbytes, size, sealed=seal is not None)
        if payload.nbytes != target.nbytes:
            what = "truncated" if payload.nbytes < target.nbytes else "corrupt"
            raise BlockFileError(what, source, f"{payload.nbytes} payload bytes, expected {target.nbytes}")
        if xxhash.xxh3_64_intdigest(payload) != payload_checksum(value):
            raise BlockFileError("corrupt", source, "payload checksum mismatch")
    # numpy's copy releases the GIL (a memoryview's does not): other I/O threads read the socket meanwhile.
    np.frombuffer(target, np.uint8)[:] = np.frombuffer(payload, np.uint8)
    if seal is not None:
        assert fields is not None
        seal.open(source, namespace, key, fields, target)
