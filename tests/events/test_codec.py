"""Event <-> record: round trips, the record's JSON shape, upcasting, and every rejection."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given

from kvledger.events import types as ev
from kvledger.events.codec import CodecError, from_record, to_record
from kvledger.events.schema import SCHEMAS, value_codecs
from kvledger.events.upcast import UPCASTERS, upcast_store_failed_v1_v2
from tests.strategies import EXAMPLE_EVENTS, events_strategy


@pytest.mark.parametrize("kind", sorted(EXAMPLE_EVENTS))
def test_every_kind_round_trips_through_json(kind: str) -> None:
    event = EXAMPLE_EVENTS[kind]
    record = to_record(event)
    assert record["kind"] == kind and record["v"] == type(event).version
    assert from_record(json.loads(json.dumps(record))) == event


@given(events_strategy())
def test_arbitrary_events_round_trip(event: ev.Event) -> None:
    assert from_record(json.loads(json.dumps(to_record(event)))) == event


def test_record_is_json_ready_with_hex_bytes_and_nested_lists() -> None:
    record = to_record(EXAMPLE_EVENTS["blocks_allocated"])
    assert record == {
        "kind": "blocks_allocated",
        "v": 1,
        "request_id": "cmpl-7f3a-0",
        "block_ids": [[13, 14], [13, 14]],
        "num_external_tokens": 16,
    }
    hashes = to_record(EXAMPLE_EVENTS["request_added"])["block_hashes"]
    assert hashes == ["01" * 32, "02" * 32, "03" * 32]
    assert list(to_record(EXAMPLE_EVENTS["step_scheduled"])) == [
        "kind", "v", "step_index", "request_ids", "num_computed_tokens", "num_scheduled_tokens", "wall_time_us",
    ]


def test_store_failed_v1_upcasts_to_all_keys() -> None:
    event = from_record({"kind": "store_failed", "v": 1, "job_id": 5, "worker_index": 2})
    assert event == ev.StoreFailed(job_id=5, worker_index=2, keys=())


def test_failures_before_reasons_upcast_to_no_reason_given() -> None:
    assert from_record({"kind": "store_failed", "v": 2, "job_id": 5, "worker_index": 1, "keys": ["ab"]}) == \
        ev.StoreFailed(job_id=5, worker_index=1, keys=(b"\xab",), reason="")
    assert from_record({"kind": "load_failed", "v": 1, "job_id": 6, "worker_index": 0, "block_ids": [3],
                        "keys": ["cd"]}) == \
        ev.LoadFailed(job_id=6, block_ids=(3,), keys=(b"\xcd",), reason="")
    assert from_record({"kind": "store_failed", "v": 1, "job_id": 5, "worker_index": 0}).reason == ""  # through two upcasters


def test_step_scheduled_v1_upcasts_to_no_recorded_time() -> None:
    event = from_record({"kind": "step_scheduled", "v": 1, "step_index": 3, "request_ids": ["a"],
                         "num_computed_tokens": [0], "num_scheduled_tokens": [16]})
    assert event == ev.StepScheduled(step_index=3, request_ids=["a"], num_computed_tokens=[0],
                                     num_scheduled_tokens=[16], wall_time_us=0)
    assert to_record(event)["v"] == 2


def test_upcaster_does_not_mutate_its_argument() -> None:
    fields = {"job_id": 5, "worker_index": 0}
    assert upcast_store_failed_v1_v2(fields) == {"job_id": 5, "worker_index": 0, "keys": []}
    assert fields == {"job_id": 5, "worker_index": 0}


def test_a_version_1_cache_reset_reads_as_keeping_device_contents() -> None:
    assert from_record({"kind": "cache_reset", "v": 1, "epoch": 2}) == ev.CacheReset(
        epoch=2, forget_device=False, rekeyed=False)


def test_a_bool_field_refuses_an_int() -> None:
    with pytest.raises(CodecError, match="rekeyed.*expected bool, got int 1"):
        from_record({"kind": "cache_reset", "v": 2, "epoch": 2, "forget_device": True, "rekeyed": 1})


def test_every_older_version_has_an_upcaster_chain() -> None:
    for kind, schema in SCHEMAS.items():
        for version in range(1, schema.version):
            assert (kind, version) in UPCASTERS, f"{kind} v{version} cannot be read"
    for kind, version in UPCASTERS:
        assert version < SCHEMAS[kind].version


def test_missing_upcaster_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(UPCASTERS, ("store_failed", 1))
    with pytest.raises(CodecError, match="store_failed: no upcaster from v1 to v2"):
        from_record({"kind": "store_failed", "v": 1, "job_id": 5, "worker_index": 0})


def _record(**changes: object) -> dict:
    record = to_record(EXAMPLE_EVENTS["load_failed"])
    record.update(changes)
    return {k: v for k, v in record.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize(
    ("record", "kind", "field", "message"),
    [
        ({"kind": "request_teleported", "v": 1}, None, None, "unknown kind 'request_teleported'"),
        ({"v": 1, "job_id": 1}, None, None, "unknown kind None"),
        (_record(v=3), "load_failed", None, "v3 is newer than this reader knows (v2)"),
        (_record(v=0), "load_failed", "v", "version must be an int >= 1"),
        (_record(v="1"), "load_failed", "v", "version must be an int >= 1"),
        (_record(keys=_DROP), "load_failed", "keys", "missing field"),
        (_record(colour="red"), "load_failed", "colour", "unknown field"),
        (_record(keys=_DROP, colour="red"), "load_failed", "keys", "missing field"),
        (_record(job_id="44"), "load_failed", "job_id", "expected int, got str '44'"),
        (_record(job_id=True), "load_failed", "job_id", "expected int, got bool"),
        (_record(job_id=4.0), "load_failed", "job_id", "expected int, got float"),
        (_record(block_ids=[13, "14"]), "load_failed", "block_ids", "expected int, got str"),
        (_record(block_ids=13), "load_failed", "block_ids", "expected array, got int"),
        (_record(keys=["0g"]), "load_failed", "keys", "bad hex '0g'"),
        (_record(keys=["abc"]), "load_failed", "keys", "bad hex 'abc'"),
        (_record(keys=["AB"]), "load_failed", "keys", "not lowercase"),
        (_record(keys=["ab cd"]), "load_failed", "keys", "not lowercase without spaces"),
        (_record(keys=[b"\x01"]), "load_failed", "keys", "expected lowercase hex str, got bytes"),
    ],
)
def test_bad_records_are_rejected_naming_kind_and_field(
    record: dict, kind: str | None, field: str | None, message: str
) -> None:
    with pytest.raises(CodecError, match=re.escape(message)) as caught:
        from_record(record)
    assert (caught.value.kind, caught.value.field) == (kind, field)
    if kind and field:
        assert str(caught.value).startswith(f"{kind}.{field}: ")


def test_event_constructor_errors_name_the_kind() -> None:
    record = to_record(EXAMPLE_EVENTS["step_scheduled"])
    record["num_scheduled_tokens"] = [1]
    with pytest.raises(CodecError, match="step_scheduled: step_scheduled columns must have equal lengths"):
        from_record(record)


def test_wrong_nesting_is_rejected() -> None:
    record = to_record(EXAMPLE_EVENTS["blocks_touched"])
    record["block_ids"] = [11, 12]
    with pytest.raises(CodecError, match="blocks_touched.block_ids: expected array, got int"):
        from_record(record)


def test_a_record_must_be_a_mapping() -> None:
    with pytest.raises(CodecError, match="record must be a mapping, got list"):
        from_record(["store_completed", 1, 3, 0])  # type: ignore[arg-type]


def test_non_events_are_not_encoded() -> None:
    with pytest.raises(CodecError, match="not an event: dict"):
        to_record({"kind": "store_completed"})  # type: ignore[arg-type]


def test_field_types_without_a_log_form_fail_at_import_time() -> None:
    with pytest.raises(TypeError, match="has no log form"):
        value_codecs(float)
    with pytest.raises(TypeError, match="has no log form"):
        value_codecs(tuple[int, str])


def test_a_workers_report_of_a_job_s_end_is_one_model() -> None:
    from kvledger.events.types import transfer_report

    assert transfer_report(3, 1, load=False) == ev.StoreCompleted(job_id=3, worker_index=1)
    assert transfer_report(3, 1, load=False, failed=True) == ev.StoreFailed(job_id=3, worker_index=1)
    assert transfer_report(3, 0, load=False, keys=[b"k"]) == ev.StoreFailed(job_id=3, worker_index=0, keys=(b"k",))
    assert transfer_report(4, 0, load=True) == ev.LoadCompleted(job_id=4, worker_index=0)
    assert transfer_report(4, 0, load=True, block_ids=[7], keys=[b"k"]) == ev.LoadFailed(
        job_id=4, worker_index=0, block_ids=(7,), keys=(b"k",))
