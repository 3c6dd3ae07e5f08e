"""The binary form of the event log: msgpack rows in CRC-checked frames, the
step frames compressed as one zstd stream per segment, segments begun by
state snapshots, and an index of the snapshots at the end of a closed log.

    file    = MAGIC frame(header) segment (frame(snapshot) segment)* [frame(index) trailer]
    segment = frame(step)*
    MAGIC   = b"KVLEDGER" + one byte, the format version (3; versions 1 and 2 are still read)
    frame   = u32 length, u32 crc32(payload), payload          (little-endian)
    header  = msgpack map: schema_version, engine_version, digest_interval,
              config, kinds {kind: code}, layouts {kind: [version, [[name, tag], ...]]},
              compression "zstd", snapshot_interval_events      (not compressed)
    payload = one type byte, then its body:
      "S" step      the next piece of the segment's zstd stream, flushed to a block
                    boundary; it decompresses to msgpack [first_seq, step_index, [row, ...]]
      "P" snapshot  u64 seq, u64 step_index (the state after the first `seq` events,
                    at the end of step `step_index`), then one self-contained zstd
                    frame of the msgpack of `engine.snapshot.capture`'s data
      "X" index     msgpack [[seq, step_index, byte offset of the snapshot frame], ...]
    trailer = u64 byte offset of the index frame, b"KVLINDEX"   (the file's last 16 bytes)
    row     = [code, version, field, ...]   fields positional, in the layout's order
            | [0, digest_bytes]             a state digest; its seq is the number
                                            of events before it (first_seq + rows so far)
            | [0, digest_bytes, part, parts]  a part digest (schema version 2)

Version 2 is version 3 without type bytes, snapshots or index: every frame
after the header is a step of one stream over the whole log. Version 1 is
version 2 without the compression: each step payload is the msgpack array
itself, and the header has no `compression` key.

Why a stream and not self-contained frames: a log mostly repeats itself. The
prompts' 16-byte block hashes are most of its bytes, and requests over shared
documents repeat long runs of them; the step_scheduled columns repeat from one
step to the next. Only a compressor that remembers earlier steps sees that, and
zstd's history (`ZSTD_WINDOW_LOG`) carries across block flushes. Each step is
flushed as a whole block, so what is on disk after a crash decodes up to the
last complete frame, and the CRC still covers every frame as written.

Why segments: a stream (and the `Strings` table) makes every frame depend on
all frames before it, so a reader had to start at the beginning. At a
snapshot both restart, on the writer's side and the reader's, so decoding can
begin at any snapshot frame with nothing read before it but the header. A
segment is hundreds of thousands of events, so the compressor loses only its
first few steps' history.

How a reader finds a snapshot: a closed log ends in the index and the
trailer (two reads from the end). A log cut by a crash has neither; its
snapshot frames are found by walking the frame heads (`scan_snapshots`: the
type byte and the snapshot's seq sit in the first bytes of a frame, so nothing
is decompressed), which reads the whole file once.

Kind codes and layouts live in the header, so the file describes itself and
reading never depends on class order. Bytes are msgpack bin, tuples arrays;
tuples of >= 4 ints or equal-length bytes are packed bins (see `packed`).
Every string goes through a `Strings` table shared by the frames of a
segment: a request id costs its text once and a 1-3 byte index afterwards (a
packed column of indices, in a step_scheduled row). A writer passes the same
`Strings` (which carries the stream too) to every `encode_binary_frame` and
`encode_snapshot_frame` call of one log (`encode_binary` does this for a log
held in memory).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from typing import cast

import attrs
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
    install_words,
    is_digest,
    join_digest,
    newer_words,
    read_event_record,
    split_digest,
)
from kvledger.events.schema import (
    SCHEMAS,
    InvalidValue,
    KindSchema,
    Strings,
    int_binary_decode,
    json_form_decoder,
)
from kvledger.events.types import TUPLE_CONVERTERS, Event

FORMAT_VERSION = 3
MAGIC = b"KVLEDGER" + bytes([FORMAT_VERSION])
MAGIC_PREFIX = MAGIC[:-1]  # the last byte is the binary format's version
MAGIC_V1 = MAGIC_PREFIX + b"\x01"  # uncompressed step frames: read, no longer written
MAGIC_V2 = MAGIC_PREFIX + b"\x02"  # one stream, no snapshots: read, no longer written
FRAME_STEP, FRAME_SNAPSHOT, FRAME_INDEX = b"S"[0], b"P"[0], b"X"[0]
SNAPSHOT_ZSTD_LEVEL = 1  # a snapshot is mostly keys and ids: level 3 saves little and costs the writer more
TRAILER_MAGIC = b"KVLINDEX"
TRAILER_BYTES = 16
COMPRESSION = "zstd"
ZSTD_LEVEL = 3
ZSTD_WINDOW_LOG = 23  # 8 MiB of history; a reader needs as much memory (zstd reads it from the stream)
DIGEST_CODE = 0
MAX_FRAME_BYTES = 1 << 28  # a larger length is corruption, not a step
KIND_CODES: dict[str, int] = {kind: code for code, kind in enumerate(SCHEMAS, start=1)}  # as this writer assigns

_FRAME_HEAD = struct.Struct("<II")
_SNAPSHOT_HEAD = struct.Struct("<BQQ")  # type byte, seq, step_index
_TRAILER = struct.Struct("<Q8s")
_HEADER_EXTRA_KEYS = {1: ("kinds", "layouts"), 2: ("kinds", "layouts", "compression"),
                      3: ("kinds", "layouts", "compression", "snapshot_interval_events")}


@attrs.frozen(kw_only=True)
class SnapshotMark:
    """Where a snapshot frame is: the state after the first `seq` events, at the
    end of step `step_index`, in the frame at byte `offset` of the file."""

    seq: int
    step_index: int
    offset: int


@attrs.frozen(kw_only=True, eq=False)
class SnapshotRecord:
    """A snapshot as read: `data` is `engine.snapshot.capture`'s, as msgpack gives
    it back (arrays as tuples)."""

    seq: int
    step_index: int
    data: object

RowWriter = Callable[[Event, Strings], list]
RowReader = Callable[[tuple, Strings], Event]
RecordReader = Callable[[tuple, Strings, int, int], EventRecord]

_new = object.__new__
_put = object.__setattr__  # a frozen attrs class's fields are set so in its own __init__


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


def encode_binary_header(header: LogHeader, *, snapshot_interval_events: int = 0) -> bytes:
    """MAGIC and the header frame: everything a reader needs before the first step.
    `snapshot_interval_events` says how often the writer means to snapshot (0: never);
    readers go by the frames, not by it."""
    data = {
        **header_to_dict(header),
        "kinds": dict(KIND_CODES),
        "layouts": {kind: schema.layout for kind, schema in SCHEMAS.items()},
        "compression": COMPRESSION,
        "snapshot_interval_events": snapshot_interval_events,
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
    return _frame(_STEP_TYPE + stream.compress(payload) + stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))


_STEP_TYPE = bytes([FRAME_STEP])


def encode_snapshot_frame(seq: int, step_index: int, data: object, *, strings: Strings) -> bytes:
    """A snapshot of the state after the first `seq` events (`data` from
    `engine.snapshot.capture`), and the start of a new segment: `strings` and
    its stream restart, so the frames after it depend on nothing before it."""
    try:
        packed = msgpack.packb(data, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LogError(f"cannot encode the snapshot after step {step_index}: {exc!r}", seq=seq) from None
    body = zstandard.ZstdCompressor(level=SNAPSHOT_ZSTD_LEVEL).compress(packed)
    strings.restart()
    return _frame(_SNAPSHOT_HEAD.pack(FRAME_SNAPSHOT, seq, step_index) + body)


def encode_index(marks: Iterable[SnapshotMark], offset: int) -> bytes:
    """The index frame and the trailer, written last at byte `offset` of a closed log."""
    rows = [[m.seq, m.step_index, m.offset] for m in marks]
    return _frame(bytes([FRAME_INDEX]) + msgpack.packb(rows)) + _TRAILER.pack(offset, TRAILER_MAGIC)


def encode_binary(header: LogHeader, records: Iterable[Record], *, snapshots: Mapping[int, object] | None = None,
                  closed: bool = False) -> bytes:
    """A whole log in memory, one frame per run of records of one step (tests,
    benchmarks); `snapshots` maps a seq at a step's end to the snapshot data
    written there, and `closed` adds the index and trailer."""
    snapshots = snapshots or {}
    strings, parts = Strings(), [encode_binary_header(header)]
    run: list[Record] = []
    marks: list[SnapshotMark] = []
    size = len(parts[0])

    def add(data: bytes) -> None:
        nonlocal size
        parts.append(data)
        size += len(data)

    for record in [*records, None]:
        if run and (record is None or record.step_index != run[0].step_index):
            add(encode_binary_frame(run[0].seq, run[0].step_index, run, strings=strings))
            end = run[-1].seq + (type(run[-1]) is EventRecord)
            if end in snapshots:
                marks.append(SnapshotMark(seq=end, step_index=run[0].step_index, offset=size))
                add(encode_snapshot_frame(end, run[0].step_index, snapshots[end], strings=strings))
            run = []
        if record is not None:
            run.append(record)
    if closed:
        add(encode_index(marks, size))
    return b"".join(parts)


# --- reading -------------------------------------------------------------


def _current_row_reader(schema: KindSchema) -> RowReader:
    """A row of this build's layout, read by code generated from the schema (`_generated_reader`).
    Its errors are `_checked_row_reader`'s, which stays the reference
    (tests/events/test_binary.py reads bad rows with both)."""
    return cast("RowReader", _generated_reader(schema, records=False))


def _current_record_reader(schema: KindSchema) -> RecordReader:
    """`_current_row_reader` that checks the row's version and builds the record too:
    what a log's reader calls per row (`_decode_frame`)."""
    return cast("RecordReader", _generated_reader(schema, records=True))


