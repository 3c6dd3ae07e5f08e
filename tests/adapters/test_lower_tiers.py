"""The scheduler's view of a shared disk tier: the start-up scan, lookups of
keys other processes wrote, and keys this process removed staying removed;
and ranks with identical KV keeping one copy of a block."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="needs the vllm package")
import structlog
import torch
from valkey import Valkey

from kvledger.adapters.settings import parse_settings
from kvledger.adapters.vllm.lower_tiers import SchedulerTiers, engine_tiers, open_worker_tiers, tier_copies
from kvledger.adapters.vllm.tier_namespace import identity, namespace
from kvledger.events import types as ev
from kvledger.transfers.lower_tiers.fs.block_file import block_path, write_block
from kvledger.transfers.lower_tiers.fs.tier import FsTierIO
from kvledger.transfers.lower_tiers.replica_tier import ReplicaTierIO
from kvledger.transfers.lower_tiers.valkey.block_value import encode_value, store_key
from tests.adapters.test_tier_namespace import kv_cache_config, mla_config, vllm_config
from tests.support.privileges import second_group

pytestmark = pytest.mark.vllm


def _tiers(tmp_path) -> SchedulerTiers:
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
        {"type": "fs", "path": str(tmp_path), "capacity_bytes": 1 << 20}]})
    return SchedulerTiers(settings, vllm_config(), kv_cache_config(), world_size=1)


def _store(tiers: SchedulerTiers, root, key: bytes) -> None:
    write_block(block_path(root, tiers.namespaces[0], key), tiers.namespaces[0], key, torch.zeros(64, dtype=torch.int8).numpy())


def _ask_until_answered(tiers: SchedulerTiers, request_id: str, keys) -> list:
    deadline = time.monotonic() + 5
    while tiers.ask(request_id, keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    return tiers.answers()


def test_blocks_of_a_format_this_build_cannot_read_are_skipped_with_a_count_and_why(tmp_path) -> None:
    """A later build writes another block format, under a namespace of its own: none of its
    blocks is found, so none can be served; the start says how many and why, in one line."""
    tiers = _tiers(tmp_path)
    try:
        _store(tiers, tmp_path, b"a" * 20)
        theirs = bytes(range(16))
        for key in (b"x" * 20, b"y" * 20, b"z" * 20):
            write_block(block_path(tmp_path, theirs, key), theirs, key, torch.zeros(64, dtype=torch.int8).numpy())
        (tmp_path / theirs.hex() / "NAMESPACE.json").write_text(json.dumps({"format_version": 2}))
        (tmp_path / tiers.namespaces[0].hex()).mkdir(exist_ok=True)
        (tmp_path / tiers.namespaces[0].hex() / "NAMESPACE.json").write_text(json.dumps({"format_version": 1}))
        with structlog.testing.capture_logs() as logs:
            (found,) = tiers.startup_events()
        assert found.keys == (b"a" * 20,)
        (skipped,) = [line for line in logs if line["event"] == "tier_format_skipped"]
        assert skipped["log_level"] == "warning" and skipped["tier"] == "1:fs"
        assert skipped["namespace"] == theirs.hex() and skipped["format_version"] == 2 and skipped["blocks"] == 3
        assert "this build reads format 1: its blocks are not served (recomputed)" in skipped["why"]
    finally:
        tiers.close()


def test_the_scan_finds_what_is_there_and_lookups_what_came_later(tmp_path) -> None:
    tiers = _tiers(tmp_path)
    try:
        _store(tiers, tmp_path, b"a" * 20)
        (found,) = tiers.startup_events()
        assert found.tier == 1 and found.keys == (b"a" * 20,)
        _store(tiers, tmp_path, b"b" * 20)  # another process, after the start
        (answer,) = _ask_until_answered(tiers, "r1", [b"b" * 20, b"c" * 20])
        assert answer.keys == (b"b" * 20,)
        assert not tiers.ask("r1", [b"b" * 20])  # asked once per request
    finally:
        tiers.close()


def test_lookups_hold_one_step_for_at_most_the_wait_all_requests_together(tmp_path) -> None:
    """Many requests arriving together: the first ask waits, the rest are sent and
    answered at a later step, and the next step may wait again. A test of the mechanism:
    the budget is read from `_wait_left`, as wall times are never asserted in the suite."""
    from kvledger.adapters.vllm.lower_tiers import LOOKUP_WAIT_S

    tiers = _tiers(tmp_path)
    release = threading.Event()
    slow_find = tiers._lookups[1].find
    tiers._lookups[1].find = lambda keys: (release.wait(5), slow_find(keys))[1]  # a stat that hangs
    try:
        _store(tiers, tmp_path, b"e" * 20)
        assert tiers.ask("r1", [b"e" * 20])  # waited its share and more: not answered
        assert tiers._wait_left == 0.0
        for n in range(2, 10):
            assert tiers.ask(f"r{n}", [b"e" * 20])  # sent, waited for no longer
            assert tiers._wait_left == 0.0
        tiers.new_step()
        assert tiers._wait_left == LOOKUP_WAIT_S
        release.set()
        found = _ask_until_answered(tiers, "r1", [b"e" * 20])  # the other asks' answers too
        assert found and {answer.keys for answer in found} == {(b"e" * 20,)}
    finally:
        release.set()
        tiers.close()


def test_a_key_this_process_removed_is_not_found_again(tmp_path) -> None:
    """A lookup can run before the worker's removal: the file is still there, the block is not."""
    tiers = _tiers(tmp_path)
    try:
        _store(tiers, tmp_path, b"d" * 20)
        tiers.removed(1, [b"d" * 20])
        assert _ask_until_answered(tiers, "r2", [b"d" * 20]) == []
    finally:
        tiers.close()


