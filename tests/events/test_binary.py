"""The binary log: its documented layout, round trips, the string table, packed
arrays, the zstd stream, old layouts and format versions, every documented
error naming its seq, and its size."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import msgpack
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from kvledger.events import types as ev
from kvledger.events.codec import CodecError
from kvledger.events.log_binary import (
    MAGIC,
    MAGIC_PREFIX,
    MAGIC_V1,
    encode_binary,
    encode_binary_frame,
    encode_binary_header,
    read_binary,
)
from kvledger.events.log_records import (
    LOG_SCHEMA_VERSION,
    DigestRecord,
    EventRecord,
    LogError,
    LogHeader,
    encode_jsonl,
    read_jsonl,
)
from kvledger.events.packed import pack_bytes, pack_ints, unpack_bytes, unpack_ints
from kvledger.events.schema import SCHEMAS, Strings, json_form_decoder
from tests.events.logs import CONFIG, DIGEST, EXAMPLE_RECORDS, HEADER, records_of
from tests.strategies import EXAMPLE_EVENTS, events_strategy
from tests.traces import realistic_trace

# --- an independent reading of the documented layout ----------------------


FIXTURES = Path(__file__).parent / "fixtures"


def frame(obj: object) -> bytes:
    payload = obj if isinstance(obj, bytes) else msgpack.packb(obj, use_bin_type=True)
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


class Stream:
    """Step frames of a hand-built log: each payload is the next block of one zstd stream."""

    def __init__(self, compressor: zstandard.ZstdCompressionObj | None = None) -> None:
        self.compressor = compressor or zstandard.ZstdCompressor().compressobj()

    def frame(self, obj: object) -> bytes:
        payload = obj if isinstance(obj, bytes) else msgpack.packb(obj, use_bin_type=True)
        return frame(b"S" + self.compressor.compress(payload)
                     + self.compressor.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))


def log(head: dict, *steps: object) -> bytes:
    """A current-version log from a header map and step arrays (or raw step payloads)."""
    stream = Stream()
    return MAGIC + frame(head) + b"".join(stream.frame(step) for step in steps)


def split_frames(data: bytes) -> list[bytes]:
    """The frames' payloads as stored (step payloads compressed, in the current version)."""
    assert data[: len(MAGIC)] in (MAGIC, MAGIC_V1)
    frames, pos = [], len(MAGIC)
    while pos < len(data):
        length, crc = struct.unpack_from("<II", data, pos)
        payload = data[pos + 8 : pos + 8 + length]
        assert zlib.crc32(payload) == crc
        frames.append(payload)
        pos += 8 + length
    return frames


def step_payloads(data: bytes) -> list[bytes]:
    """Each step frame's msgpack (after its type byte), decompressed by one zstd stream in frame order."""
    stream = zstandard.ZstdDecompressor().decompressobj()
    frames = split_frames(data)[1:]
    assert all(payload[:1] == b"S" for payload in frames)
    return [stream.decompress(payload[1:]) for payload in frames]


def header_map(header: LogHeader = HEADER) -> dict:
    return msgpack.unpackb(split_frames(encode_binary_header(header))[0])


def read_all(data: bytes | list[bytes]) -> tuple[LogHeader, list]:
    header, records = read_binary(data)
    return header, list(records)


def test_layout_is_magic_header_frame_then_one_frame_per_step() -> None:
    data = encode_binary(HEADER, EXAMPLE_RECORDS)
    assert data.startswith(MAGIC_PREFIX + b"\x03")
    header = split_frames(data)[0]
    steps = step_payloads(data)
    head = msgpack.unpackb(header)
    assert head["schema_version"] == LOG_SCHEMA_VERSION and head["config"] == CONFIG.to_dict()
    assert head["compression"] == "zstd" and head["snapshot_interval_events"] == 0
    assert head["kinds"] == {kind: code for code, kind in enumerate(SCHEMAS, start=1)}
    assert head["layouts"]["store_failed"] == [3, [["job_id", "int"], ["worker_index", "int"], ["keys", "tuple[bytes]"],
                                                ["reason", "str"]]]
    assert len(steps) == 2
    first_seq, step_index, rows = msgpack.unpackb(steps[1])
    assert (first_seq, step_index) == (8, 1)
    code = head["kinds"]["store_completed"]
    assert [code, 1, 41, 1] in rows
    assert rows[-1] == [0, bytes.fromhex(DIGEST)], "a digest row is [0, digest bytes]"


