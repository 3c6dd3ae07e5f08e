"""The Valkey tier's I/O against a real valkey-server: blocks round trip,
and every way the shared store can fail a block (evicted, lost, corrupted,
foreign, a full server, a killed or paused one, a cluster master lost) ends
as a failed position, in bounded time, never as served bytes."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from structlog.testing import capture_logs

from kvledger.transfers.lower_tiers.health import FIRST_RETRY_S, RETRY_S, Health
from kvledger.transfers.lower_tiers.valkey.block_value import encode_value, store_key
from kvledger.transfers.lower_tiers.valkey.store import StoreDown, ValkeyServer, ValkeyStore
from kvledger.transfers.lower_tiers.valkey.tier import BATCH_BLOCKS, ValkeyTierIO, keys_present

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
SIZES = (4096, 1024)  # two groups, blocks of different sizes
SLOTS = 160


def key(n: int, group: int = 0) -> bytes:
    return n.to_bytes(16, "big") + group.to_bytes(4, "big")


def server_of(process, timeout_s: float = 0.5) -> ValkeyServer:
    return ValkeyServer(nodes=(("127.0.0.1", process.port),), timeout_s=timeout_s)


@pytest.fixture
def rows() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(-128, 127, (SLOTS, max(SIZES)), dtype=torch.int8)


@pytest.fixture
def tier(rows):
    made = []

    def make(server: ValkeyServer, namespace: bytes = NS, connections: int = 3) -> ValkeyTierIO:
        made.append(ValkeyTierIO(server=server, name="1:valkey", namespace=namespace, rows=rows,
                                 payload_bytes=SIZES, connections=connections))
        return made[-1]

    yield make
    for io in made:
        io.shutdown(drain=False, timeout_s=10)


def run(io: ValkeyTierIO, job_id: int, kind: str, keys, slots, timeout_s: float = 30.0):
    getattr(io, kind)(job_id, keys, slots)
    io.wait([job_id], timeout_s)
    (outcome,) = io.poll()
    assert outcome.job_id == job_id and outcome.kind == kind
    return outcome


def both_groups(numbers: list[int], first_slot: int):
    keys = (tuple(key(n) for n in numbers), tuple(key(n, 1) for n in numbers))
    slots = (tuple(range(first_slot, first_slot + len(numbers))),
             tuple(range(first_slot + len(numbers), first_slot + 2 * len(numbers))))
    return keys, slots


def test_blocks_round_trip_in_batches_and_land_in_their_slots(valkey_server, tier, rows) -> None:
    io = tier(server_of(valkey_server()))
    numbers = list(range(BATCH_BLOCKS + 5))  # more than a batch per group
    keys, slots = both_groups(numbers, 0)
    wrote = run(io, 1, "write", keys, slots)
    assert wrote.ok and wrote.nbytes == len(numbers) * sum(SIZES)
    expected = rows.clone()
    rows[:] = 0
    back, back_slots = both_groups(numbers, 2 * len(numbers))
    read = run(io, 2, "read", back, back_slots)
    assert read.ok and read.nbytes == wrote.nbytes
    for g, size in enumerate(SIZES):
        for src, dst in zip(slots[g], back_slots[g]):
            assert torch.equal(rows[dst, :size], expected[src, :size])


def test_a_missing_corrupt_truncated_or_foreign_value_fails_its_position_only(valkey_server, tier, rows) -> None:
    process = valkey_server()
    io = tier(server_of(process))
    numbers = list(range(7))
    keys, slots = both_groups(numbers, 0)
    assert run(io, 1, "write", keys, slots).ok
    store = ValkeyStore(server_of(process))
    try:
        client = store._connect()
        client.delete(store_key(NS, key(0)))  # evicted, or lost in a restart
        client.setrange(store_key(NS, key(1)), 200, b"\xff\x00")  # a flipped payload
        value = client.get(store_key(NS, key(2)))
        client.set(store_key(NS, key(2)), value[:-100])  # cut short
        client.set(store_key(NS, key(3)), encode_value(OTHER_NS, key(3), rows[0, :SIZES[0]].numpy()))  # another model
        client.set(store_key(NS, key(4, 1)), encode_value(NS, key(4, 1), rows[0, :512].numpy()))  # another size
        client.delete(store_key(NS, key(5)))
        client.rpush(store_key(NS, key(5)), b"x")  # another program's list under the key: an error reply
        client.set(store_key(NS, key(6)), bytes(4 << 20))  # 4 MiB where a block is asked for: read past
    finally:
        store.close()
    before = rows.clone()
    back, back_slots = both_groups(numbers, 40)
    with capture_logs() as logs:
        read = run(io, 2, "read", back, back_slots)
    assert dict(zip(read.failed, read.reasons)) == {
        (0, 0): "missing", (0, 1): "corrupt", (0, 2): "truncated", (0, 3): "foreign", (1, 4): "foreign",
        (0, 5): "unreadable", (0, 6): "foreign"}
    assert io.health.up  # one key's value fails that key, not the tier
    assert read.nbytes == sum(SIZES[g] for g in range(2) for i in numbers if (g, i) not in read.failed)
    assert [e for e in logs if e["event"] == "tier_io_failed"][0]["failed"] == 7
    for g, size in enumerate(SIZES):  # the good positions hold the blocks written
        for i, (src, dst) in enumerate(zip(slots[g], back_slots[g])):
            if (g, i) not in read.failed:
                assert torch.equal(rows[dst, :size], before[src, :size])


def test_a_killed_server_fails_jobs_in_bounded_time_and_the_tier_comes_back(valkey_server, tier) -> None:
    process = valkey_server()
    io = tier(server_of(process))
    keys, slots = both_groups([1, 2, 3], 0)
    assert run(io, 1, "write", keys, slots).ok
    process.kill()
    started = time.monotonic()
    with capture_logs() as logs:
        read = run(io, 2, "read", keys, slots)
        again = run(io, 3, "write", keys, slots)
    assert time.monotonic() - started < 5
    assert set(read.reasons) == {"unreachable"} and len(read.failed) == 6
    assert set(again.reasons) == {"unreachable"}
    assert not io.health.up
    assert [e["event"] for e in logs].count("valkey_tier_down") == 1  # once, for both jobs
    process.start()  # back, and empty
    time.sleep(RETRY_S + 0.1)
    with capture_logs() as logs:
        tried = run(io, 4, "read", keys, slots)  # one batch tries the server; the others fail at once
        read = run(io, 5, "read", keys, slots)
    assert "missing" in tried.reasons and set(tried.reasons) <= {"missing", "unreachable"}
    assert set(read.reasons) == {"missing"} and io.health.up  # reached it: its keys were lost with it
    assert "valkey_tier_up" in [e["event"] for e in logs]
    assert run(io, 6, "write", keys, slots).ok and run(io, 7, "read", keys, slots).ok


def test_a_paused_server_costs_one_timeout_then_jobs_fail_at_once(valkey_server, tier) -> None:
    process = valkey_server()
    io = tier(server_of(process, timeout_s=0.5))
    keys, slots = both_groups([1, 2], 0)
    assert run(io, 1, "write", keys, slots).ok
    process.pause()
    try:
        started = time.monotonic()
        first = run(io, 2, "read", keys, slots)
        took_first = time.monotonic() - started
        started = time.monotonic()
        second = run(io, 3, "read", keys, slots)
        took_second = time.monotonic() - started
    finally:
        process.resume()
    assert set(first.reasons) == set(second.reasons) == {"unreachable"}
    assert took_first < 3 and took_second < 0.2
    time.sleep(RETRY_S + 0.1)
    tried = run(io, 4, "read", keys, slots)  # one batch tries the server; the others fail at once
    assert len(tried.failed) < 4 and set(tried.reasons) <= {"unreachable"}
    assert run(io, 5, "read", keys, slots).ok  # the server kept its keys through the pause


def test_the_tier_is_down_an_eighth_of_a_second_after_one_failure_and_longer_while_it_stays_down() -> None:
    """A stall of the host (0.1-2 s, machine-wide, seen in the soak) failed a batch and kept the
    tier down a whole second; now a first failure costs `FIRST_RETRY_S`, doubling while the
    server stays down, and one batch at a time tries it."""
    health = Health("1:valkey", "valkey://here", timeout_s=0.5)
    began = time.perf_counter()
    health.failed("a stall", began)
    assert not health.usable()
    health.failed("the same stall, another thread's batch", began)  # in flight then: the same outage
    time.sleep(FIRST_RETRY_S + 0.02)
    assert health.usable()  # this caller tries the server
    assert not health.usable()  # the others wait for its answer
    health.failed("still down", time.perf_counter())
    waits = [health._down_until - time.perf_counter()]
    for _ in range(4):
        time.sleep(waits[-1] + 0.01)
        assert health.usable()
        health.failed("still down", time.perf_counter())
        waits.append(health._down_until - time.perf_counter())
    assert waits == pytest.approx([2 * FIRST_RETRY_S, 4 * FIRST_RETRY_S, RETRY_S, RETRY_S, RETRY_S], abs=0.02)
    time.sleep(RETRY_S + 0.01)
    assert health.usable()
    health.worked()
    assert health.up and health.usable()
    health.failed("a new stall", time.perf_counter())
    assert FIRST_RETRY_S - 0.02 < health._down_until - time.perf_counter() <= FIRST_RETRY_S  # counted afresh


def test_a_try_that_never_answers_lets_another_try_after_the_timeout() -> None:
    health = Health("1:valkey", "valkey://here", timeout_s=0.05)
    health.failed("down", time.perf_counter())
    time.sleep(FIRST_RETRY_S + 0.02)
    assert health.usable() and not health.usable()
    time.sleep(0.05 + RETRY_S + 0.02)  # the try's timeout and margin: it was lost (a bug in its batch)
    assert health.usable()


def test_a_full_server_refuses_writes_and_an_evicting_one_loses_old_keys(valkey_server, tier) -> None:
    refusing = tier(server_of(valkey_server(maxmemory="2mb", policy="noeviction")))
    numbers = list(range(600))  # 600 x 5 KiB: more than 2 MB
    keys = (tuple(key(n) for n in numbers), tuple(key(n, 1) for n in numbers))
    slots = (tuple(n % SLOTS for n in numbers), tuple(n % SLOTS for n in numbers))
    with capture_logs() as logs:
        wrote = run(refusing, 1, "write", keys, slots)
    assert wrote.failed and set(wrote.reasons) == {"unwritable"} and refusing.health.up
    assert any("maxmemory" in e["error"] for e in logs if e["event"] == "valkey_set_refused")
    evicting = tier(server_of(valkey_server(maxmemory="2mb", policy="allkeys-lru")))
    assert run(evicting, 2, "write", keys, slots).ok
    oldest_and_newest = numbers[:40] + numbers[-40:]
    read = run(evicting, 3, "read", *both_groups(oldest_and_newest, 0))
    assert read.failed and set(read.reasons) == {"missing"}  # the oldest were evicted
    assert len(read.failed) < 2 * len(oldest_and_newest)  # not all: the policy is an approximate LRU


def test_lookups_find_keys_every_namespace_holds_and_fail_at_once_while_down(valkey_server, tier) -> None:
    process = valkey_server()
    server = server_of(process)
    mine, theirs = tier(server, NS), tier(server, OTHER_NS)
    keys, slots = both_groups([1, 2, 3], 0)
    assert run(mine, 1, "write", keys, slots).ok
    only_some = ((key(1), key(3)), ())
    assert run(theirs, 2, "write", only_some, ((0, 1), ())).ok
    store = ValkeyStore(server)
    health = Health("1:valkey", server.where, server.timeout_s)
    try:
        ask = (key(1), key(2), key(3), key(4))
        assert keys_present(store, health, (NS,), ask) == (key(1), key(2), key(3))
        assert keys_present(store, health, (NS, OTHER_NS), ask) == (key(1), key(3))
        process.kill()
        started = time.monotonic()
        for _ in range(2):  # the first finds the server gone, the second does not try it
            with pytest.raises(StoreDown):
                keys_present(store, health, (NS,), ask)
        assert time.monotonic() - started < 3 and not health.up
    finally:
        store.close()


@pytest.fixture
def own_cluster():
    """A cluster of this test's own: it kills a master, which the session's shared cluster
    (`valkey_cluster`, whose tests expect its first three servers to be its masters) must keep."""
    from tests.support.valkey_servers import ClusterProcesses

    cluster = ClusterProcesses()
    yield cluster
    cluster.close()


@pytest.mark.slow
def test_a_cluster_round_trips_and_survives_a_master_failover(own_cluster, tier, rows) -> None:
    valkey_cluster = own_cluster
    server = ValkeyServer(nodes=tuple(("127.0.0.1", s.port) for s in valkey_cluster.servers[:3]), cluster=True,
                          timeout_s=0.5)
    io = tier(server)
    numbers = list(range(60))  # spread over every master's slots
    keys, slots = both_groups(numbers, 0)
    assert run(io, 1, "write", keys, slots).ok
    assert run(io, 2, "read", keys, slots).ok
    victim = valkey_cluster.master_of(store_key(NS, key(0)))
    time.sleep(0.5)  # replication is asynchronous: let the replicas catch up
    valkey_cluster.fail_over(victim)  # killed; a replica took over
    time.sleep(RETRY_S + 0.1)
    deadline = time.monotonic() + 20
    jobs = itertools.count(3)

    def until_ok(kind: str):
        while True:
            outcome = run(io, next(jobs), kind, keys, slots)
            if outcome.ok or time.monotonic() > deadline:
                return outcome
            time.sleep(0.3)

    read = until_ok("read")  # the client learns the new map within a few batches
    assert read.ok, dict(zip(read.failed, read.reasons))
    write = until_ok("write")  # a batch of a job begun on the old map may still fail late and trip the breaker
    assert write.ok, dict(zip(write.failed, write.reasons))


def test_blocks_round_trip_over_tls(valkey_server, tier, rows) -> None:
    process = valkey_server(tls=True)
    server = ValkeyServer(nodes=(("127.0.0.1", process.port),), tls=True, tls_ca_file=str(process.tls[0]))
    io = tier(server)
    keys, slots = both_groups([1, 2, 3], 0)
    assert run(io, 1, "write", keys, slots).ok
    back, back_slots = both_groups([1, 2, 3], 10)
    assert run(io, 2, "read", back, back_slots).ok
    assert torch.equal(rows[10:13, :SIZES[0]], rows[0:3, :SIZES[0]])


def test_two_instances_writing_the_same_keys_at_once_leave_good_blocks(valkey_server, rows) -> None:
    """Two replicas computed the same prefix: their values are the same bytes, last writer wins."""
    server = server_of(valkey_server())
    ios = [ValkeyTierIO(server=server, name="1:valkey", namespace=NS, rows=rows, payload_bytes=SIZES, connections=4)
           for _ in range(2)]
    try:
        numbers = list(range(40))
        keys, slots = both_groups(numbers, 0)
        for round_ in range(5):
            for n, io in enumerate(ios):
                io.write(10 * round_ + n, keys, slots)
            for n, io in enumerate(ios):
                io.wait([10 * round_ + n], 30)
                assert all(o.ok for o in io.poll())
        back, back_slots = both_groups(numbers, 80)
        assert run(ios[0], 99, "read", back, back_slots).ok
        for g, size in enumerate(SIZES):
            assert torch.equal(rows[list(back_slots[g]), :size], rows[list(slots[g]), :size])
    finally:
        for io in ios:
            io.shutdown()
