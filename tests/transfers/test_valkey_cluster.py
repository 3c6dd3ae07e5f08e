"""A cluster is read as one server is (`ClusterStore`): each node with the same
bounded replies, one deadline for a whole batch across its nodes, and a MOVED
or ASK failing its key alone while the slot map is read again. Against a real
three-master cluster; a lying or trickling node is a master that announces a
`LyingServer` in front of it as its port (`cluster-announce-port`), so every
node's `CLUSTER SLOTS` sends its keys there."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from valkey.crc import key_slot
from valkey.exceptions import ResponseError

from kvledger.transfers.lower_tiers.valkey.cluster_store import ClusterStore, owners_of
from kvledger.transfers.lower_tiers.valkey.store import Landed, StoreDown, ValkeyServer, ValueTooLarge
from tests.support.valkey_servers import LyingServer, ServerProcess
from tests.transfers.test_valkey_replies import JUNK, peak_growth, trickled

pytestmark = pytest.mark.slow  # a cluster of six servers, shared by the session's cluster tests

HEAD = 100
PAYLOAD = 64 << 10
BLOCK = bytes(range(256)) * (PAYLOAD // 256)
KEYS = [b"kvledger:c%d" % n for n in range(30)]  # over every master's slots


def store_of(cluster, timeout_s: float = 1.0) -> ClusterStore:
    return ClusterStore(ValkeyServer(nodes=tuple(("127.0.0.1", s.port) for s in cluster.servers[:3]),
                                     cluster=True, timeout_s=timeout_s))


def write(store: ClusterStore, keys: list[bytes] = KEYS) -> None:
    assert store.set_many([(k, k.ljust(HEAD, b"h"), memoryview(BLOCK)) for k in keys]) == [None] * len(keys)


def read(store: ClusterStore, keys: list[bytes] = KEYS) -> tuple[list, list[memoryview]]:
    targets = [memoryview(bytearray(PAYLOAD)) for _ in keys]
    return store.get_into(keys, [HEAD] * len(keys), targets), targets


def slot_ports(server: ServerProcess) -> set[int]:
    """The ports `server`'s `CLUSTER SLOTS` names as masters."""
    reply = server._client().execute_command("CLUSTER", "SLOTS")
    return {int(entry[2][1]) for entry in reply}


@contextlib.contextmanager
def announcing(cluster, victim: ServerProcess, lie) -> Iterator[LyingServer]:
    """`victim` (a master) announces a `LyingServer` in front of it until the block ends."""
    server = LyingServer(victim.port, lie=lie)
    masters = cluster.servers[:3]
    try:
        victim.cli("CONFIG", "SET", "cluster-announce-port", str(server.port))
        _until(lambda: all(server.port in slot_ports(m) for m in masters), "the lying port announced")
        yield server
    finally:
        victim.cli("CONFIG", "SET", "cluster-announce-port", "0")
        _until(lambda: all(victim.port in slot_ports(m) for m in masters), "the real port announced again")
        server.close()
        cluster.wait_ok()