def _sets_fields_directly(cls: type) -> bool:
    """Whether an event of `cls` can be built past its `__init__`: no validator, no
    post-init check, and every converter one that passes a decoded value unchanged."""
    if hasattr(cls, "__attrs_post_init__"):
        return False
    return all(a.validator is None and (a.converter is None or a.converter in TUPLE_CONVERTERS)
               for a in attrs.fields(cls))


def _generated_reader(schema: KindSchema, *, records: bool) -> Callable[..., object]:
    """The fields in locals, ints and a string's table reference read inline, anything else
    through the field's own decoder, and the event built in one pass; `records`: with the
    version check and the `EventRecord`. A loop over the fields into a dict of keywords took
    twice as long; reading strings inline, building past `__init__` and one call a row took a
    2M-event log's decoding from 4.9 to 3.99-4.09 s (bench/history/2026-12-07.md, "Log tools,
    fourth pass")."""
    kind, cls = schema.kind, schema.cls
    scope: dict[str, object] = {"cls": cls, "KIND": kind, "CodecError": CodecError, "InvalidValue": InvalidValue,
                                "int_error": int_binary_decode, "new": _new, "put": _put, "record": read_event_record,
                                "step_error": _step_error, "version_error": _version_error}
    size = len(schema.fields) + 2
    version = schema.version
    lines = ["def read(row, strings, seq, step_index):" if records else "def read(row, strings):"]
    if records:
        lines += [f"    if len(row) < 2 or row[1] != {version}:",
                  f"        raise CodecError(version_error(row, {version}))"]
    lines += [f"    if len(row) != {size}:",
              f"        raise CodecError(f'row has {{len(row) - 2}} fields, the layout {size - 2}', kind=KIND)",
              "    texts = strings.texts",
              "    field = ''",
              "    try:"]
    names = []
    for index, field in enumerate(schema.fields, start=2):
        v = f"v{index}"
        scope[f"decode_{index}"] = field.binary_decode
        lines += [f"        field = {field.name!r}",
                  f"        {v} = row[{index}]"]
        if field.tag == "int":
            lines += [f"        if type({v}) is not int:",
                      f"            int_error({v}, strings)"]
        elif field.tag == "str":  # a reference into the table, or the text where it first appears
            lines += [f"        if type({v}) is int and 0 <= {v} < len(texts):",
                      f"            {v} = texts[{v}]",
                      "        else:",
                      f"            {v} = decode_{index}({v}, strings)"]
        else:
            lines.append(f"        {v} = decode_{index}({v}, strings)")
        names.append((field.name, v))
    lines += ["    except InvalidValue as exc:",
              "        raise CodecError(str(exc), kind=KIND, field=field) from None"]
    if _sets_fields_directly(cls):
        lines.append("    event = new(cls)")
        lines += [f"    put(event, {name!r}, {v})" for name, v in names]
    else:
        lines += ["    try:",
                  f"        event = cls({', '.join(f'{name}={v}' for name, v in names)})",
                  "    except (TypeError, ValueError) as exc:",
                  "        raise CodecError(str(exc), kind=KIND) from None"]
    if not records:
        lines.append("    return event")
    else:
        if "step_index" in schema.names:  # a step_scheduled event belongs to its own step
            lines += ["    if event.step_index != step_index:",
                      "        step_error(seq, step_index, event)"]
        lines.append("    return record(seq, step_index, event)")
    exec(compile("\n".join(lines) + "\n", f"<row reader for {kind}>", "exec"), scope)  # noqa: S102 (generated from the schema alone)
    return cast("Callable[..., object]", scope["read"])


