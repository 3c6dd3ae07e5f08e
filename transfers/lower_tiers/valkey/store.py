"""Commands on one Valkey (or Redis) server, as the Valkey tier needs them:
pipelined SET, GET and EXISTS, with no retries of the client's own and
`timeout_s` bounding a whole batch, so a dead, paused or trickling server
costs one timeout and then counts as down (`StoreDown`) for its caller to
handle. A cluster is its nodes, each one such server (`cluster_store`).

The server is shared, so its replies are not trusted: they are read here
(`_Replies`), and only the lengths a command can answer are taken
(a value of the size asked for, or close to it; a status or a number on a
short line). A GET's value longer than that is read past in small pieces and
fails its key alone (`ValueTooLarge`: someone wrote something else there);
any other reply that claims more, or is not one a command gives, fails the
batch as the server being down and drops the connection. Whatever the server
sends, memory stays bounded by the blocks asked for.

valkey-py (bench/valkey_clients.py compares it with valkey-glide and
redis-py; bench/RESULTS.md has the numbers) connects, authenticates and
sends the rare commands (not a block's). A `ValkeyStore` is one thread's:
each I/O thread holds its own connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
import valkey
from valkey.backoff import NoBackoff
from valkey.exceptions import ResponseError, ValkeyError
from valkey.retry import Retry

LINE_MAX = 4096
"""The longest reply line taken (a status, an error, a length): the commands here answer in a few bytes."""
SLACK_BYTES = 4096
"""How much longer than asked for a value may be and still be read, to fail its own key's check."""
INFO_MAX = 1 << 16
"""The longest `INFO cluster` reply taken (a few hundred bytes)."""
SLOTS_MAX = 4 << 20
"""The most bytes a `CLUSTER SLOTS` reply may take (a cluster of three masters answers in about
500; 16,384 slot ranges, each on its own master and replica, in about 2 MB)."""
REFRESH_S = 0.002
"""How long a socket timeout set to a batch's time left is kept (`_Wire`)."""
LATE = "the batch took longer than timeout_s"
"""Why a batch failed when its time ran out: a socket call that timed out (`_Wire._call`)."""
_ONLY_WHAT_HAS_COME = float("inf")
"""`_Wire._set_at`'s mark for a socket option set to a microsecond, past the deadline."""
IOV_MAX = 1024
"""The most buffers one `sendmsg` takes (Linux's IOV_MAX)."""


@attrs.frozen(kw_only=True)
class ValkeyServer:
    """Where the store is and how to talk to it."""

    nodes: tuple[tuple[str, int], ...]  # host, port: the server, or a cluster's seed nodes
    cluster: bool = False
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)  # never logged
    timeout_s: float = 1.0  # per batch, sent and answered; a server slower than this counts as down
    tls_ca_file: str | None = None  # a private CA's certificate (else the system's trusted ones)

    @property
    def where(self) -> str:
        """The server for messages and logs, without credentials."""
        scheme = "valkeys" if self.tls else "valkey"
        return ",".join(f"{scheme}://{host}:{port}" for host, port in self.nodes)


_FAILURES = (ValkeyError, OSError)
REDIRECTS = (b"MOVED ", b"ASK ")
"""The error replies of a cluster node that does not hold a key's slot (now, or while it moves)."""


class StoreDown(Exception):
    """The server could not be reached, did not answer within the timeout, or
    answered what the commands do not (a connection to it is not to be trusted)."""


class BadCertificate(StoreDown):
    """The server's TLS certificate did not verify (issued for another name, or
    by a CA not trusted): a wrong setting or an attack, not an outage."""


_T = TypeVar("_T")


