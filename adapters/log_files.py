"""Event logs on disk: the only place the log format meets files.

`open_log` reads either form, telling binary from JSONL by the magic (and a
gzip-compressed copy of either by its own magic). `LogWriter` buffers one
step's events and writes them with one unbuffered `write` at `end_step`, so
a crash loses at most the step in progress, and a reader sees whole steps.
In background mode (a live scheduler) a process killed outright also loses
the steps still queued for the writer's thread, usually none or one.

A binary log may carry state snapshots (given to `add_step`), each written
in the same `write` as the step it follows, and `close` ends it with the
index of its snapshots (see `events.log_binary`); `log_seek` reads from
them. A JSONL log carries no snapshots: it is for fixtures and debugging,
and a reader of one always starts at its beginning.
"""

from __future__ import annotations

import atexit
import contextlib
import gzip
import os
import queue
import stat
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Literal

from kvledger.adapters import log_rules
from kvledger.events.config import RULES_UNRESOLVED
from kvledger.events.log_binary import (
    MAGIC_PREFIX,
    SnapshotMark,
    encode_binary_frame,
    encode_binary_header,
    encode_index,
    encode_snapshot_frame,
    read_binary,
)
from kvledger.events.log_records import (
    DigestRecord,
    EventRecord,
    LogError,
    LogHeader,
    Record,
    encode_jsonl_header,
    encode_jsonl_record,
    read_jsonl,
)
from kvledger.events.schema import Strings
from kvledger.events.types import Event

Format = Literal["jsonl", "binary"]
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK_BYTES = 1 << 16
# What a damaged gzip stream raises while it is read.
_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


