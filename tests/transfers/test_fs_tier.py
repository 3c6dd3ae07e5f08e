"""The file-system tier's I/O on real file systems: bytes round-trip exactly,
every bad file fails only its own position with its reason, a full disk or a
vanished directory fails blocks and never the tier, and queued work can be
cancelled. Blocked jobs read into host rows whose memory is not there yet
(userfaultfd): the copy into them waits in the kernel, a real hang and no mock."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import platform
import shutil
import stat
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from kvledger.adapters.key_lookups import KeyLookups
from kvledger.transfers.copies.backend import BackendClosed, TransferTimeout
from kvledger.transfers.lower_tiers.block_header import HEADER_BYTES
from kvledger.transfers.lower_tiers.fs.block_file import block_path, write_block
from kvledger.transfers.lower_tiers.fs.tier import (
    FsTierIO,
    TierIoOutcome,
    files_present,
    remove_leftovers,
    scan_keys,
)
from kvledger.transfers.lower_tiers.replica_tier import ReplicaTierIO
from tests.support.privileges import IS_ROOT, need_root, second_group

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
ROW_BYTES = 64 << 10
SIZES = (ROW_BYTES, 5000, 1)  # three groups: a full row, a ragged prefix, one byte


def key(number: int, group: int = 0) -> bytes:
    return bytes([group]) * 16 + number.to_bytes(16, "big")


def random_rows(num_slots: int, row_bytes: int = ROW_BYTES, seed: int = 0) -> torch.Tensor:
    data = np.random.default_rng(seed).integers(-128, 128, (num_slots, row_bytes), dtype=np.int8)
    return torch.from_numpy(data)


@contextlib.contextmanager
def made_tiers(**defaults):
    """A maker of tiers that shuts each down at the end, so no thread outlives a test;
    `defaults` for every tier it makes (packs: tests/transfers/test_block_pack.py)."""
    made: list[FsTierIO] = []

    def make(root, *, rows=None, sizes=SIZES, **options) -> FsTierIO:
        io = FsTierIO(root=str(root), namespace=NS, rows=random_rows(16) if rows is None else rows,
                      payload_bytes=sizes, **{**defaults, **options})
        made.append(io)
        return io

    try:
        yield make
    finally:
        for io in made:
            with contextlib.suppress(TransferTimeout):
                io.shutdown(drain=False, timeout_s=5)


@pytest.fixture
def tiers():
    """Tiers of a file per block, on 4 threads."""
    with made_tiers(threads=4, pack_bytes=0) as make:
        yield make


def run(io: FsTierIO, kind: str, job_id: int, keys, slots) -> TierIoOutcome:
    getattr(io, kind)(job_id, keys, slots)
    io.wait([job_id], 30)
    outcomes = io.poll()
    assert [o.job_id for o in outcomes] == [job_id]
    return outcomes[0]


def payload(io: FsTierIO, slot: int, group: int) -> bytes:
    return io.rows[slot, : io.payload_bytes[group]].numpy().tobytes()


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name.startswith(".")]


@pytest.mark.fast
@pytest.mark.parametrize("direct_writes", [True, False])
def test_write_then_read_round_trips_every_group_exactly(tmp_path, tiers, direct_writes):
    io = tiers(tmp_path, direct_writes=direct_writes)
    keys = tuple(tuple(key(n, g) for n in range(3)) for g in range(3))
    sources = ((0, 1, 2), (3, 4, 5), (6, 7, 8))
    targets = ((9, 10, 11), (12, 13, 14), (15, 0, 1))
    expected = {(g, i): payload(io, s, g) for g, slots in enumerate(sources) for i, s in enumerate(slots)}
    written = run(io, "write", 1, keys, sources)
    assert written.ok and written.kind == "write" and written.reasons == ()
    assert written.nbytes == 3 * sum(SIZES) and written.seconds > 0
    for g, group_keys in enumerate(keys):
        for k in group_keys:  # whole files, truncated back to their size, nothing left aside
            assert block_path(tmp_path, NS, k).stat().st_size == HEADER_BYTES + SIZES[g]
    assert leftovers(tmp_path) == []
    io.rows.zero_()
    read = run(io, "read", 2, keys, targets)
    assert read.ok and read.kind == "read" and read.nbytes == 3 * sum(SIZES)
    for g, slots in enumerate(targets):
        for i, s in enumerate(slots):
            assert payload(io, s, g) == expected[(g, i)], (g, i)
    assert io.direct_writes is direct_writes


@pytest.mark.fast
def test_direct_and_buffered_writes_make_the_same_file(tmp_path, tiers):
    direct = tiers(tmp_path / "direct", direct_writes=True)
    buffered = tiers(tmp_path / "buffered", rows=direct.rows, direct_writes=False)
    keys = ((key(1),), (key(2, 1),), (key(3, 2),))
    for io in (direct, buffered):
        assert run(io, "write", 1, keys, ((0,), (1,), (2,))).ok
    for group in keys:
        a = block_path(tmp_path / "direct", NS, group[0]).read_bytes()
        b = block_path(tmp_path / "buffered", NS, group[0]).read_bytes()
        assert a == b


@pytest.mark.fast
def test_each_bad_file_fails_only_its_own_position_with_its_reason(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES, 5000))
    keys = ((key(0), key(1), key(2)), (key(3, 1), key(4, 1), key(5, 1)))
    assert run(io, "write", 1, keys, ((0, 1, 2), (3, 4, 5))).ok
    good = {(0, 0): payload(io, 0, 0), (1, 2): payload(io, 5, 1)}
    os.unlink(block_path(tmp_path, NS, key(1)))  # (0, 1): missing
    os.truncate(block_path(tmp_path, NS, key(2)), HEADER_BYTES + 100)  # (0, 2): truncated
    flipped = block_path(tmp_path, NS, key(3, 1))  # (1, 0): one payload byte corrupted
    raw = bytearray(flipped.read_bytes())
    raw[HEADER_BYTES + 1234] ^= 0x01
    flipped.write_bytes(bytes(raw))
    stranger = block_path(tmp_path, NS, key(4, 1))  # (1, 1): another namespace's file at this path
    write_block(stranger, OTHER_NS, key(4, 1), np.zeros(5000, dtype=np.uint8))
    io.rows.zero_()
    with capture_logs() as logs:
        outcome = run(io, "read", 2, keys, ((6, 7, 8), (9, 10, 11)))
    assert outcome.failed == ((0, 1), (0, 2), (1, 0), (1, 1))
    assert outcome.reasons == ("missing", "truncated", "corrupt", "foreign")
    assert not outcome.ok and outcome.nbytes == ROW_BYTES + 5000
    assert payload(io, 6, 0) == good[(0, 0)] and payload(io, 11, 1) == good[(1, 2)]
    warnings = [entry for entry in logs if entry["event"] == "tier_io_failed"]
    assert len(warnings) == 1  # once per job, not once per block
    assert warnings[0]["job_id"] == 2 and warnings[0]["failed"] == 4 and warnings[0]["blocks"] == 6
    assert warnings[0]["reasons"] == {"missing": 1, "truncated": 1, "corrupt": 1, "foreign": 1}
    assert warnings[0]["first_failed"] == str(block_path(tmp_path, NS, key(1)))


@pytest.mark.parametrize("direct_writes", [True, False])
def test_a_full_disk_fails_the_writes_that_do_not_fit_and_leaves_no_temp_files(small_tmpfs, tiers, direct_writes):
    size = 300 << 10  # 1 MiB holds three of these and their headers
    io = tiers(small_tmpfs, rows=random_rows(16, size), sizes=(size,), threads=4, direct_writes=direct_writes)
    keys = (tuple(key(n) for n in range(8)),)
    outcome = run(io, "write", 1, keys, (tuple(range(8)),))
    assert set(outcome.reasons) == {"disk_full"}
    stored = [n for n in range(8) if (0, n) not in outcome.failed]
    assert 1 <= len(stored) <= 3 and len(outcome.failed) == 8 - len(stored)
    assert outcome.nbytes == len(stored) * size
    assert leftovers(small_tmpfs) == []
    for n in range(8):
        assert block_path(small_tmpfs, NS, key(n)).exists() == (n in stored)
    assert io.direct_writes is direct_writes  # ENOSPC is a full disk, not a refusal of O_DIRECT
    expected = [payload(io, n, 0) for n in stored]
    io.rows.zero_()
    read = run(io, "read", 2, (tuple(key(n) for n in stored),), (tuple(range(8, 8 + len(stored))),))
    assert read.ok
    assert [payload(io, 8 + n, 0) for n in range(len(stored))] == expected


def test_a_file_system_that_refuses_direct_io_falls_back_to_the_page_cache(tiers, mount):
    """ramfs refuses O_DIRECT (EINVAL), after creating the file."""
    ramfs = mount("ramfs")
    io = tiers(ramfs, sizes=(ROW_BYTES,), threads=1)
    with capture_logs() as logs:
        outcome = run(io, "write", 1, ((key(0), key(1)),), ((0, 1),))
    assert outcome.ok and io.direct_writes is False
    assert [e["event"] for e in logs if e["event"] == "tier_direct_io_off"] == ["tier_direct_io_off"]
    assert leftovers(ramfs) == []
    expected = payload(io, 1, 0)
    assert run(io, "read", 2, ((key(1),),), ((5,),)).ok and payload(io, 5, 0) == expected


@pytest.mark.fast
def test_a_directory_removed_under_a_running_tier(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES,))
    keys = ((key(0), key(1), key(2)),)
    assert run(io, "write", 1, keys, ((0, 1, 2),)).ok
    shutil.rmtree(tmp_path / NS.hex())
    outcome = run(io, "read", 2, keys, ((3, 4, 5),))
    assert outcome.failed == ((0, 0), (0, 1), (0, 2)) and outcome.reasons == ("missing",) * 3
    assert outcome.nbytes == 0
    assert run(io, "write", 3, keys, ((0, 1, 2),)).ok  # parents made again
    expected = [payload(io, s, 0) for s in (0, 1, 2)]
    assert run(io, "read", 4, keys, ((3, 4, 5),)).ok
    assert [payload(io, s, 0) for s in (3, 4, 5)] == expected


@pytest.mark.fast
def test_delete_removes_files_ignores_missing_ones_and_logs_other_errors(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES,), threads=1)  # one thread: work runs in submission order
    keys = ((key(0), key(1), key(2)),)
    assert run(io, "write", 1, keys, ((0, 1, 2),)).ok
    stuck = block_path(tmp_path, NS, key(9))
    (stuck / "inside").mkdir(parents=True)  # a directory where a file should be: unlink fails
    with capture_logs() as logs:
        io.delete([key(0), key(2), key(7), key(9)])
        outcome = run(io, "read", 2, ((key(1),),), ((5,),))  # runs after the deletes
    assert outcome.ok
    assert not block_path(tmp_path, NS, key(0)).exists() and not block_path(tmp_path, NS, key(2)).exists()
    assert block_path(tmp_path, NS, key(1)).exists()
    failures = [e for e in logs if e["event"] == "tier_delete_failed"]
    assert len(failures) == 1 and failures[0]["path"] == str(stuck) and failures[0]["log_level"] == "warning"
    assert [e for e in logs if e["event"] == "tier_io_failed"] == []


_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFDIO_API, _UFFDIO_REGISTER, _UFFD_API, _UFFDIO_REGISTER_MODE_MISSING = 0xC018AA3F, 0xC020AA00, 0xAA, 1


class StuckRows:
    """Host rows whose slot 0 has no memory yet, registered with a userfaultfd
    that never answers: a read of a block into slot 0 waits in the kernel's
    copy until `release` closes it (then the page is made as usual)."""

    def __init__(self, num_slots: int = 16, row_bytes: int = ROW_BYTES) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        self.fd: int | None = libc.syscall(_SYS_USERFAULTFD[platform.machine()], os.O_CLOEXEC | os.O_NONBLOCK)
        if self.fd == -1 and ctypes.get_errno() == errno.EPERM and not IS_ROOT:
            need_root("a userfaultfd that waits in the kernel's copy: unprivileged ones are off "
                      "(vm.unprivileged_userfaultfd=0)")
        assert self.fd is not None and self.fd >= 0, f"userfaultfd: {os.strerror(ctypes.get_errno())}"
        fcntl.ioctl(self.fd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, 0, 0)))
        self._memory = mmap.mmap(-1, num_slots * row_bytes)
        start = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        fcntl.ioctl(self.fd, _UFFDIO_REGISTER,
                    bytearray(struct.pack("QQQQ", start, row_bytes, _UFFDIO_REGISTER_MODE_MISSING, 0)))
        self.rows = torch.frombuffer(self._memory, dtype=torch.int8).view(num_slots, row_bytes)
        self.rows[1:] = random_rows(num_slots - 1, row_bytes)  # never slot 0: this thread would wait

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def stuck_rows():
    """Makes `StuckRows`, each released after the test (before `tiers` shuts its tier down)."""
    made: list[StuckRows] = []
    yield lambda: made.append(StuckRows()) or made[-1]
    for rows in made:
        rows.release()


def stuck_key(root: Path, number: int, size: int = ROW_BYTES) -> bytes:
    """A good block of `size` bytes: its read into a `StuckRows`' slot 0 waits there."""
    write_block(block_path(root, NS, key(number)), NS, key(number), np.zeros(size, dtype=np.uint8))
    return key(number)


