"""The binary form of the event log: msgpack rows in CRC-checked frames, the
step frames compressed as one zstd stream.

    file    = MAGIC frame(header) frame(step)*
    MAGIC   = b"KVLEDGER" + one byte, the format version (2; version 1 is still read)
    frame   = u32 length, u32 crc32(payload), payload          (little-endian)
    header  = msgpack map: schema_version, engine_version, digest_interval,
              config, kinds {kind: code}, layouts {kind: [version, [[name, tag], ...]]},
              compression "zstd"                            (not compressed)
    step    = one frame per step; its payload is the next piece of the log's zstd
              stream, flushed to a block boundary, and decompresses to
              msgpack [first_seq, step_index, [row, ...]]
    row     = [code, version, field, ...]   fields positional, in the layout's order
            | [0, digest_bytes]             a state digest; its seq is the number
                                            of events before it (first_seq + rows so far)
            | [0, digest_bytes, part, parts]  a part digest (schema version 2)

Version 1 is the same without the compression: each step payload is the msgpack
array itself, and the header has no `compression` key.

Why a stream and not self-contained frames: a log mostly repeats itself. The
prompts' 16-byte block hashes are most of its bytes, and requests over shared
documents repeat long runs of them; the step_scheduled columns repeat from one
step to the next. Only a compressor that remembers earlier steps sees that, and
zstd's history (`ZSTD_WINDOW_LOG`) carries across block flushes. Each step is
flushed as a whole block, so what is on disk after a crash decodes up to the
last complete frame, and the CRC still covers every frame as written.

Kind codes and layouts live in the header, so the file describes itself and
reading never depends on class order. Bytes are msgpack bin, tuples arrays;
tuples of >= 4 ints or equal-length bytes are packed bins (see `packed`).
Every string goes through a `Strings` table shared by all frames: a request
id costs its text once and a 1-3 byte index afterwards (a packed column of
indices, in a step_scheduled row). That table and the zstd stream are why
frames are read in order from the start, and why a writer passes the same
`Strings` (which carries the stream too) to every `encode_binary_frame` call
of one log (`encode_binary` does this for a log held in memory).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Iterator

import msgpack
import zstandard

from kvledger.events.codec import CodecError, construct, from_record
from kvledger.events.log_records import (
    Cursor,
    DigestRecord,
    EventRecord,
    LogError,
    LogHeader,
    Record,
    header_from_dict,
    header_to_dict,
    is_digest,
    join_digest,
    split_digest,
)
from kvledger.events.schema import SCHEMAS, InvalidValue, KindSchema, Strings, json_form_decoder
from kvledger.events.types import Event

FORMAT_VERSION = 2
MAGIC = b"KVLEDGER" + bytes([FORMAT_VERSION])
MAGIC_PREFIX = MAGIC[:-1]  # the last byte is the binary format's version
MAGIC_V1 = MAGIC_PREFIX + b"\x01"  # uncompressed step frames: read, no longer written
COMPRESSION = "zstd"
ZSTD_LEVEL = 3
ZSTD_WINDOW_LOG = 23  # 8 MiB of history; a reader needs as much memory (zstd reads it from the stream)
DIGEST_CODE = 0
MAX_FRAME_BYTES = 1 << 28  # a larger length is corruption, not a step
KIND_CODES: dict[str, int] = {kind: code for code, kind in enumerate(SCHEMAS, start=1)}  # as this writer assigns

_FRAME_HEAD = struct.Struct("<II")
_HEADER_EXTRA_KEYS = {1: ("kinds", "layouts"), 2: ("kinds", "layouts", "compression")}

RowWriter = Callable[[Event, Strings], list]
RowReader = Callable[[tuple, Strings], Event]


def _frame(payload: bytes) -> bytes:
    return _FRAME_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


# --- writing -------------------------------------------------------------


def _make_row_writer(schema: KindSchema) -> RowWriter:
    code, version = KIND_CODES[schema.kind], schema.version
    pairs = tuple((f.name, f.binary_encode) for f in schema.fields)

    def write(event: Event, strings: Strings) -> list:
        row = [code, version]
        for name, encode in pairs:
            value = getattr(event, name)
            row.append(value if encode is None else encode(value, strings))
        return row

    return write


_ROW_WRITERS: dict[type, RowWriter] = {schema.cls: _make_row_writer(schema) for schema in SCHEMAS.values()}


def encode_binary_header(header: LogHeader) -> bytes:
    """MAGIC and the header frame: everything a reader needs before the first step."""
    data = {
        **header_to_dict(header),
        "kinds": dict(KIND_CODES),
        "layouts": {kind: schema.layout for kind, schema in SCHEMAS.items()},
        "compression": COMPRESSION,
    }
    return MAGIC + _frame(msgpack.packb(data, use_bin_type=True))


def _compressor() -> zstandard.ZstdCompressionObj:
    params = zstandard.ZstdCompressionParameters.from_level(ZSTD_LEVEL, window_log=ZSTD_WINDOW_LOG)
    return zstandard.ZstdCompressor(compression_params=params).compressobj()


def _check_frame(first_seq: int, step_index: int, records: list[Record]) -> None:
    seq = first_seq
    for record in records:
        if record.seq != seq or record.step_index != step_index:
            raise LogError(
                f"record (seq {record.seq}, step_index {record.step_index}) does not belong in the frame "
                f"for step {step_index} at seq {seq}",
                seq=first_seq,
            )
        if isinstance(record, EventRecord):
            seq += 1
        elif not is_digest(record.digest):
            raise LogError(f"digest must be lowercase hex or 'part/parts:hex', got {record.digest!r}",
                           seq=first_seq)


def _digest_row(digest: str) -> list:
    part, parts, raw = split_digest(digest)  # type: ignore[misc]  # checked by _check_frame
    return [DIGEST_CODE, raw, part, parts] if parts else [DIGEST_CODE, raw]


def _digest_of_row(row: tuple) -> str | None:
    """`[0, digest]` (full) or `[0, digest, part, parts]`; None if neither."""
    if len(row) not in (2, 4) or type(row[1]) is not bytes or not row[1]:
        return None
    if len(row) == 2:
        return row[1].hex()
    part, parts = row[2], row[3]
    if type(part) is not int or type(parts) is not int or not 0 <= part < parts:
        return None
    return join_digest(part, parts, row[1])


def encode_binary_frame(
    first_seq: int, step_index: int, records: Iterable[Record], *, strings: Strings
) -> bytes:
    """One step's records as one frame. `strings` is the log's table and stream, updated
    in place (and left as they were if the frame fails to encode)."""
    records = list(records)
    _check_frame(first_seq, step_index, records)
    mark = strings.begin_frame()
    try:
        rows = [
            _ROW_WRITERS[type(r.event)](r.event, strings)
            if isinstance(r, EventRecord)
            else _digest_row(r.digest)
            for r in records
        ]
        payload = msgpack.packb([first_seq, step_index, rows], use_bin_type=True)
    except (TypeError, ValueError, OverflowError, KeyError) as exc:
        strings.rollback(mark)
        raise LogError(f"cannot encode step {step_index}: {exc!r}", seq=first_seq) from None
    stream = strings.stream
    if stream is None:
        stream = strings.stream = _compressor()
    return _frame(stream.compress(payload) + stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))


def encode_binary(header: LogHeader, records: Iterable[Record]) -> bytes:
    """A whole log in memory, one frame per run of records of one step (tests, benchmarks)."""
    strings, parts = Strings(), [encode_binary_header(header)]
    run: list[Record] = []
    for record in [*records, None]:
        if run and (record is None or record.step_index != run[0].step_index):
            parts.append(encode_binary_frame(run[0].seq, run[0].step_index, run, strings=strings))
            run = []
        if record is not None:
            run.append(record)
    return b"".join(parts)


# --- reading -------------------------------------------------------------


def _current_row_reader(schema: KindSchema) -> RowReader:
    kind, cls = schema.kind, schema.cls
    pairs = tuple((f.name, f.binary_decode) for f in schema.fields)
    size = len(pairs) + 2

    def read(row: tuple, strings: Strings) -> Event:
        if len(row) != size:
            raise CodecError(f"row has {len(row) - 2} fields, the layout {len(pairs)}", kind=kind)
        kwargs = {}
        name = ""
        try:
            for (name, decode), value in zip(pairs, row[2:]):
                kwargs[name] = decode(value, strings)
        except InvalidValue as exc:
            raise CodecError(str(exc), kind=kind, field=name) from None
        return construct(cls, kind, kwargs)

    return read


def _old_row_reader(kind: str, version: int, fields: list) -> RowReader:
    """Rows of an older version: to JSON form by the header's layout, then upcast."""
    names = [name for name, _tag in fields]
    converters = [json_form_decoder(tag) for _name, tag in fields]

    def read(row: tuple, strings: Strings) -> Event:
        if len(row) != len(names) + 2:
            raise CodecError(f"row has {len(row) - 2} fields, the layout {len(names)}", kind=kind)
        record = {"kind": kind, "v": version}
        name = ""
        try:
            for name, convert, value in zip(names, converters, row[2:]):
                record[name] = convert(value, strings)
        except InvalidValue as exc:
            raise CodecError(str(exc), kind=kind, field=name) from None
        return from_record(record)

    return read


