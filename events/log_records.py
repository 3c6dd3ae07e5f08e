"""The event log's model (header, records, errors) and its JSONL form.

A log is a header, then records in `seq` order: each event record carries the
number of events before it (`seq`) and the scheduler step it belongs to; a
digest record carries a state digest taken after the `seq` events before it,
so a replay can name the first step where it diverges. Only inputs are
logged; effects are recomputed on replay.

JSONL: line 1 is `{"kind": "header", ...}`; then one record per line,
`{"v":1,"seq":n,"kind":"...","step_index":s,...fields}` for events and
`{"kind":"state_digest","seq":n,"step_index":s,"digest":"hex"}` for digests.
The reader works on an iterable of byte lines (an open file will do) and
stops at the first problem with a `LogError` naming the line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Union

import attrs

from kvledger.events.codec import CodecError, from_record, write_fields
from kvledger.events.config import RULES, RULES_UNRESOLVED, EngineConfig
from kvledger.events.schema import SCHEMAS
from kvledger.events.types import Event

LOG_SCHEMA_VERSION = 2
"""2: digest records hold part digests ("part/parts:hex", see engine.digest); 1: full digests."""
HEADER_KIND = "header"
DIGEST_KIND = "state_digest"
assert HEADER_KIND not in SCHEMAS and DIGEST_KIND not in SCHEMAS

# Kinds whose events have their own `step_index` field (step_scheduled): on a
# JSONL line the record's `step_index` and the event's are one key.
_STEP_FIELD_KINDS = frozenset(kind for kind, schema in SCHEMAS.items() if "step_index" in schema.names)
_HEADER_KEYS = ("schema_version", "engine_version", "digest_interval", "config")
_HEADER_KEYS_OPTIONAL = ("commit",)  # from 0.2.0 on


class LogError(ValueError):
    """A log cannot be read (or a record cannot be written) as it stands.

    `line` (JSONL, 1-based) or `seq` (binary: the first seq of the bad frame)
    locates the problem, and `source` (a path, set by the file adapter) the
    log; the message names all that are known.
    """

    def __init__(
        self, detail: str, *, line: int | None = None, seq: int | None = None, source: str | None = None
    ) -> None:
        self.detail, self.line, self.seq, self.source = detail, line, seq, source
        where = [source] if source is not None else []
        if line is not None:
            where.append(f"line {line}")
        if seq is not None:
            where.append(f"seq {seq}")
        super().__init__(": ".join([*where, detail]))

    def at(self, source: str) -> LogError:
        """The same error, located in the log `source`."""
        return LogError(self.detail, line=self.line, seq=self.seq, source=source)


def _int_at_least(lowest: int) -> Callable[[object, attrs.Attribute, object], None]:
    def check(_instance: object, attribute: attrs.Attribute, value: object) -> None:
        if type(value) is not int or value < lowest:
            raise ValueError(f"{attribute.name} must be an int >= {lowest}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class LogHeader:
    """What a log was recorded under; a log means nothing without its config."""

    schema_version: int = attrs.field(default=LOG_SCHEMA_VERSION, validator=_int_at_least(1))
    engine_version: str = attrs.field(validator=attrs.validators.instance_of(str))
    config: EngineConfig = attrs.field(validator=attrs.validators.instance_of(EngineConfig))
    digest_interval: int = attrs.field(validator=_int_at_least(0))  # steps between state digests; 0 = none
    # The commit of the build that wrote the log ("" before 0.2.0, which did not record it).
    commit: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    # Whether the header names the config's rules (from 0.2.0 on); else they are a
    # 0.1.0 log's, as its records show them (adapters/log_rules.py).
    rules_recorded: bool = True

    @property
    def writer(self) -> str:
        return writer_words(self.engine_version, self.commit)


def writer_words(engine_version: str, commit: str) -> str:
    """The build that wrote a log, in words: `kvledger 0.2.0 (commit 1a2b3c4d5e6f)`."""
    return f"kvledger {engine_version}" + (f" (commit {commit[:12]})" if commit else "")


def install_words(engine_version: str, commit: str) -> str:
    """How to install that build, from a clone of kvledger's repository."""
    ref = commit.removesuffix("+dirty")[:12] if commit else f"<the tag or commit of release {engine_version}>"
    return f"git checkout {ref} && pip install ."


def newer_words(engine_version: str, commit: str, written: str, reads: str) -> str:
    """A log this build cannot read, refused naming the build that can: `written` says in what
    (`in log schema 3`), `reads` what this build reads (`schemas 1-2`)."""
    return (f"written by {writer_words(engine_version, commit)} {written}; this build reads {reads}: replay it "
            f"with that build or a later one ({install_words(engine_version, commit)})")


def _check_step_index(instance: EventRecord, _attribute: object, step_index: int) -> None:
    own = getattr(instance.event, "step_index", step_index)
    if own != step_index:
        raise ValueError(f"{instance.event.kind} of step {own} recorded under step_index {step_index}")