def test_every_kind_round_trips() -> None:
    assert read_all(encode_binary(HEADER, EXAMPLE_RECORDS)) == (HEADER, EXAMPLE_RECORDS)


@given(
    st.lists(st.lists(events_strategy(), max_size=4), max_size=4),
    st.integers(0, 3),
    st.integers(1, 64),
)
def test_arbitrary_logs_round_trip_in_any_chunking(steps: list, digest_every: int, chunk: int) -> None:
    records = records_of(steps, digest_every)
    data = encode_binary(HEADER, records)
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    assert read_all(chunks) == (HEADER, records)


def test_kind_codes_are_read_from_the_header() -> None:
    """Swap two codes in the header and the rows: the same events come back."""
    head = header_map()
    a, b = head["kinds"]["request_added"], head["kinds"]["cache_reset"]
    head["kinds"]["request_added"], head["kinds"]["cache_reset"] = b, a
    rows = [[b, 1, "r", 3, []], [a, 3, 9, True, False, False]]
    data = log(head, [0, 0, rows])
    events = [r.event for r in read_all(data)[1]]
    assert events == [ev.RequestAdded(request_id="r", num_prompt_tokens=3, block_hashes=()), ev.CacheReset(epoch=9)]


def test_a_string_is_written_once_then_referenced() -> None:
    name = "cmpl-" + "ab" * 16 + "-0"
    records = [
        EventRecord(seq=0, step_index=0, event=ev.RequestAborted(request_id=name)),
        EventRecord(seq=1, step_index=1, event=ev.RequestPreempted(request_id=name)),
    ]
    first, second = step_payloads(encode_binary(HEADER, records))
    assert msgpack.unpackb(first)[2][0][2] == name
    assert msgpack.unpackb(second)[2][0][2] == 0
    assert len(second) < len(first) - len(name)
    assert read_all(encode_binary(HEADER, records))[1] == records


def test_the_string_table_clears_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Strings, "CAPACITY", 3)
    steps = [[ev.RequestAborted(request_id=f"r{(i * 7) % 5}"), ev.RequestResumed(request_id="r0")] for i in range(12)]
    steps.append([ev.StepScheduled(step_index=0, request_ids=("r1", "r2", "r3", "r4", "r1"),
                                   num_computed_tokens=(1,) * 5, num_scheduled_tokens=(1,) * 5)])
    records = records_of(steps)
    assert read_all(encode_binary(HEADER, records))[1] == records


def test_a_frame_that_fails_to_encode_leaves_the_string_table_as_it_was() -> None:
    strings = Strings()
    bad = [
        EventRecord(seq=0, step_index=0, event=ev.RequestAborted(request_id="fresh")),
        EventRecord(seq=1, step_index=0, event=ev.CacheReset(epoch=2**70)),
    ]
    with pytest.raises(LogError, match="seq 0: cannot encode step 0"):
        encode_binary_frame(0, 0, bad, strings=strings)
    assert len(strings) == 0
    good = bad[:1]
    data = encode_binary_header(HEADER) + encode_binary_frame(0, 0, good, strings=strings)
    assert read_all(data)[1] == good


def test_frame_records_must_match_its_seq_and_step() -> None:
    record = EventRecord(seq=5, step_index=2, event=EXAMPLE_EVENTS["cache_reset"])
    with pytest.raises(LogError, match="does not belong in the frame for step 2 at seq 4"):
        encode_binary_frame(4, 2, [record], strings=Strings())
    with pytest.raises(LogError, match="digest must be lowercase hex"):
        encode_binary_frame(0, 0, [DigestRecord(seq=0, step_index=0, digest="xy")], strings=Strings())


