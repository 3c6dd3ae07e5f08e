"""Block files on a real file system: every way a file can be wrong is named,
never served; writers never tear a file, even on a full disk."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

from kvledger.transfers.block_file import (
    HEADER_BYTES,
    BlockFileError,
    block_path,
    read_block_into,
    write_block,
)

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


@pytest.fixture
def small_tmpfs(mount):
    """A real 1 MiB tmpfs."""
    return mount("tmpfs", "size=1m")


def test_a_full_disk_fails_the_write_and_leaves_nothing_torn(small_tmpfs):
    data = payload(300 << 10)
    stored = []
    for number in range(8):  # 1 MiB holds three 300 KiB blocks and their headers
        key = KEY[:-1] + bytes([number])
        path = block_path(small_tmpfs, NS, key)
        try:
            write_block(path, NS, key, data)
        except BlockFileError as error:
            assert error.reason == "unwritable" and "No space left" in error.detail
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
