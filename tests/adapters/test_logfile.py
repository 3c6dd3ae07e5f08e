"""Log files: write a step at a time, read either form back, and errors that name the path."""

from __future__ import annotations

import contextlib
import gzip
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.adapters.log_files import LogWriter, open_log
from kvledger.events import types as ev
from kvledger.events.log_binary import MAGIC, TRAILER_BYTES, read_trailer
from kvledger.events.log_records import DigestRecord, EventRecord, LogError
from tests.events.logs import DIGEST, HEADER
from tests.strategies import EXAMPLE_EVENTS

FORMATS = ("jsonl", "binary")


def step_events(step_index: int) -> list[ev.Event]:
    return [
        ev.RequestAdded(request_id=f"r{step_index}", num_prompt_tokens=16, block_hashes=(b"\x07" * 32,)),
        ev.StepScheduled(
            step_index=step_index, request_ids=(f"r{step_index}",), num_computed_tokens=(0,), num_scheduled_tokens=(16,)
        ),
        ev.StoreCompleted(job_id=step_index),
    ]


def write_steps(writer: LogWriter, steps: range, digest_every: int = 2) -> list:
    expected: list = []
    for step_index in steps:
        for event in step_events(step_index):
            expected.append(writer.append(event, step_index))
        digest = DIGEST if step_index % digest_every == 0 else None
        writer.end_step(digest)
        if digest:
            expected.append(DigestRecord(seq=writer.next_seq, step_index=step_index, digest=DIGEST))
    return expected


def read(path: Path) -> list:
    header, records = open_log(path)
    assert header == HEADER
    return list(records)


