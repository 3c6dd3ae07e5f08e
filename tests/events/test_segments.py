"""Binary format 3: snapshot frames that begin a segment (stream and string
table restarted), the index and trailer of a closed log, the walk of frame
heads in a log without them, and format 2 still read."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.events.log_binary import (
    MAGIC_V2,
    TRAILER_BYTES,
    SnapshotRecord,
    encode_binary,
    read_binary,
    read_binary_header,
    read_index,
    read_trailer,
    scan_snapshots,
)
from kvledger.events.log_records import EventRecord, LogError, read_jsonl
from tests.events.logs import HEADER, records_of
from tests.traces import realistic_trace

pytestmark = pytest.mark.fast
FIXTURES = Path(__file__).parent / "fixtures"
SNAPSHOT_DATA = [1, [2, b"\x00" * 40], "text", None]  # any plain data: this layer does not look inside


def _log(every: int = 3, steps: int = 12, closed: bool = True) -> tuple[bytes, list, dict[int, object]]:
    """A log of a realistic trace (repeated request ids, so the string table matters)
    with a snapshot after every `every`-th step."""
    records = records_of(realistic_trace(num_running=6, num_steps=steps, seed=1), digest_every=2)
    ends: list[int] = []
    for a, b in zip(records, records[1:]):
        if a.step_index != b.step_index and a.step_index % every == every - 1:
            ends.append(b.seq)
    snapshots = {seq: [seq, *SNAPSHOT_DATA] for seq in ends}
    return encode_binary(HEADER, records, snapshots=snapshots, closed=closed), records, snapshots


def _chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


def test_a_plain_read_skips_the_snapshots_and_the_index() -> None:
    data, records, snapshots = _log()
    assert len(snapshots) >= 3
    header, read = read_binary(data)
    assert header == HEADER and list(read) == records


def test_snapshots_are_read_where_they_were_written() -> None:
    data, records, snapshots = _log()
    log = read_binary_header([data])
    read = list(log.records_and_snapshots([data[log.data_offset:]]))
    found = [r for r in read if isinstance(r, SnapshotRecord)]
    assert [r.seq for r in found] == sorted(snapshots)
    assert all(r.data == tuple(_tupled(snapshots[r.seq])) for r in found)
    assert [r for r in read if not isinstance(r, SnapshotRecord)] == records


def _tupled(value: list) -> list:
    return [tuple(_tupled(v)) if isinstance(v, list) else v for v in value]


def test_the_index_names_every_snapshot_and_reading_can_begin_at_any() -> None:
    data, records, snapshots = _log()
    offset = read_trailer(data[-TRAILER_BYTES:])
    assert offset is not None
    marks = read_index(data[offset:-TRAILER_BYTES])
    assert marks is not None and [m.seq for m in marks] == sorted(snapshots)
    log = read_binary_header([data])
    for mark in marks:
        # Nothing before the snapshot frame is given: the segment decodes on its own.
        snapshot, rest = log.records_from([data[mark.offset:]], mark)
        assert snapshot.seq == mark.seq and snapshot.data[0] == mark.seq
        assert list(rest) == [r for r in records if r.seq > mark.seq or (r.seq == mark.seq and
                                                                           isinstance(r, EventRecord))]


def test_a_segment_writes_its_strings_again() -> None:
    """The string table restarts at a snapshot: a request id met before is written as text again."""
    data, records, _snapshots = _log(every=4, steps=8)
    marks = read_index(data[read_trailer(data[-TRAILER_BYTES:]):-TRAILER_BYTES])  # type: ignore[misc]
    assert marks
    pos = _frame_end(data, marks[0].offset)  # the first step frame of the new segment
    payload = data[pos + 8:_frame_end(data, pos)]
    assert payload[:1] == b"S"
    _first_seq, _step, rows = msgpack.unpackb(zstandard.ZstdDecompressor().decompressobj().decompress(payload[1:]))
    texts = set(_strings(rows))
    before = {r.event.request_id for r in records
              if isinstance(r, EventRecord) and r.seq < marks[0].seq and hasattr(r.event, "request_id")}
    assert texts & before, "ids seen in the earlier segment must be written as text again"


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


@settings(max_examples=30, deadline=None)
@given(chunk=st.integers(1, 4096), cut=st.floats(0, 1))
def test_the_walk_of_frame_heads_finds_the_whole_snapshots_in_any_chunking(chunk: int, cut: float) -> None:
    data, _records, _snapshots = _log(closed=False)
    closed, _, _ = _log(closed=True)
    marks = read_index(closed[read_trailer(closed[-TRAILER_BYTES:]):-TRAILER_BYTES])  # type: ignore[misc]
    assert marks
    offset = read_binary_header([data]).data_offset
    assert scan_snapshots(_chunked(data[offset:], chunk), offset) == marks
    assert scan_snapshots(_chunked(closed[offset:], chunk), offset) == marks  # it stops at the index
    end = offset + int(cut * (len(data) - offset))
    whole = [m for m in marks if m.offset < end and _frame_end(data, m.offset) <= end]
    assert scan_snapshots(_chunked(data[offset:end], chunk), offset) == whole


def _frame_end(data: bytes, offset: int) -> int:
    return offset + 8 + int.from_bytes(data[offset:offset + 4], "little")


def test_a_damaged_index_or_trailer_reads_as_none() -> None:
    data, _records, _snapshots = _log()
    offset = read_trailer(data[-TRAILER_BYTES:])
    assert offset is not None
    index = bytearray(data[offset:-TRAILER_BYTES])
    index[-1] ^= 0xFF
    assert read_index(bytes(index)) is None
    assert read_trailer(data[-TRAILER_BYTES:-1] + b"?") is None
    assert read_trailer(b"short") is None


def test_an_index_must_end_the_log() -> None:
    data, _records, _snapshots = _log()
    with pytest.raises(LogError, match="index frame is not followed by the trailer alone"):
        list(read_binary(data + b"more")[1])


def test_a_snapshot_out_of_place_is_corruption() -> None:
    data, _records, snapshots = _log()
    marks = read_index(data[read_trailer(data[-TRAILER_BYTES:]):-TRAILER_BYTES])  # type: ignore[misc]
    assert marks
    log = read_binary_header([data])
    wrong = type(marks[0])(seq=marks[0].seq + 1, step_index=marks[0].step_index, offset=marks[0].offset)
    with pytest.raises(LogError, match="snapshot: seq"):
        log.records_from([data[wrong.offset:]], wrong)
    step = type(marks[0])(seq=0, step_index=0, offset=log.data_offset)
    with pytest.raises(LogError, match=f"no snapshot frame at byte {log.data_offset}"):
        log.records_from([data[log.data_offset:]], step)
    with pytest.raises(LogError, match=f"truncated: frame at byte {marks[0].offset} has"):
        log.records_from([data[marks[0].offset:marks[0].offset + 40]], marks[0])


def test_the_committed_version_2_log_decodes() -> None:
    """Written by the format-2 writer (one stream, no snapshots), as its JSONL twin says."""
    data = (FIXTURES / "format_v2.kvlog").read_bytes()
    assert data.startswith(MAGIC_V2)
    header, records = read_binary(data)
    with (FIXTURES / "format_v2.expected.jsonl").open("rb") as lines:
        expected_header, expected = read_jsonl(lines)
        assert (header, list(records)) == (expected_header, list(expected))
    log = read_binary_header([data])
    assert log.version == 2
    with pytest.raises(LogError, match="has no snapshots"):
        log.records_from([data], read_index(b"") or None)  # type: ignore[arg-type]
