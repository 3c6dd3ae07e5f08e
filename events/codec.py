"""Event <-> JSON-ready record: `{"kind": ..., "v": version, **fields}`.

Records are keyed by the stable kind string, never by class path, and carry
the version they were written at; `from_record` upcasts older versions and
rejects anything it cannot decode exactly, naming the kind and field.
"""

from __future__ import annotations

from collections.abc import Callable

from kvledger.events.schema import SCHEMAS, InvalidValue, KindSchema
from kvledger.events.types import Event
from kvledger.events.upcast import UPCASTERS

_ENVELOPE = ("kind", "v")


class CodecError(ValueError):
    """A record does not decode to an event. `kind` and `field` name where, when known."""

    def __init__(self, detail: str, *, kind: str | None = None, field: str | None = None) -> None:
        self.detail, self.kind, self.field = detail, kind, field
        where = "" if kind is None else kind if field is None else f"{kind}.{field}"
        super().__init__(f"{where}: {detail}" if where else detail)


def _make_writer(schema: KindSchema) -> Callable[[Event, dict], dict]:
    pairs = tuple((f.name, f.json_encode) for f in schema.fields)

    def write(event: Event, into: dict) -> dict:
        for name, encode in pairs:
            value = getattr(event, name)
            into[name] = value if encode is None else encode(value)
        return into

    return write


def _field_set_error(schema: KindSchema, record: dict) -> CodecError:
    names = set(schema.names)
    missing = sorted(names - set(record))
    if missing:
        return CodecError("missing field", kind=schema.kind, field=missing[0])
    unknown = sorted(set(record) - names - set(_ENVELOPE))
    return CodecError("unknown field", kind=schema.kind, field=unknown[0])


def _upcast(schema: KindSchema, record: dict) -> dict:
    kind, version = schema.kind, record.get("v")
    if type(version) is not int or version < 1:
        raise CodecError(f"record version must be an int >= 1, got {version!r}", kind=kind, field="v")
    if version > schema.version:
        raise CodecError(f"v{version} is newer than this reader knows (v{schema.version})", kind=kind)
    fields = {k: v for k, v in record.items() if k not in _ENVELOPE}
    for old in range(version, schema.version):
        upcaster = UPCASTERS.get((kind, old))
        if upcaster is None:
            raise CodecError(f"no upcaster from v{old} to v{old + 1}", kind=kind)
        fields = upcaster(fields)
    return {"kind": kind, "v": schema.version, **fields}


def _make_reader(schema: KindSchema) -> Callable[[dict], Event]:
    kind, version, cls = schema.kind, schema.version, schema.cls
    pairs = tuple((f.name, f.json_decode) for f in schema.fields)
    size = len(pairs) + len(_ENVELOPE)

    def read(record: dict) -> Event:
        if record.get("v") != version:
            record = _upcast(schema, record)
        if len(record) != size:
            raise _field_set_error(schema, record)
        kwargs = {}
        name = ""
        try:
            for name, decode in pairs:
                kwargs[name] = decode(record[name])
        except KeyError:
            raise _field_set_error(schema, record) from None
        except InvalidValue as exc:
            raise CodecError(str(exc), kind=kind, field=name) from None
        return construct(cls, kind, kwargs)

    return read


def construct(cls: type, kind: str, kwargs: dict) -> Event:
    """Build the event; a value its class refuses becomes a CodecError naming the kind."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise CodecError(str(exc), kind=kind) from None


_WRITERS = {schema.cls: _make_writer(schema) for schema in SCHEMAS.values()}
_READERS = {kind: _make_reader(schema) for kind, schema in SCHEMAS.items()}


def _writer(event: Event) -> Callable[[Event, dict], dict]:
    writer = _WRITERS.get(type(event))
    if writer is None:
        raise CodecError(f"not an event: {type(event).__name__}")
    return writer


def write_fields(event: Event, into: dict) -> dict:
    """Add the event's fields, in JSON form, to `into` (so callers choose the key order)."""
    return _writer(event)(event, into)


def to_record(event: Event) -> dict:
    """The event as a JSON-ready dict: kind, version, then fields in attrs order."""
    return _writer(event)(event, {"kind": event.kind, "v": event.version})


def from_record(record: dict) -> Event:
    """Decode a record, upcasting older versions; raises CodecError naming kind and field."""
    if not isinstance(record, dict):
        raise CodecError(f"record must be a mapping, got {type(record).__name__}")
    kind = record.get("kind")
    reader = _READERS.get(kind) if type(kind) is str else None
    if reader is None:
        raise CodecError(f"unknown kind {kind!r}")
    return reader(record)
