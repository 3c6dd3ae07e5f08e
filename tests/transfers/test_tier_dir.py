"""The file-system tier's directory is held by descriptor (`tier_dir`): whoever
can write a directory on the way swaps a component for a link after the tier
started, and the tier neither follows it nor writes through it. Real
directories, real links."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from structlog.testing import capture_logs

from kvledger.transfers.lower_tiers.fs.block_file import block_path
from kvledger.transfers.lower_tiers.fs.tier import FileLookup, files_present, other_formats, scan_keys
from tests.support.privileges import need_root, second_group
from tests.transfers.test_fs_tier import NS, ROW_BYTES, key, made_tiers, payload, run

pytestmark = pytest.mark.fast


@pytest.fixture(params=[0, 2 << 20], ids=["files", "packs"])
def tiers(request):
    """Tiers of a file per block, and of packs (each key's name a hard link made across directories)."""
    with made_tiers(threads=4, pack_bytes=request.param) as make:
        yield make

KEYS = ((key(0), key(1), key(2)),)  # all in fan-out directory 00


def files_under(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_the_tiers_directory_swapped_for_a_link_after_start_keeps_the_tier_where_it_started(tmp_path, tiers):
    root, elsewhere = tmp_path / "tier", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    elsewhere.mkdir()
    io = tiers(root, sizes=(ROW_BYTES,))
    assert run(io, "write", 1, KEYS, ((0, 1, 2),)).ok
    root.rename(tmp_path / "moved")
    root.symlink_to(elsewhere)  # whoever can write the parent points the tier's path elsewhere
    assert run(io, "read", 2, KEYS, ((3, 4, 5),)).ok  # still from the directory it started in
    assert run(io, "write", 3, ((key(7),),), ((6,),)).ok
    assert files_under(elsewhere) == []
    assert block_path(tmp_path / "moved", NS, key(7)).is_file()
    assert payload(io, 3, 0) == payload(io, 0, 0)


def test_a_namespace_directory_swapped_for_a_link_is_not_followed(tmp_path, tiers):
    io = tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, KEYS, ((0, 1, 2),)).ok
    space, elsewhere = tmp_path / "tier" / NS.hex(), tmp_path / "elsewhere"
    shutil.copytree(space, elsewhere)  # the same good blocks, where the link points
    space.rename(tmp_path / "tier" / "old")
    space.symlink_to(elsewhere)
    before = files_under(elsewhere)
    assert run(io, "read", 2, KEYS, ((3, 4, 5),)).ok  # the held directory, renamed or not
    assert run(io, "write", 3, ((key(7),),), ((6,),)).ok
    assert files_under(elsewhere) == before


def test_a_fan_out_directory_swapped_for_a_link_fails_its_blocks_and_nothing_goes_through_it(tmp_path, tiers):
    io = tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, KEYS, ((0, 1, 2),)).ok
    fan, elsewhere = tmp_path / "tier" / NS.hex() / "00", tmp_path / "elsewhere"
    shutil.copytree(fan, elsewhere)  # good blocks behind the link: still not served through it
    shutil.rmtree(fan)
    fan.symlink_to(elsewhere)
    before = files_under(elsewhere)
    read = run(io, "read", 2, KEYS, ((3, 4, 5),))
    assert read.failed == ((0, 0), (0, 1), (0, 2)) and set(read.reasons) == {"unreadable"}
    write = run(io, "write", 3, KEYS, ((0, 1, 2),))
    assert set(write.reasons) == {"unwritable"} and write.nbytes == 0
    io.delete([key(0)])
    assert run(io, "read", 4, ((key(9),),), ((6,),)).reasons == ("unreadable",)  # after the delete, in order
    assert files_under(elsewhere) == before and fan.is_symlink()