def started(io: FsTierIO, timeout_s: float = 10.0) -> None:
    """Until the threads took every queued block (with one thread: it sits in the stuck read)."""
    deadline = time.monotonic() + timeout_s
    while io._queue:
        assert time.monotonic() < deadline, "the tier's threads never took the queued work"
        time.sleep(0.005)


@pytest.mark.fast
def test_wait_times_out_on_a_blocked_job_and_other_jobs_go_on(tmp_path, tiers, stuck_rows):
    stuck = stuck_rows()
    io = tiers(tmp_path, rows=stuck.rows, sizes=(ROW_BYTES,), threads=2)
    io.read(1, ((stuck_key(tmp_path, 0),),), ((0,),))
    assert run(io, "write", 2, ((key(1),),), ((1,),)).ok  # the other thread serves it
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="job 1"):
        io.wait([1], 0.2)
    assert time.monotonic() - started >= 0.2
    io.wait([2, 99], 0.01)  # finished and unknown ids do not wait
    stuck.release()
    io.wait([1], 10)
    [outcome] = io.poll()
    assert outcome.job_id == 1 and outcome.ok


@pytest.mark.fast
def test_shutdown_without_drain_cancels_queued_jobs(tmp_path, tiers, stuck_rows):
    stuck = stuck_rows()
    io = tiers(tmp_path, rows=stuck.rows, sizes=(ROW_BYTES,), threads=1)
    io.read(1, ((stuck_key(tmp_path, 0),),), ((0,),))
    started(io)
    io.write(2, ((key(1), key(2)),), ((1, 2),))
    io.read(3, ((key(3),),), ((3,),))
    io.delete([key(4)])
    with pytest.raises(TransferTimeout):  # the thread is still inside job 1's read
        io.shutdown(drain=False, timeout_s=0.2)
    outcomes = {o.job_id: o for o in io.poll()}
    assert set(outcomes) == {2, 3}
    assert outcomes[2].failed == ((0, 0), (0, 1)) and outcomes[2].reasons == ("cancelled", "cancelled")
    assert outcomes[3].reasons == ("cancelled",) and outcomes[2].nbytes == outcomes[3].nbytes == 0
    assert not block_path(tmp_path, NS, key(1)).exists()
    with pytest.raises(BackendClosed):
        io.write(4, ((key(5),),), ((5,),))
    stuck.release()
    io.wait([1], 10)
    assert [(o.job_id, o.reasons) for o in io.poll()] == [(1, ())]
    io._threads[0].join(10)
    assert not io._threads[0].is_alive()


