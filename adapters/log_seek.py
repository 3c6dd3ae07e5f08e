"""Reading a binary log from a snapshot instead of from its beginning.

Where the snapshots are: a closed log says so in its index (the trailer's
offset, then one frame: two small reads). A log cut by a crash, or still being
written, has no index; its frame heads are walked instead (the whole file is
read once, nothing decompressed), which takes seconds on a log of tens of
millions of events rather than milliseconds. An index that does not check out
(a damaged tail) is treated as absent.

JSONL logs, gzip-compressed logs and binary logs of formats 1 and 2 have no
snapshots here: a reader starts at their beginning (`open_log`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import attrs

from kvledger.adapters.log_files import check_regular, open_log, records_closing, resolve_rules
from kvledger.events.log_binary import (
    MAGIC_PREFIX,
    TRAILER_BYTES,
    BinaryLog,
    SnapshotMark,
    SnapshotRecord,
    read_binary_header,
    read_index,
    read_trailer,
    scan_snapshots,
)
from kvledger.events.log_records import LogError, LogHeader, Record

_CHUNK_BYTES = 1 << 20


@attrs.frozen
class Snapshots:
    """A log's snapshots, and how they were found: "index", "scan", or "none" (a
    log with no snapshots to offer: another form or format)."""

    marks: tuple[SnapshotMark, ...]
    found_by: str


def _chunks(file: BinaryIO) -> Iterator[bytes]:
    return iter(lambda: file.read(_CHUNK_BYTES), b"")


@contextlib.contextmanager
def _closed_on_error(file: BinaryIO, source: str) -> Iterator[None]:
    """Close `file` if reading it fails; a LogError names the log."""
    try:
        yield
    except LogError as exc:
        file.close()
        raise exc.at(source) from None
    except BaseException:
        file.close()
        raise


def _open_binary(path: Path) -> tuple[BinaryIO, BinaryLog] | None:
    """The file and its header, if it is an uncompressed binary log of format 3 or later."""
    try:
        check_regular(path)
        file: BinaryIO = path.open("rb")
    except (OSError, LogError):
        return None  # open_log names the problem
    with _closed_on_error(file, str(path)):
        if file.read(len(MAGIC_PREFIX)) != MAGIC_PREFIX:
            file.close()
            return None
        file.seek(0)
        log = read_binary_header(_chunks(file))
    if log.version < 3:
        file.close()
        return None
    return file, log


def _marks(file: BinaryIO, log: BinaryLog) -> Snapshots:
    size = file.seek(0, os.SEEK_END)
    if size >= log.data_offset + TRAILER_BYTES:
        file.seek(size - TRAILER_BYTES)
        offset = read_trailer(file.read(TRAILER_BYTES))
        if offset is not None and log.data_offset <= offset < size - TRAILER_BYTES:
            file.seek(offset)
            head = file.read(4)  # the index frame's length must fill the rest: else no read of it
            length = size - TRAILER_BYTES - offset
            marks = read_index(head + file.read(length - 4)) if int.from_bytes(head, "little") + 8 == length \
                else None
            if marks is not None and all(m.offset < offset for m in marks):
                return Snapshots(tuple(marks), "index")
    file.seek(log.data_offset)
    return Snapshots(tuple(scan_snapshots(_chunks(file), log.data_offset)), "scan")


def find_snapshots(path: str | os.PathLike) -> Snapshots:
    opened = _open_binary(Path(path))
    if opened is None:
        return Snapshots((), "none")
    file, log = opened
    with file:
        return _marks(file, log)


@attrs.frozen
class LogStart:
    """A log opened at a snapshot (`snapshot` None: at its beginning)."""

    header: LogHeader
    snapshot: SnapshotRecord | None
    records: Iterator[Record]
    snapshots: Snapshots


def open_log_at(path: str | os.PathLike, events_before: int) -> LogStart:
    """Open the log at its latest snapshot taken after at most `events_before`
    events (at its beginning if there is none); the records follow that snapshot."""
    source = str(path)
    opened = _open_binary(Path(path))
    if opened is None:
        header, records = open_log(path)
        return LogStart(header, None, records, Snapshots((), "none"))
    file, log = opened
    with _closed_on_error(file, source):
        header = resolve_rules(source, log.header)
        snapshots = _marks(file, log)
        usable = [m for m in snapshots.marks if m.seq <= events_before]
        if not usable:
            file.seek(log.data_offset)
            return LogStart(header, None, records_closing(log.records(_chunks(file)), file, source), snapshots)
        snapshot, records = _from_mark(file, log, usable[-1])
    return LogStart(header, snapshot, records_closing(records, file, source), snapshots)


def _from_mark(file: BinaryIO, log: BinaryLog, mark: SnapshotMark) -> tuple[SnapshotRecord, Iterator[Record]]:
    file.seek(mark.offset)
    return log.records_from(_chunks(file), mark)


def _at_snapshot(path: str | os.PathLike, mark: SnapshotMark) -> tuple[BinaryIO, BinaryLog, SnapshotRecord,
                                                                        Iterator[Record]]:
    opened = _open_binary(Path(path))
    if opened is None:
        raise LogError("not a binary log of format 3 or later: it has no snapshots", source=str(path))
    file, log = opened
    with _closed_on_error(file, str(path)):
        snapshot, records = _from_mark(file, log, mark)
    return file, log, snapshot, records


def read_snapshot(path: str | os.PathLike, mark: SnapshotMark) -> tuple[LogHeader, SnapshotRecord, Iterator[Record]]:
    """The log's header, the snapshot at `mark` and the records after it (to the
    log's end; the file closes when they have been read)."""
    file, log, snapshot, records = _at_snapshot(path, mark)
    with _closed_on_error(file, str(path)):
        header = resolve_rules(str(path), log.header)
    return header, snapshot, records_closing(records, file, str(path))


def load_snapshot(path: str | os.PathLike, mark: SnapshotMark) -> SnapshotRecord:
    """The snapshot at `mark` alone."""
    file, _log, snapshot, _records = _at_snapshot(path, mark)
    file.close()
    return snapshot