def _failing_row_reader(detail: str, kind: str | None) -> RowReader:
    def read(row: tuple, strings: Strings) -> Event:
        raise CodecError(detail, kind=kind)

    return read


def _layout(value: object) -> tuple[int, list] | None:
    """A header layout `[version, [[name, tag], ...]]`, or None if malformed."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        return None
    version, fields = value
    if type(version) is not int or not isinstance(fields, (list, tuple)):
        return None
    for field in fields:
        if not (isinstance(field, (list, tuple)) and len(field) == 2 and all(type(x) is str for x in field)):
            return None
    return version, [list(f) for f in fields]


def _row_readers(kinds: object, layouts: object) -> tuple[dict[int, tuple[int, RowReader]], str | None]:
    """code -> (version, reader) from the header; or a problem. Unknown kinds and newer
    versions fail only when a row uses them: a log may list kinds it never wrote."""
    if not isinstance(kinds, dict) or not isinstance(layouts, dict):
        return {}, "kinds and layouts must be mappings"
    readers: dict[int, tuple[int, RowReader]] = {}
    for kind, code in kinds.items():
        if type(kind) is not str or type(code) is not int or code == DIGEST_CODE or code in readers:
            return {}, f"bad kind code {kind!r}: {code!r}"
        layout = _layout(layouts.get(kind))
        if layout is None:
            return {}, f"bad or missing layout for {kind!r}"
        version, fields = layout
        schema = SCHEMAS.get(kind)
        if schema is None:
            reader = _failing_row_reader(f"unknown kind {kind!r}", None)
        elif version > schema.version:
            reader = _failing_row_reader(f"v{version} is newer than this reader knows (v{schema.version})", kind)
        elif version == schema.version:
            if fields != schema.layout[1]:
                return {}, f"{kind} v{version}: layout {fields} differs from this reader's {schema.layout[1]}"
            reader = _current_row_reader(schema)
        else:
            try:
                reader = _old_row_reader(kind, version, fields)
            except InvalidValue as exc:
                return {}, f"{kind} v{version}: {exc}"
        readers[code] = (version, reader)
    return readers, None


class _Chunks:
    """Exact-size reads over an iterable of byte chunks; `offset` counts bytes consumed."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buffer = bytearray()
        self._pos = 0
        self.offset = 0

    def read(self, size: int) -> bytes:
        """`size` bytes, or fewer at the end of the data."""
        while len(self._buffer) - self._pos < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            del self._buffer[: self._pos]
            self._pos = 0
            self._buffer += chunk
        out = bytes(self._buffer[self._pos : self._pos + size])
        self._pos += len(out)
        self.offset += len(out)
        return out