def check_regular(path: Path) -> None:
    """A log is a regular file: a FIFO or a device (`/dev/zero`) would block or
    never end a read, so it is refused before it is opened."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise LogError("no such log", source=str(path)) from None
    except OSError as exc:
        raise LogError(f"cannot open: {exc.strerror or exc}", source=str(path)) from None
    if stat.S_ISDIR(mode):
        raise LogError("is a directory, not a log", source=str(path))
    if not stat.S_ISREG(mode):
        what = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) \
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        raise LogError(f"is {what}, not a log file (a log is read from a regular file)", source=str(path))


def _open(path: Path) -> BinaryIO:
    check_regular(path)
    try:
        file: BinaryIO = path.open("rb")
    except FileNotFoundError:  # removed since `check_regular` looked
        raise LogError("no such log", source=str(path)) from None
    except OSError as exc:
        raise LogError(f"cannot open: {exc.strerror or exc}", source=str(path)) from None
    try:
        if file.read(len(_GZIP_MAGIC)) == _GZIP_MAGIC:
            file.close()
            file = gzip.open(path, "rb")  # type: ignore[assignment]
        else:
            file.seek(0)
        return file
    except OSError as exc:
        file.close()
        raise LogError(f"cannot read: {exc.strerror or exc}", source=str(path)) from None


def records_closing(records: Iterator[Record], file: BinaryIO, source: str) -> Iterator[Record]:
    """The records, with `file` closed when they end; a read error names the log."""
    with file:
        try:
            yield from records
        except LogError as exc:
            raise exc.at(source) from None
        except _GZIP_ERRORS as exc:
            raise LogError(f"corrupt gzip stream: {exc}", source=source) from None


def _candidates(path: str) -> Iterator[str]:
    """`path`, then `name.1.ext`, `name.2.ext`, ...: a restarted server, or a
    second engine, must never overwrite the log of an earlier run."""
    yield path
    root, ext = os.path.splitext(path)
    n = 1
    while True:
        yield f"{root}.{n}{ext}"
        n += 1


def create_unused(path: str | os.PathLike) -> tuple[BinaryIO, Path]:
    """Create the first free name of `_candidates`' sequence, atomically: two
    engines starting at once on one path each get a file of their own."""
    for candidate in _candidates(os.fspath(path)):
        try:
            return create_private(candidate, overwrite=False), Path(candidate)
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def create_private(path: str | os.PathLike, *, overwrite: bool) -> BinaryIO:
    """A log file only its owner reads (0600, whatever the umask): it holds the chain keys of
    every prompt, which name what a shared tier holds. An overwritten file is made private too."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_TRUNC
        return os.fdopen(fd, "wb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def open_log(path: str | os.PathLike, *, resolve: bool = True) -> tuple[LogHeader, Iterator[Record]]:
    """The log's header now, and an iterator over its records (which closes the file at its end).

    Every problem, from a missing file to a bad record, is a LogError naming the path.
    The header's config carries the rules the log was decided under: recorded,
    or for a log of kvledger 0.1.0 shown by its records (`log_rules`; not with
    `resolve` False, which that inference itself reads the log with).
    """
    path = Path(path)
    source = str(path)
    file = _open(path)
    try:
        head = file.read(len(MAGIC_PREFIX))
        if not head:
            raise LogError("empty log: no header")
        file.seek(0)
        if head == MAGIC_PREFIX:
            header, records = read_binary(iter(lambda: file.read(_CHUNK_BYTES), b""))
        else:
            header, records = read_jsonl(file)
    except LogError as exc:
        file.close()
        raise exc.at(source) from None
    except _GZIP_ERRORS as exc:
        file.close()
        raise LogError(f"corrupt gzip stream: {exc}", source=source) from None
    except BaseException:
        file.close()
        raise
    if resolve and header.config.rules == RULES_UNRESOLVED:
        file.close()
        return resolve_rules(source, header), _unresolved(source)[1]
    return header, records_closing(records, file, source)


def log_header(path: str | os.PathLike) -> LogHeader:
    """The log's header alone (as `open_log` gives it), the file closed after it. A bad first
    record is left to whoever reads the records to report."""
    header, records = open_log(path)
    with contextlib.suppress(LogError):
        next(records, None)  # started, the generator holds the file in its `with`: `close` closes it
    records.close()  # type: ignore[attr-defined]
    return header


def resolve_rules(source: str, header: LogHeader) -> LogHeader:
    """The header with the log's rules: for a 0.1.0 log, as its records show them (`log_rules`)."""
    return log_rules.resolve(source, header, _unresolved)


def _unresolved(path: str) -> tuple[LogHeader, Iterator[Record]]:
    return open_log(path, resolve=False)


# (first seq, step index, events, digest, snapshot data)
_Step = tuple[int, int, tuple[Event, ...], "str | None", object]


def _step_records(step: _Step) -> list[Record]:
    first, step_index, events, digest, _snapshot = step
    records: list[Record] = [EventRecord(seq=first + i, step_index=step_index, event=e) for i, e in enumerate(events)]
    if digest is not None:
        records.append(DigestRecord(seq=first + len(events), step_index=step_index, digest=digest))
    return records


class LogWriter:
    """Write a log one step at a time: `append` events, then `end_step`.

    Seq numbers are assigned here. Each step is written as one frame (binary)
    or one run of lines (JSONL), followed by its digest record if one is
    given, in one write. `close` (and leaving the `with` block, even on an
    exception) writes a step still buffered. A step that fails to encode or
    write leaves the writer failed: later calls raise, since the log on disk
    can no longer be continued without a gap.

    `background=True` encodes and writes on a thread of its own, as a live
    scheduler needs: encoding a step costs about as much as the connector's
    own work in it, and on a GPU the scheduler's thread then waits on the
    forward, when the writer's thread can run. At most `MAX_QUEUED_STEPS` wait:
    a disk that far behind fails the log rather than stall the step (the
    engine host then stops logging and serves on); a failure there is
    raised by the next call, or by `close`. At interpreter exit the queued
    steps are written and later steps go straight to the file (`_at_exit`),
    so an engine that never shuts down cleanly still leaves every step it
    handed over on disk, those of vLLM's own shutdown included.
    """

    MAX_QUEUED_STEPS = 256
    CLOSE_TIMEOUT_S = 120.0
    FAILED_CLOSE_WAIT_S = 0.5

    def __init__(
        self, path: str | os.PathLike, header: LogHeader, fmt: Format = "jsonl", *, overwrite: bool = False,
        background: bool = False, next_free: bool = False, snapshot_interval_events: int = 0,
    ) -> None:
        """`next_free`: if `path` is taken, write `name.1.ext`, `name.2.ext`, ...
        (the first free one, claimed atomically); `self.path` says which.
        `snapshot_interval_events` is recorded in a binary header (the caller
        decides when to snapshot)."""
        if fmt not in ("jsonl", "binary"):
            raise ValueError(f"fmt must be 'jsonl' or 'binary', got {fmt!r}")
        self.path = Path(path)
        self.header = header
        self.fmt = fmt
        self._strings = Strings()
        self._pending: list[EventRecord] = []
        self._next_seq = 0
        self._step_index = 0
        self._failure: LogError | None = None
        self._failure_raised = False
        self._queue: queue.Queue[list[Record] | _Step | None] | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._offset = 0  # bytes written so far (the file is ours from its first byte)
        self.snapshots: list[SnapshotMark] = []  # written so far (binary), for the index at close
        self.last_snapshot_bytes = 0  # the last snapshot frame's size
        self._snapshot_end = 0  # the offset just after it
        head = (encode_binary_header(header, snapshot_interval_events=snapshot_interval_events)
                if fmt == "binary" else encode_jsonl_header(header))
        # Unbuffered: each step is one write of whole frames, and no copy of a
        # half-written buffer can be flushed twice (by a forked child, say).
        if next_free and not overwrite:
            self._file, self.path = create_unused(self.path)
        else:
            self._file = create_private(self.path, overwrite=overwrite)
        self._owner = os.getpid()
        try:
            self._write(head)
        except BaseException:
            self._failure_raised = True
            self.close()
            raise
        if background:
            self._queue = queue.Queue(self.MAX_QUEUED_STEPS)
            self._thread = threading.Thread(target=self._drain, name="kvledger-log", daemon=True)
            self._thread.start()
            atexit.register(self._at_exit)

    def bytes_since_snapshot(self) -> int:
        """Bytes written after the last snapshot (after the header, before the first)."""
        return self._offset - self._snapshot_end

    @property
    def next_seq(self) -> int:
        """The seq the next appended event gets (= events appended so far)."""
        return self._next_seq

    def append(self, event: Event, step_index: int) -> EventRecord:
        """Buffer an event of step `step_index`; all events of one step go before its `end_step`."""
        self._check_open()
        if step_index < self._step_index or (self._pending and step_index != self._step_index):
            raise ValueError(
                f"event of step {step_index} appended while at step {self._step_index}; "
                "steps go forward, and each ends with end_step"
            )
        record = EventRecord(seq=self._next_seq, step_index=step_index, event=event)
        self._pending.append(record)
        self._next_seq += 1
        self._step_index = step_index
        return record

    def add_step(self, step_index: int, events: Sequence[Event], digest: str | None = None,
                 snapshot: object = None) -> None:
        """`append` of each event, then `end_step(digest)`, in one call. In
        background mode the records are built on the writer's thread too, so
        the caller pays for a tuple, not a record per event. `snapshot`
        (`engine.snapshot.capture`'s data, the state after these events) is
        written after the step in a binary log, and encoded on the writer's
        thread in background mode; a JSONL log leaves it out."""
        self._check_open()
        if self._pending:
            raise ValueError("add_step while appended events wait for end_step")
        if step_index < self._step_index:
            raise ValueError(f"step {step_index} added while at step {self._step_index}; steps go forward")
        first = self._next_seq
        self._next_seq = first + len(events)
        self._step_index = step_index
        if self.fmt != "binary":
            snapshot = None
        if not events and digest is None and snapshot is None:
            return
        step = (first, step_index, tuple(events), digest, snapshot)
        if self._queue is not None:
            try:
                self._queue.put_nowait(step)
            except queue.Full:  # the disk is this far behind: stop rather than stall the step
                self._failure = LogError(f"the log's disk fell {self.MAX_QUEUED_STEPS} steps behind",
                                         source=str(self.path))
                self._failure_raised = True
                raise self._failure from None
            return
        try:
            self._write_step(_step_records(step), step)
        except BaseException:
            self._failure_raised = True
            raise

    def end_step(self, digest: str | None = None) -> None:
        """Write the buffered step, then `digest` (hex) if given, and flush the file."""
        self._check_open()
        records: list[Record] = list(self._pending)
        if digest is not None:
            records.append(DigestRecord(seq=self._next_seq, step_index=self._step_index, digest=digest))
        self._pending.clear()
        if not records:
            return
        if self._queue is not None:
            self._queue.put(records)
            return
        try:
            self._write_step(records)
        except BaseException:
            self._failure_raised = True
            raise

    def close(self) -> None:
        """Write any buffered step, then close the file. Closing twice is harmless.
        In background mode it first waits for the queued steps, and raises a
        failure no earlier call has raised."""
        if self._file is None:
            return
        if os.getpid() != self._owner:  # a forked child's copy: the log is its parent's to write
            file, self._file = self._file, None
            file.close()
            return
        try:
            if self._pending and self._failure is None:
                self.end_step()
        finally:
            self._stop_thread()
            if self.fmt == "binary" and self._failure is None:
                with contextlib.suppress(LogError):  # a log without its index reads as one cut by a crash
                    self._write(encode_index(self.snapshots, self._offset))
            file, self._file = self._file, None
            file.close()
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._file is None:
            raise ValueError(f"{self.path}: the log writer is closed")
        if self._failure is not None:
            self._failure_raised = True
            raise LogError(f"an earlier step failed to write ({self._failure.detail})", source=str(self.path))

    def _write_step(self, records: list[Record], step: _Step | None = None) -> None:
        """The step's records, and its snapshot if it has one, in one write."""
        snapshot = step[4] if step is not None else None
        mark = None
        try:
            if self.fmt == "binary":
                data = encode_binary_frame(records[0].seq, records[0].step_index, records,
                                           strings=self._strings) if records else b""
                if snapshot is not None:
                    assert step is not None
                    seq, step_index = step[0] + len(step[2]), step[1]
                    mark = SnapshotMark(seq=seq, step_index=step_index, offset=self._offset + len(data))
                    data += encode_snapshot_frame(seq, step_index, snapshot, strings=self._strings)
            else:
                data = b"".join([encode_jsonl_record(r) for r in records])
        except LogError as exc:
            self._failure = exc
            raise
        self._write(data)
        if mark is not None:
            self.snapshots.append(mark)
            self._snapshot_end = self._offset
            self.last_snapshot_bytes = self._offset - mark.offset

    def _write(self, data: bytes) -> None:
        """Write all of `data`, or none: a write cut short (a full disk) is
        truncated away, so the log ends at its last whole step, not in a torn
        frame or half of a step's lines, which a JSONL reader could not tell
        from a whole step."""
        assert self._file is not None
        try:
            start: int | None = self._file.tell()
        except OSError:  # a pipe: nothing to take back
            start = None
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]  # a raw write may take less than all
        except OSError as exc:
            if start is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._file.fileno(), start)
            self._failure = LogError(f"write failed: {exc}", source=str(self.path))
            raise self._failure from exc
        self._offset += len(data)

    def _drain(self) -> None:
        """The background thread: write steps in order until the stop mark; after
        a failure, take the rest without writing (the log cannot go on with a gap)."""
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            if self._failure is not None and self._closing:
                return  # closed after a failure: what is queued will never be written
            if self._failure is None:
                try:
                    if type(item) is list:
                        self._write_step(item)
                    else:
                        self._write_step(_step_records(item), item)  # type: ignore[arg-type]
                except Exception as exc:  # kept for the caller; the thread must not die
                    if self._failure is None:
                        self._failure = exc if isinstance(exc, LogError) else LogError(
                            f"step failed to encode: {type(exc).__name__}: {exc}", source=str(self.path))

    def _at_exit(self) -> None:
        """At interpreter exit: write the queued steps, then write in the caller's
        thread. vLLM may shut down after this hook has run, and the steps of its
        shutdown belong in the log too; the file is closed by `close`, or by the
        process's end (every write has reached the OS by then: it is unbuffered)."""
        if self._file is None or os.getpid() != self._owner:
            return
        try:
            self._stop_thread()
        finally:
            self._queue = None

    def _stop_thread(self) -> None:
        """Wait for the queued steps; after a failure, not at all: the thread
        may be stuck in a write to a stalled disk, and the caller serves."""
        if self._thread is None:
            return
        atexit.unregister(self._at_exit)
        assert self._queue is not None
        self._closing = True
        wait = self.CLOSE_TIMEOUT_S if self._failure is None else self.FAILED_CLOSE_WAIT_S
        with contextlib.suppress(queue.Full):  # the thread also stops on _closing after a failure
            self._queue.put(None, timeout=wait)
        self._thread.join(wait)
        if self._thread.is_alive() and self._failure is None:
            self._failure = LogError(f"steps still unwritten after {self.CLOSE_TIMEOUT_S:.0f} s",
                                     source=str(self.path))
        self._thread = None
