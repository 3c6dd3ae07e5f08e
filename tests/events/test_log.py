"""The JSONL log: line shapes, round trips, the committed old-version fixture, and
every documented error naming its line."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.events import types as ev
from kvledger.events.config import RULES, EngineConfig, StoreJobs
from kvledger.events.log_binary import encode_binary, read_binary
from kvledger.events.log_records import (
    LOG_SCHEMA_VERSION,
    DigestRecord,
    EventRecord,
    LogError,
    LogHeader,
    encode_jsonl,
    encode_jsonl_header,
    encode_jsonl_record,
    read_jsonl,
)
from tests.events.logs import CONFIG, DIGEST, EXAMPLE_RECORDS, HEADER, records_of
from tests.strategies import EXAMPLE_EVENTS, events_strategy

GOLDEN = Path(__file__).parent.parent / "golden"


def jsonl(records: list, header: LogHeader = HEADER) -> list[bytes]:
    return [encode_jsonl_header(header), *(encode_jsonl_record(r) for r in records)]


def read_all(lines: list[bytes]) -> tuple[LogHeader, list]:
    header, records = read_jsonl(lines)
    return header, list(records)


def test_header_line() -> None:
    line = json.loads(encode_jsonl_header(HEADER))
    assert line == {
        "kind": "header",
        "schema_version": LOG_SCHEMA_VERSION,
        "engine_version": "0.1.0",
        "digest_interval": 4,
        "config": CONFIG.to_dict(),
    }


def test_event_and_digest_lines() -> None:
    event = EventRecord(seq=3, step_index=2, event=EXAMPLE_EVENTS["store_completed"])
    line = encode_jsonl_record(event)
    assert line == b'{"v":1,"seq":3,"kind":"store_completed","step_index":2,"job_id":41,"worker_index":1}\n'
    digest = encode_jsonl_record(DigestRecord(seq=4, step_index=2, digest=DIGEST))
    assert json.loads(digest) == {"kind": "state_digest", "seq": 4, "step_index": 2, "digest": DIGEST}


def test_step_scheduled_shares_its_step_index_with_the_record() -> None:
    step = EXAMPLE_EVENTS["step_scheduled"]
    line = json.loads(encode_jsonl_record(EventRecord(seq=0, step_index=7, event=step)))
    assert line["step_index"] == 7 and list(line).count("step_index") == 1
    with pytest.raises(ValueError, match="step_scheduled of step 7 recorded under step_index 8"):
        EventRecord(seq=0, step_index=8, event=step)


def test_every_kind_round_trips() -> None:
    header, records = read_all(jsonl(EXAMPLE_RECORDS))
    assert header == HEADER
    assert records == EXAMPLE_RECORDS
    assert {r.event.kind for r in records if isinstance(r, EventRecord)} == set(ev.KIND_TO_TYPE)


@given(st.lists(st.lists(events_strategy(), max_size=4), max_size=4), st.integers(0, 3))
def test_arbitrary_logs_round_trip(steps: list[list[ev.Event]], digest_every: int) -> None:
    records = records_of(steps, digest_every)
    assert read_all(jsonl(records)) == (HEADER, records)


def test_old_store_failed_v1_fixture_decodes_with_all_keys() -> None:
    with (GOLDEN / "old_store_failed_v1.jsonl").open("rb") as file:
        header, records = read_jsonl(file)
        events = [r.event for r in records]
    # Recorded before `store_jobs`: a header without it reads as one job per request.
    assert header.config == attrs.evolve(CONFIG, store_jobs=StoreJobs.REQUEST)
    assert ev.StoreFailed(job_id=0, worker_index=0, keys=()) in events
    assert b'"kind":"store_failed","step_index":1,"job_id":0,"worker_index":0}' in (
        GOLDEN / "old_store_failed_v1.jsonl"
    ).read_bytes(), "the fixture must keep its v1 record without keys"


# --- errors --------------------------------------------------------------


def fails(lines: list[bytes], message: str, line: int) -> LogError:
    with pytest.raises(LogError, match=message) as caught:
        read_all(lines)
    assert caught.value.line == line
    assert str(caught.value).startswith(f"line {line}: ")
    return caught.value


@pytest.mark.parametrize("store_jobs", list(StoreJobs))
def test_store_jobs_round_trip_and_a_config_without_it_is_an_older_logs(store_jobs: StoreJobs) -> None:
    config = attrs.evolve(CONFIG, store_jobs=store_jobs)
    data = config.to_dict()
    assert EngineConfig.from_dict(data) == config
    # Only the option's new default is written, so an older log's config (and digests) read back unchanged.
    assert ("store_jobs" in data) is (store_jobs is StoreJobs.STEP)
    assert EngineConfig.from_dict({k: v for k, v in data.items() if k != "store_jobs"}).store_jobs is StoreJobs.REQUEST


def test_truncated_last_line() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines[-1] = lines[-1][:-9]
    fails(lines, "truncated: the last line has no newline", len(lines))


def test_last_line_without_newline_is_truncated_even_if_it_parses() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines[-1] = lines[-1].rstrip(b"\n")
    fails(lines, "truncated", len(lines))


def test_bad_json() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines[3] = lines[3].replace(b'"kind"', b'"kind', 1)
    fails(lines, "corrupt: bad JSON", 4)


def test_a_line_must_be_an_object() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines[2] = b"[1, 2]\n"
    fails(lines, "corrupt: expected a JSON object, got list", 3)


def test_a_line_nested_too_deeply_is_corrupt_not_a_crash() -> None:
    """json once raised RecursionError out of the reader here."""
    lines = jsonl(EXAMPLE_RECORDS)
    lines[2] = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    fails(lines, "corrupt: JSON nested too deeply", 3)


def test_a_kind_that_is_not_a_string_is_corrupt() -> None:
    """Found by the log fuzzer: a list here once raised TypeError out of the reader."""
    lines = jsonl(EXAMPLE_RECORDS)
    lines[2] = lines[2].replace(b'"kind":"block_hashes_appended"', b'"kind":[]')
    fails(lines, "corrupt: a record's kind must be a string, got \\[\\]", 3)


def test_unknown_kind() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines[2] = lines[2].replace(b'"kind":"block_hashes_appended"', b'"kind":"hashes_grown"')
    fails(lines, "unknown kind 'hashes_grown'", 3)


def test_record_version_too_new() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines[1] = lines[1].replace(b'"v":1', b'"v":9')
    error = fails(lines, r"request_added: v9 is newer than this reader knows \(v1\)", 2)
    assert "request_added" in str(error)


def test_bad_field_names_kind_and_field() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines[1] = lines[1].replace(b'"num_prompt_tokens":50', b'"num_prompt_tokens":"50"')
    fails(lines, "request_added.num_prompt_tokens: expected int, got str", 2)


def test_seq_gap_means_lost_records() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    del lines[4]
    fails(lines, r"seq gap: seq 4 follows seq 2, 1 record\(s\) lost", 5)


def test_repeated_seq() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines.insert(4, lines[3])
    fails(lines, r"seq 2 repeats or goes back \(seq 3 was due\)", 5)


def test_step_index_never_goes_back() -> None:
    records = [
        EventRecord(seq=0, step_index=3, event=EXAMPLE_EVENTS["cache_reset"]),
        EventRecord(seq=1, step_index=2, event=EXAMPLE_EVENTS["cache_reset"]),
    ]
    fails(jsonl(records), "step_index 2 goes back from 3", 3)


def test_digest_seq_is_the_number_of_events_before_it() -> None:
    records = [
        EventRecord(seq=0, step_index=0, event=EXAMPLE_EVENTS["cache_reset"]),
        DigestRecord(seq=0, step_index=0, digest=DIGEST),
    ]
    fails(jsonl(records), r"seq 0 repeats or goes back \(seq 1 was due\)", 3)


def test_bad_digest() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    digest_line = next(i for i, line in enumerate(lines) if b"state_digest" in line)
    lines[digest_line] = lines[digest_line].replace(DIGEST.encode(), b"XYZ")
    fails(lines, "state_digest: digest must be lowercase hex or 'part/parts:hex', got 'XYZ'", digest_line + 1)
    for bad in ("AB", "2/2:ab", "1/0:ab", "-1/2:ab", "01/2:ab", "1/2:", "1/2:AB", "1/2/3:ab", "1:ab"):
        with pytest.raises(LogError, match="digest must be lowercase hex or 'part/parts:hex'"):
            encode_jsonl_record(DigestRecord(seq=0, step_index=0, digest=bad))


@pytest.mark.parametrize("digest", ["00ff", "0/1:00ff", "3/16:a66397a46f3204f0ff7e85d601bf4066"])
def test_digest_forms_round_trip(digest: str) -> None:
    """Full digests (schema 1) and part digests (schema 2) both survive both forms."""
    records = [*EXAMPLE_RECORDS[:1], DigestRecord(seq=1, step_index=EXAMPLE_RECORDS[0].step_index, digest=digest)]
    _, decoded = read_jsonl(encode_jsonl(HEADER, records).splitlines(keepends=True))
    assert [r.digest for r in decoded if type(r) is DigestRecord] == [digest]
    _, decoded = read_binary(encode_binary(HEADER, records))
    assert [r.digest for r in decoded if type(r) is DigestRecord] == [digest]


def test_missing_header_in_an_empty_log() -> None:
    fails([], "missing header: the log is empty", 1)


def test_missing_header_when_line_1_is_a_record() -> None:
    fails(jsonl(EXAMPLE_RECORDS)[1:], "missing header: line 1 is a 'request_added' record", 1)


def _header_line(**changes: object) -> bytes:
    header = json.loads(encode_jsonl_header(HEADER))
    header.update(changes)
    return (json.dumps({k: v for k, v in header.items() if v is not None}) + "\n").encode()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (_header_line(config={**CONFIG.to_dict(), "num_gpu_blocks": 7}), "config: unknown config keys: num_gpu_blocks"),
        (_header_line(config={**CONFIG.to_dict(), "num_tier_slots": -5}), "config: num_tier_slots must be a positive"),
        (
            _header_line(config={k: v for k, v in CONFIG.to_dict().items() if k != "hash_block_size"}),
            "config: .*'hash_block_size'",
        ),
        (_header_line(config={**CONFIG.to_dict(), "groups": [{"group_id": 0}]}), "config: .*'kind'"),
        (_header_line(config={**CONFIG.to_dict(), "policy": "fifo"}), "config: .*'fifo'"),
        (_header_line(config={**CONFIG.to_dict(), "store_jobs": "batch"}), "config: .*'batch'"),
        (_header_line(config=[1]), "config: config must be a mapping"),
        # Impossible sizes are refused before anything is allocated (they once overflowed,
        # filled memory, or ran for minutes).
        (_header_line(config={**CONFIG.to_dict(), "num_tier_slots": 10**30}), "config: num_tier_slots must be at most"),
        (_header_line(config={**CONFIG.to_dict(), "num_device_blocks": 2**31}), "config: num_device_blocks must be at most"),
        (_header_line(config={**CONFIG.to_dict(), "world_size": 10**9}), "config: world_size must be at most"),
        (_header_line(schema_version=LOG_SCHEMA_VERSION + 1),
         rf"written by kvledger 0.1.0 in log schema {LOG_SCHEMA_VERSION + 1}; this build reads schemas "
         rf"1-{LOG_SCHEMA_VERSION}: replay it with that build or a later one"),
        (_header_line(config={**CONFIG.to_dict(), "rules": RULES + 1}, commit="abc123"),
         rf"written by kvledger 0.1.0 \(commit abc123\) under engine rules {RULES + 1}; this build reads "
         rf"rules 1-{RULES}: replay it with that build or a later one \(git checkout abc123 && pip install \.\)"),
        (_header_line(config={**CONFIG.to_dict(), "rules": -1}), "config: rules must be an int from 1"),
        (_header_line(commit=7), "commit must be a str"),
        (_header_line(schema_version="1"), "schema_version must be an int"),
        (_header_line(engine_version=None), "missing key 'engine_version'"),
        (_header_line(digest_interval=-1), "digest_interval must be an int >= 0"),
        (_header_line(compression="zstd"), "unknown key 'compression'"),
    ],
)
def test_malformed_header(line: bytes, message: str) -> None:
    error = fails([line, *jsonl(EXAMPLE_RECORDS)[1:]], f"header: {message}", 1)
    assert error.seq is None


def test_errors_surface_lazily_after_good_records() -> None:
    lines = jsonl(EXAMPLE_RECORDS)
    lines[5] = b"{not json}\n"
    header, records = read_jsonl(lines)
    assert [next(records) for _ in range(4)] == EXAMPLE_RECORDS[:4]
    with pytest.raises(LogError, match="line 6: corrupt"):
        next(records)


def test_log_error_message_names_source_line_and_seq() -> None:
    assert str(LogError("boom", line=3, source="a.log")) == "a.log: line 3: boom"
    assert str(LogError("boom", seq=12).at("b.bin")) == "b.bin: seq 12: boom"
    assert isinstance(LogError("x"), ValueError)


def test_headers_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match="digest_interval must be an int >= 0, got -1"):
        LogHeader(engine_version="0.1.0", config=CONFIG, digest_interval=-1)
    with pytest.raises(TypeError, match="engine_version"):
        LogHeader(engine_version=1, config=CONFIG, digest_interval=0)  # type: ignore[arg-type]