def _expire_one_at_a_time(tombstones: dict[bytes, float], before: float, most: int) -> None:
    while tombstones:
        oldest = next(iter(tombstones))
        if tombstones[oldest] >= before and len(tombstones) <= most:
            return
        del tombstones[oldest]


@given(removals=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3)), max_size=60),
       most=st.integers(1, 12), age=st.integers(1, 6))
def test_tombstones_expire_as_taken_one_oldest_at_a_time(removals, most, age) -> None:
    """`_expire` forgets in one pass what taking the oldest tombstone at a time forgets: those
    older than the age, then any past the bound, whatever the order keys were removed in."""
    from kvledger.adapters.vllm import lower_tiers

    ours: dict[bytes, float] = {}
    theirs: dict[bytes, float] = {}
    now = 0.0
    for key, wait in removals:
        now += wait
        for tombstones in (ours, theirs):
            tombstones.pop(bytes([key]), None)
            tombstones[bytes([key])] = now
        lower_tiers._expire(ours, now - age, most)
        _expire_one_at_a_time(theirs, now - age, most)
        assert list(ours.items()) == list(theirs.items())


def test_removed_keys_are_remembered_for_a_while_not_for_ever(tmp_path) -> None:
    """Tombstones age out (a soak's disk tier evicting all day held 11 MB of them): past
    `TOMBSTONE_S` a file that is still there, written again by another process, is found."""
    from kvledger.adapters.vllm.lower_tiers import TOMBSTONE_S

    tiers = _tiers(tmp_path)
    now = [1000.0]
    tiers.clock = lambda: now[0]
    try:
        _store(tiers, tmp_path, b"f" * 20)
        tiers.removed(1, [b"f" * 20, b"g" * 20])
        now[0] += TOMBSTONE_S - 1
        tiers.removed(1, [b"h" * 20])
        assert _ask_until_answered(tiers, "r1", [b"f" * 20]) == []
        assert list(tiers._tombstones[1]) == [b"f" * 20, b"g" * 20, b"h" * 20]
        now[0] += 2  # f and g aged out, h not yet
        (answer,) = _ask_until_answered(tiers, "r2", [b"f" * 20])
        assert answer.keys == (b"f" * 20,)
        assert list(tiers._tombstones[1]) == [b"h" * 20]
        now[0] += TOMBSTONE_S
        tiers.answers()
        assert tiers._tombstones[1] == {}
    finally:
        tiers.close()


def _valkey_tiers(url: str, **more) -> SchedulerTiers:
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
        {"type": "valkey", "url": url, "capacity_bytes": 1 << 20, "timeout_s": 0.5, **more}]})
    return SchedulerTiers(settings, vllm_config(), kv_cache_config(), world_size=1)


def test_a_valkey_tier_is_looked_up_not_scanned_and_counts_for_metrics(valkey_server) -> None:
    server = valkey_server()
    tiers = _valkey_tiers(server.url)
    try:
        space = tiers.namespaces[0]
        payload = torch.zeros(64, dtype=torch.int8).numpy()
        server_keys = [b"a" * 20, b"b" * 20]
        client = Valkey(port=server.port)
        for key in server_keys:
            client.set(store_key(space, key), encode_value(space, key, payload))
        client.close()
        assert tiers.startup_events() == []  # a shared store is not scanned
        (answer,) = _ask_until_answered(tiers, "r1", [b"a" * 20, b"c" * 20, b"b" * 20])
        assert answer.tier == 1 and answer.keys == (b"a" * 20, b"b" * 20)
        assert tiers.counts[1] == {"lookup_keys": 3, "lookup_timeouts": 0}
        assert tiers.answered() == {1: (3, 2)}  # vLLM 0.33's chunk queries and hits
        assert tiers.health[1].up
        tiers.removed(1, [b"a" * 20])  # nothing is deleted from a shared store: still found
        assert _ask_until_answered(tiers, "r2", [b"a" * 20])[0].keys == (b"a" * 20,)
        server.kill()
        # Down: found nothing, in bounded time, and the lookup's failure goes on the record.
        assert _ask_until_answered(tiers, "r3", [b"a" * 20]) == [
            ev.TierLookupFailed(tier=1, request_id="r3", reason="down")]
        assert not tiers.health[1].up
        assert tiers.answered() == {1: (4, 3)}  # an ask the server never answered is no query
    finally:
        tiers.close()