def _step_error(seq: int, step_index: int, event: Event) -> None:
    EventRecord(seq=seq, step_index=step_index, event=event)  # raises, naming both steps


def _version_error(row: tuple, version: int) -> str:
    return f"row version {row[1:2]} differs from the header's v{version}"


def _record_reader(version: int, reader: RowReader) -> RecordReader:
    """A record reader around an event's (an older layout's, or one that refuses)."""

    def read(row: tuple, strings: Strings, seq: int, step_index: int) -> EventRecord:
        if len(row) < 2 or row[1] != version:
            raise CodecError(_version_error(row, version))
        event = reader(row, strings)
        if event.kind == "step_scheduled" and event.step_index != step_index:  # type: ignore[union-attr]
            _step_error(seq, step_index, event)
        return read_event_record(seq, step_index, event)

    return read


def _checked_row_reader(schema: KindSchema) -> RowReader:
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


def _row_readers(kinds: object, layouts: object, header: LogHeader) -> tuple[dict[int, RecordReader], str | None]:
    """code -> record reader from the header; or a problem. Unknown kinds and newer
    versions fail only when a row uses them (naming the build that wrote them):
    a log may list kinds it never wrote."""
    newer = (f"; written by {header.writer}: replay it with that build or a later one "
             f"({install_words(header.engine_version, header.commit)})")
    if not isinstance(kinds, dict) or not isinstance(layouts, dict):
        return {}, "kinds and layouts must be mappings"
    readers: dict[int, RecordReader] = {}
    for kind, code in kinds.items():
        if type(kind) is not str or type(code) is not int or code == DIGEST_CODE or code in readers:
            return {}, f"bad kind code {kind!r}: {code!r}"
        layout = _layout(layouts.get(kind))
        if layout is None:
            return {}, f"bad or missing layout for {kind!r}"
        version, fields = layout
        schema = SCHEMAS.get(kind)
        if schema is None:
            reader = _failing_row_reader(f"unknown kind {kind!r}{newer}", None)
        elif version > schema.version:
            reader = _failing_row_reader(f"v{version} is newer than this reader knows (v{schema.version}){newer}",
                                         kind)
        elif version == schema.version:
            if fields != schema.layout[1]:
                return {}, f"{kind} v{version}: layout {fields} differs from this reader's {schema.layout[1]}"
            readers[code] = _current_record_reader(schema)
            continue
        else:
            try:
                reader = _old_row_reader(kind, version, fields)
            except InvalidValue as exc:
                return {}, f"{kind} v{version}: {exc}"
        readers[code] = _record_reader(version, reader)
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