def test_a_fan_out_directory_another_user_made_is_refused(tmp_path, tiers):
    """Its owner could put blocks in it, or take them."""
    need_root("it gives a directory to another user")
    fan = tmp_path / "tier" / NS.hex() / "00"
    fan.mkdir(parents=True)
    os.chown(fan, 65534, 65534)
    io = tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, KEYS, ((0, 1, 2),)).reasons == ("unwritable",) * 3
    assert set(run(io, "read", 2, KEYS, ((3, 4, 5),)).reasons) == {"unreadable"}
    assert list(fan.iterdir()) == []


def test_a_group_writable_fan_out_directory_is_refused_without_the_tiers_group(tmp_path, tiers):
    fan = tmp_path / "tier" / NS.hex() / "00"
    fan.mkdir(parents=True)
    os.chmod(fan, 0o770)
    io = tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, KEYS, ((0, 1, 2),)).reasons == ("unwritable",) * 3
    assert list(fan.iterdir()) == []
    assert run(io, "write", 2, ((key(0, 1),),), ((0,),)).ok  # another fan-out directory (01), the tier's own


def test_a_namespace_directory_removed_and_made_anew_by_another_process_is_found_again(tmp_path, tiers):
    """Someone clears the tier while it runs, and another process on the directory writes blocks
    again: this one lets go of the removed directories it held and reads and writes the new ones."""
    io, other = tiers(tmp_path / "tier", sizes=(ROW_BYTES,)), tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, KEYS, ((0, 1, 2),)).ok
    shutil.rmtree(tmp_path / "tier" / NS.hex())
    assert run(other, "write", 2, KEYS, ((0, 1, 2),)).ok  # made anew
    assert run(io, "read", 3, KEYS, ((3, 4, 5),)).ok
    shutil.rmtree(tmp_path / "tier")
    assert run(io, "write", 4, ((key(7),),), ((6,),)).ok  # the tier's directory too: made again
    assert block_path(tmp_path / "tier", NS, key(7)).is_file()


def test_lookups_and_the_start_scan_follow_no_fan_out_directory_swapped_for_a_link(tmp_path, tiers):
    io = tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, KEYS, ((0, 1, 2),)).ok
    lookup = FileLookup(str(tmp_path / "tier"), (NS,))
    try:
        assert lookup(KEYS[0]) == KEYS[0] and sorted(scan_keys(str(tmp_path / "tier"), NS)) == sorted(KEYS[0])
        fan, elsewhere = tmp_path / "tier" / NS.hex() / "00", tmp_path / "elsewhere"
        shutil.copytree(fan, elsewhere)
        shutil.rmtree(fan)
        fan.symlink_to(elsewhere)
        assert lookup(KEYS[0]) == ()  # good files behind the link: not offered
        assert scan_keys(str(tmp_path / "tier"), NS) == []
    finally:
        lookup.close()


def test_the_start_scan_skips_a_fan_out_directory_others_can_write_and_says_so(tmp_path, tiers):
    io = tiers(tmp_path / "tier", sizes=(ROW_BYTES,))
    assert run(io, "write", 1, KEYS, ((0, 1, 2),)).ok
    os.chmod(tmp_path / "tier" / NS.hex() / "00", 0o777)
    with capture_logs() as logs:
        assert scan_keys(str(tmp_path / "tier"), NS) == []
    assert [e["event"] for e in logs] == ["tier_directory_refused"] and "writable by every user" in logs[0]["error"]
    assert files_present(str(tmp_path / "tier"), (NS,), KEYS[0]) == ()


def test_a_group_tier_reports_another_members_namespace_of_another_format(tmp_path):
    """In a tier shared by a group, a namespace another member made is the tier's: its format is
    reported; without the group it is someone else's directory, passed over."""
    need_root("it gives a directory to another user")
    _, gid = second_group()
    root = tmp_path / "tier"
    root.mkdir(mode=0o2770)
    os.chown(root, -1, gid)
    theirs = root / bytes(range(1, 17)).hex()
    theirs.mkdir(mode=0o2770)
    (theirs / "NAMESPACE.json").write_text(json.dumps({"format_version": 2}))
    os.chown(theirs, 65534, gid)
    assert other_formats(str(root), gid) == [(theirs.name, 2, 0)]
    assert other_formats(str(root)) == []