@attrs.frozen(kw_only=True)
class EventRecord:
    """An event as logged. A step_scheduled event belongs to its own step."""

    seq: int
    step_index: int = attrs.field(validator=_check_step_index)
    event: Event


_new = object.__new__
_set = object.__setattr__


def read_event_record(seq: int, step_index: int, event: Event) -> EventRecord:
    """An EventRecord built past its validator, for a reader that checks a
    step_scheduled event's step itself: a third of the cost, and a log reader
    builds one per event."""
    record = _new(EventRecord)
    _set(record, "seq", seq)
    _set(record, "step_index", step_index)
    _set(record, "event", event)
    return record


@attrs.frozen(kw_only=True)
class DigestRecord:
    """The state digest (hex) after the first `seq` events, at the end of a step."""

    seq: int
    step_index: int
    digest: str


Record = Union[EventRecord, DigestRecord]


def split_digest(value: object) -> tuple[int, int, bytes] | None:
    """A digest record's value as `(part, parts, digest)`: `"part/parts:hex"` is a
    part digest (schema 2), plain `"hex"` a full one (`parts` 0). None if malformed."""
    if type(value) is not str:
        return None
    head, sep, text = value.rpartition(":")
    part = parts = 0
    if sep:
        first, slash, second = head.partition("/")
        if not (slash and first.isdigit() and second.isdigit() and first.isascii() and second.isascii()):
            return None
        part, parts = int(first), int(second)
        if not 0 <= part < parts or f"{part}/{parts}" != head:
            return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    return (part, parts, raw) if raw and raw.hex() == text else None


def join_digest(part: int, parts: int, raw: bytes) -> str:
    return f"{part}/{parts}:{raw.hex()}" if parts else raw.hex()


def is_digest(value: object) -> bool:
    return split_digest(value) is not None


def header_to_dict(header: LogHeader) -> dict:
    data = {
        "schema_version": header.schema_version,
        "engine_version": header.engine_version,
        "digest_interval": header.digest_interval,
        "config": header.config.to_dict(),
    }
    if header.commit:
        data["commit"] = header.commit
    return data