class BinaryLog:
    """A binary log's header as read: what decoding any part of the log needs.
    `data_offset` is the byte where the first segment begins."""

    def __init__(self, header: LogHeader, readers: dict, version: int, snapshot_interval_events: int,
                 data_offset: int) -> None:
        self.header = header
        self.readers = readers
        self.version = version
        self.snapshot_interval_events = snapshot_interval_events
        self.data_offset = data_offset

    def records(self, chunks: Iterable[bytes]) -> Iterator[Record]:
        """The records of the data after the header (`chunks` begin at `data_offset`)."""
        return cast(Iterator[Record], _read_steps(_Chunks(chunks), self, Cursor(), False))

    def records_and_snapshots(self, chunks: Iterable[bytes]) -> Iterator[Record | SnapshotRecord]:
        """`records`, with a `SnapshotRecord` where each snapshot frame is."""
        return _read_steps(_Chunks(chunks), self, Cursor(), True)

    def records_from(self, chunks: Iterable[bytes], mark: SnapshotMark) -> tuple[SnapshotRecord, Iterator[Record]]:
        """Begin at the snapshot `mark` names (`chunks` begin at its offset): the
        snapshot, and the records after it, as though the log began there."""
        if self.version < 3:
            raise LogError(f"binary format version {self.version} has no snapshots")
        buffer = _Chunks(chunks)
        buffer.offset = mark.offset  # errors name bytes of the file
        cursor = Cursor()
        cursor.next_seq, cursor.step_index = mark.seq, mark.step_index
        payload = _read_frame(buffer, mark.seq)
        if payload is None or not payload or payload[0] != FRAME_SNAPSHOT:
            raise LogError(f"corrupt: no snapshot frame at byte {mark.offset}", seq=mark.seq)
        first = _snapshot_record(payload, cursor, decode=True)
        assert first is not None
        return first, cast(Iterator[Record], _read_steps(buffer, self, cursor, False))