class ValkeyStore:
    """One server's commands. `deadline` (a `time.monotonic()`), where a
    command takes it, bounds the batch instead of `timeout_s` from now: a
    cluster's batch spans several nodes within one timeout."""

    def __init__(self, server: ValkeyServer) -> None:
        if server.cluster:
            raise ValueError(f"{server.where} is a cluster: its store is a ClusterStore (open_store)")
        self.server = server
        self._client: valkey.Valkey | None = None
        self.redirected = False  # whether the last batch met MOVED or ASK (a cluster's slots moved)

    def _connect(self) -> valkey.Valkey:
        """The client, connected: TLS checks the certificate and its host name
        and takes nothing older than TLS 1.2."""
        if self._client is None:
            tier = self.server
            host, port = tier.nodes[0]
            try:
                self._client = valkey.Valkey(
                    host=host, port=port, db=tier.db, single_connection_client=True,
                    username=tier.username, password=tier.password, ssl=tier.tls, ssl_ca_certs=tier.tls_ca_file,
                    ssl_cert_reqs="required", ssl_check_hostname=True, ssl_min_version=ssl.TLSVersion.TLSv1_2,
                    socket_timeout=tier.timeout_s, socket_connect_timeout=tier.timeout_s,
                    retry=Retry(NoBackoff(), 0), client_name="kvledger")
            except _FAILURES as exc:
                raise _down(exc) from None
        return self._client

    def ping(self, deadline: float | None = None) -> None:
        refused = self._exchange([b"*1\r\n$4\r\nPING\r\n"], lambda replies: replies.status(b"+PONG"), deadline)
        if refused is not None:
            self._reset()
            raise StoreDown(refused)

    def cluster_enabled(self) -> bool:
        """Whether one server (`cluster` false) is a cluster node, which would
        answer most keys with MOVED (`INFO cluster`; a server that will not
        say counts as no node)."""
        info = self._exchange([b"*2\r\n$4\r\nINFO\r\n$7\r\ncluster\r\n"], lambda replies: replies.bulk(INFO_MAX))
        return info is not None and b"cluster_enabled:1" in info

    def cluster_slots(self, deadline: float | None = None) -> object:
        """`CLUSTER SLOTS`'s reply, as nested lists (`_Replies.tree`), at most `SLOTS_MAX` bytes."""
        return self._exchange([b"*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n"],
                              lambda replies: replies.tree(SLOTS_MAX, depth=4), deadline)

    def set_many(self, items: Sequence[tuple[bytes, bytes, memoryview]],
                 deadline: float | None = None) -> list[str | None]:
        """SET each key to its header and payload; per item None, or why the
        server refused it (a full server: OOM).

        The commands are framed here and the payload sent from its own memory,
        as the socket's `send` takes it: valkey-py's packer (libvalkey's)
        copies every value into one buffer per command, and joining header and
        payload would copy it once more, which on a busy host costs the tier a
        third of its write speed (bench/valkey_tier_io.py)."""
        if not items:
            return []
        chunks: list[bytes | memoryview] = []
        after = b""  # the previous payload's CRLF, sent with the next command's head
        for key, header, payload in items:
            chunks.append(b"%s*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
                after, len(key), key, len(header) + payload.nbytes, header))
            chunks.append(payload)
            after = b"\r\n"
        chunks.append(after)
        return self._exchange(chunks, lambda replies: replies.each(len(items), 5, lambda: replies.status(b"+OK")),
                              deadline)

    def get_into(self, keys: Sequence[bytes], heads: Sequence[int], targets: Sequence[memoryview],
                 deadline: float | None = None) -> list[bytes | None | Exception | Landed]:
        """GET each key; a value of `heads[n]` + `len(targets[n])` bytes lands in
        place: its first `heads[n]` bytes are returned (`Landed`), the rest read
        from the socket straight into `targets[n]`, unchecked (the caller checks
        it). A value of another length, up to `SLACK_BYTES` longer, is returned
        whole (its check fails it), a missing key as None, an error reply (a key
        of another type, a cluster's MOVED) as its `ResponseError`, a longer
        value as `ValueTooLarge` (read past, not kept).

        A reply read into its block costs no allocation and no copy, where
        valkey-py's reader makes a bytes object of every value
        (bench/valkey_tier_io.py)."""
        if not keys:
            return []
        command = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)
        return self._exchange([command], lambda replies: replies.values(heads, targets), deadline)

    def exists_each(self, keys: Sequence[bytes], deadline: float | None = None) -> list[bool]:
        """Whether each key has a value; an error reply counts as none."""
        if not keys:
            return []
        command = b"".join(b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)
        return self._exchange([command], lambda replies: replies.each(len(keys), 4, replies.exists), deadline)

    def _exchange(self, chunks: Sequence[bytes | memoryview], read: Callable[[_Replies], _T],
                  deadline: float | None = None) -> _T:
        """Send `chunks`, then `read` the replies, all by `deadline` (else within
        `timeout_s`). Any failure, a reply the commands do not give among them,
        drops the connection."""
        if deadline is None:
            deadline = time.monotonic() + self.server.timeout_s
        self.redirected = False
        try:
            connection = self._fresh_connection()
            with _whole_blocks(connection, deadline) as wire:
                wire.send_all(chunks)
                replies = _Replies(wire)
                answers = read(replies)
                replies.finish()
                self.redirected = replies.redirected
                return answers
        except (*_FAILURES, _ProtocolError) as exc:
            self._reset()
            raise _down(exc) from None

    def _fresh_connection(self):
        """The single-connection client's own connection, reopened if the server
        closed it meanwhile (a restart): a socket with something to read between
        commands is one the server gave up on."""
        connection = self._connect().connection
        if connection._sock is not None:
            waiting = select.poll()  # not select(): a process of vLLM's may hold descriptors past FD_SETSIZE
            waiting.register(connection._sock, select.POLLIN)
            if waiting.poll(0):
                connection.disconnect()  # the next send connects again
        return connection

    def hset(self, name: bytes, field: str, value: str) -> None:
        self._command("hset", name, field, value)

    def hash_fields(self, name: bytes, most: int) -> dict[bytes, bytes]:
        """At most `most` fields of a hash (HSCAN, so the server never sends one huge reply)."""
        found: dict[bytes, bytes] = {}
        cursor = 0
        while True:
            cursor, page = self._command("hscan", name, cursor, None, 64)
            found.update(list(page.items())[: most - len(found)])
            if not cursor or len(found) >= most:
                return found

    def count_keys(self, pattern: bytes, budget_s: float) -> tuple[int, bool]:
        """How many keys match `pattern` (SCAN), counted for at most `budget_s`:
        (count, whether the count is complete)."""
        deadline = time.monotonic() + budget_s
        count = 0
        try:
            for _ in self._connect().scan_iter(match=pattern, count=1000):
                count += 1
                if time.monotonic() > deadline:
                    return count, False
        except _FAILURES as exc:
            self._reset()
            raise _down(exc) from None
        return count, True

    def _command(self, name: str, *args: object) -> Any:
        """One of the rare commands (not a block's), through valkey-py."""
        try:
            return getattr(self._connect(), name)(*args)
        except _FAILURES as exc:
            self._reset()
            raise _down(exc) from None

    def _reset(self) -> None:
        """Drop the connection after a failure; the next command reconnects."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # a broken socket may fail to close; it is dropped either way
                pass

    def close(self) -> None:
        self._reset()


def _describe(exc: object) -> str:
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else str(exc)


def _down(exc: BaseException) -> StoreDown:
    """`StoreDown`, or `BadCertificate` where a certificate check failed
    (valkey-py raises its own error while handling the one from `ssl`)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return BadCertificate(_describe(exc))
        seen = seen.__cause__ or seen.__context__
    return StoreDown(_describe(exc))