# --- packed arrays --------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "code"),
    [
        ((0, 1, 2, 255), b"B"),
        ((0, 1, 2, 256), b"H"),
        ((0, 1, 2, 1 << 31), b"I"),
        ((0, 1, 2, 2**64 - 1), b"Q"),
        ((-1, 0, 1, 127), b"b"),
        ((-1, 0, 1, 128), b"h"),
        ((-1, 0, 1, 1 << 20), b"i"),
        ((-(2**63), 0, 1, 2**63 - 1), b"q"),
    ],
)
def test_ints_pack_in_the_narrowest_width(values: tuple, code: bytes) -> None:
    packed = pack_ints(values)
    assert packed is not None and packed[:1] == code
    assert unpack_ints(packed) == values


def test_ints_stay_plain_when_short_or_too_wide() -> None:
    assert pack_ints((1, 2, 3)) is None
    assert pack_ints((0, 1, 2, 2**64)) is None
    assert pack_ints((-1, 0, 1, 2**63)) is None


def test_bytes_pack_when_equal_width() -> None:
    hashes = tuple(bytes([i]) * 32 for i in range(5))
    packed = pack_bytes(hashes)
    assert packed is not None and len(packed) == 1 + 5 * 32
    assert unpack_bytes(packed) == hashes
    assert pack_bytes(hashes[:3]) is None
    assert pack_bytes((b"ab", b"ab", b"ab", b"abc")) is None
    assert pack_bytes((b"", b"", b"", b"")) is None


