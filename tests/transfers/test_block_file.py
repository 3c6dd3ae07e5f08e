"""Block files on a real file system: every way a file can be wrong is named,
never served; writers never tear a file, even on a full disk."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from kvledger.transfers.lower_tiers.block_errors import BlockFileError
from kvledger.transfers.lower_tiers.block_header import HEADER_BYTES
from kvledger.transfers.lower_tiers.fs.block_file import block_path, read_block_into, write_block
from tests.support.privileges import IS_ROOT, second_group

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
KEY = bytes(range(32)) + (1).to_bytes(4, "big")


def payload(size: int = 64 << 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def written(tmp_path: Path, data: np.ndarray | None = None) -> tuple[Path, np.ndarray]:
    data = payload() if data is None else data
    path = block_path(tmp_path, NS, KEY)
    assert write_block(path, NS, KEY, data) == HEADER_BYTES + data.nbytes
    return path, data


def read(path: Path, size: int = 64 << 10, namespace: bytes = NS, key: bytes = KEY) -> np.ndarray:
    out = np.zeros(size, dtype=np.uint8)
    read_block_into(path, namespace, key, out)
    return out


def reason(path: Path, **kwargs: object) -> str:
    with pytest.raises(BlockFileError) as raised:
        read(path, **kwargs)  # type: ignore[arg-type]
    return raised.value.reason


@pytest.mark.parametrize("size", [1, 4096, 64 << 10, (2 << 20) + 3])
def test_a_block_round_trips_byte_for_byte(tmp_path, size):
    path, data = written(tmp_path, payload(size, seed=size))
    assert path == tmp_path / NS.hex() / KEY.hex()[:2] / (KEY.hex() + ".kvb")
    assert path.stat().st_size == HEADER_BYTES + size
    assert np.array_equal(read(path, size), data)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing left aside


def test_the_payload_starts_on_a_direct_io_boundary(tmp_path):
    path, data = written(tmp_path)
    raw = path.read_bytes()
    assert HEADER_BYTES % 4096 == 0 and raw[HEADER_BYTES:] == data.tobytes()


def test_a_missing_file(tmp_path):
    assert reason(block_path(tmp_path, NS, KEY)) == "missing"


@pytest.mark.parametrize("keep", [0, 10, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1000])
def test_a_truncated_file(tmp_path, keep):
    path, _ = written(tmp_path)
    os.truncate(path, keep)
    assert reason(path) in ("truncated", "foreign" if keep < 8 else "truncated")


@pytest.mark.parametrize("offset", [0, 9, 13, 24, 35, 44, 49, 60, 90, HEADER_BYTES, HEADER_BYTES + 12345, -1])
def test_a_flipped_byte_anywhere_is_caught(tmp_path, offset):
    path, _ = written(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))
    assert reason(path) in ("corrupt", "foreign")


def test_a_flipped_byte_in_the_header_padding_is_harmless(tmp_path):
    """The padding carries nothing; the bytes that matter are all checked."""
    path, data = written(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES - 1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert np.array_equal(read(path), data)


def test_another_namespace_another_key_or_another_size_is_foreign(tmp_path):
    path, _ = written(tmp_path)
    assert reason(path, namespace=OTHER_NS) == "foreign"
    assert reason(path, key=KEY[:-1] + b"\x02") == "foreign"
    assert reason(path, size=32 << 10) == "foreign"
    other = block_path(tmp_path, NS, KEY[:-1] + b"\x02")
    other.parent.mkdir(parents=True, exist_ok=True)
    os.rename(path, other)  # a file under another key's name
    assert reason(other, key=KEY[:-1] + b"\x02") == "foreign"


def test_extra_bytes_and_a_file_that_is_not_a_block(tmp_path):
    path, _ = written(tmp_path)
    with open(path, "ab") as file:
        file.write(b"x")
    assert reason(path) == "corrupt"
    path.write_bytes(b"\0" * (HEADER_BYTES + (64 << 10)))
    assert reason(path) == "foreign"


def test_a_directory_that_vanished_or_cannot_be_written(tmp_path):
    blocker = tmp_path / "file-not-dir"
    blocker.write_bytes(b"")
    with pytest.raises(BlockFileError) as raised:
        write_block(blocker / "x.kvb", NS, KEY, payload())
    assert raised.value.reason == "unwritable" and "file-not-dir" in str(raised.value)


def test_bad_namespace_or_key_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="namespace"):
        write_block(tmp_path / "a.kvb", b"short", KEY, payload())
    with pytest.raises(ValueError, match="key"):
        write_block(tmp_path / "a.kvb", NS, b"", payload())


def _writer(root: str, seed: int, rounds: int) -> None:
    data = payload(256 << 10, seed=seed)
    for _ in range(rounds):
        write_block(block_path(root, NS, KEY), NS, KEY, data)


@pytest.mark.slow
def test_writers_of_one_key_in_several_processes_never_tear_it(tmp_path):
    """Each process writes its own bytes under the same key; a reader at any
    moment finds one writer's whole block or nothing."""
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_writer, args=(str(tmp_path), seed, 40)) for seed in range(3)]
    for writer in writers:
        writer.start()
    candidates = {payload(256 << 10, seed=seed).tobytes() for seed in range(3)}
    path, seen = block_path(tmp_path, NS, KEY), 0
    while any(w.is_alive() for w in writers) or not seen:
        try:
            got = read(path, 256 << 10)
        except BlockFileError as error:
            assert error.reason == "missing", error  # before the first rename only
            continue
        assert got.tobytes() in candidates
        seen += 1
    for writer in writers:
        writer.join(timeout=60)
        assert writer.exitcode == 0
    assert seen > 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_full_disk_fails_the_write_and_leaves_nothing_torn(small_tmpfs):
    data = payload(300 << 10)
    stored = []
    for number in range(8):  # 1 MiB holds three 300 KiB blocks and their headers
        key = KEY[:-1] + bytes([number])
        path = block_path(small_tmpfs, NS, key)
        try:
            write_block(path, NS, key, data)
        except BlockFileError as error:
            assert error.reason == "disk_full" and "No space left" in error.detail
            assert not path.exists()
            continue
        stored.append(key)
    assert 1 <= len(stored) < 8
    for key in stored:
        out = np.zeros(data.nbytes, dtype=np.uint8)
        read_block_into(block_path(small_tmpfs, NS, key), NS, key, out)
        assert np.array_equal(out, data)
    leftovers = [p for p in small_tmpfs.rglob("*") if p.is_file() and p.suffix == ".tmp"]
    assert leftovers == []


