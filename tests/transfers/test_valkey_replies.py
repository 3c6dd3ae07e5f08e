"""A shared store's replies are not trusted. Against real sockets (a real
valkey-server, and a `LyingServer` in front of one that answers what a real
server would not), a reply that claims too much, never ends its line,
trickles, or is not one the command gives fails its batch as the store being
down (`StoreDown`) within the timeout, drops the connection and keeps memory
bounded; a value of a wrong length within bounds fails only its own key; and
start refuses a certificate for another name or a cluster node named as one
server."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

import pytest
import valkey
from structlog.testing import capture_logs

from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.tier_io import TierJob
from kvledger.transfers.lower_tiers.tier_types import check_tiers, parse_tiers
from kvledger.transfers.lower_tiers.valkey.cluster_store import open_store
from kvledger.transfers.lower_tiers.valkey.store import (
    BadCertificate,
    Landed,
    StoreDown,
    ValkeyServer,
    ValkeyStore,
    ValueTooLarge,
)
from tests.support.valkey_servers import LyingServer

HEAD = 100
PAYLOAD = 64 << 10
BLOCK = bytes(range(256)) * (PAYLOAD // 256)
JUNK = bytes(1 << 20)  # made once: a lie streams it without allocating


def store_at(port: int, **more) -> ValkeyStore:
    return ValkeyStore(ValkeyServer(nodes=(("127.0.0.1", port),), timeout_s=0.5, **more))


def keys(count: int) -> list[bytes]:
    return [b"k%d" % n for n in range(count)]


def items(count: int, payload: bytes = BLOCK) -> list[tuple[bytes, bytes, memoryview]]:
    return [(key, key.ljust(HEAD, b"h"), memoryview(payload)) for key in keys(count)]


def targets(count: int, size: int = PAYLOAD) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(count)]


def get(store: ValkeyStore, into: list[memoryview]) -> list:
    return store.get_into(keys(len(into)), [HEAD] * len(into), into)


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M).group(1)) << 10


@contextlib.contextmanager
def peak_growth() -> Iterator[list[int]]:
    """How far the process's peak resident memory rose over the block (VmHWM, reset at its start)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    start = _status("VmRSS")
    grew = [0]
    yield grew
    grew[0] = _status("VmHWM") - start


def on(command: bytes, *chunks: bytes, junk_mib: int = 0):
    """A lie: `command` is answered with `chunks`, then `junk_mib` MiB of zeros; others are relayed."""
    def lie(args: list[bytes]):
        if args[0].upper() != command:
            return None
        return iter([*chunks, *[JUNK] * junk_mib])
    return lie


@pytest.fixture
def lying(valkey_server):
    made: list[LyingServer] = []

    def make(**options) -> LyingServer:
        made.append(LyingServer(valkey_server().port, **options))
        return made[-1]

    yield make
    for server in made:
        server.close()


def test_a_value_claiming_4_gb_fails_the_batch_as_down_in_bounded_memory(lying) -> None:
    """Buffering a claimed size as it arrived let forged values take a 64 KiB
    read to most of a GB; a claim larger than asked for now ends the batch."""
    server = lying()
    store = store_at(server.port)
    try:
        assert store.set_many(items(8)) == [None] * 8
        server.lie = on(b"GET", b"$%d\r\n" % (4 << 30), junk_mib=64)
        into = targets(8)
        with peak_growth() as grew, pytest.raises(StoreDown, match="4294967296-byte value"):
            get(store, into)
        assert grew[0] < 16 << 20
        assert server.wait_closed(1)  # the connection was dropped, not read on
        server.lie = lambda args: None
        values = get(store, into)
        assert all(isinstance(v, Landed) for v in values) and all(bytes(t) == BLOCK for t in into)
    finally:
        store.close()


@pytest.mark.parametrize("command", [b"SET", b"EXISTS"])
def test_set_and_exists_replies_claiming_4_gb_fail_as_down_in_bounded_memory(lying, command) -> None:
    """SET and EXISTS answer a status or a number: a bulk reply to them is a lie, not to be buffered."""
    server = lying(lie=on(command, b"$%d\r\n" % (4 << 30), junk_mib=64))
    store = store_at(server.port)
    try:
        with peak_growth() as grew, pytest.raises(StoreDown, match="b'\\$4294967296'"):
            store.set_many(items(8)) if command == b"SET" else store.exists_each(keys(8))
        assert grew[0] < 16 << 20
    finally:
        store.close()