@pytest.mark.parametrize("fmt", FORMATS)
def test_written_logs_read_back(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"run.{fmt}"
    with LogWriter(path, HEADER, fmt=fmt) as writer:  # type: ignore[arg-type]
        expected = write_steps(writer, range(5))
    assert [r.seq for r in expected if isinstance(r, EventRecord)] == list(range(15))
    assert read(path) == expected


def test_the_format_is_told_by_the_magic_not_the_name(tmp_path: Path) -> None:
    binary, jsonl = tmp_path / "a.jsonl", tmp_path / "b.bin"
    for path, fmt in ((binary, "binary"), (jsonl, "jsonl")):
        with LogWriter(path, HEADER, fmt=fmt) as writer:  # type: ignore[arg-type]
            write_steps(writer, range(2))
    assert binary.read_bytes().startswith(MAGIC)
    assert jsonl.read_bytes().startswith(b'{"kind":"header"')
    assert read(binary) == read(jsonl)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gzip_copies_read_too(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "run.log"
    with LogWriter(path, HEADER, fmt=fmt) as writer:  # type: ignore[arg-type]
        expected = write_steps(writer, range(3))
    zipped = tmp_path / "run.log.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes()))
    assert read(zipped) == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_end_step_is_on_disk_before_close(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "run.log"
    with LogWriter(path, HEADER, fmt=fmt) as writer:  # type: ignore[arg-type]
        expected = write_steps(writer, range(2))
        writer.append(EXAMPLE_EVENTS["cache_reset"], 2)  # buffered, not yet written
        assert read(path) == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_close_writes_the_buffered_step(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "run.log"
    writer = LogWriter(path, HEADER, fmt=fmt)  # type: ignore[arg-type]
    record = writer.append(EXAMPLE_EVENTS["cache_reset"], 0)
    writer.close()
    writer.close()
    assert read(path) == [record]


@pytest.mark.parametrize("fmt", FORMATS)
def test_leaving_the_block_on_an_exception_keeps_the_buffered_step(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "run.log"
    with pytest.raises(RuntimeError), LogWriter(path, HEADER, fmt=fmt) as writer:  # type: ignore[arg-type]
        record = writer.append(EXAMPLE_EVENTS["cache_reset"], 0)
        raise RuntimeError("the engine crashed")
    assert read(path) == [record]


def test_a_digest_alone_ends_a_step(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    with LogWriter(path, HEADER, fmt="binary") as writer:
        writer.end_step(DIGEST)
        record = writer.append(EXAMPLE_EVENTS["cache_reset"], 0)
        writer.end_step()
        writer.end_step()  # nothing buffered: nothing written
    assert read(path) == [DigestRecord(seq=0, step_index=0, digest=DIGEST), record]


def test_steps_go_forward_and_end_before_the_next(tmp_path: Path) -> None:
    with LogWriter(tmp_path / "run.log", HEADER) as writer:
        writer.append(EXAMPLE_EVENTS["cache_reset"], 3)
        with pytest.raises(ValueError, match="event of step 4 appended while at step 3"):
            writer.append(EXAMPLE_EVENTS["cache_reset"], 4)
        writer.end_step()
        with pytest.raises(ValueError, match="event of step 2 appended while at step 3"):
            writer.append(EXAMPLE_EVENTS["cache_reset"], 2)
        with pytest.raises(ValueError, match="step_scheduled of step 7 recorded under step_index 4"):
            writer.append(EXAMPLE_EVENTS["step_scheduled"], 4)
        assert writer.next_seq == 1


def test_an_existing_log_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    path.write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        LogWriter(path, HEADER)
    assert path.read_bytes() == b"precious"
    LogWriter(path, HEADER, overwrite=True).close()
    assert read(path) == []


def test_a_step_that_cannot_be_encoded_fails_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    writer = LogWriter(path, HEADER, fmt="binary")
    writer.append(ev.CacheReset(epoch=2**70), 0)
    with pytest.raises(LogError, match="cannot encode step 0"):
        writer.end_step()
    with pytest.raises(LogError, match="an earlier step failed to write"):
        writer.append(EXAMPLE_EVENTS["cache_reset"], 1)
    writer.close()
    assert read(path) == []


def test_bad_format_name() -> None:
    with pytest.raises(ValueError, match="fmt must be 'jsonl' or 'binary'"):
        LogWriter("unused", HEADER, fmt="xml")  # type: ignore[arg-type]


# --- errors name the path --------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "no such log"),
        (lambda p: p.mkdir(), "is a directory, not a log"),
        (lambda p: p.write_bytes(b""), "empty log: no header"),
        (lambda p: p.write_bytes(gzip.compress(b"")), "empty log: no header"),
        (lambda p: p.write_bytes(b"\x1f\x8bnot really gzip"), "corrupt gzip stream"),
        (lambda p: p.write_bytes(b"KVLEDGER\x01\x00"), "truncated: frame head"),
        (lambda p: p.write_bytes(b"hello\n"), "line 1: corrupt: bad JSON"),
    ],
)
def test_unreadable_logs_name_the_path(tmp_path: Path, make: object, message: str) -> None:
    path = tmp_path / "run.log"
    make(path)  # type: ignore[operator]
    with pytest.raises(LogError, match=message) as caught:
        open_log(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert caught.value.source == str(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_record_names_path_and_place(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "run.log"
    with LogWriter(path, HEADER, fmt=fmt) as writer:  # type: ignore[arg-type]
        write_steps(writer, range(3))
    data = path.read_bytes()
    if fmt == "binary":  # cut the last step, not the index a closed binary log ends in
        data = data[: read_trailer(data[-TRAILER_BYTES:])]
    path.write_bytes(data[:-4])
    header, records = open_log(path)
    with pytest.raises(LogError, match="truncated") as caught:
        list(records)
    where = "line 12" if fmt == "jsonl" else "seq 6"  # header + 9 events + 2 digests; step 2 starts at seq 6
    assert str(caught.value).startswith(f"{path}: {where}: ")


def test_a_damaged_gzip_stream_is_a_log_error(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    with LogWriter(path, HEADER) as writer:
        write_steps(writer, range(20))
    zipped = tmp_path / "run.log.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes())[:-30])
    header, records = open_log(zipped)
    with pytest.raises(LogError, match="corrupt gzip stream|truncated") as caught:
        list(records)
    assert str(caught.value).startswith(f"{zipped}: ")


def test_abandoning_the_iterator_closes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    with LogWriter(path, HEADER) as writer:
        write_steps(writer, range(3))
    header, records = open_log(path)
    next(records)
    records.close()  # a generator: closing it closes the file
    with pytest.raises(StopIteration):
        next(records)


def test_an_existing_event_log_is_never_overwritten(tmp_path):
    from kvledger.adapters.log_files import create_unused

    def created(path: Path) -> str:
        file, made = create_unused(path)
        file.close()
        return str(made)

    log = tmp_path / "events.log"
    assert created(log) == str(log)
    log.write_bytes(b"an earlier run")
    assert created(log) == str(tmp_path / "events.1.log")
    assert created(log) == str(tmp_path / "events.2.log")
    assert log.read_bytes() == b"an earlier run"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_background_writer_writes_the_same_bytes(tmp_path: Path, fmt: str) -> None:
    """Encoding on the writer's thread changes where the work runs, not what is written."""
    paths = tmp_path / "sync.log", tmp_path / "background.log"
    for path, background in zip(paths, (False, True)):
        with LogWriter(path, HEADER, fmt=fmt, background=background) as writer:  # type: ignore[arg-type]
            expected = write_steps(writer, range(40), digest_every=3)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert read(paths[1]) == expected


def test_a_background_failure_is_raised_by_the_next_call(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    writer = LogWriter(path, HEADER, fmt="binary", background=True)
    kept = write_steps(writer, range(2))
    writer.append(ev.CacheReset(epoch=2**70), 2)  # cannot be encoded, found on the writer's thread
    writer.end_step()
    deadline = time.monotonic() + 10
    while writer._failure is None and time.monotonic() < deadline:  # the thread gets to it within ms
        time.sleep(0.01)
    with pytest.raises(LogError, match="an earlier step failed to write .*cannot encode step 2"):
        writer.append(EXAMPLE_EVENTS["cache_reset"], 3)
    writer.close()  # already raised: closing is quiet
    assert read(path) == kept


def test_close_raises_a_background_failure_nobody_saw(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    writer = LogWriter(path, HEADER, fmt="binary", background=True)
    writer.append(ev.CacheReset(epoch=2**70), 0)
    writer.end_step()
    with pytest.raises(LogError, match="cannot encode step 0"):
        writer.close()
    writer.close()
    assert read(path) == []


def test_a_background_writer_left_open_is_closed_at_exit(tmp_path: Path) -> None:
    """An engine that never calls close still leaves every handed-over step on disk."""
    path = tmp_path / "run.log"
    code = (
        "from pathlib import Path\n"
        "from kvledger.adapters.log_files import LogWriter\n"
        "from tests.adapters.test_logfile import write_steps\n"
        "from tests.events.logs import HEADER\n"
        f"writer = LogWriter(Path({str(path)!r}), HEADER, fmt='binary', background=True)\n"
        "write_steps(writer, range(300))\n"
    )
    done = _run_python(code)
    assert done.returncode == 0, done.stderr
    assert len([r for r in read(path) if isinstance(r, EventRecord)]) == 900


def _run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a Python process of its own, from the repository root: an exit as vLLM's process exits."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)


def test_steps_handed_over_after_the_exit_hook_are_written_too(tmp_path: Path) -> None:
    """vLLM can shut down after the writer's exit hook ran; its last steps once raised
    'the log writer is closed' and were lost."""
    path = tmp_path / "run.log"
    code = (
        "import atexit\n"
        "from pathlib import Path\n"
        "from kvledger.adapters.log_files import LogWriter\n"
        "from tests.adapters.test_logfile import write_steps\n"
        "from tests.events.logs import HEADER\n"
        "def late_shutdown():\n"  # registered first, so it runs after the writer's hook
        "    write_steps(writer, range(300, 310))\n"
        "atexit.register(late_shutdown)\n"
        f"writer = LogWriter(Path({str(path)!r}), HEADER, fmt='binary', background=True)\n"
        "write_steps(writer, range(300))\n"
    )
    done = _run_python(code)
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert len([r for r in read(path) if isinstance(r, EventRecord)]) == 930


@pytest.mark.parametrize("background", [False, True])
def test_add_step_writes_what_append_and_end_step_write(tmp_path: Path, background: bool) -> None:
    paths = tmp_path / "append.log", tmp_path / "add.log"
    with LogWriter(paths[0], HEADER, fmt="binary") as writer:
        write_steps(writer, range(6))
    with LogWriter(paths[1], HEADER, fmt="binary", background=background) as writer:
        for step_index in range(6):
            writer.add_step(step_index, step_events(step_index), DIGEST if step_index % 2 == 0 else None)
        with pytest.raises(ValueError, match="step 2 added while at step 5"):
            writer.add_step(2, step_events(2))
        writer.append(EXAMPLE_EVENTS["cache_reset"], 6)
        with pytest.raises(ValueError, match="add_step while appended events wait"):
            writer.add_step(6, [])
        writer.end_step()
    assert read(paths[1])[:-1] == read(paths[0])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("background", [False, True])
def test_a_forked_child_leaves_its_parents_log_alone(tmp_path: Path, background: bool) -> None:
    """A child forked while a step is buffered exits (running `close` at exit)
    without writing that step or anything else into the parent's log."""
    path = tmp_path / "run.log"
    writer = LogWriter(path, HEADER, fmt="binary", background=background)
    expected = write_steps(writer, range(3))
    writer.append(EXAMPLE_EVENTS["cache_reset"], 3)  # buffered when the child is made
    pid = os.fork()
    if pid == 0:  # the child: close as an exiting interpreter would, then leave at once
        try:
            writer.close()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    expected.append(writer._pending[0])
    writer.close()
    assert read(path) == expected


def test_engines_starting_at_once_on_one_path_each_get_a_log(tmp_path: Path) -> None:
    """Checking for a free name, then creating it, once lost this race (FileExistsError)."""
    import threading

    log = tmp_path / "events.log"
    start = threading.Barrier(8)
    paths: list[Path] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        start.wait()
        try:
            writer = LogWriter(log, HEADER, "binary", next_free=True)
            paths.append(writer.path)
            writer.close()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert sorted(paths) == sorted([log] + [tmp_path / f"events.{n}.log" for n in range(1, 8)])
    for path in paths:
        header, records = open_log(path)
        assert header == HEADER and list(records) == []


@pytest.mark.vllm
def test_an_event_log_that_cannot_be_created_names_the_setting(tmp_path: Path) -> None:
    from kvledger.adapters.settings import parse_settings
    from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
    from kvledger.events.config import ConfigError

    settings = parse_settings({"capacity_bytes": 1 << 20, "event_log": str(tmp_path / "missing" / "events.log")})
    with pytest.raises(ConfigError, match=r"event_log '.*missing/events.log' cannot be created: No such file"):
        LedgerScheduler(HEADER.config, settings)


@pytest.fixture
def tiny_tmpfs(mount) -> Path:
    """A real 64 KiB tmpfs."""
    return mount("tmpfs", "size=64k")


@pytest.mark.parametrize("background", [False, True])
def test_a_full_log_disk_stops_the_log_and_the_engine_goes_on(tiny_tmpfs: Path, background: bool) -> None:
    """A full log disk once raised out of the scheduler's step and took vLLM down."""
    import random

    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from tests.engine.builders import SIMULATED_CONFIGS

    config = SIMULATED_CONFIGS[0]
    host = EngineHost(config, log_path=tiny_tmpfs / "events.log", fmt="jsonl", background=background,
                      keep_serving=True)
    sim = Simulator(config, host=host)
    run_random(sim, random.Random(1), steps=600, arrivals=0.9, max_tokens=20, completion_rate=0.4)
    assert sim.step_index == 599  # every step ran
    sim.check()
    host.close()  # a background writer's failure may surface only here: it must not raise either
    # In background mode the writer's thread may also fall behind first, when this
    # thread holds the interpreter for 256 steps: the log stops either way.
    stopped = ("No space left", "steps behind") if background else ("No space left",)
    assert host.log_failure is not None and any(why in str(host.log_failure) for why in stopped), host.log_failure
    assert host.writer is None  # the log stopped; the engine went on
    _ends_at_a_whole_step(tiny_tmpfs / "events.log")


def test_a_stalled_log_sink_stops_the_log_and_the_engine_goes_on(tmp_path: Path) -> None:
    """A log whose writes block (a named pipe nobody reads: a hung NFS mount, a
    stalled disk): the writer's thread stalls, the steps queue up to the bound,
    then the log stops, one error, and every step still runs without waiting."""
    import random
    import threading

    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from tests.engine.builders import SIMULATED_CONFIGS

    fifo = tmp_path / "events.log"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # opened, never read: writes block once the pipe is full
    try:
        config = SIMULATED_CONFIGS[0]
        host = EngineHost(config, log_path=fifo, fmt="jsonl", background=True, keep_serving=True, overwrite=True)
        sim = Simulator(config, host=host)
        started = time.monotonic()
        run_random(sim, random.Random(1), steps=1200, arrivals=0.9, max_tokens=20, completion_rate=0.4)
        took = time.monotonic() - started
        assert sim.step_index == 1199
        assert host.writer is None and "steps behind" in str(host.log_failure), host.log_failure
        closing = time.monotonic()
        host.close()  # once, this waited forever on the stalled thread
        assert time.monotonic() - closing < 5
        drain = threading.Thread(target=_drain, args=(reader,), daemon=True)
        drain.start()  # let the writer's thread finish its blocked write and end
        drain.join(30)
    finally:
        os.close(reader)
    assert took < LogWriter.CLOSE_TIMEOUT_S  # no step waited on the stalled writer


def _drain(fd: int) -> None:
    import select

    waiting = select.poll()  # not select(): the suite's processes may hold descriptors past FD_SETSIZE
    waiting.register(fd, select.POLLIN)
    while waiting.poll(5000):  # until the writer closes its end (EOF) or 5 s of silence
        try:
            if not os.read(fd, 1 << 16):
                return
        except BlockingIOError:
            continue


def _ends_at_a_whole_step(path: Path) -> None:
    """A write cut short by the full disk was taken back: the log ends where its
    last whole step ends, with no torn line and no half of a step (a part digest
    may follow that step's events: it is written after the step it covers)."""
    from kvledger.adapters.cli.log_commands import Prefix
    from kvledger.events.types import StepScheduled

    header, records = open_log(path)
    prefix = Prefix(records)
    kept = list(prefix)
    assert prefix.tear is None, prefix.tear
    events = [record for record in kept if not isinstance(record, DigestRecord)]
    assert events and isinstance(events[-1].event, StepScheduled)


def test_without_keep_serving_a_full_log_disk_is_raised(tiny_tmpfs: Path) -> None:
    import random

    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.testing.simulator import Simulator, run_random
    from tests.engine.builders import SIMULATED_CONFIGS

    host = EngineHost(SIMULATED_CONFIGS[0], log_path=tiny_tmpfs / "events.log", fmt="jsonl")
    with pytest.raises(LogError, match="No space left"):
        run_random(Simulator(SIMULATED_CONFIGS[0], host=host), random.Random(1), steps=600, arrivals=0.9,
                   max_tokens=20, completion_rate=0.4)


@pytest.mark.fast
@pytest.mark.parametrize("fmt", ["jsonl", "binary"])
def test_a_log_is_private_to_its_owner_however_it_is_created(tmp_path: Path, fmt: str) -> None:
    """A log names every prompt's chain keys: 0600 whatever the umask, fresh, overwritten or the
    next free name."""
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh.log"
        with LogWriter(fresh, HEADER, fmt=fmt):  # type: ignore[arg-type]
            pass
        taken = tmp_path / "taken.log"
        taken.write_bytes(b"old")
        os.chmod(taken, 0o644)
        with LogWriter(taken, HEADER, fmt=fmt, overwrite=True):  # type: ignore[arg-type]
            pass
        with LogWriter(taken, HEADER, fmt=fmt, next_free=True) as writer:  # type: ignore[arg-type]
            beside = writer.path
    finally:
        os.umask(old)
    assert beside != taken
    for path in (fresh, taken, beside):
        assert os.stat(path).st_mode & 0o777 == 0o600, path
    assert open_log(taken)[0] == open_log(fresh)[0]  # the overwritten file holds the new log whole


@pytest.mark.parametrize("cut", [False, True])
def test_a_logs_header_alone_is_read_and_its_file_closed(tmp_path, cut) -> None:
    """`log_header` (whatif's passes and `replay --jobs` take the header first) leaves no file
    open, and leaves a bad first record to whoever reads the records."""
    import gc
    import warnings

    from kvledger.adapters.cli.main import main
    from kvledger.adapters.log_files import log_header

    path = tmp_path / "events.log"
    assert main(["simulate", "--scenario", "full", "--steps", "20", "--out", str(path)]) == 0
    if cut:  # inside the first step's frame, just past the header's
        data = path.read_bytes()
        header_end = len(MAGIC) + 8 + int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
        path.write_bytes(data[: header_end + 10])
    gc.collect()  # what earlier tests on this worker left to the collector is not this test's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        header = log_header(path)
        gc.collect()
    left = [w for w in caught if issubclass(w.category, ResourceWarning) and str(path) in str(w.message)]
    assert not left  # closed, not left to the collector
    whole, records = open_log(path)
    with contextlib.suppress(LogError):
        for _record in records:  # read to its end (or its tear), which closes the file
            pass
    assert header == whole