def test_a_valkey_tiers_writers_name_their_block_format_and_another_formats_blocks_are_counted(valkey_server) -> None:
    """A Valkey store is not listed, so its writers say which block format each namespace is in
    (one hash under the key prefix); a build of another format counts those blocks at start and
    says why it skips them, in one line."""
    server = valkey_server()
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
        {"type": "valkey", "url": server.url, "capacity_bytes": 1 << 20, "timeout_s": 0.5}]})
    io = open_worker_tiers(settings, vllm_config(), kv_cache_config(), rank=0, world_size=1,
                           rows=torch.zeros((4, 64), dtype=torch.int8), payload_bytes=(64,))[1]
    io.shutdown()
    client = Valkey(port=server.port)
    try:
        assert client.hgetall(b"kvledger:formats") == {io.namespace.hex().encode(): b"1"}
        theirs = bytes(range(16))
        client.hset(b"kvledger:formats", theirs.hex(), "2")
        for key in (b"x" * 20, b"y" * 20, b"z" * 20):
            client.set(store_key(theirs, key), b"a block in format 2")
        tiers = _valkey_tiers(server.url)
        try:
            with structlog.testing.capture_logs() as logs:
                assert tiers.startup_events() == []
        finally:
            tiers.close()
        (skipped,) = [line for line in logs if line["event"] == "tier_format_skipped"]
        assert skipped["tier"] == "1:valkey" and skipped["namespace"] == theirs.hex()
        assert skipped["format_version"] == 2 and skipped["blocks"] == 3
    finally:
        client.close()


def test_a_valkey_tier_down_at_start_with_warn_comes_up_with_its_server(valkey_server) -> None:
    server = valkey_server()
    port = server.port
    server.kill()
    tiers = _valkey_tiers(f"redis://127.0.0.1:{port}", on_unreachable="warn")
    try:
        assert _ask_until_answered(tiers, "r1", [b"a" * 20]) == [
            ev.TierLookupFailed(tier=1, request_id="r1", reason="down")]
        assert not tiers.health[1].up
        server.start()
        time.sleep(1.1)  # the tier's retry interval
        assert _ask_until_answered(tiers, "r2", [b"a" * 20]) == []  # reached, and empty
        assert tiers.health[1].up
    finally:
        tiers.close()


def test_ranks_with_identical_kv_keep_one_copy_of_a_block(tmp_path) -> None:
    # MLA under TP=2: one namespace, one file per block, written by rank 0 alone,
    # and the tier holds twice the blocks of a model whose ranks hold shards.
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
        {"type": "fs", "path": str(tmp_path), "capacity_bytes": 1 << 20}]})
    config, mla = vllm_config(tp=2), mla_config()
    assert (tier_copies(config, mla, 2), tier_copies(config, kv_cache_config(), 2)) == (1, 2)
    (once,), (twice,) = engine_tiers(settings, 4096, 1), engine_tiers(settings, 4096, 2)
    assert once.num_blocks // 2 == twice.num_blocks > 0
    tiers = SchedulerTiers(settings, config, mla, world_size=2)
    try:
        assert len(tiers.namespaces) == 1
    finally:
        tiers.close()
    rows = torch.zeros((4, 64), dtype=torch.int8)
    ios = [open_worker_tiers(settings, config, mla, rank=rank, world_size=2, rows=rows, payload_bytes=(64,))[1]
           for rank in (0, 1)]
    try:
        assert type(ios[0]) is FsTierIO and type(ios[1]) is ReplicaTierIO
        assert ios[0].namespace == tiers.namespaces[0]
    finally:
        for io in ios:
            io.shutdown()