def header_from_dict(data: object, *, extra_keys: Iterable[str] = (), line: int | None = None) -> LogHeader:
    """Check a header mapping; `extra_keys` are the form's own (checked by the caller)."""

    def fail(detail: str) -> LogError:
        return LogError(f"header: {detail}", line=line)

    if not isinstance(data, dict):
        raise fail(f"expected a mapping, got {type(data).__name__}")
    schema_version = data.get("schema_version")
    if type(schema_version) is not int or schema_version < 1:
        raise fail(f"schema_version must be an int >= 1, got {schema_version!r}")
    if schema_version > LOG_SCHEMA_VERSION:
        version, commit = data.get("engine_version"), data.get("commit", "")
        if type(version) is str and type(commit) is str:
            raise fail(newer_words(version, commit, f"in log schema {schema_version}",
                                   f"schemas 1-{LOG_SCHEMA_VERSION}"))
        raise fail(f"schema_version {schema_version} is newer than this reader knows ({LOG_SCHEMA_VERSION})")
    known = {*_HEADER_KEYS, *_HEADER_KEYS_OPTIONAL, *extra_keys}
    missing = [key for key in (*_HEADER_KEYS, *extra_keys) if key not in data]
    if missing:
        raise fail(f"missing key {missing[0]!r}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise fail(f"unknown key {unknown[0]!r}")
    if type(data["engine_version"]) is not str:
        raise fail(f"engine_version must be a str, got {data['engine_version']!r}")
    if type(data["digest_interval"]) is not int or data["digest_interval"] < 0:
        raise fail(f"digest_interval must be an int >= 0, got {data['digest_interval']!r}")
    commit = data.get("commit", "")
    if type(commit) is not str:
        raise fail(f"commit must be a str, got {commit!r}")
    rules = data["config"].get("rules") if isinstance(data["config"], dict) else None
    if type(rules) is int and rules > RULES:
        version = str(data["engine_version"])
        raise fail(newer_words(version, commit, f"under engine rules {rules}", f"rules 1-{RULES}"))
    try:
        config = EngineConfig.from_dict(data["config"])
    except (TypeError, ValueError) as exc:
        raise fail(f"config: {exc}") from None
    rules_recorded = "rules" in data["config"]
    if not rules_recorded and config.lower_tiers:  # kvledger 0.1.0, where its rules matter
        config = attrs.evolve(config, rules=RULES_UNRESOLVED)
    return LogHeader(
        schema_version=schema_version,
        engine_version=data["engine_version"],
        config=config,
        digest_interval=data["digest_interval"],
        commit=commit,
        rules_recorded=rules_recorded,
    )


class Cursor:
    """Where a reader stands: the next seq due and the last step seen.

    `check` returns what is wrong with a record at (seq, step_index), or None;
    seq must be exactly the next one (a gap means lost records) and steps
    never go back.
    """

    def __init__(self) -> None:
        self.next_seq = 0
        self.step_index = 0

    def check(self, seq: object, step_index: object) -> str | None:
        if type(seq) is not int:
            return f"seq must be an int, got {seq!r}"
        if type(step_index) is not int or step_index < 0:
            return f"step_index must be an int >= 0, got {step_index!r}"
        if seq > self.next_seq:
            return f"seq gap: seq {seq} follows seq {self.next_seq - 1}, {seq - self.next_seq} record(s) lost"
        if seq < self.next_seq:
            return f"seq {seq} repeats or goes back (seq {self.next_seq} was due)"
        if step_index < self.step_index:
            return f"step_index {step_index} goes back from {self.step_index}"
        self.step_index = step_index
        return None


# --- JSONL ---------------------------------------------------------------


def _dumps(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def encode_jsonl_header(header: LogHeader) -> bytes:
    return _dumps({"kind": HEADER_KIND, **header_to_dict(header)})


def encode_jsonl_record(record: Record) -> bytes:
    """One line, newline included."""
    if isinstance(record, DigestRecord):
        if not is_digest(record.digest):
            raise LogError(f"digest must be lowercase hex or 'part/parts:hex', got {record.digest!r}",
                           seq=record.seq)
        return _dumps(
            {"kind": DIGEST_KIND, "seq": record.seq, "step_index": record.step_index, "digest": record.digest}
        )
    event = record.event
    line = {"v": event.version, "seq": record.seq, "kind": event.kind, "step_index": record.step_index}
    return _dumps(write_fields(event, line))


def encode_jsonl(header: LogHeader, records: Iterable[Record]) -> bytes:
    """A whole log in memory (tests, benchmarks)."""
    return encode_jsonl_header(header) + b"".join([encode_jsonl_record(r) for r in records])


def _parse_line(line: bytes, number: int) -> dict:
    if not line.endswith(b"\n"):
        raise LogError("truncated: the last line has no newline", line=number)
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise LogError(f"corrupt: bad JSON ({exc})", line=number) from None
    except RecursionError:  # a value nested thousands deep: no record of ours is
        raise LogError("corrupt: JSON nested too deeply", line=number) from None
    if type(obj) is not dict:
        raise LogError(f"corrupt: expected a JSON object, got {type(obj).__name__}", line=number)
    return obj


def _decode_digest(obj: dict, cursor: Cursor, number: int) -> DigestRecord:
    unknown = sorted(set(obj) - {"kind", "seq", "step_index", "digest"})
    if unknown:
        raise LogError(f"{DIGEST_KIND}: unknown field {unknown[0]!r}", line=number)
    seq, step_index, digest = obj.get("seq"), obj.get("step_index"), obj.get("digest")
    problem = cursor.check(seq, step_index)
    if problem:
        raise LogError(problem, line=number)
    if not is_digest(digest):
        raise LogError(f"{DIGEST_KIND}: digest must be lowercase hex or 'part/parts:hex', got {digest!r}",
                       line=number)
    return DigestRecord(seq=seq, step_index=step_index, digest=digest)  # type: ignore[arg-type]


def _decode_event(obj: dict, cursor: Cursor, number: int) -> EventRecord:
    seq = obj.pop("seq", None)
    kind = obj.get("kind")
    if type(kind) is not str:  # found by the log fuzzer: a list here once raised TypeError
        raise LogError(f"corrupt: a record's kind must be a string, got {kind!r:.40}", line=number)
    step_index = obj.get("step_index") if kind in _STEP_FIELD_KINDS else obj.pop("step_index", None)
    problem = cursor.check(seq, step_index)
    if problem:
        raise LogError(problem, line=number)
    try:
        event = from_record(obj)
    except CodecError as exc:
        raise LogError(str(exc), line=number) from None
    cursor.next_seq += 1
    return EventRecord(seq=seq, step_index=step_index, event=event)  # type: ignore[arg-type]


def _read_records(lines: Iterator[bytes]) -> Iterator[Record]:
    cursor = Cursor()
    for number, line in enumerate(lines, start=2):
        obj = _parse_line(line, number)
        if obj.get("kind") == DIGEST_KIND:
            yield _decode_digest(obj, cursor, number)
        else:
            yield _decode_event(obj, cursor, number)


def read_jsonl(lines: Iterable[bytes]) -> tuple[LogHeader, Iterator[Record]]:
    """Read the header now; records lazily, raising LogError at the first bad line."""
    it = iter(lines)
    first = next(it, None)
    if first is None:
        raise LogError("missing header: the log is empty", line=1)
    obj = _parse_line(first, 1)
    if obj.get("kind") != HEADER_KIND:
        raise LogError(f"missing header: line 1 is a {obj.get('kind')!r} record", line=1)
    del obj["kind"]
    return header_from_dict(obj, line=1), _read_records(it)