def read_binary_header(chunks: Iterable[bytes]) -> BinaryLog:
    """Read MAGIC and the header frame from the start of a log (the chunks
    may go on past it; only the header's bytes are consumed from them)."""
    buffer = _Chunks(chunks)
    log = _read_header(buffer)
    return log


def _read_header(chunks: _Chunks) -> BinaryLog:
    magic = chunks.read(len(MAGIC))
    if magic[: len(MAGIC_PREFIX)] != MAGIC_PREFIX or len(magic) < len(MAGIC):
        raise LogError("missing header: not a kvledger binary log (bad magic)")
    version = magic[-1]
    if version > FORMAT_VERSION:
        identity = _newer_identity(chunks)
        if identity is None:
            raise LogError(f"binary format version {version} is newer than this reader knows ({FORMAT_VERSION})")
        raise LogError(newer_words(*identity, f"in binary format {version}", f"formats 1-{FORMAT_VERSION}"))
    if version not in _HEADER_EXTRA_KEYS:
        raise LogError(f"binary format version {version} does not exist")
    payload = _read_frame(chunks, None)
    if payload is None:
        raise LogError("missing header: the log ends after its magic")
    data = _unpack(payload, None, use_list=True)
    header = header_from_dict(data, extra_keys=_HEADER_EXTRA_KEYS[version])
    if version >= 2 and data["compression"] != COMPRESSION:  # type: ignore[index]
        raise LogError(f"header: unknown compression {data['compression']!r}")  # type: ignore[index]
    interval = data.get("snapshot_interval_events", 0) if isinstance(data, dict) else 0
    if type(interval) is not int or interval < 0:
        raise LogError(f"header: snapshot_interval_events must be an int >= 0, got {interval!r}")
    readers, problem = _row_readers(data["kinds"], data["layouts"], header)  # type: ignore[index]
    if problem:
        raise LogError(f"header: {problem}")
    return BinaryLog(header, readers, version, interval, chunks.offset)


def _newer_identity(chunks: _Chunks) -> tuple[str, str] | None:
    """The version and commit in the header frame of a log of a newer format,
    where it can be read: every format keeps the header a msgpack map in the
    first frame, so a build can name the build that can read what it cannot."""
    try:
        payload = _read_frame(chunks, None)
        data = msgpack.unpackb(payload, raw=False) if payload else None
    except (LogError, ValueError, msgpack.UnpackException):
        return None
    if not isinstance(data, dict) or type(data.get("engine_version")) is not str:
        return None
    commit = data.get("commit", "")
    return data["engine_version"][:40], commit[:64] if type(commit) is str else ""