def _read_frame(chunks: _Chunks, seq: int | None) -> bytes | None:
    """The next frame's checked payload; None at a clean end of data."""
    start = chunks.offset
    head = chunks.read(_FRAME_HEAD.size)
    if not head:
        return None
    if len(head) < _FRAME_HEAD.size:
        raise LogError(f"truncated: frame head at byte {start} has {len(head)} of 8 bytes", seq=seq)
    length, crc = _FRAME_HEAD.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise LogError(f"corrupt: frame at byte {start} claims {length} bytes", seq=seq)
    payload = chunks.read(length)
    if len(payload) < length:
        raise LogError(f"truncated: frame at byte {start} has {len(payload)} of {length} bytes", seq=seq)
    if zlib.crc32(payload) != crc:
        raise LogError(f"corrupt: CRC mismatch in frame at byte {start}", seq=seq)
    return payload


def _unpack(payload: bytes, seq: int | None, *, use_list: bool) -> object:
    try:
        return msgpack.unpackb(payload, raw=False, use_list=use_list, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise LogError(f"corrupt: bad msgpack ({exc})", seq=seq) from None


def _read_header(chunks: _Chunks) -> tuple[LogHeader, dict, int]:
    magic = chunks.read(len(MAGIC))
    if magic[: len(MAGIC_PREFIX)] != MAGIC_PREFIX or len(magic) < len(MAGIC):
        raise LogError("missing header: not a kvledger binary log (bad magic)")
    version = magic[-1]
    if version > FORMAT_VERSION:
        raise LogError(f"binary format version {version} is newer than this reader knows ({FORMAT_VERSION})")
    if version not in _HEADER_EXTRA_KEYS:
        raise LogError(f"binary format version {version} does not exist")
    payload = _read_frame(chunks, None)
    if payload is None:
        raise LogError("missing header: the log ends after its magic")
    data = _unpack(payload, None, use_list=True)
    header = header_from_dict(data, extra_keys=_HEADER_EXTRA_KEYS[version])
    if version >= 2 and data["compression"] != COMPRESSION:  # type: ignore[index]
        raise LogError(f"header: unknown compression {data['compression']!r}")  # type: ignore[index]
    readers, problem = _row_readers(data["kinds"], data["layouts"])  # type: ignore[index]
    if problem:
        raise LogError(f"header: {problem}")
    return header, readers, version


def _decode_frame(frame: object, cursor: Cursor, readers: dict, strings: Strings) -> Iterator[Record]:
    seq = cursor.next_seq
    if not (type(frame) is tuple and len(frame) == 3 and type(frame[2]) is tuple):
        raise LogError("corrupt: a frame must be [first_seq, step_index, [rows]]", seq=seq)
    first_seq, step_index, rows = frame
    problem = cursor.check(first_seq, step_index)
    if problem:
        raise LogError(problem, seq=seq)
    strings.begin_frame()
    for row in rows:
        if type(row) is not tuple or not row or type(row[0]) is not int:
            raise LogError(f"corrupt: bad row {row!r}", seq=seq)
        code = row[0]
        if code == DIGEST_CODE:
            digest = _digest_of_row(row)
            if digest is None:
                raise LogError(f"corrupt: bad digest row {row!r}", seq=seq)
            yield DigestRecord(seq=cursor.next_seq, step_index=step_index, digest=digest)
            continue
        entry = readers.get(code)
        if entry is None:
            raise LogError(f"unknown kind code {code} (not in the header)", seq=seq)
        version, reader = entry
        try:
            if len(row) < 2 or row[1] != version:
                raise CodecError(f"row version {row[1:2]} differs from the header's v{version}")
            record = EventRecord(seq=cursor.next_seq, step_index=step_index, event=reader(row, strings))
        except ValueError as exc:  # CodecError, or an event of another step
            raise LogError(f"record seq {cursor.next_seq}: {exc}", seq=seq) from None
        yield record
        cursor.next_seq += 1


def _read_steps(chunks: _Chunks, readers: dict, version: int) -> Iterator[Record]:
    cursor, strings = Cursor(), Strings()
    stream = zstandard.ZstdDecompressor().decompressobj() if version >= 2 else None
    while True:
        payload = _read_frame(chunks, cursor.next_seq)
        if payload is None:
            return
        if stream is not None:
            try:
                payload = stream.decompress(payload)
            except zstandard.ZstdError as exc:
                raise LogError(f"corrupt: bad zstd block ({exc})", seq=cursor.next_seq) from None
        frame = _unpack(payload, cursor.next_seq, use_list=False)
        yield from _decode_frame(frame, cursor, readers, strings)


def read_binary(data: bytes | bytearray | memoryview | Iterable[bytes]) -> tuple[LogHeader, Iterator[Record]]:
    """Read the header now and records lazily, from a buffer or an iterable of chunks.

    Raises LogError naming the first seq of the bad frame (the seq it should
    have started at, since a corrupt frame's own numbers cannot be trusted).
    """
    chunks = _Chunks([bytes(data)] if isinstance(data, (bytes, bytearray, memoryview)) else data)
    header, readers, version = _read_header(chunks)
    return header, _read_steps(chunks, readers, version)