@pytest.mark.fast
def test_shutdown_with_drain_finishes_queued_jobs(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES,), threads=2)
    for job in range(5):
        io.write(job, ((key(2 * job), key(2 * job + 1)),), ((job, job + 5),))
    io.shutdown(drain=True, timeout_s=30)
    outcomes = io.poll()
    assert sorted(o.job_id for o in outcomes) == list(range(5)) and all(o.ok for o in outcomes)
    assert all(not t.is_alive() for t in io._threads)


@pytest.mark.fast
def test_malformed_jobs_are_refused_at_submit_and_empty_ones_finish_at_once(tmp_path, tiers, stuck_rows):
    stuck = stuck_rows()
    io = tiers(tmp_path, rows=stuck.rows, sizes=(ROW_BYTES, 5000))
    with pytest.raises(ValueError, match="groups"):
        io.write(1, ((key(0),),), ((0,),))
    with pytest.raises(ValueError, match="keys for"):
        io.write(1, ((key(0),), ()), ((0,), (1,)))
    with pytest.raises(ValueError, match="slot"):
        io.read(1, ((key(0),), ()), ((16,), ()))
    with pytest.raises(ValueError, match="key is"):
        io.read(1, ((b"",), ()), ((0,), ()))
    with pytest.raises(ValueError, match="slot 3 for two blocks"):  # a slot is a row, whatever the group
        io.read(1, ((key(0),), (key(1),)), ((3,), (3,)))
    io.read(1, ((stuck_key(tmp_path, 0),), ()), ((0,), ()))
    with pytest.raises(ValueError, match="already in flight"):
        io.read(1, ((key(1),), ()), ((1,), ()))
    io.write(2, ((), ()), ((), ()))
    assert io.poll() == [TierIoOutcome(2, "write", (), (), 0.0, 0)]
    stuck.release()