def _decode_frame(frame: object, cursor: Cursor, readers: dict[int, RecordReader], strings: Strings,
                  out: list[Record]) -> None:
    """The frame's records, appended to `out` (those before a bad row are there when it raises)."""
    seq = cursor.next_seq
    if not (type(frame) is tuple and len(frame) == 3 and type(frame[2]) is tuple):
        raise LogError("corrupt: a frame must be [first_seq, step_index, [rows]]", seq=seq)
    first_seq, step_index, rows = frame
    problem = cursor.check(first_seq, step_index)
    if problem:
        raise LogError(problem, seq=seq)
    strings.begin_frame()
    next_seq = seq  # counted here; the cursor holds the seq due next when the frame is handed on
    append = out.append
    try:
        for row in rows:
            if type(row) is not tuple or not row or type(row[0]) is not int:
                raise LogError(f"corrupt: bad row {row!r}", seq=seq)
            code = row[0]
            if code == DIGEST_CODE:
                digest = _digest_of_row(row)
                if digest is None:
                    raise LogError(f"corrupt: bad digest row {row!r}", seq=seq)
                append(DigestRecord(seq=next_seq, step_index=step_index, digest=digest))
                continue
            read = readers.get(code)
            if read is None:
                raise LogError(f"unknown kind code {code} (not in the header)", seq=seq)
            try:
                append(read(row, strings, next_seq, step_index))
            except ValueError as exc:  # CodecError, or an event of another step
                raise LogError(f"record seq {next_seq}: {exc}", seq=seq) from None
            next_seq += 1
    finally:
        cursor.next_seq = next_seq


def _snapshot_record(payload: bytes, cursor: Cursor, *, decode: bool) -> SnapshotRecord | None:
    """A snapshot frame's record (its data decoded only if `decode`); the cursor
    moves to it, and a record that does not follow on is corruption."""
    if len(payload) < _SNAPSHOT_HEAD.size:
        raise LogError("corrupt: a snapshot frame too short for its head", seq=cursor.next_seq)
    _type, seq, step_index = _SNAPSHOT_HEAD.unpack_from(payload)
    problem = cursor.check(seq, step_index)
    if problem:
        raise LogError(f"snapshot: {problem}", seq=cursor.next_seq)
    if not decode:
        return None
    try:
        packed = zstandard.ZstdDecompressor().decompress(payload[_SNAPSHOT_HEAD.size:])
    except zstandard.ZstdError as exc:
        raise LogError(f"corrupt: bad zstd frame in the snapshot ({exc})", seq=seq) from None
    return SnapshotRecord(seq=seq, step_index=step_index, data=_unpack(packed, seq, use_list=False))


def _read_steps(chunks: _Chunks, log: BinaryLog, cursor: Cursor, snapshots: bool) -> Iterator[Record | SnapshotRecord]:
    """The records, decoded a frame at a time and handed on at C speed: a log tool's reading
    is a generator's resumption a frame (about 20 events), not one an event."""
    return chain.from_iterable(_read_frames(chunks, log, cursor, snapshots))


def _read_frames(chunks: _Chunks, log: BinaryLog, cursor: Cursor,
                 snapshots: bool) -> Iterator[list[Record | SnapshotRecord]]:
    """Each frame's records, in a list (a snapshot's record alone); records decoded before
    a bad row are handed on before the error is raised."""
    strings, version, readers = Strings(), log.version, log.readers
    stream = zstandard.ZstdDecompressor().decompressobj() if version >= 2 else None
    while True:
        payload = _read_frame(chunks, cursor.next_seq)
        if payload is None:
            return
        if version >= 3:
            kind = payload[0] if payload else None
            if kind == FRAME_SNAPSHOT:
                record = _snapshot_record(payload, cursor, decode=snapshots)
                strings, stream = Strings(), zstandard.ZstdDecompressor().decompressobj()
                if record is not None:
                    yield [record]
                continue
            if kind == FRAME_INDEX:
                _check_end(chunks, cursor.next_seq)
                return
            if kind != FRAME_STEP:
                raise LogError(f"corrupt: unknown frame type {kind!r}", seq=cursor.next_seq)
            payload = payload[1:]
        if stream is not None:
            try:
                payload = stream.decompress(payload)
            except zstandard.ZstdError as exc:
                raise LogError(f"corrupt: bad zstd block ({exc})", seq=cursor.next_seq) from None
        frame = _unpack(payload, cursor.next_seq, use_list=False)
        out: list[Record | SnapshotRecord] = []
        try:
            _decode_frame(frame, cursor, readers, strings, out)  # type: ignore[arg-type]
        except LogError:
            yield out
            raise
        yield out


