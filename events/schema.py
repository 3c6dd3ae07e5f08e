"""Each event kind's field layout, read once from its attrs class at import.

Both log forms (JSON records and binary rows) need, per field, an encoder and
a validating decoder. Building them here once per class, as closures, keeps
the per-event work to a loop over prepared functions instead of re-inspecting
types (or calling `attrs.asdict`) on every event.

Two value forms exist. The JSON form writes bytes as lowercase hex and tuples
as lists. The binary form keeps bytes as bytes and tuples as arrays (or, for ints and
equal-length bytes, packed bins: see `packed`), and passes strings through a
`Strings` table so a repeated request id costs a small int, not its text.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable
from typing import Any

import attrs

from kvledger.events import packed
from kvledger.events.types import EVENT_TYPES

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]


class InvalidValue(ValueError):
    """A field value has the wrong type or form; the caller names the field."""


class Strings:
    """The binary form's string table, one per log, kept alike by writer and reader.

    A string is written as text the first time and as its index afterwards;
    the reader rebuilds the same table from the texts it meets, in order. At
    the start of a frame a full table (`CAPACITY` entries) is cleared, on both
    sides by the same rule, so a long log needs bounded memory. A writer whose
    frame fails to encode rolls the table back to the frame's start.

    It is a writer's whole per-segment state: `stream` holds the segment's
    compression stream once `log_binary.encode_binary_frame` has started it, and
    `restart` begins a new segment (a snapshot frame).
    """

    CAPACITY = 1 << 16

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self.texts: list[str] = []  # in order; the generated row readers index it directly (one list, cleared in place)
        self.stream: Any = None  # the writer's zstd stream (events.binary), from its first frame

    def __len__(self) -> int:
        return len(self.texts)

    def begin_frame(self) -> int:
        """Clear a full table; return the mark that `rollback` returns to."""
        if len(self.texts) >= self.CAPACITY:
            self._index.clear()
            self.texts.clear()
        return len(self.texts)

    def restart(self) -> None:
        """Forget every text and the stream: a new segment of the log begins (at a snapshot)."""
        self._index.clear()
        self.texts.clear()
        self.stream = None

    def rollback(self, mark: int) -> None:
        for text in self.texts[mark:]:
            del self._index[text]
        del self.texts[mark:]

    def encode_many(self, texts: tuple[str, ...]) -> list[int | str]:
        """`encode` of each text in turn; one C-level pass when all are known
        (a step's request ids, mostly)."""
        items = list(map(self._index.get, texts))
        if None in items:
            return [self.encode(text) for text in texts]
        return items  # type: ignore[return-value]

    def encode(self, text: str) -> int | str:
        index = self._index.get(text)
        if index is not None:
            return index
        self._index[text] = len(self.texts)
        self.texts.append(text)
        return text

    def decode(self, value: object) -> str:
        if type(value) is int:
            if 0 <= value < len(self.texts):
                return self.texts[value]
            raise InvalidValue(f"string reference {value} is not in the table ({len(self.texts)} entries)")
        if type(value) is str:
            self.texts.append(value)
            return value
        raise InvalidValue(f"expected str, got {_type_name(value)}")

    def decode_refs(self, refs: tuple[int, ...]) -> tuple[str, ...]:
        """Many references at once (a packed column of request ids)."""
        texts = self.texts
        if refs and (min(refs) < 0 or max(refs) >= len(texts)):
            raise InvalidValue(
                f"string references {min(refs)}..{max(refs)} are not all in the table ({len(texts)} entries)"
            )
        return tuple([texts[i] for i in refs])


@attrs.frozen
class FieldCodec:
    """How one field travels. `None` encoders mean the value goes as is.

    `tag` spells the type ("bool", "int", "str", "bytes", "enum", "tuple[X]") so a
    binary header can describe each layout it writes, and a reader can make
    sense of a layout older than its own classes.
    """

    name: str
    tag: str
    json_encode: Encode | None
    json_decode: Decode
    binary_encode: Callable[[Any, Strings], Any] | None
    binary_decode: Callable[[Any, Strings], Any]


@attrs.frozen
class KindSchema:
    kind: str
    version: int
    cls: type
    fields: tuple[FieldCodec, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def layout(self) -> list:
        """`[version, [[name, tag], ...]]`, as a binary header records it."""
        return [self.version, [[f.name, f.tag] for f in self.fields]]


def _type_name(value: object) -> str:
    return type(value).__name__


def _bool_decode(value: object) -> bool:
    if type(value) is not bool:
        raise InvalidValue(f"expected bool, got {_type_name(value)} {value!r}")
    return value


def _bool_binary_decode(value: object, _strings: Strings) -> bool:
    return _bool_decode(value)


def _int_decode(value: object) -> int:
    if type(value) is not int:
        raise InvalidValue(f"expected int, got {_type_name(value)} {value!r}")
    return value


def _str_decode(value: object) -> str:
    if type(value) is not str:
        raise InvalidValue(f"expected str, got {_type_name(value)} {value!r}")
    return value


def _hex_decode(value: object) -> bytes:
    if type(value) is not str:
        raise InvalidValue(f"expected lowercase hex str, got {_type_name(value)} {value!r}")
    try:
        data = bytes.fromhex(value)
    except ValueError:
        raise InvalidValue(f"bad hex {value!r}") from None
    if data.hex() != value:  # fromhex accepts spaces and upper case; the log never writes them
        raise InvalidValue(f"bad hex {value!r}: not lowercase without spaces")
    return data


def _bytes_decode(value: object, _strings: Strings) -> bytes:
    if type(value) is not bytes:
        raise InvalidValue(f"expected bytes, got {_type_name(value)}")
    return value


def int_binary_decode(value: object, _strings: Strings) -> int:
    if type(value) is not int:
        raise InvalidValue(f"expected int, got {_type_name(value)} {value!r}")
    return value


def _str_binary_encode(value: str, strings: Strings) -> int | str:
    return strings.encode(value)


def _str_binary_decode(value: object, strings: Strings) -> str:
    return strings.decode(value)


def _enum_codecs(enum_cls: type[enum.Enum]) -> tuple[Encode, Decode, Callable, Callable]:
    def decode(value: object) -> enum.Enum:
        try:
            return enum_cls(value)
        except ValueError:
            raise InvalidValue(f"{value!r} is not a {enum_cls.__name__}") from None

    return (
        lambda value: value.value,
        decode,
        lambda value, _strings: value.value,
        lambda value, _strings: decode(value),
    )


def _array(value: object) -> list | tuple:
    if type(value) is not list and type(value) is not tuple:
        raise InvalidValue(f"expected array, got {_type_name(value)} {value!r}")
    return value


def _tuple_codecs(inner: tuple, item: type | None = None) -> tuple:
    """Tuples of any field type; `item`, where given, is a scalar type whose JSON
    form is the value itself, so a whole list is checked in one pass."""
    json_enc, json_dec, bin_enc, bin_dec = inner

    def json_encode(value: tuple) -> list:
        return list(value) if json_enc is None else [json_enc(item) for item in value]

    def json_decode(value: object) -> tuple:
        items = _array(value)
        if item is not None and all(type(entry) is item for entry in items):
            return tuple(items)
        return tuple([json_dec(entry) for entry in items])

    def binary_encode(value: tuple, strings: Strings) -> list:
        return [bin_enc(item, strings) for item in value]

    def binary_decode(value: object, strings: Strings) -> tuple:
        return tuple([bin_dec(item, strings) for item in _array(value)])

    return json_encode, json_decode, (None if bin_enc is None else binary_encode), binary_decode


def _unpacked(unpack: Callable[[bytes], tuple], value: bytes) -> tuple:
    try:
        return unpack(value)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None


def _packed_tuple_codecs(
    inner: tuple, pack: Callable[[tuple], bytes | None], unpack: Callable[[bytes], tuple], item: type
) -> tuple:
    """tuple[int] and tuple[bytes]: in binary, one packed bin where that is shorter."""
    json_encode, json_decode, _bin_enc, _bin_dec = _tuple_codecs(inner, item if item is int else None)
    item_name = item.__name__

    def binary_encode(value: tuple, _strings: Strings) -> bytes | tuple:
        packed = pack(value)
        return value if packed is None else packed

    def binary_decode(value: object, _strings: Strings) -> tuple:
        if type(value) is bytes:
            return _unpacked(unpack, value)
        for entry in _array(value):
            if type(entry) is not item:
                raise InvalidValue(f"expected {item_name}, got {_type_name(entry)} {entry!r}")
        return tuple(value)  # type: ignore[arg-type]

    return json_encode, json_decode, binary_encode, binary_decode


def _int_table_codecs(inner: tuple) -> tuple:
    """tuple[tuple[int]] (a block table, a group per row): each row decoded in
    place, without a call per row through the inner codec; most events carry one."""
    json_encode, json_decode, binary_encode, _bin_dec = _tuple_codecs(inner)
    unpack = packed.unpack_ints

    def binary_decode(value: object, _strings: Strings) -> tuple:
        rows = []
        for row in _array(value):
            if type(row) is bytes:
                try:
                    rows.append(unpack(row))
                except ValueError as exc:
                    raise InvalidValue(str(exc)) from None
                continue
            for entry in _array(row):
                if type(entry) is not int:
                    raise InvalidValue(f"expected int, got {_type_name(entry)} {entry!r}")
            rows.append(tuple(row))
        return tuple(rows)

    return json_encode, json_decode, binary_encode, binary_decode


def _str_tuple_codecs(inner: tuple) -> tuple:
    """tuple[str]: in binary, table references packed like ints once every item is one."""
    json_encode, json_decode, _bin_enc, _bin_dec = _tuple_codecs(inner, str)

    def binary_encode(value: tuple, strings: Strings) -> list | bytes:
        items = strings.encode_many(value)
        if len(items) >= packed.MIN_PACKED_ITEMS and str not in map(type, items):  # all table refs
            return packed.pack_ints(items) or items  # type: ignore[arg-type]
        return items

    def binary_decode(value: object, strings: Strings) -> tuple:
        if type(value) is bytes:
            return strings.decode_refs(_unpacked(packed.unpack_ints, value))
        return tuple([strings.decode(item) for item in _array(value)])

    return json_encode, json_decode, binary_encode, binary_decode


def value_codecs(tp: object) -> tuple:
    """(json_encode, json_decode, binary_encode, binary_decode) for an event field type."""
    if tp is bool:  # before int: a bool is an int
        return None, _bool_decode, None, _bool_binary_decode
    if tp is int:
        return None, _int_decode, None, int_binary_decode
    if tp is str:
        return None, _str_decode, _str_binary_encode, _str_binary_decode
    if tp is bytes:
        return bytes.hex, _hex_decode, None, _bytes_decode
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_codecs(tp)
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = value_codecs(args[0])
        if args[0] is int:
            return _packed_tuple_codecs(inner, packed.pack_ints, packed.unpack_ints, int)
        if args[0] is bytes:
            return _packed_tuple_codecs(inner, packed.pack_bytes, packed.unpack_bytes, bytes)
        if args[0] is str:
            return _str_tuple_codecs(inner)
        if args[0] == tuple[int, ...]:
            return _int_table_codecs(inner)
        return _tuple_codecs(inner)
    raise TypeError(f"event field type {tp!r} has no log form; use bool, int, str, bytes, an enum or tuple[X, ...]")


def type_tag(tp: object) -> str:
    if tp in (bool, int, str, bytes):
        return tp.__name__
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "enum"
    return f"tuple[{type_tag(typing.get_args(tp)[0])}]"


def json_form_decoder(tag: str) -> Callable[[Any, Strings], Any]:
    """Turn a binary value of type `tag` into its JSON form, for upcasting old layouts.

    Strings go through the table (they may be references), bytes become hex,
    arrays become lists; nothing else is checked here: `from_record` does that
    once the record has reached the current version.
    """
    if tag == "str":
        return _str_binary_decode
    if tag == "bytes":
        return lambda value, _strings: value.hex() if type(value) is bytes else value
    if tag in ("bool", "int", "enum"):
        return lambda value, _strings: value
    if tag in ("tuple[int]", "tuple[bytes]", "tuple[str]"):
        unpack = packed.unpack_bytes if tag == "tuple[bytes]" else packed.unpack_ints
        item = json_form_decoder(tag[len("tuple[") : -1])
        return lambda value, strings: [
            item(entry, strings) for entry in (_unpacked(unpack, value) if type(value) is bytes else _array(value))
        ]
    if tag.startswith("tuple[") and tag.endswith("]"):
        inner = json_form_decoder(tag[len("tuple[") : -1])
        return lambda value, strings: [inner(item, strings) for item in _array(value)]
    raise InvalidValue(f"unknown field type {tag!r}")


def schema_of(cls: type) -> KindSchema:
    hints = typing.get_type_hints(cls)
    fields = tuple(
        FieldCodec(a.name, type_tag(hints[a.name]), *value_codecs(hints[a.name])) for a in attrs.fields(cls)
    )
    return KindSchema(kind=cls.kind, version=cls.version, cls=cls, fields=fields)  # type: ignore[attr-defined]


SCHEMAS: dict[str, KindSchema] = {cls.kind: schema_of(cls) for cls in EVENT_TYPES}  # type: ignore[attr-defined]