def test_a_header_line_without_its_end_fails_within_the_line_cap(lying) -> None:
    """Searching the whole growing buffer on every read held the GIL for seconds on a 64 MB line."""
    server = lying(lie=on(b"GET", b"+", junk_mib=64))
    store = store_at(server.port)
    try:
        started = time.monotonic()
        with peak_growth() as grew, pytest.raises(StoreDown, match="longer than 4096 bytes"):
            get(store, targets(2))
        assert time.monotonic() - started < 1 and grew[0] < 16 << 20
    finally:
        store.close()


@pytest.mark.parametrize("reply", [b"$abc\r\n", b"$-5\r\n", b"-ERR " + b"e" * 5000 + b"\r\n"],
                         ids=["not-a-number", "negative", "long-error"])
def test_a_reply_no_get_gives_fails_the_batch_as_down(lying, reply) -> None:
    """A length that is not one (a ValueError escaped the tier's down path, or a
    negative one read as missing) or an error line past the cap: the server is not to be trusted."""
    server = lying(lie=on(b"GET", reply))
    store = store_at(server.port)
    try:
        with pytest.raises(StoreDown):
            get(store, targets(2))
        assert server.wait_closed(1)
    finally:
        store.close()


def test_a_value_of_another_length_fails_its_key_and_a_much_longer_one_fails_its_key_alone(valkey_server) -> None:
    """A value written by another program may be a little off (its key's check fails
    it); one far longer than asked for is read past, not kept, and fails its key alone:
    the batch's other keys land and the connection goes on."""
    process = valkey_server()
    store = store_at(process.port)
    other = valkey.Valkey(port=process.port)
    try:
        assert store.set_many(items(3)) == [None] * 3
        other.set(b"k1", b"x" * (HEAD + PAYLOAD + 100))
        other.set(b"k2", b"x" * (HEAD + PAYLOAD - 100))
        values = get(store, targets(3))
        assert isinstance(values[0], Landed)
        assert [type(v) for v in values[1:]] == [bytes, bytes]
        assert [len(v) for v in values[1:]] == [HEAD + PAYLOAD + 100, HEAD + PAYLOAD - 100]
        other.set(b"k1", b"x" * 2 * (HEAD + PAYLOAD))
        other.set(b"k2", b"x" * (8 << 20))
        into = targets(3)
        values = get(store, into)
        assert isinstance(values[0], Landed) and bytes(into[0]) == BLOCK
        assert [type(v) for v in values[1:]] == [ValueTooLarge, ValueTooLarge]
        assert f"{2 * (HEAD + PAYLOAD)}-byte value" in str(values[1]) and f"{8 << 20}-byte value" in str(values[2])
        into = targets(1)
        assert isinstance(get(store, into)[0], Landed) and bytes(into[0]) == BLOCK
    finally:
        other.close()
        store.close()


def trickled(seconds: float) -> Iterator[bytes]:
    """A GET's reply of the size asked for, a byte every 20 ms for `seconds`."""
    ends = time.monotonic() + seconds
    for byte in b"$%d\r\n" % (HEAD + PAYLOAD) + JUNK:
        if time.monotonic() > ends:
            return
        time.sleep(0.02)
        yield bytes([byte])


def test_a_trickling_reply_fails_the_batch_within_its_timeout(lying) -> None:
    """A timeout per system call let a server sending a byte at a time hold a batch for seconds."""
    def trickle(args: list[bytes]):
        return trickled(4) if args[0].upper() == b"GET" else None

    server = lying(lie=trickle)
    store = store_at(server.port)
    try:
        started = time.monotonic()
        with pytest.raises(StoreDown, match="longer than timeout_s"):
            get(store, targets(2))
        assert time.monotonic() - started < 1.5  # a byte every 20 ms for 4 s, had each read its own timeout
    finally:
        store.close()


def test_a_server_slow_to_take_a_batch_fails_it_within_its_timeout(lying) -> None:
    """Sending is bounded the same way: a server reading slowly does not hold a batch either."""
    server = lying(read_pause_s=0.01)
    store = store_at(server.port)
    try:
        started = time.monotonic()
        with pytest.raises(StoreDown, match="longer than timeout_s"):
            store.set_many(items(1024))  # 64 MiB, taken at about 1.6 MB/s: most of a minute
        assert time.monotonic() - started < 1.5
    finally:
        store.close()


def test_blocks_larger_than_a_tls_record_land_in_place(valkey_server) -> None:
    """A TLS socket takes no recv flags: a block spanning records is read in several calls."""
    process = valkey_server(tls=True)
    store = store_at(process.port, tls=True, tls_ca_file=str(process.tls[0]))
    try:
        assert store.set_many(items(4)) == [None] * 4
        into = targets(4)
        values = get(store, into)
        assert all(isinstance(v, Landed) for v in values) and all(bytes(t) == BLOCK for t in into)
    finally:
        store.close()