@pytest.fixture
def umask():
    """Sets the process's umask for a test, and puts the old one back."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)




def mode_and_group(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return stat.S_IMODE(info.st_mode) | (info.st_mode & stat.S_ISGID), info.st_gid


def test_files_and_directories_are_the_users_alone(tmp_path, umask):
    """Block files are KV, the prompts' content: no other local user may read them (0644 and 0755 did)."""
    path = block_path(tmp_path / "tier", NS, KEY)
    write_block(path, NS, KEY, payload())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for folder in (path.parent, path.parent.parent, tmp_path / "tier"):  # fan-out, namespace, the tier's own
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_with_a_group_files_and_directories_are_the_groups_whatever_the_umask(tmp_path, umask):
    """Replicas running as other users of a service group share the tier: directories are setgid, so
    every file made in them is the group's, and a narrow umask does not take the group's access away."""
    _name, gid = second_group()
    umask(0o077)
    path = block_path(tmp_path, NS, KEY)
    write_block(path, NS, KEY, payload(), gid=gid)
    assert mode_and_group(path) == (0o660, gid)
    assert mode_and_group(path.parent) == mode_and_group(path.parent.parent) == (0o2770, gid)


def test_a_link_at_a_blocks_path_is_never_followed(tmp_path):
    """Whoever can write the directory could point a block's name at any file this user can read,
    or write."""
    elsewhere, data = written(tmp_path / "elsewhere")  # a good block of this very key
    path = block_path(tmp_path / "tier", NS, KEY)
    path.parent.mkdir(parents=True)
    path.symlink_to(elsewhere)
    with pytest.raises(BlockFileError) as raised:
        read(path)
    assert raised.value.reason == "unreadable" and "symbolic link" in raised.value.detail
    before = elsewhere.read_bytes()
    write_block(path, NS, KEY, payload(seed=1))
    assert not path.is_symlink() and stat.S_ISREG(path.lstat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert elsewhere.read_bytes() == before and np.array_equal(read(path), payload(seed=1))


def test_a_fifo_device_or_directory_at_a_blocks_path_fails_its_read_at_once(tmp_path):
    """A FIFO hung the reading thread in open() forever; each names what it is."""
    path = block_path(tmp_path, NS, KEY)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)

    def reader() -> None:
        with contextlib.suppress(BlockFileError):
            read(path)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(1.0)
    try:
        assert not thread.is_alive(), "the read of a FIFO waits for a writer"
    finally:
        if thread.is_alive():
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    with pytest.raises(BlockFileError, match="a FIFO, not a regular file") as raised:
        read(path)
    assert raised.value.reason == "unreadable"
    path.unlink()
    if IS_ROOT:  # a device node needs root to make: as another user, the FIFO and the directory alone
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's: reads as an empty file
        with pytest.raises(BlockFileError, match="a character device, not a regular file"):
            read(path)
        path.unlink()
    path.mkdir()
    with pytest.raises(BlockFileError, match="a directory, not a regular file"):
        read(path)