def test_a_worker_opens_its_tier_with_the_tiers_group_and_clears_old_leftovers(tmp_path) -> None:
    """A crashed writer's aside files are removed when the next worker of its namespace opens the tier."""
    root = tmp_path / "tier"
    group, gid = second_group()
    settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
        {"type": "fs", "path": str(root), "capacity_bytes": 1 << 20, "group": group}]})
    rows = torch.zeros((4, 64), dtype=torch.int8)

    def open_and_close() -> FsTierIO:
        io = open_worker_tiers(settings, vllm_config(), kv_cache_config(), rank=0, world_size=1, rows=rows,
                               payload_bytes=(64,))[1]
        io.shutdown()
        assert isinstance(io, FsTierIO)
        return io

    space = open_and_close().namespace
    identity = (root / space.hex() / "NAMESPACE.json").stat()
    assert (stat.S_IMODE(identity.st_mode), identity.st_gid) == (0o660, gid)
    leftover = block_path(root, space, bytes(32)).with_name(f".{bytes(32).hex()}.kvb.0123456789abcdef.tmp")
    leftover.parent.mkdir(exist_ok=True)  # the worker made its fan-out directories
    leftover.write_bytes(b"x")
    os.utime(leftover, (time.time() - 3600,) * 2)
    open_and_close()
    assert not leftover.exists()


def test_deployments_under_other_secrets_never_share_a_directory(tmp_path, monkeypatch) -> None:
    """The namespace carries a fingerprint of the naming key: two secrets on one directory are
    two namespaces (so neither scans, counts, evicts or resets the other's blocks), one secret is
    one namespace for the scheduler and every worker, and no secret leaves namespaces as they were."""
    monkeypatch.setenv("KVLEDGER_TEST_A", "a" * 64)
    monkeypatch.setenv("KVLEDGER_TEST_B", "b" * 64)

    def tiers(secret: str | None) -> SchedulerTiers:
        extra = {"secret_env": secret} if secret else {}
        settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
            {"type": "fs", "path": str(tmp_path), "capacity_bytes": 1 << 20, **extra}]})
        return SchedulerTiers(settings, vllm_config(), kv_cache_config(), world_size=1)

    with structlog.testing.capture_logs() as logs:
        a, b, again, plain = tiers("KVLEDGER_TEST_A"), tiers("KVLEDGER_TEST_B"), tiers("KVLEDGER_TEST_A"), tiers(None)
    try:
        assert a.namespaces != b.namespaces and a.namespaces == again.namespaces
        assert plain.namespaces[0] == namespace(identity(vllm_config(), kv_cache_config(), rank=0, world_size=1,
                                                         block_keys=plain.block_keys))  # as before: no "naming"
        fingerprints = [line["fingerprint"] for line in logs if line["event"] == "tier_naming_key"]
        assert len(fingerprints) == 3 and fingerprints[0] == fingerprints[2] != fingerprints[1]
        assert "a" * 16 not in repr(logs)  # the secret is never logged
        settings = parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": [
            {"type": "fs", "path": str(tmp_path), "capacity_bytes": 1 << 20, "secret_env": "KVLEDGER_TEST_A"}]})
        io = open_worker_tiers(settings, vllm_config(), kv_cache_config(), rank=0, world_size=1,
                               rows=torch.zeros((4, 64), dtype=torch.int8), payload_bytes=(64,))[1]
        try:
            assert io.namespace == a.namespaces[0]  # the worker writes where the scheduler looks
        finally:
            io.shutdown()
    finally:
        for made in (a, b, again, plain):
            made.close()


def test_a_replicas_own_disk_secret_leaves_the_fleets_names_alone(tmp_path, monkeypatch) -> None:
    """Names derive from the shared tiers' secrets: replicas that share Valkey under one secret,
    each with a private disk (`shared: false`) under a secret of its own, name blocks alike, so
    each finds what the others wrote there. With no shared tier's secret, the private one names."""
    from kvledger.adapters.vllm.lower_tiers import chain_secret

    for name, text in (("FLEET", "f" * 64), ("DISK_A", "a" * 64), ("DISK_B", "b" * 64)):
        monkeypatch.setenv(f"KVLEDGER_TEST_{name}", text)

    def secret(*entries: dict) -> bytes | None:
        return chain_secret(parse_settings({"capacity_bytes": 1 << 20, "secondary_tiers": list(entries)})
                            .secondary_tiers)

    def disk(variable: str | None, shared: bool = False) -> dict:
        return {"type": "fs", "path": str(tmp_path / f"disk-{variable}"), "capacity_bytes": 1 << 20,
                "shared": shared, **({"secret_env": f"KVLEDGER_TEST_{variable}"} if variable else {})}

    valkey = {"type": "valkey", "url": "redis://127.0.0.1:1", "capacity_bytes": 1 << 20,  # (never reached)
              "on_unreachable": "warn", "secret_env": "KVLEDGER_TEST_FLEET"}
    fleet = secret(valkey)
    assert fleet is not None
    assert secret(disk("DISK_A"), valkey) == secret(disk("DISK_B"), valkey) == secret(disk(None), valkey) == fleet
    assert secret(disk("DISK_A")) != secret(disk("DISK_B")) and secret(disk("DISK_A")) is not None
    assert secret(disk("DISK_A", shared=True), valkey) != fleet  # a shared disk's secret is the fleet's too
    assert secret(disk(None)) is None