@pytest.mark.parametrize(
    ("unpack", "data", "message"),
    [
        (unpack_ints, b"", "bad format"),
        (unpack_ints, b"x\x01", "bad format b'x'"),
        (unpack_ints, b"H\x01\x02\x03", "3 bytes is not a whole number of 2-byte items"),
        (unpack_bytes, b"\x00", "width 0"),
        (unpack_bytes, b"\x02abc", "do not hold items of width 2"),
    ],
)
def test_bad_packed_arrays(unpack: object, data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        unpack(data)  # type: ignore[operator]


def test_readers_accept_plain_and_packed_forms() -> None:
    head = header_map()
    code = head["kinds"]["load_failed"]
    rows = [
        [code, 2, 1, 0, [1, 2, 3, 4, 5], [b"k" * 4] * 4, ""],
        [code, 2, 2, 0, pack_ints((1, 2, 3, 4, 5)), pack_bytes((b"k" * 4,) * 4), "corrupt"],
    ]
    events = [r.event for r in read_all(log(head, [0, 0, rows]))[1]]
    assert events[0] == ev.LoadFailed(job_id=1, block_ids=(1, 2, 3, 4, 5), keys=(b"kkkk",) * 4)
    assert events[1] == ev.LoadFailed(job_id=2, block_ids=(1, 2, 3, 4, 5), keys=(b"kkkk",) * 4, reason="corrupt")


# --- old layouts ------------------------------------------------------------


def test_an_old_store_failed_row_is_read_by_the_headers_layout_and_upcast() -> None:
    head = header_map()
    head["layouts"]["store_failed"] = [1, [["job_id", "int"], ["worker_index", "int"]]]
    code = head["kinds"]["store_failed"]
    data = log(head, [0, 0, [[code, 1, 7, 2]]])
    assert read_all(data)[1] == [EventRecord(seq=0, step_index=0, event=ev.StoreFailed(job_id=7, worker_index=2))]


def test_an_old_cache_reset_keeps_what_the_device_held() -> None:
    """v1 resets left device contents and request keys alone; replaying an old log must too."""
    head = header_map()
    head["layouts"]["cache_reset"] = [1, [["epoch", "int"]]]
    data = log(head, [0, 0, [[head["kinds"]["cache_reset"], 1, 4]]])
    (record,) = read_all(data)[1]
    assert record.event == ev.CacheReset(epoch=4, forget_device=False, rekeyed=False)


def test_a_v2_cache_reset_empties_the_tiers_below_host_memory() -> None:
    """v2 resets always dropped what the lower tiers held: replayed today they still do."""
    head = header_map()
    head["layouts"]["cache_reset"] = [2, [["epoch", "int"], ["forget_device", "bool"], ["rekeyed", "bool"]]]
    data = log(head, [0, 0, [[head["kinds"]["cache_reset"], 2, 5, True, False]]])
    (record,) = read_all(data)[1]
    assert record.event == ev.CacheReset(epoch=5, forget_device=True, rekeyed=False, keep_lower=False)


def test_old_layouts_resolve_strings_and_packed_arrays() -> None:
    """An old row reaches the upcasters in JSON form: table strings resolved,
    packed arrays unpacked into lists, bytes as hex."""
    strings = Strings()
    strings.encode("req")
    assert json_form_decoder("str")(0, strings) == "req"
    assert json_form_decoder("tuple[tuple[int]]")(((1, 2), pack_ints((3, 4, 5, 6))), strings) == [[1, 2], [3, 4, 5, 6]]
    assert json_form_decoder("tuple[bytes]")(pack_bytes((b"\x01",) * 4), strings) == ["01"] * 4
    assert json_form_decoder("tuple[str]")(pack_ints((0, 0, 0, 0)), strings) == ["req"] * 4


# --- errors ---------------------------------------------------------------


def fails(data: bytes | list[bytes], message: str, seq: int | None) -> LogError:
    with pytest.raises(LogError, match=message) as caught:
        read_all(data)
    assert caught.value.seq == seq
    if seq is not None:
        assert str(caught.value).startswith(f"seq {seq}: ")
    return caught.value


def three_steps() -> tuple[bytes, list[bytes], Stream]:
    """A log of three steps (seq 0-4, 5-8, 9 with a digest after each), and its
    stream, to append frames that continue it."""
    records = records_of([list(EXAMPLE_EVENTS.values())[:5], list(EXAMPLE_EVENTS.values())[5:9], [
        EXAMPLE_EVENTS["cache_reset"]]], 1)
    strings = Strings()
    data = encode_binary_header(HEADER)
    for step in (records[:6], records[6:11], records[11:]):
        data += encode_binary_frame(step[0].seq, step[0].step_index, step, strings=strings)
    assert read_all(data)[1] == records
    return data, split_frames(data), Stream(strings.stream)


def test_flipped_byte_is_a_crc_error_naming_the_frames_first_seq() -> None:
    data, frames, _stream = three_steps()
    where = len(data) - 8 - len(frames[-1]) - 8 - len(frames[-2]) // 2  # inside the second step's frame
    corrupt = data[:where] + bytes([data[where] ^ 0x10]) + data[where + 1 :]
    fails(corrupt, "corrupt: CRC mismatch in frame at byte", 5)


def test_truncated_frame() -> None:
    data, frames, _stream = three_steps()
    fails(data[:-3], r"truncated: frame at byte \d+ has \d+ of \d+ bytes", 9)


def test_truncated_frame_head() -> None:
    data, frames, _stream = three_steps()
    fails(data[: len(data) - len(frames[-1]) - 5], "truncated: frame head at byte .* has 3 of 8 bytes", 9)


def test_a_frame_length_beyond_reason_is_corruption() -> None:
    data, _frames, _stream = three_steps()
    fails(data + struct.pack("<II", 1 << 31, 0), "corrupt: frame at byte .* claims", 10)


def test_bad_msgpack_with_a_good_crc() -> None:
    data, _frames, stream = three_steps()
    fails(data + stream.frame(b"\xc1"), "corrupt: bad msgpack", 10)


def test_a_payload_that_is_not_the_zstd_stream() -> None:
    data, _frames, _stream = three_steps()
    fails(data + frame(b"S" + b"\xff" * 16), r"corrupt: bad zstd block", 10)
    fails(data + frame(b"Q" + b"\xff" * 16), r"corrupt: unknown frame type 81", 10)


def test_bad_frame_shape() -> None:
    for step, message in (
        ({"seq": 10}, r"corrupt: a frame must be \[first_seq, step_index, \[rows\]\]"),
        ([10, 3, ["x"]], "corrupt: bad row 'x'"),
        ([10, 3, [[0, "ab"]]], "corrupt: bad digest row"),
    ):
        data, _frames, stream = three_steps()
        fails(data + stream.frame(step), message, 10)


def test_seq_gap_from_a_lost_frame() -> None:
    """In version 1 each frame stands alone, so a lost one shows as a gap."""
    frames = [msgpack.packb(step) for step in ([0, 0, [[1, 1, "a", 1, []]]], [1, 1, [[10, 1, 0]]], [2, 2, []])]
    data = MAGIC_V1 + frame(v1_header_map(1)) + frame(frames[0]) + frame(frames[2])
    fails(data, r"seq gap: seq 2 follows seq 0, 1 record\(s\) lost", 1)


def test_a_lost_frame_breaks_the_stream() -> None:
    """In version 2 a later block may refer back into a lost one: the log reads as
    corrupt from there (never as other events)."""
    records = records_of([[EXAMPLE_EVENTS["request_added"]]] * 3 + [[EXAMPLE_EVENTS["request_added"],
                                                                      EXAMPLE_EVENTS["request_aborted"]]])
    data = encode_binary(HEADER, records)
    frames = split_frames(data)
    lost = MAGIC + b"".join(frame(f) for f in [frames[0], frames[1], frames[3], frames[4]])
    with pytest.raises(LogError) as caught:
        read_all(lost)
    assert caught.value.seq == 1


def test_step_index_never_goes_back() -> None:
    data, _frames, stream = three_steps()
    fails(data + stream.frame([10, 1, []]), "step_index 1 goes back from 2", 10)


def test_missing_header() -> None:
    fails(b"", r"missing header: not a kvledger binary log \(bad magic\)", None)
    fails(b'{"kind": "header"}\n', "bad magic", None)
    fails(MAGIC, "missing header: the log ends after its magic", None)


def test_newer_binary_format() -> None:
    fails(MAGIC_PREFIX + b"\x04", r"binary format version 4 is newer than this reader knows \(3\)", None)
    fails(MAGIC_PREFIX + b"\x00", r"binary format version 0 does not exist", None)


def test_unknown_compression() -> None:
    head = header_map()
    head["compression"] = "lz4"
    fails(MAGIC + frame(head), "header: unknown compression 'lz4'", None)
    del head["compression"]
    fails(MAGIC + frame(head), "header: missing key 'compression'", None)


# --- version 1: uncompressed frames, still read ------------------------------


def v1_header_map(version: int = 1) -> dict:
    """The header map of a version-1 (or, with `version` 2, version-2) log."""
    head = header_map()
    del head["snapshot_interval_events"]
    if version == 1:
        del head["compression"]
    return head


def test_the_committed_version_1_log_decodes() -> None:
    """Written by the version-1 writer (before compression): every kind, packed
    arrays, string references and digests, as its JSONL twin says."""
    data = (FIXTURES / "format_v1.kvlog").read_bytes()
    assert data.startswith(MAGIC_V1)
    header, records = read_all(data)
    with (FIXTURES / "format_v1.expected.jsonl").open("rb") as lines:
        expected_header, expected = read_jsonl(lines)
        assert (header, records) == (expected_header, list(expected))
    later = {"tier_keys_found", "block_hashes_rewound", "tier_lookup_failed",  # kinds added after the version-1
             "restore_costs_measured", "restore_budgeted", "tier_pressure", "first_generation_hashes"}  # writer
    assert {r.event.kind for r in records if isinstance(r, EventRecord)} == set(SCHEMAS) - later
    assert any(isinstance(r, DigestRecord) for r in records)


def test_version_1_frames_are_read_without_compression() -> None:
    head = v1_header_map(1)
    code = head["kinds"]["cache_reset"]
    data = MAGIC_V1 + frame(head) + frame([0, 0, [[code, 3, 3, True, False, False]]]) + frame([1, 2, [[code, 3, 4, True, True, False]]])
    assert [r.event for r in read_all(data)[1]] == [ev.CacheReset(epoch=3), ev.CacheReset(epoch=4, rekeyed=True)]
    fails(MAGIC_V1 + frame(v1_header_map(2)), "header: unknown key 'compression'", None)


def test_bad_header_config_names_the_key() -> None:
    head = header_map()
    head["config"]["num_gpu_blocks"] = 5
    fails(MAGIC + frame(head), "header: config: unknown config keys: num_gpu_blocks", None)
    del head["config"]["num_gpu_blocks"], head["config"]["num_tier_slots"]
    fails(MAGIC + frame(head), "header: config: .*num_tier_slots", None)


def test_schema_version_too_new() -> None:
    head = header_map()
    head["schema_version"] = LOG_SCHEMA_VERSION + 1
    fails(MAGIC + frame(head), f"written by kvledger {head['engine_version']} in log schema {LOG_SCHEMA_VERSION + 1}; "
                               f"this build reads schemas 1-{LOG_SCHEMA_VERSION}", None)


def test_header_needs_kinds_and_layouts() -> None:
    head = header_map()
    del head["layouts"]
    fails(MAGIC + frame(head), "header: missing key 'layouts'", None)
    head = header_map()
    head["kinds"]["cache_reset"] = 0
    fails(MAGIC + frame(head), "header: bad kind code 'cache_reset': 0", None)


def test_a_changed_layout_without_a_version_bump_is_refused() -> None:
    head = header_map()
    head["layouts"]["load_failed"][1].reverse()
    fails(MAGIC + frame(head), "header: load_failed v2: layout .* differs from this reader's", None)


def test_unknown_kind_fails_when_a_row_uses_it() -> None:
    head = header_map()
    head["kinds"]["request_teleported"] = 99
    head["layouts"]["request_teleported"] = [1, [["request_id", "str"]]]
    stream = Stream()
    data = MAGIC + frame(head) + stream.frame([0, 0, [[1, 1, "r", 1, []]]])
    assert len(read_all(data)[1]) == 1, "listing a kind is harmless"
    fails(data + stream.frame([1, 0, [[99, 1, "r"]]]), "record seq 1: unknown kind 'request_teleported'", 1)


def test_unknown_kind_code() -> None:
    fails(log(header_map(), [0, 0, [[77, 1]]]), r"unknown kind code 77 \(not in the header\)", 0)


def test_record_version_too_new() -> None:
    head = header_map()
    head["layouts"]["store_failed"][0] = 4
    code = head["kinds"]["store_failed"]
    data = log(head, [0, 0, [[code, 4, 1, 0, [], ""]]])
    fails(data, r"store_failed: v4 is newer than this reader knows \(v3\)", 0)


def test_row_version_must_match_the_header() -> None:
    head = header_map()
    code = head["kinds"]["store_completed"]
    fails(log(head, [0, 0, [[code, 2, 1, 0]]]), "row version .* differs from the header's v1", 0)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (["store_completed", 1, "1", 0], "store_completed.job_id: expected int, got str '1'"),
        (["store_completed", 1, 1], "store_completed: row has 1 fields, the layout 2"),
        (["request_aborted", 1, 5], r"request_aborted.request_id: string reference 5 is not in the table \(0 entries\)"),
        (["request_aborted", 1, b"r"], "request_aborted.request_id: expected str, got bytes"),
        (["load_failed", 2, 1, 0, b"Z", [], ""], "load_failed.block_ids: packed ints: bad format"),
        (["load_failed", 2, 1, 0, [], [1], ""], "load_failed.keys: expected bytes, got int"),
        (["blocks_touched", 1, "r", [[1, "2"]]], "blocks_touched.block_ids: expected int, got str"),
    ],
)
def test_bad_rows_name_kind_field_and_seq(row: list, message: str) -> None:
    head = header_map()
    row = [head["kinds"][row[0]], *row[1:]]
    fails(log(head, [0, 0, [row]]), "record seq 0: " + message, 0)