@contextlib.contextmanager
def _whole_blocks(connection, deadline: float) -> Iterator[_Wire]:
    """The connection's socket, blocking, each call bounded by the time left
    until `deadline` (`_Wire`); valkey-py's own timeout restored after. A
    connection made here (its handshake: TLS, AUTH, the client's name) is
    bounded by the same deadline."""
    if connection._sock is None:
        timeouts = connection.socket_timeout, connection.socket_connect_timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(LATE)
        connection.socket_timeout = connection.socket_connect_timeout = left
        try:
            connection.connect()
        finally:
            connection.socket_timeout, connection.socket_connect_timeout = timeouts
            if connection._sock is not None:
                connection._sock.settimeout(timeouts[0])
    sock = connection._sock
    previous = sock.gettimeout()
    sock.settimeout(None)
    try:
        yield _Wire(sock, deadline)
    finally:
        if connection._sock is sock:  # not dropped by a failure meanwhile
            sock.settimeout(previous)


class _Wire:
    """A socket whose every call ends by a deadline: a batch's.

    On a plain socket the timeout is kept by the kernel (SO_RCVTIMEO,
    SO_SNDTIMEO, set to the time left): a block then moves in one system
    call, not one per chunk the socket buffer holds, and one such call ends
    by its timeout however the bytes trickle in. With Python's own timeout
    every chunk is a poll and a recv, each taking the GIL back, which in a
    process whose engine thread is busy (vLLM's) waits up to a switch
    interval: a 32-block batch took 450-900 ms that way, against 20-50 ms in
    one call per block. Hence also as few calls a batch as its bytes allow:
    one `sendmsg` for all its commands, replies laid over their targets by
    `recvmsg_into` (`_Replies.values`). A TLS socket reads a record per call
    either way, and may read the socket many times per record, each given the
    kernel's whole timeout: it keeps Python's, which bounds a call whole.

    Setting a timeout is a system call of its own: one set less than
    `REFRESH_S` ago is kept, so a call may end that much past the deadline.

    Past the deadline a call still takes what has already come (a timeout of
    a microsecond): the server answered in time, and this thread read late
    because its process was not scheduled, or waited for the GIL behind
    vLLM's engine loop. Only a call that would wait for bytes yet to come
    makes the batch late. Such a read had marked a live server down for a
    stall of the client's own host."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._set_at: dict[int, float] = {}  # per option (TLS: one), when its timeout was last set

    def _bound(self, option: int) -> None:
        now = time.monotonic()
        left = self.deadline - now
        option = -1 if self.tls else option
        if left <= 0:  # only what has come: see the class's docstring
            if self._set_at.get(option) == _ONLY_WHAT_HAS_COME:
                return
            self._set_at[option] = _ONLY_WHAT_HAS_COME
            left = 1e-6
        elif now - self._set_at.get(option, -REFRESH_S) < REFRESH_S:
            return
        else:
            self._set_at[option] = now
        if self.tls:
            self.sock.settimeout(left)
        else:
            micros = max(1, int(left * 1e6))  # a zero timeval would mean no timeout at all
            self.sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", micros // 1_000_000, micros % 1_000_000))

    def _call(self, option: int, call: Callable[..., _T], *args) -> _T:
        """One socket call within the time left. The kernel's timeout ends a
        call that moved nothing with EAGAIN (`BlockingIOError`; on a TLS socket,
        Python's own timeout): the batch is late."""
        self._bound(option)
        try:
            return call(*args)
        except (BlockingIOError, TimeoutError):
            raise TimeoutError(LATE) from None

    def send_all(self, chunks: Sequence[bytes | memoryview]) -> None:
        """Every chunk, on a plain socket in as few `sendmsg` calls as the
        kernel takes (one per `IOV_MAX` chunks while the server keeps up): each
        call's return waits for the GIL, which in a busy process is a switch
        interval (5 ms), so a call per chunk made a 32-block batch 64 waits."""
        views = [view for chunk in chunks if (view := memoryview(chunk).cast("B")).nbytes]
        while views:
            if self.tls:  # an SSLSocket has no sendmsg
                sent = self._call(socket.SO_SNDTIMEO, self.sock.send, views[0])
            else:
                sent = self._call(socket.SO_SNDTIMEO, self.sock.sendmsg, views[:IOV_MAX])
            while views and sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            if sent:
                views[0] = views[0][sent:]

    def recv(self, size: int, sure: int = 0) -> bytes:
        """Up to `size` bytes; on a plain socket where `sure` bytes are known to
        be coming, exactly those, in one call (MSG_WAITALL)."""
        if sure > 0 and not self.tls:
            chunk = self._call(socket.SO_RCVTIMEO, self.sock.recv, sure, socket.MSG_WAITALL)
        else:
            chunk = self._call(socket.SO_RCVTIMEO, self.sock.recv, size)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    def recv_scattered(self, views: Sequence[memoryview], sure: int) -> int:
        """Bytes laid over `views` in order (plain sockets): exactly `sure` of
        them in one call where that many are known to be coming (MSG_WAITALL),
        else as many as have come. (SO_RCVLOWAT would let one call take both;
        on Linux 6.18 a read of 32 SET replies waiting on it for their 160 bytes
        slept to its timeout with them there; why was not examined.)"""
        flags = 0
        if sure > 0:
            flags, left, views = socket.MSG_WAITALL, sure, list(views)
            for n, view in enumerate(views):
                if view.nbytes >= left:
                    views[n:] = [view[:left]]
                    break
                left -= view.nbytes
        count = self._call(socket.SO_RCVTIMEO, self.sock.recvmsg_into, views[:IOV_MAX], 0, flags)[0]
        if not count:
            raise ConnectionError("the server closed the connection")
        return count

    def recv_into(self, target: memoryview) -> None:
        """Fill `target` whole."""
        got = 0
        while got < target.nbytes:
            if self.tls:
                count = self._call(socket.SO_RCVTIMEO, self.sock.recv_into, target[got:])
            else:
                count = self._call(socket.SO_RCVTIMEO, self.sock.recv_into, target[got:], 0, socket.MSG_WAITALL)
            if not count:
                raise ConnectionError("the server closed the connection")
            got += count


class Landed(bytes):
    """A value's head; its payload was read into the caller's target."""


class _ProtocolError(Exception):
    """A reply that is not what the command sent answers."""


class ValueTooLarge(Exception):
    """A GET answered a value longer than any block of the size asked for: read past, not kept."""


SKIP_BYTES = 1 << 16
"""The piece an oversized value is read past in: the memory it costs, whatever its size."""

BULK_MAX = 512 << 20
"""Valkey's longest value (`proto-max-bulk-len`'s default): a claim past it is the server lying,
not a value to read past, and fails the batch at once."""


class _Replies:
    """RESP replies to the commands sent, read with a small buffer for the
    lines and `recv_into` for values, which land in place or in a buffer of
    their own size; the buffer holds at most a line and one read's bytes
    (or, after `_landed`, the bytes of a batch's replies asked for)."""

    def __init__(self, wire: _Wire) -> None:
        self.wire = wire
        self.buffer = bytearray()
        self.least = 0  # the fewest bytes the replies still to come take: a read waits for them
        self.redirected = False  # a MOVED or ASK among the replies

    def _error(self, line: bytes) -> ResponseError:
        """An error reply's line (`-...`), as its error; a cluster's redirect noted."""
        if line[1:].startswith(REDIRECTS):
            self.redirected = True
        return ResponseError(line[1:].decode(errors="replace"))

    def each(self, count: int, least: int, read: Callable[[], _T]) -> list[_T]:
        """`count` replies, each of `least` bytes or more, read by `read`: a
        server answering as it goes wakes the thread a few times, not once a reply."""
        answers = []
        for left in range(count, 0, -1):
            self.least = left * least
            answers.append(read())
        self.least = 0
        return answers

    def _line(self) -> bytes:
        scanned = 0
        while (end := self.buffer.find(b"\r\n", scanned, LINE_MAX + 2)) < 0:
            if len(self.buffer) >= LINE_MAX + 2:
                raise _ProtocolError(f"a reply line longer than {LINE_MAX} bytes")
            scanned = max(0, len(self.buffer) - 1)  # a CR at the end may begin the CRLF
            self.buffer += self.wire.recv(1 << 16, self.least - len(self.buffer))
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 2]
        return line

    def _into(self, target: memoryview) -> None:
        got = min(len(self.buffer), target.nbytes)
        target[:got] = self.buffer[:got]
        del self.buffer[:got]
        if got < target.nbytes:
            self.wire.recv_into(target[got:])

    def _exact(self, size: int) -> bytes:
        """`size` bytes, which the caller has bounded."""
        if len(self.buffer) >= size:
            data = bytes(self.buffer[:size])
            del self.buffer[:size]
            return data
        data = bytearray(size)
        self._into(memoryview(data))
        return bytes(data)

    def _end(self) -> None:
        if self._exact(2) != b"\r\n":
            raise _ProtocolError("a bulk reply without its CRLF")

    def _length(self, line: bytes) -> int:
        """A bulk reply's length: -1 (none), or a count of bytes."""
        digits = line[1:]
        if line[:1] != b"$" or not (digits == b"-1" or digits.isdigit() and len(digits) <= 18):
            raise _ProtocolError(f"a bulk reply expected, got {line[:40]!r}")
        return int(digits)

    def values(self, heads: Sequence[int], targets: Sequence[memoryview]) -> list[bytes | None | Exception | Landed]:
        """GETs' replies (see `ValkeyStore.get_into`). On a plain socket a run of
        them is read as the values asked for come (`_landed`), a few calls a
        batch where `value` takes two or three a value, each waiting for the GIL
        (a switch interval in a process whose engine is busy); a reply that
        differs (a missing key, another size, an error) is read by `value`, and
        the run goes on after it."""
        if self.wire.tls:
            return [self.value(head, target) for head, target in zip(heads, targets)]
        answers: list[bytes | None | Exception | Landed] = []
        while len(answers) < len(heads):
            answers += self._landed(heads[len(answers):], targets[len(answers):])
            if len(answers) < len(heads):
                answers.append(self.value(heads[len(answers)], targets[len(answers)]))
        return answers

    def _landed(self, heads: Sequence[int], targets: Sequence[memoryview]) -> list[Landed]:
        """The replies, from the first, that are values of the sizes asked for,
        scattered by `recvmsg_into` over a head buffer, the target and a CRLF
        buffer each. From the first reply that differs on, the bytes come are
        put back in the buffer, for `value`."""
        fixed = [b"$%d\r\n" % (head + target.nbytes) for head, target in zip(heads, targets)]
        metas = [bytearray(len(lead) + head) for lead, head in zip(fixed, heads)]
        segments = [view for meta, target in zip(metas, targets)
                    for view in (memoryview(meta), target, memoryview(bytearray(2)))]
        at = got = 0  # segments[at] is the first not full; `got` bytes of it are
        while at < len(segments):
            if self.buffer:  # bytes already come, read by `value`
                count = _lay(self.buffer, segments[at:], got)
                del self.buffer[:count]
            else:
                sure = 0  # the rest of a value whose size has come, and its CRLF
                if at % 3 or got >= len(fixed[at // 3]):
                    sure = sum(view.nbytes for view in segments[at:at - at % 3 + 3]) - got
                count = self.wire.recv_scattered([segments[at][got:], *segments[at + 1:]], sure)
            while at < len(segments) and (count or got == segments[at].nbytes):
                took = min(count, segments[at].nbytes - got)
                count, got = count - took, got + took
                block, part = divmod(at, 3)
                expected = fixed[block] if part == 0 else b"\r\n" if part == 2 else b""
                seen = min(got, len(expected))
                if segments[at][:seen] != expected[:seen]:
                    if part == 2:
                        raise _ProtocolError("a bulk reply without its CRLF")
                    self.buffer[:0] = _gather(segments[at:], got + count)
                    return [Landed(meta[len(lead):]) for meta, lead in zip(metas[:block], fixed)]
                if got == segments[at].nbytes:
                    at, got = at + 1, 0
        return [Landed(meta[len(lead):]) for meta, lead in zip(metas, fixed)]

    def value(self, head: int, target: memoryview) -> bytes | None | Exception | Landed:
        """A GET's reply (see `ValkeyStore.get_into`)."""
        line = self._line()
        if line[:1] == b"-":
            return self._error(line)
        size = self._length(line)
        if size < 0:
            return None
        expected = head + target.nbytes
        if size == expected:
            value: bytes = Landed(self._exact(head))
            self._into(target)
        elif size <= expected + SLACK_BYTES:
            value = self._exact(size)
        elif size > BULK_MAX:
            raise _ProtocolError(f"a GET answered a {size}-byte value, longer than a server stores")
        else:  # another writer's: its key fails, the batch's other keys and the connection go on
            self._skip(size)
            self._end()
            return ValueTooLarge(f"a {size}-byte value where {expected} bytes were asked for")
        self._end()
        return value

    def _skip(self, size: int) -> None:
        """Read past `size` bytes, `SKIP_BYTES` at a time, within the batch's time."""
        took = min(len(self.buffer), size)
        del self.buffer[:took]
        scratch = memoryview(bytearray(min(SKIP_BYTES, size - took)))
        while took < size:
            piece = scratch[: min(scratch.nbytes, size - took)]
            self.wire.recv_into(piece)
            took += piece.nbytes

    def status(self, ok: bytes) -> str | None:
        """A reply of `ok` (None), or an error reply: why."""
        line = self._line()
        if line == ok:
            return None
        if line[:1] == b"-":
            return _describe(self._error(line))
        raise _ProtocolError(f"{ok!r} or an error expected, got {line[:40]!r}")

    def exists(self) -> bool:
        """An EXISTS of one key's reply; an error reply counts as no value."""
        line = self._line()
        if line[:1] == b"-":
            self._error(line)
            return False
        if line in (b":0", b":1"):
            return line == b":1"
        raise _ProtocolError(f"an EXISTS answered {line[:40]!r}")

    def bulk(self, most: int) -> bytes | None:
        """A bulk reply of up to `most` bytes; None for none, or an error reply."""
        line = self._line()
        if line[:1] == b"-":
            return None
        size = self._length(line)
        if size < 0:
            return None
        if size > most:
            raise _ProtocolError(f"a {size}-byte reply where at most {most} bytes were expected")
        value = self._exact(size)
        self._end()
        return value

    def tree(self, most: int, depth: int) -> object:
        """A reply of any RESP2 kind (`CLUSTER SLOTS`'s), as bytes, an int, None,
        a `ResponseError` or a list of these, nested at most `depth` lists deep,
        its lines and strings at most `most` bytes together (each element
        counted as it comes, so a claimed count costs nothing until it does)."""
        left = most

        def take(count: int) -> None:
            nonlocal left
            left -= count
            if left < 0:
                raise _ProtocolError(f"a reply longer than {most} bytes")

        def one(level: int) -> object:
            line = self._line()
            take(len(line) + 2)
            kind, rest = line[:1], line[1:]
            if kind == b"-":
                return self._error(line)
            if kind == b"+":
                return rest
            if kind == b"$":
                size = self._length(line)
                if size < 0:
                    return None
                take(size + 2)
                value = self._exact(size)
                self._end()
                return value
            digits = rest[1:] if rest[:1] == b"-" else rest
            if kind not in (b":", b"*") or not digits.isdigit() or len(digits) > 18:
                raise _ProtocolError(f"a reply of a kind not expected: {line[:40]!r}")
            number = int(rest)
            if kind == b":":
                return number
            if number < 0:
                return None
            if level == depth:
                raise _ProtocolError(f"a reply nested more than {depth} deep")
            return [one(level + 1) for _ in range(number)]

        return one(0)

    def finish(self) -> None:
        """After the last reply: nothing more may have come."""
        if self.buffer:
            raise _ProtocolError(f"{len(self.buffer)} bytes beyond the replies to the commands sent")


def _lay(data: bytearray, views: Sequence[memoryview], skip: int) -> int:
    """Copy `data` over `views` in order, from `skip` bytes into the first; how many bytes it took."""
    laid = 0
    for n, view in enumerate(views):
        room = view[skip if n == 0 else 0:]
        take = min(room.nbytes, len(data) - laid)
        room[:take] = data[laid:laid + take]
        laid += take
        if laid == len(data):
            break
    return laid


def _gather(views: Sequence[memoryview], count: int) -> bytes:
    """The first `count` bytes laid over `views` in order."""
    parts = []
    for view in views:
        if count <= 0:
            break
        parts.append(bytes(view[:count]))
        count -= view.nbytes
    return b"".join(parts)