def _until(done, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def on_keys_of(victim_keys: set[bytes], make):
    """A lie for GETs of `victim_keys` alone (`make(key)` gives its reply); the rest relayed."""
    def lie(args: list[bytes]):
        if args[0].upper() != b"GET" or args[1] not in victim_keys:
            return None
        return make(args[1])
    return lie


def keys_of(cluster, victim: ServerProcess) -> set[bytes]:
    return {k for k in KEYS if cluster.master_of(k) is victim}


def test_a_batch_spans_every_master_and_its_values_land_in_place(valkey_cluster) -> None:
    store = store_of(valkey_cluster)
    try:
        write(store)
        values, targets = read(store)
        assert all(isinstance(v, Landed) for v in values) and all(bytes(t) == BLOCK for t in targets)
        assert store.exists_each([*KEYS, b"kvledger:none"]) == [True] * len(KEYS) + [False]
        assert sorted(port for _, port in store.masters()) == sorted(s.port for s in valkey_cluster.servers[:3])
        assert len({valkey_cluster.master_of(k).port for k in KEYS}) == 3
    finally:
        store.close()


def test_a_node_s_oversized_values_fail_their_keys_alone_in_bounded_memory(valkey_cluster) -> None:
    """Through valkey-py's cluster pipeline a 64 KiB read took a 64 MiB value whole (peak 27 -> 157
    MiB): a node's value longer than asked for is read past in pieces and fails its key alone."""
    victim = valkey_cluster.master_of(KEYS[0])
    mine = keys_of(valkey_cluster, victim)
    store = store_of(valkey_cluster, timeout_s=5.0)
    try:
        write(store)
        store.close()
        with announcing(valkey_cluster, victim,
                        on_keys_of(mine, lambda key: iter([b"$%d\r\n" % (64 << 20), *[JUNK] * 64, b"\r\n"]))):
            with peak_growth() as grew:
                values, targets = read(store)
            assert grew[0] < 16 << 20, grew[0]
            for key, value, target in zip(KEYS, values, targets):
                if key in mine:
                    assert isinstance(value, ValueTooLarge) and f"{64 << 20}-byte value" in str(value)
                else:
                    assert isinstance(value, Landed) and bytes(target) == BLOCK
            assert store.exists_each(KEYS) == [True] * len(KEYS)  # the connection went on
    finally:
        store.close()


def test_a_value_claiming_more_than_a_server_stores_fails_the_batch_as_down(valkey_cluster) -> None:
    victim = valkey_cluster.master_of(KEYS[0])
    store = store_of(valkey_cluster)
    try:
        write(store)
        store.close()
        with announcing(valkey_cluster, victim, on_keys_of(keys_of(valkey_cluster, victim),
                                                           lambda key: iter([b"$4294967296\r\n", JUNK]))):
            with peak_growth() as grew, pytest.raises(StoreDown, match="longer than a server stores"):
                read(store)
            assert grew[0] < 16 << 20, grew[0]
    finally:
        store.close()


def test_a_trickling_node_fails_the_whole_batch_within_one_timeout(valkey_cluster) -> None:
    """Through valkey-py's cluster pipeline a node sending a byte at a time held a batch past 8 s
    with a 1 s timeout; now the batch, every node of it, ends by one deadline."""
    victim = valkey_cluster.master_of(KEYS[-1])
    store = store_of(valkey_cluster, timeout_s=1.0)
    try:
        write(store)
        store.close()
        with announcing(valkey_cluster, victim, on_keys_of(keys_of(valkey_cluster, victim), lambda key: trickled(6))):
            store.masters()  # the map, read before the batch's clock starts
            started = time.monotonic()
            with pytest.raises(StoreDown, match="longer than timeout_s"):
                read(store)
            assert time.monotonic() - started < 1.5
    finally:
        store.close()


def test_a_migrating_then_moved_slot_fails_its_keys_alone_and_the_map_is_read_again(valkey_cluster) -> None:
    """A slot resharded as `valkey-cli --cluster reshard` does it: while it migrates, a key the old
    master no longer holds answers ASK; once given to the new master, the old one answers MOVED.
    Each fails its key alone (no redirect followed, the rest of the batch served), and the next
    batch asks the master the map names now."""
    store = store_of(valkey_cluster)
    masters = valkey_cluster.servers[:3]
    taken = {key_slot(k) for k in KEYS}
    present = next(k for k in (b"kvledger:m%d" % n for n in range(100000)) if key_slot(k) not in taken)
    slot = key_slot(present)
    absent = next(k for k in (b"kvledger:a%d" % n for n in range(1000000)) if key_slot(k) == slot)
    asked = [absent, present, *KEYS]
    old = valkey_cluster.master_of(present)
    new = next(m for m in masters if m is not old)
    ids = {m.port: m.cli("CLUSTER", "MYID") for m in masters}
    try:
        write(store, [present, *KEYS])
        store.masters()  # the map as it is now
        new.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[old.port])
        old.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[new.port])
        values, _ = read(store, asked)
        assert isinstance(values[0], ResponseError) and str(values[0]).startswith("ASK"), values[0]
        assert all(isinstance(v, Landed) for v in values[1:])
        store.masters()  # read again after the ASK: the slot is still the old master's
        old._client().execute_command("MIGRATE", "127.0.0.1", str(new.port), "", "0", "5000", "KEYS", present)
        for master in (new, old, *(m for m in masters if m not in (old, new))):
            master.cli("CLUSTER", "SETSLOT", str(slot), "NODE", ids[new.port])
        values, _ = read(store, asked)
        assert all(isinstance(v, ResponseError) and str(v).startswith("MOVED") for v in values[:2]), values[:2]
        assert all(isinstance(v, Landed) for v in values[2:])
        values, targets = read(store, asked)  # the map read again: the new master
        assert values[0] is None and isinstance(values[1], Landed) and bytes(targets[1]) == BLOCK
        assert all(isinstance(v, Landed) for v in values[2:])
        assert valkey_cluster.master_of(present) is new
    finally:
        for master in (old, new):
            master.cli("CLUSTER", "SETSLOT", str(slot), "STABLE", check=False)
        store.close()
        valkey_cluster.wait_ok()


def test_a_slot_map_that_is_not_one_is_refused() -> None:
    asked = ("10.0.0.1", 7000)
    owners = owners_of([[0, 99, [b"", 7001, b"id"]], [100, 16383, [b"10.0.0.2", 7002, b"id2"], [b"r", 1]]], asked)
    assert owners[0] == ("10.0.0.1", 7001) and owners[16383] == ("10.0.0.2", 7002)
    assert owners_of([[5, 5, [b"?", 7003]]], asked)[5] is None and owners_of([[5, 5, [b"?", 7003]]], asked)[6] is None
    for lie in ([], b"OK", [[0, 16384, [b"h", 1]]], [[9, 3, [b"h", 1]]], [[0, 1, [b"h", 0]]], [[0, 1, [b"h"]]],
                [[0, 1, [b"h" * 256, 1]]], [[0, 1]]):
        with pytest.raises(StoreDown, match="CLUSTER SLOTS answered"):
            owners_of(lie, asked)