def test_step_scheduled_must_belong_to_its_frames_step() -> None:
    head = header_map()
    code = head["kinds"]["step_scheduled"]
    data = log(head, [0, 3, [[code, 2, 4, [], [], [], 0]]])
    fails(data, "step_scheduled of step 4 recorded under step_index 3", 0)


# --- size -----------------------------------------------------------------


def _bytes_per_event(steps: list[list[ev.Event]]) -> tuple[float, float, int]:
    records = records_of(steps)
    binary = encode_binary(HEADER, records)
    assert read_all(binary)[1] == records
    return len(binary) / len(records), len(encode_jsonl(HEADER, records)) / len(records), len(records)


def test_binary_log_size_on_a_realistic_trace() -> None:
    """64 running requests, sha256 (32-byte) block hashes. The first 200 steps are
    dominated by the cold start (64 prompts' hashes at once); over 1000 steps the
    steady state shows. The target is <= 64 bytes per event on the latter."""
    steps = realistic_trace(num_running=64, num_steps=1000)
    short, steady = _bytes_per_event(steps[:200]), _bytes_per_event(steps)
    for name, (binary, jsonl, events) in (("200 steps", short), ("1000 steps", steady)):
        print(f"\n{name}: {events} events, binary {binary:.1f} B/event, jsonl {jsonl:.1f} B/event")
    assert steady[0] <= 64