def test_a_paused_tls_server_fails_a_batch_as_late(valkey_server) -> None:
    """A TLS socket keeps Python's timeout: its expiry reads as late, as the kernel's does."""
    process = valkey_server(tls=True)
    store = store_at(process.port, tls=True, tls_ca_file=str(process.tls[0]))
    try:
        assert store.set_many(items(2)) == [None] * 2
        process.pause()
        try:
            started = time.monotonic()
            with pytest.raises(StoreDown, match="longer than timeout_s"):
                get(store, targets(2))
            assert time.monotonic() - started < 1.5
        finally:
            process.resume()
    finally:
        store.close()


def test_a_certificate_for_another_name_stops_start_even_with_warn(valkey_server) -> None:
    """A certificate for another host is a wrong setting or an attack, not an outage to wait out."""
    process = valkey_server(tls=True, tls_name="other.example")
    ca_file = str(process.tls[0])
    entry = {"type": "valkey", "url": f"rediss://127.0.0.1:{process.port}", "capacity_bytes": 1 << 20,
             "tls_ca_file": ca_file, "on_unreachable": "warn"}
    with pytest.raises(ConfigError, match=r"does not verify for host 127\.0\.0\.1"):
        check_tiers(parse_tiers([entry]))
    store = store_at(process.port, tls=True, tls_ca_file=ca_file)
    try:
        with pytest.raises(BadCertificate, match="mismatch"):
            store.ping()
    finally:
        store.close()


def test_a_cluster_node_named_as_one_server_stops_start(valkey_server) -> None:
    """A plain client of a cluster node fails most keys with MOVED: start says to set cluster: true."""
    node = valkey_server(cluster=True)
    entry = {"type": "valkey", "url": node.url, "capacity_bytes": 1 << 20, "on_unreachable": "warn"}
    with pytest.raises(ConfigError, match="set cluster: true"):
        check_tiers(parse_tiers([entry]))
    plain = valkey_server()
    check_tiers(tiers := parse_tiers([{**entry, "url": plain.url}]))
    assert len(tiers) == 1


def test_a_job_failed_only_as_unreachable_logs_below_warning() -> None:
    """The tier logs going down and up once: a warning per job while it is down would flood the log."""
    with capture_logs() as logs:
        for job_id, reasons in ((1, ("unreachable", "unreachable")), (2, ("unreachable", "missing"))):
            job = TierJob(job_id, "read", len(reasons))
            outcome = job.settle([(0, n, reason, f"k{n}") for n, reason in enumerate(reasons)], 0, 0, None)
            job.finished(outcome)
    levels = {e["job_id"]: e["log_level"] for e in logs if e["event"] == "tier_io_failed"}
    assert levels.get(1, "debug") == "debug" and levels[2] == "warning"


@pytest.mark.slow  # six TLS servers joined into a cluster, per case
@pytest.mark.parametrize("name, works", [("127.0.0.1", True), ("other.example", False)])
def test_a_tls_cluster_checks_every_node_s_host_name(name, works, needs_tls) -> None:
    """Every node of a cluster is connected to as one server is, its certificate's
    host name checked (valkey-py's cluster client dropped the check from its nodes'
    options): a certificate for another name must not serve."""
    from tests.support.valkey_servers import ClusterProcesses

    cluster = ClusterProcesses(tls=True, tls_name=name)
    try:
        ca_file = str(cluster.certificate[0])
        server = ValkeyServer(nodes=tuple(("127.0.0.1", s.port) for s in cluster.servers[:3]), cluster=True,
                              tls=True, tls_ca_file=ca_file, timeout_s=2.0)
        store = open_store(server)
        try:
            if works:
                keys = [b"kvledger:k%d" % n for n in range(20)]  # spread over the three masters
                assert store.set_many([(k, b"h", memoryview(b"v")) for k in keys]) == [None] * 20
                assert store.exists_each(keys) == [True] * 20
                nodes = [store._node(address) for address in store.masters()]
                assert len(nodes) == 3 and all(node._connect().connection.check_hostname for node in nodes)
            else:
                with pytest.raises(StoreDown, match="(?i)certificate|mismatch|hostname"):
                    store.ping()
        finally:
            store.close()
        if not works:
            entry = {"type": "valkey", "urls": [f"rediss://127.0.0.1:{s.port}" for s in cluster.servers[:3]],
                     "capacity_bytes": 1 << 20, "tls_ca_file": ca_file, "on_unreachable": "warn"}
            with pytest.raises(ConfigError, match="127.0.0.1"):
                check_tiers(parse_tiers([entry]))
    finally:
        cluster.close()