def touch(root: Path, number: int, mtime_s: int, namespace: bytes = NS) -> Path:
    path = block_path(root, namespace, key(number))
    write_block(path, namespace, key(number), np.zeros(100, dtype=np.uint8))
    os.utime(path, ns=(mtime_s * 10**9, mtime_s * 10**9))
    return path


@pytest.mark.fast
def test_scan_keys_oldest_first_skipping_what_is_not_a_block_file(tmp_path):
    assert scan_keys(str(tmp_path / "nowhere"), NS) == []
    touch(tmp_path, 5, 300)
    touch(tmp_path, 3, 100)
    touch(tmp_path, 9, 200)
    touch(tmp_path, 7, 200)  # same time as 9: ordered by key
    touch(tmp_path, 1, 400, namespace=OTHER_NS)  # another namespace's directory
    folder = block_path(tmp_path, NS, key(3)).parent
    junk = {
        f".{key(4).hex()}.kvb.1.2.3.tmp": HEADER_BYTES + 100,  # a writer's temp file
        "notes.txt": 10,
        f"{key(0xab).hex().upper()}.kvb": HEADER_BYTES + 100,  # block_path never writes this
        f"{key(4).hex()[:-1]}.kvb": HEADER_BYTES + 100,  # odd length
        f"{key(6).hex()}.kvb": 10,  # shorter than a header: a crash's leftover
    }
    for name, size in junk.items():
        (folder / name).write_bytes(bytes(size))
    misplaced = tmp_path / NS.hex() / "ff" / (key(8).hex() + ".kvb")  # in the wrong fan-out folder
    misplaced.parent.mkdir()
    misplaced.write_bytes(bytes(HEADER_BYTES + 100))
    (folder / (key(10).hex() + ".kvb")).mkdir()  # a directory with a key's name
    (folder / (key(11).hex() + ".kvb")).symlink_to(block_path(tmp_path, NS, key(3)))  # a link to a good block
    os.mkfifo(folder / (key(12).hex() + ".kvb"))
    (tmp_path / NS.hex() / "NAMESPACE.json").write_text("{}")
    assert scan_keys(str(tmp_path), NS) == [key(3), key(7), key(9), key(5)]
    assert scan_keys(str(tmp_path), OTHER_NS) == [key(1)]
    assert scan_keys(str(tmp_path / NS.hex() / "NAMESPACE.json"), NS) == []