# --- the generated row readers ------------------------------------------------

_ODD_VALUES = st.sampled_from([0, -1, 7, True, None, "", "x", b"", b"\x01\x02", [], [1, "a"], [[1, 2]], (b"Z",),
                               pack_ints((1, 2, 3, 4)), 2**70, 1.5])


@given(kind=st.sampled_from(sorted(SCHEMAS)), position=st.integers(0, 8), value=_ODD_VALUES,
       cut=st.booleans())
def test_the_generated_reader_reads_and_refuses_as_the_field_loop_does(kind: str, position: int, value: object,
                                                                        cut: bool) -> None:
    """Each kind's row reader is generated from its schema for speed; the loop over the
    fields (`_checked_row_reader`) is the reference. On a row of an example event with
    one field replaced (or the row cut short), both build the same event or refuse it
    with the same words."""
    from kvledger.events.log_binary import (
        _ROW_WRITERS,
        _checked_row_reader,
        _current_record_reader,
        _current_row_reader,
    )

    example = EXAMPLE_EVENTS[kind]
    row = _ROW_WRITERS[type(example)](example, Strings())
    index = 2 + position % max(1, len(row) - 2)
    if cut:
        row = row[:index]
    elif index < len(row):
        row[index] = value
    outcomes = []
    for reader in (_current_row_reader(SCHEMAS[kind]), _checked_row_reader(SCHEMAS[kind])):
        try:
            outcomes.append(("event", reader(tuple(row), Strings())))
        except CodecError as exc:
            outcomes.append(("error", str(exc)))
    assert outcomes[0] == outcomes[1]
    # The reader a log's frames are read with: the same event, in its record.
    # (A step_scheduled event is read under its own step: another is refused: test_step_scheduled_must_belong_to_its_frames_step.)
    step_index = getattr(outcomes[1][1], "step_index", 3)
    try:
        record = _current_record_reader(SCHEMAS[kind])(tuple(row), Strings(), 17, step_index)
        assert (record.seq, record.step_index) == (17, step_index)
        outcomes.append(("event", record.event))
    except CodecError as exc:
        outcomes.append(("error", str(exc)))
    assert outcomes[2] == outcomes[1]
