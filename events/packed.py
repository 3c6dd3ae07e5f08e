"""Packed arrays: a tuple of ints, or of equal-length bytes, as one msgpack bin.

A step's columns (64 computed-token counts) and a prompt's block hashes are
the bulk of a binary log. As plain msgpack each int costs 1-9 bytes by value
and each hash 2 bytes of header; packed, the ints share one fixed width and
the hashes one header, and decoding is a single `struct.unpack` or slicing
pass instead of a Python-level check per item.

    ints:  bin = format char (one of "BHIQbhiq") + little-endian items
    bytes: bin = u8 item width (1-255) + items back to back

Only tuples of at least `MIN_PACKED_ITEMS` items are packed; shorter ones
stay plain arrays, and readers accept either form.
"""

from __future__ import annotations

import struct

MIN_PACKED_ITEMS = 4

_INT_FORMATS = (  # narrowest first
    ("B", 0, 0xFF),
    ("H", 0, 0xFFFF),
    ("I", 0, 0xFFFF_FFFF),
    ("Q", 0, 0xFFFF_FFFF_FFFF_FFFF),
    ("b", -0x80, 0x7F),
    ("h", -0x8000, 0x7FFF),
    ("i", -0x8000_0000, 0x7FFF_FFFF),
    ("q", -0x8000_0000_0000_0000, 0x7FFF_FFFF_FFFF_FFFF),
)
_INT_SIZES = {ord(code): struct.calcsize(code) for code, _low, _high in _INT_FORMATS}


def pack_ints(values: tuple[int, ...]) -> bytes | None:
    """The packed form, or None where the tuple is short or does not fit 64 bits."""
    if len(values) < MIN_PACKED_ITEMS:
        return None
    low, high = min(values), max(values)
    for code, lowest, highest in _INT_FORMATS:
        if lowest <= low and high <= highest:
            return code.encode() + struct.pack(f"<{len(values)}{code}", *values)
    return None


_UNPACKERS: dict[tuple[int, int], struct.Struct] = {}


def unpack_ints(data: bytes) -> tuple[int, ...]:
    try:
        unpacker = _UNPACKERS[data[0], len(data)]  # a log holds few (width, count) shapes
    except (KeyError, IndexError):
        unpacker = _unpacker(data)
    return unpacker.unpack_from(data, 1)


def _unpacker(data: bytes) -> struct.Struct:
    size = _INT_SIZES.get(data[0]) if data else None
    if size is None:
        raise ValueError(f"packed ints: bad format {data[:1]!r}")
    count, extra = divmod(len(data) - 1, size)
    if extra:
        raise ValueError(f"packed ints: {len(data) - 1} bytes is not a whole number of {size}-byte items")
    unpacker = struct.Struct(f"<{count}{chr(data[0])}")
    if len(_UNPACKERS) < 4096:  # bounded: a corrupt log could name any shape
        _UNPACKERS[data[0], len(data)] = unpacker
    return unpacker


def pack_bytes(values: tuple[bytes, ...]) -> bytes | None:
    """The packed form, or None where the tuple is short or its items differ in length."""
    if len(values) < MIN_PACKED_ITEMS:
        return None
    width = len(values[0])
    if not 0 < width < 256 or min(map(len, values)) != width or max(map(len, values)) != width:
        return None
    return bytes((width,)) + b"".join(values)


def unpack_bytes(data: bytes) -> tuple[bytes, ...]:
    width = data[0] if data else 0
    if not width or (len(data) - 1) % width:
        raise ValueError(f"packed bytes: {len(data)} bytes do not hold items of width {width}")
    return tuple([data[i : i + width] for i in range(1, len(data), width)])