def answers(lookups: KeyLookups, count: int, timeout_s: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += lookups.poll()
        time.sleep(0.005)
    return got


@pytest.mark.fast
def test_key_lookups_find_a_key_only_where_every_namespace_has_it(tmp_path):
    for number in (1, 2, 5):
        touch(tmp_path, number, 100, NS)
        touch(tmp_path, number, 100, OTHER_NS)
    touch(tmp_path, 3, 100, NS)  # only the first rank
    touch(tmp_path, 4, 100, OTHER_NS)  # only the second
    os.truncate(block_path(tmp_path, OTHER_NS, key(5)), HEADER_BYTES - 1)  # too short to be a block
    lookups = KeyLookups(functools.partial(files_present, str(tmp_path), (NS, OTHER_NS)), "1:fs")
    try:
        lookups.submit("a", tuple(key(n) for n in (4, 2, 3, 1, 5, 6)))
        lookups.submit(("b", 1), (key(1), key(2)))
        lookups.submit("c", ())
        got = answers(lookups, 3)
        assert got == [("a", (key(2), key(1)), "answered"), (("b", 1), (key(1), key(2)), "answered"),
                       ("c", (), "answered")]
        touch(tmp_path, 3, 100, OTHER_NS)  # the second rank catches up
        lookups.submit("d", (key(3),))
        assert answers(lookups, 1) == [("d", (key(3),), "answered")]
        assert lookups.poll() == []
    finally:
        lookups.close()
    assert not lookups._thread.is_alive()
    with pytest.raises(BackendClosed):
        lookups.submit("e", (key(1),))
    only_one = KeyLookups(functools.partial(files_present, str(tmp_path / "nowhere"), (NS,)), "1:fs")
    try:
        only_one.submit("f", (key(1),))
        assert answers(only_one, 1) == [("f", (), "answered")]
    finally:
        only_one.close()


@pytest.mark.fast
def test_a_lookup_that_raises_finds_nothing() -> None:
    """A store that is down: the ask is answered, empty, so the request computes."""
    def down(keys):
        raise ConnectionError("refused")

    lookups = KeyLookups(down, "2:valkey")
    try:
        lookups.submit("a", (key(1),))
        assert answers(lookups, 1) == [("a", (), "down")]
    finally:
        lookups.close()


@pytest.mark.parametrize("pack_bytes", [0, 2 << 20])
def test_a_removal_queued_before_a_write_of_the_same_key_never_deletes_the_new_file(tmp_path, tiers,
                                                                                   pack_bytes) -> None:
    """Evicted, then written again at once: whichever thread gets there first, the new file stays
    (a file per block, or a pack, whose write looks for its keys' removals in one pass)."""
    io = tiers(tmp_path, threads=16, pack_bytes=pack_bytes)
    keys = tuple(key(n) for n in range(8))
    groups = len(SIZES)
    only_first = lambda ids: tuple(ids if g == 0 else () for g in range(groups))  # noqa: E731
    for job_id in range(1, 40):
        io.delete(keys)
        io.write(job_id, only_first(keys), only_first(tuple(range(8))))
        io.wait([job_id], 30)
        assert io.poll()[0].ok
        # The removals of this round are done or skipped once the queue drains.
        deadline = time.monotonic() + 5
        while io._removals and time.monotonic() < deadline:
            time.sleep(0.001)
        assert all(block_path(tmp_path, NS, k).exists() for k in keys), job_id


@pytest.mark.fast
def test_a_replica_reads_the_writers_files_and_writes_or_removes_none(tmp_path, tiers):
    # Two ranks with identical KV share one namespace: the writer's files serve both.
    writer = tiers(tmp_path)
    own = tiers(tmp_path, rows=random_rows(16, seed=1))
    replica = ReplicaTierIO(own)
    keys = ((key(1), key(2)), (key(3, 1),), ())
    sources = ((0, 1), (2,), ())
    written = run(replica, "write", 1, keys, sources)  # first, as a faster rank may report
    assert written.ok and written.kind == "write" and written.nbytes == 0
    assert not any(block_path(tmp_path, NS, k).exists() for group in keys for k in group)
    assert run(writer, "write", 1, keys, sources).ok
    read = run(replica, "read", 2, keys, ((5, 6), (7,), ()))
    assert read.ok
    for (g, i), target in {(0, 0): 5, (0, 1): 6, (1, 0): 7}.items():
        assert payload(own, target, g) == payload(writer, sources[g][i], g)
    replica.delete([key(1)])
    replica.shutdown()
    assert block_path(tmp_path, NS, key(1)).exists()


@pytest.mark.fast
@pytest.mark.parametrize("direct_writes", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
def test_blocks_are_readable_by_the_user_or_the_tiers_group_alone(tmp_path, tiers, direct_writes, grouped):
    """KV is the prompts' content: 0644 files in 0755 directories let every local user read it."""
    gid = second_group()[1] if grouped else None
    io = tiers(tmp_path, direct_writes=direct_writes, gid=gid)
    assert run(io, "write", 1, ((key(1),), (key(2, 1),), ()), ((0,), (1,), ())).ok
    path = block_path(tmp_path, NS, key(1))
    file_mode, dir_mode = (0o600, 0o700) if gid is None else (0o660, 0o2770)
    for made, mode in ((path, file_mode), (path.parent, dir_mode), (path.parent.parent, dir_mode)):
        info = made.lstat()
        assert stat.S_IMODE(info.st_mode) == mode, made
        assert gid is None or info.st_gid == gid


@pytest.mark.fast
@pytest.mark.parametrize("direct_writes", [True, False])
def test_a_link_at_a_blocks_path_is_replaced_never_written_through(tmp_path, tiers, direct_writes):
    io = tiers(tmp_path / "tier", direct_writes=direct_writes)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = block_path(tmp_path / "tier", NS, key(1))
    path.parent.mkdir(parents=True, exist_ok=True)  # the tier made its fan-out directories
    path.symlink_to(victim)
    assert run(io, "write", 1, ((key(1),), (), ()), ((0,), (), ())).ok
    assert victim.read_bytes() == b"keep"
    assert stat.S_ISREG(path.lstat().st_mode) and stat.S_IMODE(path.lstat().st_mode) == 0o600


@pytest.mark.fast
def test_a_link_or_a_fifo_at_a_blocks_path_is_neither_found_nor_read(tmp_path, tiers):
    """A link would serve whatever it points at; a FIFO hung a tier thread in open() for good."""
    io = tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, ((key(1),),), ((0,),)).ok
    elsewhere = block_path(tmp_path / "elsewhere", NS, key(2))
    write_block(elsewhere, NS, key(2), np.zeros(ROW_BYTES, dtype=np.uint8))  # a good block of key 2
    block_path(tmp_path / "tier", NS, key(2)).symlink_to(elsewhere)
    os.mkfifo(block_path(tmp_path / "tier", NS, key(3)))
    root = str(tmp_path / "tier")
    assert files_present(root, (NS,), (key(1), key(2), key(3))) == (key(1),)
    assert scan_keys(root, NS) == [key(1)]
    io.read(2, ((key(2), key(3)),), ((1, 2),))
    io.wait([2], 2)
    [outcome] = io.poll()
    assert outcome.failed == ((0, 0), (0, 1)) and outcome.reasons == ("unreadable", "unreadable")


def aged(path: Path, seconds_ago: float) -> Path:
    when = time.time() - seconds_ago
    os.utime(path, (when, when), follow_symlinks=False)
    return path


@pytest.mark.fast
def test_leftovers_of_crashed_writers_are_removed_at_start_once_past_the_grace_period(tmp_path, tiers):
    """A writer that dies mid-write leaves its aside file for good, taking room no capacity counts.
    One younger than the grace period may be a live writer's, on another host."""
    io = tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, ((key(1),),), ((0,),)).ok
    root, fan_out = tmp_path / "tier", block_path(tmp_path / "tier", NS, key(1)).parent
    old = [fan_out / f".{key(2).hex()}.kvb.0123456789abcdef.tmp", fan_out / f".{key(3).hex()}.kvb.1.2.3.tmp",
           root / NS.hex() / ".NAMESPACE.json.0123456789abcdef.tmp", root / ".kvledger-probe-k3j2h1"]
    fresh = [fan_out / f".{key(4).hex()}.kvb.fedcba9876543210.tmp", root / ".kvledger-probe-a1b2c3"]
    kept = [block_path(root, NS, key(1)), root / NS.hex() / "NAMESPACE.json", fan_out / ".notes",
            block_path(root, OTHER_NS, key(5)).parent / ".another-namespace.tmp"]
    for path in old + fresh + kept[1:]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    (fan_out / ".a-directory.tmp").mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (fan_out / ".planted.tmp").symlink_to(victim)
    for path in [*old, *kept, fan_out / ".a-directory.tmp", fan_out / ".planted.tmp"]:
        aged(path, 3600)
    with capture_logs() as logs:
        assert io.remove_leftovers() == len(old) + 1
    assert not any(p.exists() or p.is_symlink() for p in [*old, fan_out / ".planted.tmp"])
    assert all(p.exists() for p in [*fresh, *kept, fan_out / ".a-directory.tmp", victim])
    [event] = [e for e in logs if e["event"] == "tier_leftovers_removed"]
    assert event["removed"] == len(old) + 1 and event["root"] == str(root)
    for path in fresh:
        aged(path, 601)
    assert remove_leftovers(str(root), NS) == len(fresh)
    assert remove_leftovers(str(tmp_path / "nowhere"), NS) == 0