def _check_end(chunks: _Chunks, seq: int) -> None:
    """After the index frame: the trailer, then nothing."""
    start = chunks.offset
    trailer = chunks.read(TRAILER_BYTES)
    if len(trailer) < TRAILER_BYTES or _TRAILER.unpack(trailer)[1] != TRAILER_MAGIC or chunks.read(1):
        raise LogError(f"corrupt: the index frame is not followed by the trailer alone (byte {start})", seq=seq)


def read_trailer(tail: bytes) -> int | None:
    """The index frame's offset, from a log's last `TRAILER_BYTES`; None if they are
    no trailer (a log cut by a crash, or one of an older format)."""
    if len(tail) != TRAILER_BYTES:
        return None
    offset, magic = _TRAILER.unpack(tail)
    return offset if magic == TRAILER_MAGIC else None


def read_index(frame: bytes) -> list[SnapshotMark] | None:
    """The snapshot marks of an index frame (head included, as on disk); None if
    it is no whole, valid index frame."""
    if len(frame) < _FRAME_HEAD.size + 1:
        return None
    length, crc = _FRAME_HEAD.unpack_from(frame)
    payload = frame[_FRAME_HEAD.size:]
    if length != len(payload) or zlib.crc32(payload) != crc or payload[0] != FRAME_INDEX:
        return None
    try:
        rows = msgpack.unpackb(payload[1:], use_list=False)
        marks = [SnapshotMark(seq=seq, step_index=step, offset=offset) for seq, step, offset in rows]
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    ordered = all(a.seq <= b.seq and a.offset < b.offset for a, b in zip(marks, marks[1:]))
    return marks if ordered and all(type(m.seq) is int and type(m.offset) is int for m in marks) else None


def scan_snapshots(chunks: Iterable[bytes], offset: int) -> list[SnapshotMark]:
    """The snapshot marks found by walking the frame heads from byte `offset`
    (where the chunks begin), decompressing nothing. The walk ends at the end of
    the data, at an index frame or at an implausible frame head; a snapshot frame
    cut short by the end of the data is not counted."""
    it = iter(chunks)
    marks: list[SnapshotMark] = []
    buffer, base, pos = b"", offset, 0  # buffer[0] is at byte `base`; the next frame at base + pos

    def fill(n: int) -> bool:
        """Make the buffer hold bytes [pos, pos + n); False at the end of the data."""
        nonlocal buffer, base, pos
        while len(buffer) < pos + n:
            chunk = next(it, None)
            if chunk is None:
                return False
            drop = min(pos, len(buffer))
            buffer, base, pos = buffer[drop:], base + drop, pos - drop
            if not buffer and pos >= len(chunk):  # inside a frame being skipped
                base, pos = base + len(chunk), pos - len(chunk)
                continue
            buffer += chunk
        return True

    while fill(_FRAME_HEAD.size + 1):
        length = int.from_bytes(buffer[pos:pos + 4], "little")
        kind = buffer[pos + _FRAME_HEAD.size]
        if not 1 <= length <= MAX_FRAME_BYTES or kind == FRAME_INDEX:
            break
        mark = None
        if kind == FRAME_SNAPSHOT:
            if length < _SNAPSHOT_HEAD.size or not fill(_FRAME_HEAD.size + _SNAPSHOT_HEAD.size):
                break
            _type, seq, step_index = _SNAPSHOT_HEAD.unpack_from(buffer, pos + _FRAME_HEAD.size)
            mark = SnapshotMark(seq=seq, step_index=step_index, offset=base + pos)
        pos += _FRAME_HEAD.size + length
        if mark is not None:
            if not fill(0):  # the frame runs past the end of the data
                break
            marks.append(mark)
    return marks


def _log_records(chunks: _Chunks, log: BinaryLog) -> Iterator[Record]:
    return cast(Iterator[Record], _read_steps(chunks, log, Cursor(), False))


def read_binary(data: bytes | bytearray | memoryview | Iterable[bytes]) -> tuple[LogHeader, Iterator[Record]]:
    """Read the header now and records lazily, from a buffer or an iterable of chunks.

    Raises LogError naming the first seq of the bad frame (the seq it should
    have started at, since a corrupt frame's own numbers cannot be trusted).
    """
    chunks = _Chunks([bytes(data)] if isinstance(data, (bytes, bytearray, memoryview)) else data)
    log = _read_header(chunks)
    return log.header, _log_records(chunks, log)
