"""Packs on real file systems: a write job's small blocks in one file that every
key's name links to, read back through one descriptor per run; a block damaged
inside a pack, a pack cut short or a table that lies fails only what it must;
a removed key's extent is punched out; a full disk falls back to a file per block."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvledger.transfers.lower_tiers.block_header import HEADER_BYTES
from kvledger.transfers.lower_tiers.block_seal import BlockSeal
from kvledger.transfers.lower_tiers.fs.block_file import block_path, write_block
from kvledger.transfers.lower_tiers.fs.block_pack import decode_table, is_pack
from kvledger.transfers.lower_tiers.fs.tier import files_present, scan_keys
from tests.transfers.test_fs_tier import (
    NS,
    OTHER_NS,
    ROW_BYTES,
    SIZES,
    key,
    leftovers,
    made_tiers,
    payload,
    random_rows,
    run,
)

pytestmark = pytest.mark.fast


@pytest.fixture
def tiers():
    """Tiers of packs, on one thread: one run reads a job, so which blocks a pack serves is known."""
    with made_tiers(threads=1, pack_bytes=2 << 20) as make:
        yield make


def _entries(root, first_key: bytes) -> dict[bytes, tuple[int, int]]:
    data = block_path(root, NS, first_key).read_bytes()
    assert is_pack(data)
    return decode_table("pack", data, NS)


@pytest.mark.parametrize("direct_writes", [True, False])
def test_a_jobs_blocks_go_in_one_pack_every_name_links_and_read_back_exactly(tmp_path, tiers, direct_writes):
    io = tiers(tmp_path, direct_writes=direct_writes)
    keys = tuple(tuple(key(n, g) for n in range(3)) for g in range(3))
    sources = ((0, 1, 2), (3, 4, 5), (6, 7, 8))
    expected = {(g, i): payload(io, s, g) for g, slots in enumerate(sources) for i, s in enumerate(slots)}
    written = run(io, "write", 1, keys, sources)
    assert written.ok and written.nbytes == 3 * sum(SIZES)
    inodes = {block_path(tmp_path, NS, k).stat().st_ino for group in keys for k in group}
    assert len(inodes) == 1  # one file ...
    assert block_path(tmp_path, NS, keys[0][0]).stat().st_nlink == 9  # ... named by each key, nothing else
    assert leftovers(tmp_path) == []
    entries = _entries(tmp_path, keys[0][0])
    assert sorted(entries) == sorted(k for group in keys for k in group)
    every = tuple(k for group in keys for k in group)
    assert sorted(scan_keys(str(tmp_path), NS)) == sorted(every)
    assert files_present(str(tmp_path), (NS,), every) == every
    io.rows.zero_()
    read = run(io, "read", 2, keys, ((9, 10, 11), (12, 13, 14), (15, 0, 1)))
    assert read.ok and read.nbytes == 3 * sum(SIZES)
    targets = ((9, 10, 11), (12, 13, 14), (15, 0, 1))
    assert all(payload(io, s, g) == expected[(g, i)] for g, slots in enumerate(targets) for i, s in enumerate(slots))


def test_direct_and_buffered_packs_are_the_same_bytes(tmp_path, tiers):
    direct = tiers(tmp_path / "direct", direct_writes=True)
    buffered = tiers(tmp_path / "buffered", rows=direct.rows, direct_writes=False)
    keys = ((key(1), key(2)), (key(3, 1),), (key(4, 2),))
    for io in (direct, buffered):
        assert run(io, "write", 1, keys, ((0, 1), (2,), (3,))).ok
    assert (block_path(tmp_path / "direct", NS, key(1)).read_bytes()
            == block_path(tmp_path / "buffered", NS, key(1)).read_bytes())


def test_jobs_are_cut_into_packs_of_pack_bytes_and_a_lone_block_is_a_plain_file(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES,), pack_bytes=2 * ROW_BYTES)
    keys = (tuple(key(n) for n in range(5)),)
    assert run(io, "write", 1, keys, ((0, 1, 2, 3, 4),)).ok
    names = [block_path(tmp_path, NS, k) for k in keys[0]]
    assert [p.stat().st_nlink for p in names] == [2, 2, 2, 2, 1]
    assert names[0].stat().st_ino == names[1].stat().st_ino != names[2].stat().st_ino
    assert not is_pack(names[4].read_bytes()) and names[4].stat().st_size == HEADER_BYTES + ROW_BYTES


def test_damage_inside_a_pack_fails_only_the_blocks_it_touches(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES,))
    keys = (tuple(key(n) for n in range(6)),)
    assert run(io, "write", 1, keys, ((0, 1, 2, 3, 4, 5),)).ok
    good = [payload(io, s, 0) for s in range(6)]
    entries = _entries(tmp_path, key(0))
    fd = os.open(block_path(tmp_path, NS, key(0)), os.O_RDWR)
    try:
        offset = entries[key(1)][0]
        os.pwrite(fd, bytes([os.pread(fd, 1, offset + HEADER_BYTES + 77)[0] ^ 1]), offset + HEADER_BYTES + 77)
        os.ftruncate(fd, entries[key(4)][0] + HEADER_BYTES + 1000)  # block 4 cut short, block 5 gone
    finally:
        os.close(fd)
    io.rows.zero_()
    outcome = run(io, "read", 2, keys, ((6, 7, 8, 9, 10, 11),))
    assert dict(zip(outcome.failed, outcome.reasons)) == {(0, 1): "corrupt", (0, 4): "truncated",
                                                          (0, 5): "truncated"}
    assert [payload(io, s, 0) for s in (6, 8, 9)] == [good[0], good[2], good[3]]


def test_a_table_that_lies_fails_its_blocks_and_serves_nothing(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES,))
    keys = (tuple(key(n) for n in range(3)),)
    assert run(io, "write", 1, keys, ((0, 1, 2),)).ok
    fd = os.open(block_path(tmp_path, NS, key(0)), os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff", 40)  # inside the first entry: the table's checksum no longer holds
    finally:
        os.close(fd)
    io.rows.fill_(7)
    outcome = run(io, "read", 2, keys, ((3, 4, 5),))
    assert outcome.reasons == ("corrupt", "corrupt", "corrupt")
    assert all(payload(io, s, 0) == bytes([7]) * ROW_BYTES for s in (3, 4, 5))


def test_a_table_claiming_a_huge_size_is_refused_before_anything_is_read(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES,))
    keys = (tuple(key(n) for n in range(2)),)
    assert run(io, "write", 1, keys, ((0, 1),)).ok
    fd = os.open(block_path(tmp_path, NS, key(0)), os.O_RDWR)
    try:
        os.pwrite(fd, (0xFFFFFFFF).to_bytes(4, "little"), 10)  # the table's size field: 4 GiB
    finally:
        os.close(fd)
    outcome = run(io, "read", 2, keys, ((2, 3),))
    assert outcome.reasons == ("corrupt", "corrupt")


def test_a_name_replaced_by_anothers_file_is_read_from_the_pack_or_fails_when_opened(tmp_path, tiers):
    """The first key of a run is opened by its name: another namespace's file there
    fails it. A key the opened pack holds is read from it, checked as ever."""
    io = tiers(tmp_path, sizes=(ROW_BYTES,))
    keys = (tuple(key(n) for n in range(3)),)
    assert run(io, "write", 1, keys, ((0, 1, 2),)).ok
    good = [payload(io, s, 0) for s in range(3)]
    write_block(block_path(tmp_path, NS, key(1)), OTHER_NS, key(1), np.zeros(ROW_BYTES, np.int8))
    io.rows.zero_()
    outcome = run(io, "read", 2, keys, ((3, 4, 5),))
    assert outcome.ok and [payload(io, s, 0) for s in (3, 4, 5)] == good
    outcome = run(io, "read", 3, ((key(1), key(2)),), ((6, 7),))
    assert dict(zip(outcome.failed, outcome.reasons)) == {(0, 0): "foreign"}
    assert payload(io, 7, 0) == good[2]  # the foreign file was no pack: key 2 opened by its own name


def test_a_forged_block_in_a_sealed_pack_is_never_served(tmp_path, tiers):
    seal = BlockSeal(b"s" * 32)
    io = tiers(tmp_path, sizes=(ROW_BYTES,), seal=seal)
    keys = (tuple(key(n) for n in range(3)),)
    assert run(io, "write", 1, keys, ((0, 1, 2),)).ok
    entries = _entries(tmp_path, key(0))
    fd = os.open(block_path(tmp_path, NS, key(0)), os.O_RDWR)
    try:  # a writer of the directory without the secret rewrites block 2's payload in place
        os.pwrite(fd, bytes(ROW_BYTES), entries[key(2)][0] + HEADER_BYTES)
    finally:
        os.close(fd)
    outcome = run(io, "read", 2, keys, ((3, 4, 5),))
    # With a secret, a block that fails any check at its keyed name is forged (its checksum failed first)
    assert dict(zip(outcome.failed, outcome.reasons)) == {(0, 2): "forged"}


@pytest.mark.parametrize("direct_writes", [True, False])
def test_an_encrypted_pack_round_trips_and_holds_no_plaintext(tmp_path, tiers, direct_writes):
    io = tiers(tmp_path, sizes=(ROW_BYTES,), seal=BlockSeal(b"s" * 32, encrypt=True), direct_writes=direct_writes)
    keys = (tuple(key(n) for n in range(4)),)
    assert run(io, "write", 1, keys, ((0, 1, 2, 3),)).ok
    good = [payload(io, s, 0) for s in range(4)]
    raw = block_path(tmp_path, NS, key(0)).read_bytes()
    assert all(block[:4096] not in raw for block in good)
    io.rows.zero_()
    assert run(io, "read", 2, keys, ((4, 5, 6, 7),)).ok
    assert [payload(io, s, 0) for s in (4, 5, 6, 7)] == good


def test_removing_a_key_punches_its_block_out_and_the_last_name_frees_the_pack(tmp_path, tiers):
    io = tiers(tmp_path, sizes=(ROW_BYTES,))
    keys = (tuple(key(n) for n in range(4)),)
    assert run(io, "write", 1, keys, ((0, 1, 2, 3),)).ok
    good = [payload(io, s, 0) for s in range(4)]
    before = block_path(tmp_path, NS, key(0)).stat().st_blocks
    io.delete([key(1)])
    assert run(io, "write", 2, ((key(9),),), ((9,),)).ok  # one thread: after the delete
    assert not block_path(tmp_path, NS, key(1)).exists()
    after = block_path(tmp_path, NS, key(0)).stat()
    assert (before - after.st_blocks) * 512 >= ROW_BYTES and after.st_nlink == 3
    io.rows.zero_()
    outcome = run(io, "read", 3, ((key(0), key(2), key(3)),), ((4, 5, 6),))
    assert outcome.ok and [payload(io, s, 0) for s in (4, 5, 6)] == [good[0], good[2], good[3]]
    outcome = run(io, "read", 4, ((key(0), key(1)),), ((7, 8),))  # asked anyway: its extent reads as nothing
    assert dict(zip(outcome.failed, outcome.reasons)) == {(0, 1): "missing"}
    io.delete([key(0), key(2), key(3), key(9)])
    io.shutdown(drain=True, timeout_s=10)
    assert [p for p in (tmp_path / NS.hex()).rglob("*") if p.is_file()] == []


def test_a_full_disk_falls_back_to_a_file_per_block(small_tmpfs, tiers):
    size = 300 << 10  # 1 MiB holds three of these and their headers, not a pack of eight
    io = tiers(small_tmpfs, rows=random_rows(16, size), sizes=(size,), pack_bytes=8 * size)
    keys = (tuple(key(n) for n in range(8)),)
    outcome = run(io, "write", 1, keys, (tuple(range(8)),))
    stored = [n for n in range(8) if (0, n) not in outcome.failed]
    assert set(outcome.reasons) == {"disk_full"} and 1 <= len(stored) <= 3
    assert leftovers(small_tmpfs) == []
    expected = [payload(io, n, 0) for n in stored]
    io.rows.zero_()
    read = run(io, "read", 2, (tuple(key(n) for n in stored),), (tuple(range(8, 8 + len(stored))),))
    assert read.ok and [payload(io, 8 + n, 0) for n in range(len(stored))] == expected


def test_a_pack_holds_at_most_blocks_max_blocks_whatever_their_size(tmp_path, tiers):
    from kvledger.transfers.lower_tiers.fs.block_pack import BLOCKS_MAX

    count = BLOCKS_MAX + 45
    io = tiers(tmp_path, rows=random_rows(count, 64), sizes=(64,))  # 300 blocks of 64 bytes: 19 KB
    keys = (tuple(key(n) for n in range(count)),)
    assert run(io, "write", 1, keys, (tuple(range(count)),)).ok
    links = [block_path(tmp_path, NS, k).stat().st_nlink for k in keys[0]]
    assert links == [BLOCKS_MAX] * BLOCKS_MAX + [45] * 45
    expected = [payload(io, n, 0) for n in range(count)]
    io.rows.zero_()
    assert run(io, "read", 2, keys, (tuple(range(count)),)).ok
    assert [payload(io, n, 0) for n in range(count)] == expected


def test_a_key_written_again_or_a_name_planted_at_it_is_replaced_by_the_new_pack(tmp_path, tiers):
    """A pack's name goes straight to a key's free name; a name already there (the
    key's earlier block, or a link planted at it) is replaced, never followed."""
    io = tiers(tmp_path, sizes=(ROW_BYTES,))
    keys = ((key(1), key(2)),)
    assert run(io, "write", 1, keys, ((0, 1),)).ok
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the tier's")
    planted = block_path(tmp_path, NS, key(3))
    os.symlink(outside, planted)
    again = ((key(2), key(3)),)
    assert run(io, "write", 2, again, ((4, 5),)).ok  # key 2 again, from other rows; key 3's name is a link
    assert outside.read_bytes() == b"not the tier's" and not planted.is_symlink()
    assert block_path(tmp_path, NS, key(2)).stat().st_ino == planted.stat().st_ino  # the new pack's names
    assert leftovers(tmp_path) == []
    expected = [payload(io, s, 0) for s in (4, 5)]
    assert len(set(expected)) == 2
    io.rows.zero_()
    assert run(io, "read", 3, again, ((8, 9),)).ok  # from the names, which open the new pack
    assert [payload(io, s, 0) for s in (8, 9)] == expected
