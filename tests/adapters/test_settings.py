"""kv_connector_extra_config: every mistake is named, nothing is guessed."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvledger.adapters.settings import (
    FaultSettings,
    FsTierSettings,
    ValkeyTierSettings,
    block_file_bytes,
    parse_settings,
)
from kvledger.adapters.vllm_version import UnsupportedVLLMVersion, check_vllm_version
from kvledger.events.config import ConfigError, PolicyName, Protection, StoreMode
from kvledger.transfers.lower_tiers.valkey.store import ValkeyServer
from tests.support.privileges import need_root, second_group

pytestmark = pytest.mark.fast


def test_defaults_and_the_vllm_alias_for_capacity():
    settings = parse_settings({"cpu_bytes_to_use": 1 << 30})
    assert settings.capacity_bytes == 1 << 30
    assert settings.eviction_policy is PolicyName.LRU
    assert settings.event_log is None
    assert settings.faults == FaultSettings()  # no injected faults unless asked
    assert settings.load_timeout_s == 30.0


def test_the_transfer_config_builder_gives_settings_the_connector_accepts():
    from kvledger.adapters.settings import kv_transfer_config

    config = kv_transfer_config(capacity_bytes=4096, store_mode="lazy")
    assert config["kv_connector_module_path"] == "kvledger.adapters.vllm"
    assert config["kv_load_failure_policy"] == "recompute"
    assert parse_settings(config["kv_connector_extra_config"]).store_mode.value == "lazy"


def test_every_key_is_read():
    settings = parse_settings({
        "capacity_bytes": 4096, "eviction_policy": "arc", "protection": "pin", "event_log": "/tmp/x.log", "event_log_format": "jsonl",
        "digest_interval": 8, "snapshot_interval_events": 1000, "log_level": "debug", "log_json": True,
        "load_timeout_s": 2.5,
        "fault_injection": {"load_rate": 0.5, "store_rate": 0.25, "load_block_rate": 0.1, "seed": 7,
                            "corrupt": True},
    })
    assert (settings.eviction_policy, settings.event_log, settings.event_log_format) == (
        PolicyName.ARC, "/tmp/x.log", "jsonl")
    assert settings.protection is Protection.PIN
    lazy = parse_settings({"capacity_bytes": 1, "store_mode": "lazy", "lazy_target_blocks": 8})
    assert (lazy.store_mode, lazy.lazy_target_blocks) == (StoreMode.LAZY, 8)
    assert (settings.digest_interval, settings.log_level, settings.log_json) == (8, "debug", True)
    assert settings.snapshot_interval_events == 1000
    assert settings.load_timeout_s == 2.5
    faults = settings.faults
    assert (faults.load_rate, faults.store_rate, faults.load_block_rate, faults.seed, faults.corrupt) == (
        0.5, 0.25, 0.1, 7, True)


def test_faults_can_be_limited_to_some_tensor_parallel_ranks():
    # A failure on one rank only: the others copy every block.
    everywhere = parse_settings({"capacity_bytes": 1, "fault_injection": {"load_rate": 0.5}}).faults
    assert everywhere.ranks == () and everywhere.applies_to(0) and everywhere.applies_to(3)
    one = parse_settings({"capacity_bytes": 1, "fault_injection": {"load_rate": 0.5, "ranks": [1, 1]}}).faults
    assert one.ranks == (1,)
    assert one.applies_to(1) and not one.applies_to(0)


@pytest.mark.parametrize("extra, words", [
    ({}, "capacity_bytes"),
    ({"capacity_bytes": 1, "capacity": 2}, "'capacity'"),
    ({"capacity_bytes": "1GB"}, "must be int"),
    ({"capacity_bytes": True}, "must be int"),
    ({"capacity_bytes": 0}, "positive"),
    ({"capacity_bytes": 1, "cpu_bytes_to_use": 2}, "disagree"),
    ({"capacity_bytes": 1, "eviction_policy": "fifo"}, "'lru' or 'arc'"),
    ({"capacity_bytes": 1, "event_log_format": "csv"}, "event_log_format"),
    ({"capacity_bytes": 1, "protection": "lock"}, "'flush' or 'pin'"),
    ({"capacity_bytes": 1, "store_mode": "never"}, "'eager' or 'lazy'"),
    ({"capacity_bytes": 1, "store_mode": "lazy", "protection": "pin"}, "needs protection 'flush'"),
    ({"capacity_bytes": 1, "lazy_target_blocks": 0}, "lazy_target_blocks"),
    ({"capacity_bytes": 1, "fault_injection": {"store_hold_steps": -1}}, "store_hold_steps"),
    ({"capacity_bytes": 1, "log_level": "loud"}, "log_level"),
    ({"capacity_bytes": 1, "load_timeout_s": -1}, "load_timeout_s"),
    ({"capacity_bytes": 1, "digest_interval": -1}, "digest_interval"),
    ({"capacity_bytes": 1, "snapshot_interval_events": -5}, "snapshot_interval_events"),
    ({"capacity_bytes": 1, "fault_injection": {"load_rate": 2}}, "within [0, 1]"),
    ({"capacity_bytes": 1, "fault_injection": {"rate": 0.1}}, "'rate'"),
    ({"capacity_bytes": 1, "fault_injection": {"seed": 0.5}}, "fault_injection.seed"),
    ({"capacity_bytes": 1, "fault_injection": []}, "fault_injection"),
    ({"capacity_bytes": 1, "weights_version": ""}, "weights_version must be a non-empty string"),
    ({"capacity_bytes": 1, "weights_version": 3}, "kv_connector_extra_config['weights_version'] must be str"),
    ({"capacity_bytes": 1, "fault_injection": {"ranks": 1}}, "fault_injection.ranks"),
    ({"capacity_bytes": 1, "fault_injection": {"ranks": [-1]}}, "worker indices"),
    ({"capacity_bytes": 1, "fault_injection": {"ranks": [True]}}, "worker indices"),
])
def test_bad_settings_name_the_problem(extra, words):
    with pytest.raises(ConfigError) as info:
        parse_settings(extra)
    assert words in str(info.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0"])
def test_supported_vllm_versions(version):
    assert check_vllm_version(version) == version


@pytest.mark.parametrize(("version", "advice"), [
    ("0.31.2", "upgrade vLLM to 0.32.x or 0.33.x"),
    ("0.34.0", r"install vLLM 0.32.x or 0.33.x \(pip install 'vllm>=0.32,<0.34'\), or a kvledger release"),
    ("1.0.0", "install vLLM 0.32.x or 0.33.x .*, or a kvledger release whose compatibility table lists this vLLM"),
])
def test_other_vllm_versions_are_refused_by_name_with_what_to_do(version, advice):
    with pytest.raises(UnsupportedVLLMVersion, match=f"0.32.x or 0.33.x; the installed vLLM is {version}: {advice}"):
        check_vllm_version(version)


def test_an_unreadable_version_is_refused():
    with pytest.raises(UnsupportedVLLMVersion, match="cannot read the vLLM version 'dev'; kvledger supports vLLM 0.32.x"):
        check_vllm_version("dev")


def test_version_line_for_an_unsupported_vllm(monkeypatch):
    from kvledger.adapters import vllm_version

    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: ("vllm", "0.34.1"))
    assert vllm_version.describe().startswith("vLLM: vllm 0.34.1, NOT supported: kvledger supports vLLM 0.32.x")
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: None)
    assert vllm_version.describe() == "vLLM: not installed (supported: 0.32.x or 0.33.x)"



# --- secondary_tiers: checked against the real file system ---


def with_tiers(*tiers: dict) -> dict:
    return {"capacity_bytes": 4096, "secondary_tiers": list(tiers)}


def fs(path: str | Path, capacity_bytes: int = 1 << 20, **keys: object) -> dict:
    return {"type": "fs", "path": str(path), "capacity_bytes": capacity_bytes, **keys}


def problem(extra: dict) -> str:
    with pytest.raises(ConfigError) as raised:
        parse_settings(extra)
    return str(raised.value)


@pytest.fixture
def mounted(mount):
    """Mounts a real tmpfs with the given options, its root this user's alone
    (a tmpfs's is 1777 by default, which a tier refuses)."""
    return lambda options: mount("tmpfs", f"mode=0700,{options}")


def test_no_secondary_tiers_by_default():
    assert parse_settings({"capacity_bytes": 1}).secondary_tiers == ()


def test_an_fs_tier_with_its_defaults_and_its_directory_made(tmp_path):
    path = tmp_path / "a" / "b" / "tier"
    settings = parse_settings(with_tiers(fs(path, capacity_bytes=4096)))
    assert settings.secondary_tiers == (FsTierSettings(path=str(path), capacity_bytes=4096),)
    tier = settings.secondary_tiers[0]
    assert (tier.kind, tier.threads, tier.shared) == ("fs", 16, True)
    assert path.is_dir() and list(path.iterdir()) == []  # the write probe left nothing behind


def test_every_fs_key_is_read_and_the_order_kept(tmp_path):
    settings = parse_settings(with_tiers(
        fs(tmp_path / "first", capacity_bytes=1 << 16, threads=2, shared=False),
        {"type": "fs", "root_dir": str(tmp_path / "second"), "capacity_bytes": 1 << 17}))
    assert settings.secondary_tiers == (
        FsTierSettings(path=str(tmp_path / "first"), capacity_bytes=1 << 16, threads=2, shared=False),
        FsTierSettings(path=str(tmp_path / "second"), capacity_bytes=1 << 17))


def test_paths_are_made_absolute_and_normal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tier, = parse_settings(with_tiers(fs("x/../tier/"))).secondary_tiers
    assert tier.path == str(tmp_path / "tier")


def test_path_and_root_dir_may_both_be_given_if_they_agree(tmp_path):
    tier, = parse_settings(with_tiers({**fs(tmp_path / "t"), "root_dir": f"{tmp_path}/t/"})).secondary_tiers
    assert tier.path == str(tmp_path / "t")
    words = problem(with_tiers({**fs(tmp_path / "t"), "root_dir": str(tmp_path / "u")}))
    assert "secondary_tiers[0].path and secondary_tiers[0].root_dir" in words and "disagree" in words


def test_parsing_twice_as_the_worker_does_gives_the_same_settings(tmp_path):
    extra = with_tiers(fs(tmp_path / "tier"), fs(tmp_path / "other"))
    assert parse_settings(extra) == parse_settings(extra)


@pytest.mark.parametrize("tiers, words", [
    ({"type": "fs"}, "kv_connector_extra_config['secondary_tiers'] must be list"),
    (["fs"], "secondary_tiers[0] must be a dict, got 'fs'"),
    ([{"path": "/tmp/x", "capacity_bytes": 1}], "secondary_tiers[0] needs a 'type': one of 'fs'"),
    ([{"type": "nfs"}], "secondary_tiers[0].type 'nfs' is not supported; supported types: 'fs'"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": 1, "size": 2}],
     "unknown secondary_tiers[0] key(s) 'size'; a 'fs' tier knows: capacity_bytes, encrypt, group, pack_bytes, path, "
     "previous_secret_env, previous_secret_until, root_dir, secret_env, shared, threads, type"),
    ([{"type": "fs", "capacity_bytes": 1}], "secondary_tiers[0] needs 'path'"),
    ([{"type": "fs", "path": ""}], "secondary_tiers[0].path must be a non-empty str, got ''"),
    ([{"type": "fs", "root_dir": 7}], "secondary_tiers[0].root_dir must be a non-empty str, got 7"),
    ([{"type": "fs", "path": "/tmp/x"}], "secondary_tiers[0] needs 'capacity_bytes'"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": -1}],
     "secondary_tiers[0].capacity_bytes must be a positive int, got -1"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": 0}],
     "secondary_tiers[0].capacity_bytes must be a positive int, got 0"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": True}],
     "secondary_tiers[0].capacity_bytes must be a positive int, got True"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": "1GB"}],
     "secondary_tiers[0].capacity_bytes must be a positive int, got '1GB'"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": 1.5}],
     "secondary_tiers[0].capacity_bytes must be a positive int, got 1.5"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": 1, "threads": 0}],
     "secondary_tiers[0].threads must be a positive int, got 0"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": 1, "pack_bytes": -1}],
     "secondary_tiers[0].pack_bytes must be an int >= 0 (0: a file per block), got -1"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": 1, "pack_bytes": "2MB"}],
     "secondary_tiers[0].pack_bytes must be an int >= 0 (0: a file per block), got '2MB'"),
    ([{"type": "fs", "path": "/tmp/x", "capacity_bytes": 1, "shared": "yes"}],
     "secondary_tiers[0].shared must be a bool, got 'yes'"),
])
def test_bad_tier_entries_name_the_key(tiers, words, tmp_path):
    assert words in problem({"capacity_bytes": 1, "secondary_tiers": tiers})


def test_the_index_of_a_bad_tier_is_named(tmp_path):
    words = problem(with_tiers(fs(tmp_path / "good"), fs(tmp_path / "bad", threads=-2)))
    assert words == "secondary_tiers[1].threads must be a positive int, got -2"


def test_a_path_that_is_a_file(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    assert problem(with_tiers(fs(tmp_path / "file"))) == (
        f"secondary_tiers[0].path {str(tmp_path / 'file')!r} is not a directory")


def test_a_path_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    words = problem(with_tiers(fs(tmp_path / "file" / "tier")))
    assert words.startswith(f"secondary_tiers[0].path {str(tmp_path / 'file' / 'tier')!r} cannot be created: ")
    assert "Not a directory" in words


def test_a_read_only_directory_is_refused(mounted):
    read_only = mounted("ro,size=1m")
    assert problem(with_tiers(fs(read_only, capacity_bytes=4096))).startswith(
        f"secondary_tiers[0].path {str(read_only)!r} is not writable: [Errno 30] Read-only file system: "
        f"{str(read_only / '.kvledger-probe-')!r}"[:-1])
    words = problem(with_tiers(fs(read_only / "below", capacity_bytes=4096)))
    assert "secondary_tiers[0].path" in words and "cannot be created" in words and "Read-only file system" in words


def test_a_capacity_over_the_free_space_is_refused(mounted):
    small = mounted("size=1m")
    free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
    assert free == 1 << 20
    assert parse_settings(with_tiers(fs(small, capacity_bytes=free))).secondary_tiers[0].capacity_bytes == free
    assert problem(with_tiers(fs(small, capacity_bytes=free + 1))) == (
        f"secondary_tiers[0].capacity_bytes {free + 1} does not fit in {str(small)!r}: the file system has "
        f"{free} bytes free, and block files already there take 0")


def test_block_files_already_in_the_tier_count_as_room(mounted):
    small = mounted("size=1m")
    for number in range(3):  # 600 KiB of block files, in the layout block_file.block_path makes
        (small / "ns" / f"{number:02x}").mkdir(parents=True)
        (small / "ns" / f"{number:02x}" / f"{number:02x}.kvb").write_bytes(bytes(200 << 10))
    (small / "other.bin").write_bytes(bytes(200 << 10))  # not the tier's: no room
    extra = with_tiers(fs(small, capacity_bytes=(1 << 20) - (64 << 10)))
    words = problem(extra)
    assert "secondary_tiers[0].capacity_bytes" in words and f"take {600 << 10}" in words
    (small / "other.bin").unlink()
    assert parse_settings(extra).secondary_tiers[0].path == str(small)


def test_block_file_bytes_walks_the_tree_and_counts_only_block_files(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "k.kvb").write_bytes(os.urandom(8192))
    (tmp_path / "a" / "j.kvb").write_bytes(os.urandom(4096))
    os.mkfifo(tmp_path / "a" / "fifo.kvb")
    (tmp_path / "a" / "j.kvb.tmp").write_bytes(bytes(1000))  # a write in flight
    (tmp_path / "NAMESPACE.json").write_bytes(bytes(1000))
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "far.kvb").write_bytes(bytes(5000))
    (tmp_path / "link").symlink_to(outside)  # not followed
    (tmp_path / "a" / "far.kvb").symlink_to(outside / "far.kvb")  # nor this one
    os.link(tmp_path / "a" / "b" / "k.kvb", tmp_path / "a" / "k2.kvb")  # a pack's second name: counted once
    allocated = sum(os.stat(tmp_path / "a" / name).st_blocks * 512 for name in ("b/k.kvb", "j.kvb"))
    assert allocated >= 12288 and block_file_bytes(str(tmp_path)) == allocated
    assert block_file_bytes(str(tmp_path / "missing")) == 0


def test_a_sparse_block_file_makes_no_room(mounted):
    """An 8 TiB sparse file let a 4 TiB capacity pass on a disk with far less free."""
    small = mounted("size=1m")
    (small / "ns").mkdir()
    with open(small / "ns" / "big.kvb", "wb") as sparse:
        sparse.truncate(8 << 40)
    assert block_file_bytes(str(small)) == 0
    assert problem(with_tiers(fs(small, capacity_bytes=4 << 40))) == (
        f"secondary_tiers[0].capacity_bytes {4 << 40} does not fit in {str(small)!r}: the file system has "
        f"{1 << 20} bytes free, and block files already there take 0")


USERS_GID = grp.getgrnam("users").gr_gid  # real groups other than root's
NOGROUP_GID = grp.getgrnam("nogroup").gr_gid


def mode_and_group(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return stat.S_IMODE(info.st_mode), info.st_gid


def test_a_tier_directory_kvledger_makes_is_the_users_alone_or_the_tiers_groups(tmp_path):
    """Its blocks are the prompts' KV: under 0755 every local user could read them."""
    tier, = parse_settings(with_tiers(fs(tmp_path / "a" / "own"))).secondary_tiers
    assert tier.gid is None and mode_and_group(tmp_path / "a" / "own")[0] == 0o700
    name, gid = second_group()
    old = os.umask(0o077)  # a narrow umask must not take the group's access away
    try:
        tier, = parse_settings(with_tiers(fs(tmp_path / "shared", group=name))).secondary_tiers
    finally:
        os.umask(old)
    assert tier.gid == gid and mode_and_group(tmp_path / "shared") == (0o2770, gid)
    for same in (gid, str(gid)):  # by id too; and the directory made is accepted again
        assert parse_settings(with_tiers(fs(tmp_path / "shared", group=same))).secondary_tiers == (tier,)


@pytest.mark.parametrize("group, words", [
    ("kvledger-no-such-group", "secondary_tiers[0].group 'kvledger-no-such-group' is not a group on this host"),
    ("", "secondary_tiers[0].group must be a group's name or id, got ''"),
    (True, "secondary_tiers[0].group must be a group's name or id, got True"),
    (-1, "secondary_tiers[0].group must be a group's name or id, got -1"),
    (1.5, "secondary_tiers[0].group must be a group's name or id, got 1.5"),
])
def test_a_bad_group_is_named(tmp_path, group, words):
    assert words in problem(with_tiers(fs(tmp_path / "tier", group=group)))
    assert not (tmp_path / "tier").exists()


def test_a_tier_directory_another_user_owns_is_refused_unless_it_is_the_tiers_groups(tmp_path):
    """Its owner could read every block, and plant blocks that every replica serves."""
    need_root("it gives a directory to another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o2770)
    os.chown(theirs, 65534, NOGROUP_GID)
    words = problem(with_tiers(fs(theirs)))
    assert words.startswith(f"secondary_tiers[0].path {str(theirs)!r} is owned by uid 65534")
    assert "not by this process's user uid 0" in words and f"'group': the directory's group (gid {NOGROUP_GID}" in words
    assert "is owned by uid 65534" in problem(with_tiers(fs(theirs, group="users")))
    tier, = parse_settings(with_tiers(fs(theirs, group="nogroup"))).secondary_tiers  # a service group's directory
    assert tier.gid == NOGROUP_GID
    mine = tmp_path / "mine"  # this user's, another group's: the tier's group could not use it
    mine.mkdir()
    assert problem(with_tiers(fs(mine, group="users"))).startswith(
        f"secondary_tiers[0].path {str(mine)!r} belongs to group gid 0 (root), not the tier's 'group' "
        f"gid {USERS_GID} (users)")


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o2772])
def test_a_tier_directory_every_user_can_write_is_refused(tmp_path, mode):
    """Anyone could plant blocks in it that every replica serves, or remove them."""
    path = tmp_path / "open"
    path.mkdir()
    os.chmod(path, mode)
    assert problem(with_tiers(fs(path))).startswith(
        f"secondary_tiers[0].path {str(path)!r} is writable by every user (mode {mode:#o}): ")


def test_a_tier_directory_that_is_a_link_is_refused(tmp_path):
    """Whoever can replace the link can point the tier at another directory."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert problem(with_tiers(fs(tmp_path / "link"))).startswith(
        f"secondary_tiers[0].path {str(tmp_path / 'link')!r} is a symbolic link (to {str(tmp_path / 'real')!r})")


@pytest.mark.parametrize("second", ["{0}/tier", "{0}/tier/"])  # an alias by a link is refused as a link
def test_two_tiers_in_one_directory_are_refused(tmp_path, second):
    (tmp_path / "tier").mkdir()
    words = problem(with_tiers(fs(tmp_path / "tier"), fs(second.format(tmp_path))))
    assert words.startswith("secondary_tiers[1].path") and words.endswith("is also secondary_tiers[0].path")


def test_a_tier_inside_another_is_refused(tmp_path):
    words = problem(with_tiers(fs(tmp_path / "tier" / "inner"), fs(tmp_path / "tier")))
    assert "secondary_tiers[1].path" in words and "secondary_tiers[0].path" in words and "nest" in words
    assert parse_settings(with_tiers(fs(tmp_path / "tier1"), fs(tmp_path / "tier2"))).secondary_tiers


# -- the Valkey tier ------------------------------------------------------------------------------


def valkey(url: str = "redis://127.0.0.1:1", **more) -> dict:
    return {"type": "valkey", "url": url, "capacity_bytes": 1 << 20, **more}


def test_a_valkey_tier_from_its_url(valkey_server, monkeypatch):
    server = valkey_server()
    tier, = parse_settings(with_tiers(valkey(server.url))).secondary_tiers
    assert tier == ValkeyTierSettings(server=ValkeyServer(nodes=(("127.0.0.1", server.port),)),
                                      capacity_bytes=1 << 20)
    assert (tier.kind, tier.shared, tier.connections, tier.server.timeout_s) == ("valkey", True, 8, 1.0)
    other, = parse_settings(with_tiers(valkey(f"valkey://127.0.0.1:{server.port}/0", timeout_s=0.25,
                                              connections=2))).secondary_tiers
    assert other.server.timeout_s == 0.25 and other.connections == 2


def test_a_password_from_the_url_or_the_environment_is_never_shown(valkey_server, monkeypatch):
    server = valkey_server()
    server.cli("CONFIG", "SET", "requirepass", "s3cret word")
    tier, = parse_settings(with_tiers(valkey(f"redis://:s3cret%20word@127.0.0.1:{server.port}"))).secondary_tiers
    assert tier.server.password == "s3cret word" and "s3cret" not in repr(tier)
    monkeypatch.setenv("KVLEDGER_TEST_PASSWORD", "s3cret word")
    tier, = parse_settings(with_tiers(valkey(server.url, password_env="KVLEDGER_TEST_PASSWORD"))).secondary_tiers
    assert tier.server.password == "s3cret word"
    words = problem(with_tiers(valkey(server.url)))  # no password: the server refuses
    assert "secondary_tiers[0]: the Valkey server at valkey://127.0.0.1" in words and "s3cret" not in words


@pytest.mark.parametrize("entry, words", [
    (valkey("http://127.0.0.1:6379"), "secondary_tiers[0].url scheme 'http' is not supported"),
    (valkey("redis://"), "secondary_tiers[0].url names no host"),
    (valkey("redis://127.0.0.1:notaport"), "secondary_tiers[0].url has a bad port"),
    (valkey("redis://127.0.0.1:6379/db"), "path must be a database number"),
    (valkey("redis://127.0.0.1:6379?timeout=1"), "takes no query"),
    (valkey(None), "secondary_tiers[0].url must be a non-empty str"),
    ({"type": "valkey", "capacity_bytes": 1}, "needs 'url'"),
    ({**valkey(), "urls": ["redis://a:1"]}, "needs 'url'"),
    ({"type": "valkey", "urls": ["redis://a:1", "redis://b:1"], "cluster": False, "capacity_bytes": 1},
     "several are a cluster's seed nodes"),
    ({"type": "valkey", "urls": ["redis://a:1", "rediss://b:1"], "capacity_bytes": 1}, "disagree on TLS"),
    ({"type": "valkey", "urls": ["redis://a:1/2"], "cluster": True, "capacity_bytes": 1}, "only database 0"),
    ({"type": "valkey", "url": "redis://a:1"}, "needs 'capacity_bytes'"),
    (valkey(timeout_s=0), "secondary_tiers[0].timeout_s must be a number of seconds in (0, 60]"),
    (valkey(connections=0), "secondary_tiers[0].connections must be a positive int"),
    (valkey(on_unreachable="ignore"), "secondary_tiers[0].on_unreachable must be 'error' or 'warn'"),
    (valkey(password_env="KVLEDGER_SURELY_UNSET"), "password_env names 'KVLEDGER_SURELY_UNSET', which is not set"),
    (valkey("redis://:pw@a:1", password_env="HOME"), "the password is in the URL and in password_env"),
    (valkey(host="a"), "unknown secondary_tiers[0] key(s) 'host'"),
])
def test_a_bad_valkey_tier_names_its_key(entry, words):
    assert words in problem(with_tiers(entry))


def test_an_unreachable_server_stops_start_or_with_warn_starts_the_tier_down(valkey_server, monkeypatch):
    from kvledger.transfers.lower_tiers.valkey import settings as valkey_settings

    monkeypatch.setattr(valkey_settings, "START_RETRIES_S", (0.01,))  # the waits: the next test's
    server = valkey_server()
    port = server.port
    server.kill()
    words = problem(with_tiers(valkey(f"redis://127.0.0.1:{port}")))
    assert f"the Valkey server at valkey://127.0.0.1:{port} cannot be reached" in words
    assert "on_unreachable" in words
    with capture_logs() as logs:
        tier, = parse_settings(with_tiers(valkey(f"redis://127.0.0.1:{port}", on_unreachable="warn"))).secondary_tiers
    assert tier.on_unreachable == "warn"
    assert [e["event"] for e in logs] == ["tier_start_check_retried", "tier_unreachable_at_start",  # tried twice
                                         "tier_checked", "shared_tier_without_secret"]  # checked: down, as asked


def test_a_server_slow_to_answer_at_start_is_tried_again_before_start_fails(valkey_server):
    """A ping that outlasts `timeout_s` once (a host stall, a failover) is not a wrong setting:
    the start check tries again (`START_RETRIES_S`), and a server answering by then starts the
    tier up. A replica restarted in the fleet soak failed to start on one such ping."""
    import threading

    server = valkey_server()
    server.pause()
    threading.Timer(0.8, server.resume).start()  # past the first try's 0.5 s, before the second's
    with capture_logs() as logs:
        tier, = parse_settings(with_tiers(valkey(server.url, timeout_s=0.5))).secondary_tiers
    events = [e["event"] for e in logs]
    assert events[0] == "tier_start_check_retried" and "tier_unreachable_at_start" not in events, events
    assert "tier_checked" in events


@pytest.mark.slow  # the session's six-server cluster, started for it if no slow test did
def test_a_cluster_from_its_seed_nodes(valkey_cluster):
    urls = valkey_cluster.urls
    tier, = parse_settings(with_tiers({"type": "valkey", "urls": urls, "capacity_bytes": 1 << 20})).secondary_tiers
    assert tier.server.cluster and len(tier.server.nodes) == 3


def test_a_tls_server_with_a_private_ca(valkey_server):
    server = valkey_server(tls=True)
    cert = str(server.tls[0])
    tier, = parse_settings(with_tiers(valkey(server.url, tls_ca_file=cert))).secondary_tiers
    assert tier.server.tls and tier.server.tls_ca_file == cert
    words = problem(with_tiers(valkey(server.url)))  # the system's CAs do not know this certificate
    assert "cannot be reached" in words and "certificate" in words.lower()
    plain = problem(with_tiers(valkey(server.url.replace("rediss", "redis"))))  # TLS spoken to as plain
    assert "cannot be reached" in plain
    assert "tls_ca_file is for TLS" in problem(with_tiers(valkey("redis://127.0.0.1:1", tls_ca_file=cert)))
    assert "is not a readable file" in problem(with_tiers(valkey(server.url, tls_ca_file="/nonexistent.crt")))


# A tier's secret, its key prefix, and URLs with passwords.

SECRET = "0123456789abcdef" * 4  # 32 bytes in hex: used as they decode
OLD = "f" * 32  # 16 bytes in hex: too few, stretched like a passphrase


def material(text: str) -> bytes:
    from kvledger.transfers.lower_tiers.block_seal import key_material

    return key_material(text.encode())[0]


def test_a_secret_comes_from_the_environment_and_is_never_shown(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_TEST_SECRET", SECRET)
    monkeypatch.setenv("KVLEDGER_TEST_OLD", OLD)
    tier, = parse_settings(with_tiers(fs(tmp_path, secret_env="KVLEDGER_TEST_SECRET",
                                         previous_secret_env="KVLEDGER_TEST_OLD", encrypt=True))).secondary_tiers
    assert tier.secret.current == bytes.fromhex(SECRET) and tier.secret.encrypt
    assert tier.secret.previous == material(OLD) and tier.secret.stretched == ("previous_secret_env",)
    assert tier.secret.naming == material(OLD)  # names stay the fleet's until the rotation ends
    assert SECRET not in repr(tier) and "ffff" not in repr(tier)
    seal = tier.secret.seal()
    assert seal is not None and seal.encrypt
    plain, = parse_settings(with_tiers(fs(tmp_path))).secondary_tiers
    assert plain.secret.seal() is None and plain.secret.naming is None
    strict, = parse_settings(with_tiers(fs(tmp_path, secret_env="KVLEDGER_TEST_SECRET",
                                           encrypt="required"))).secondary_tiers
    assert strict.secret.encrypt and strict.secret.require_encrypted and strict.secret.seal().require_encrypted


def test_a_rotation_ends_at_its_date_and_names_then_follow_the_new_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_TEST_SECRET", SECRET)
    monkeypatch.setenv("KVLEDGER_TEST_OLD", OLD)
    rotation = {"secret_env": "KVLEDGER_TEST_SECRET", "previous_secret_env": "KVLEDGER_TEST_OLD"}
    ended, = parse_settings(with_tiers(fs(tmp_path, **rotation, previous_secret_until="2020-01-01"))).secondary_tiers
    assert ended.secret.previous_until == 1577836800.0  # midnight UTC
    assert ended.secret.naming == bytes.fromhex(SECRET)  # ended: names are the new secret's
    going, = parse_settings(with_tiers(fs(tmp_path, **rotation,
                                          previous_secret_until="2999-01-01T12:00:00+01:00"))).secondary_tiers
    assert going.secret.previous_until == 32472183600.0 and going.secret.naming == material(OLD)  # 11:00 UTC


@pytest.mark.parametrize("keys, words", [
    ({"secret_env": "KVLEDGER_SURELY_UNSET"}, "secret_env names 'KVLEDGER_SURELY_UNSET', which is not set"),
    ({"secret_env": "KVLEDGER_TEST_SHORT"}, "holds 5 bytes; a tier secret needs at least 16"),
    ({"secret_env": ""}, "secret_env must name an environment variable"),
    ({"previous_secret_env": "KVLEDGER_TEST_SECRET"}, "previous_secret_env is for a rotation: it needs secret_env"),
    ({"encrypt": True}, "encrypt needs secret_env"),
    ({"encrypt": "yes", "secret_env": "KVLEDGER_TEST_SECRET"}, 'encrypt must be true, false or "required"'),
    ({"encrypt": "required"}, "encrypt needs secret_env"),
    ({"secret_env": "KVLEDGER_TEST_SECRET", "previous_secret_until": "2026-12-31"},
     "previous_secret_until ends a rotation: it needs previous_secret_env"),
    ({"secret_env": "KVLEDGER_TEST_SECRET", "previous_secret_env": "KVLEDGER_TEST_SECRET",
      "previous_secret_until": "next week"}, "previous_secret_until: 'next week' is not an ISO 8601 date or time"),
    ({"secret_env": "KVLEDGER_TEST_SECRET", "previous_secret_env": "KVLEDGER_TEST_SECRET",
      "previous_secret_until": 20261231}, "previous_secret_until must be an ISO 8601 date or time"),
])
def test_bad_secret_settings_name_the_problem(tmp_path, monkeypatch, keys, words):
    monkeypatch.setenv("KVLEDGER_TEST_SECRET", SECRET)
    monkeypatch.setenv("KVLEDGER_TEST_SHORT", "short")
    assert words in problem(with_tiers(fs(tmp_path, **keys)))


def test_a_key_prefix_for_acls(valkey_server):
    server = valkey_server()
    tier, = parse_settings(with_tiers(valkey(server.url, key_prefix="kvledger:tenant-a:"))).secondary_tiers
    assert tier.key_prefix == b"kvledger:tenant-a:"
    for bad, words in (("", "key_prefix must be 1-64 printable"), ("a b", "without spaces"),
                       ("tenant*", "holds a glob character")):
        assert words in problem(with_tiers(valkey(server.url, key_prefix=bad)))


@pytest.mark.parametrize("url", ["redis://:pa#ss@127.0.0.1:6379", "redis://:pa/ss@127.0.0.1:6379",
                                 "redis://:pa?ss@127.0.0.1:6379", "redis://user:p@ss:99999x@127.0.0.1:1"])
def test_a_url_error_never_quotes_the_password(url):
    words = problem(with_tiers(valkey(url)))
    assert "pa" not in words.replace("password", "").replace("path", "") and "ss@" not in words


def test_a_password_in_the_url_draws_a_warning(valkey_server):
    server = valkey_server()
    server.cli("CONFIG", "SET", "requirepass", "word")
    with capture_logs() as logs:
        parse_settings(with_tiers(valkey(f"redis://:word@127.0.0.1:{server.port}")))
    warned = [entry for entry in logs if entry["event"] == "tier_password_in_url"]
    assert warned and "password_env" in warned[0]["advice"] and "word@" not in repr(warned)


def test_key_generations_default_to_private():
    base = {"capacity_bytes": 1 << 20}
    assert parse_settings(base).key_generations == "private"
    assert parse_settings({**base, "key_generations": "counted"}).key_generations == "counted"
    assert parse_settings({**base, "key_generations": "kept"}).key_generations == "kept"
    assert "key_generations must be 'private', 'counted' or 'kept'" in problem({**base, "key_generations": "shared"})


def test_vllms_store_threshold_and_prompt_only_under_vllms_names():
    base = {"capacity_bytes": 1 << 20}
    settings = parse_settings(base)
    assert (settings.store_threshold, settings.max_tracker_size, settings.offload_prompt_only) == (1, 64_000, False)
    settings = parse_settings({**base, "store_threshold": 2, "max_tracker_size": 1000, "offload_prompt_only": True})
    assert (settings.store_threshold, settings.max_tracker_size, settings.offload_prompt_only) == (2, 1000, True)
    assert "store_threshold must be >= 1" in problem({**base, "store_threshold": 0})
    assert "max_tracker_size must be >= 1" in problem({**base, "max_tracker_size": 0})
    assert "offload_prompt_only'] must be bool" in problem({**base, "offload_prompt_only": "yes"})


# The README and the parser agree, and values are refused with what to write instead.


def test_the_readme_table_names_every_key_the_parser_takes():
    from kvledger.adapters import settings

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = text.split("### `kv_connector_extra_config`", 1)[1].split("\n\n", 2)[1]
    documented = {row.split("`")[1] for row in table.splitlines() if row.startswith("| `")}
    assert documented == set(settings._FIELDS) - {"cpu_bytes_to_use"}  # the alias, in capacity_bytes' row


def _readme_table_after(heading: str) -> set[str]:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = text.split(heading, 1)[1].split("\n| key", 1)[1].split("\n\n", 1)[0]
    return {row.split("`")[1] for row in rows.splitlines() if row.startswith("| `")}


# Each tier type's section of the README, whose key table lists what its row's parser takes.
README_TIER_SECTIONS = {"fs": "### A disk tier below host memory", "valkey": "### A shared tier on Valkey"}


def test_the_readme_tables_name_every_key_of_each_tier_type_and_of_fault_injection():
    from kvledger.adapters import settings
    from kvledger.transfers.lower_tiers import tier_settings, tier_types

    assert _readme_table_after("#### `fault_injection`") == set(settings._FAULT_FIELDS)
    assert set(README_TIER_SECTIONS) == set(tier_types.TIER_TYPES), "every tier type needs its README section"
    for kind, heading in README_TIER_SECTIONS.items():
        keys = tier_types.TIER_TYPES[kind].keys
        assert _readme_table_after(heading) == {*keys, *tier_settings.SECRET_KEYS}, kind


@pytest.mark.parametrize("extra, words", [
    ({"capacity_bytes": 64e9}, "must be an integer, got 64000000000.0: write 64000000000"),
    ({"capacity_bytes": 1 << 20, "load_timeout_s": float("nan")}, "load_timeout_s must be a finite number"),
    ({"capacity_bytes": 1 << 20, "load_timeout_s": float("inf")}, "load_timeout_s must be a finite number"),
])
def test_a_float_for_an_integer_or_a_nan_timeout_is_refused_by_name(extra, words):
    assert words in problem(extra)


def test_an_event_log_that_is_a_directory_is_refused(tmp_path):
    words = problem({"capacity_bytes": 1 << 20, "event_log": str(tmp_path)})
    assert "is a directory: name the log file in it" in words
    assert not list(tmp_path.iterdir()) and not (tmp_path.parent / f"{tmp_path.name}.1").exists()


@pytest.mark.parametrize("text, stretched", [
    ("0123456789abcdef" * 4, False),  # `openssl rand -hex 32`
    ("ASNFZ4mrze8BI0VniavN7wEjRWeJq83vASNFZ4mrze8=", False),  # `openssl rand -base64 32`
    ("ASNFZ4mrze8BI0VniavN7wEjRWeJq83vASNFZ4mrze8=\n", False),  # read from a file, its newline kept
    ("correct horse battery staple", True),  # a passphrase
    ("0123456789abcdef" * 2, True),  # 16 random bytes in hex: fewer than 32
])
def test_a_secret_is_32_random_bytes_or_is_stretched_once_at_start(tmp_path, monkeypatch, text, stretched):
    """Each block names the key that sealed it by an id derived from it: with a passphrase for a
    key, the id would let whoever reads one block test guesses offline at hash speed. So a text
    that is not at least 32 bytes in hex or base64 is stretched with scrypt (once, at start), and
    the start says so."""
    import base64
    import hashlib

    from structlog.testing import capture_logs

    from kvledger.transfers.lower_tiers.tier_types import check_tiers

    monkeypatch.setenv("KVLEDGER_TEST_SECRET", text)
    tier, = parse_settings(with_tiers(fs(tmp_path / "t", secret_env="KVLEDGER_TEST_SECRET"))).secondary_tiers
    key = tier.secret.current
    assert key is not None and len(key) == 32
    if stretched:
        assert key == hashlib.scrypt(text.encode(), salt=b"kvledger 2026-12 tier secret, stretched", n=1 << 15, r=8,
                                     p=1, dklen=32, maxmem=1 << 26)
    else:
        assert key in (bytes.fromhex(text) if len(text) == 64 else b"", base64.b64decode(text.strip()))
    with capture_logs() as logs:
        check_tiers((tier,))
    warned = [e for e in logs if e["event"] == "tier_secret_stretched"]
    assert [e["keys"] for e in warned] == ([["secret_env"]] if stretched else [])
    assert text.strip() not in str(logs)


def test_a_tier_directory_its_group_can_write_is_refused_without_the_tiers_group(tmp_path):
    """Under a umask of 002 a user's directories are group-writable: the group's members could plant blocks."""
    path = tmp_path / "grouped"
    path.mkdir()
    os.chmod(path, 0o770)
    assert problem(with_tiers(fs(path))).startswith(
        f"secondary_tiers[0].path {str(path)!r} is writable by its group gid {os.getegid()}")


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o775, True), (0o1777, False), (0o755, False)])
def test_a_tier_under_a_directory_others_can_write_is_refused(tmp_path, mode, refused):
    """Whoever can write a directory above the tier can rename the tier away and put a link in its place."""
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "tier").mkdir(mode=0o700)
    os.chmod(parent, mode)
    if refused:
        words = problem(with_tiers(fs(parent / "tier")))
        assert words.startswith(f"secondary_tiers[0].path {str(parent / 'tier')!r} sits where another user could "
                                f"replace it: {parent} is writable by ")
    else:  # sticky, as /tmp: others cannot rename what is not theirs
        assert parse_settings(with_tiers(fs(parent / "tier"))).secondary_tiers


def test_a_tier_under_a_directory_another_user_owns_is_refused(tmp_path):
    need_root("it gives a directory to another user")
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    (parent / "tier").mkdir(mode=0o700)
    os.chown(parent, 65534, NOGROUP_GID)
    assert f"{parent} is owned by uid 65534, who could replace the tier's directory" in problem(
        with_tiers(fs(parent / "tier")))
