"""Commands on a Valkey (or Redis) server or cluster, as the Valkey tier needs
them: pipelined SET, GET and EXISTS, with bounded timeouts and no retries of
the client's own, so a dead or paused server costs one timeout and then
counts as down (`StoreDown`) for its caller to handle.

The client is valkey-py with libvalkey's parser (bench/valkey_clients.py
compares it with valkey-glide and redis-py; bench/RESULTS.md has the numbers).
A `ValkeyStore` is one thread's: each I/O thread holds its own connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
from collections.abc import Iterator, Sequence

import attrs
import valkey
from valkey.backoff import NoBackoff
from valkey.cluster import ClusterNode, ValkeyCluster
from valkey.exceptions import ResponseError, ValkeyError
from valkey.retry import Retry


@attrs.frozen(kw_only=True)
class ValkeyServer:
    """Where the store is and how to talk to it."""

    nodes: tuple[tuple[str, int], ...]  # host, port: the server, or a cluster's seed nodes
    cluster: bool = False
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)  # never logged
    timeout_s: float = 1.0  # per command; a server slower than this counts as down
    tls_ca_file: str | None = None  # a private CA's certificate (else the system's trusted ones)

    @property
    def where(self) -> str:
        """The server for messages and logs, without credentials."""
        scheme = "valkeys" if self.tls else "valkey"
        return ",".join(f"{scheme}://{host}:{port}" for host, port in self.nodes)


class StoreDown(Exception):
    """The server could not be reached, or did not answer within the timeout."""


class ValkeyStore:
    def __init__(self, server: ValkeyServer) -> None:
        self.server = server
        self._client: valkey.Valkey | ValkeyCluster | None = None

    def _connect(self) -> valkey.Valkey | ValkeyCluster:
        if self._client is None:
            tier = self.server
            common = dict(username=tier.username, password=tier.password, ssl=tier.tls, ssl_ca_certs=tier.tls_ca_file,
                          socket_timeout=tier.timeout_s, socket_connect_timeout=tier.timeout_s,
                          retry=Retry(NoBackoff(), 0), client_name="kvledger")
            try:
                if tier.cluster:
                    # A master that dies is replaced by its replica within the cluster's node
                    # timeout; the client refreshes its slot map on the next command.
                    self._client = ValkeyCluster(
                        startup_nodes=[ClusterNode(host, port) for host, port in tier.nodes],
                        cluster_error_retry_attempts=1, require_full_coverage=False, **common)
                else:
                    host, port = tier.nodes[0]
                    self._client = valkey.Valkey(host=host, port=port, db=tier.db, single_connection_client=True,
                                                 **common)
            except (ValkeyError, OSError) as exc:
                raise StoreDown(_describe(exc)) from None
        return self._client

    def ping(self) -> None:
        try:
            self._connect().ping()
        except (ValkeyError, OSError) as exc:
            self._reset()
            raise StoreDown(_describe(exc)) from None

    def set_many(self, items: Sequence[tuple[bytes, bytes, memoryview]]) -> list[str | None]:
        """SET each key to its header and payload; per item None, or why the
        server refused it (a full server: OOM).

        On one server the commands are framed here and the payload sent from
        its own memory, as the socket's `sendall` takes it: valkey-py's packer
        (libvalkey's) copies every value into one buffer per command, and
        joining header and payload would copy it once more, which on a busy
        host costs the tier a third of its write speed (bench/valkey_tier_io.py).
        A cluster routes each key to its node: values are joined there."""
        if not items:
            return []
        if self.server.cluster:
            joined = [(key, b"".join((header, payload))) for key, header, payload in items]
            return [None if ok is True else _describe(ok) for ok in self._pipeline("set", joined)]
        chunks: list[bytes | memoryview] = []
        for key, header, payload in items:
            chunks.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
                len(key), key, len(header) + payload.nbytes, header))
            chunks.append(payload)
            chunks.append(b"\r\n")
        try:
            connection = self._fresh_connection()
            with _whole_blocks(connection, self.server.timeout_s):
                connection.send_packed_command(chunks)
            refused: list[str | None] = []
            for _ in items:
                try:
                    connection.read_response()
                    refused.append(None)
                except ResponseError as exc:
                    refused.append(_describe(exc))
        except (ValkeyError, OSError) as exc:
            self._reset()
            raise StoreDown(_describe(exc)) from None
        return refused

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None | Exception]:
        return self._pipeline("get", [(k,) for k in keys])

    def get_into(self, keys: Sequence[bytes], heads: Sequence[int],
                 targets: Sequence[memoryview]) -> list[bytes | None | Exception | Landed]:
        """GET each key; a value of `heads[n]` + `len(targets[n])` bytes lands in
        place: its first `heads[n]` bytes are returned (`Landed`), the rest read
        from the socket straight into `targets[n]`, unchecked (the caller checks
        it). Any other value is returned whole, a missing key as None.

        On one server only, as `set_many` frames its commands: a reply read into
        its block costs no allocation and no copy, where valkey-py's reader
        makes a bytes object of every value (bench/valkey_tier_io.py)."""
        if self.server.cluster:
            return self.get_many(keys)
        try:
            connection = self._fresh_connection()
            with _whole_blocks(connection, self.server.timeout_s):
                connection.send_packed_command([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys])
                replies = _Replies(connection._sock)
                return [replies.value(head, target) for head, target in zip(heads, targets)]
        except (ValkeyError, OSError, _ProtocolError) as exc:
            self._reset()
            raise StoreDown(_describe(exc)) from None

    def exists_each(self, keys: Sequence[bytes]) -> list[bool]:
        return [answer == 1 for answer in self._pipeline("exists", [(k,) for k in keys])]

    def _pipeline(self, command: str, args: Sequence[tuple]) -> list:
        if not args:
            return []
        try:
            pipe = self._connect().pipeline(transaction=False)
            call = getattr(pipe, command)
            for arg in args:
                call(*arg)
            answers = pipe.execute(raise_on_error=False)
        except (ValkeyError, OSError) as exc:
            self._reset()
            raise StoreDown(_describe(exc)) from None
        down = [a for a in answers if isinstance(a, Exception) and not isinstance(a, ResponseError)]
        if down:  # a cluster node lost mid-pipeline: the rest of the answers are not to be trusted either
            self._reset()
            raise StoreDown(_describe(down[0]))
        return answers

    def _fresh_connection(self):
        """The single-connection client's own connection, reopened if the server
        closed it meanwhile (a restart): a socket with something to read between
        commands is one the server gave up on."""
        connection = self._connect().connection
        if connection._sock is not None and select.select([connection._sock], [], [], 0)[0]:
            connection.disconnect()  # the next send connects again
        return connection

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


@contextlib.contextmanager
def _whole_blocks(connection, timeout_s: float) -> Iterator[None]:
    """The socket blocking, with the timeout kept by the kernel (SO_RCVTIMEO,
    SO_SNDTIMEO): a block then moves in one system call, not one per chunk
    the socket buffer holds. With Python's own timeout every chunk is a poll
    and a recv, each taking the GIL back, which in a process whose engine
    thread is busy (vLLM's) waits up to a switch interval: a 32-block batch
    took 450-900 ms that way, against 20-50 ms in one call per block."""
    if connection._sock is None:
        connection.connect()
    sock = connection._sock
    whole = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))
    previous = sock.gettimeout()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, whole)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, whole)
    sock.settimeout(None)
    try:
        yield
    finally:
        if connection._sock is sock:  # not dropped by a failure meanwhile
            sock.settimeout(previous)


class Landed(bytes):
    """A value's head; its payload was read into the caller's target."""


class _ProtocolError(Exception):
    """A reply that is not what a GET answers."""


class _Replies:
    """RESP replies to GETs, read from a socket with a small buffer for the lines
    and `recv_into` for payloads that land in place."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buffer += chunk

    def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 2]
        return line

    def _exact(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def _into(self, target: memoryview) -> None:
        got = min(len(self.buffer), target.nbytes)
        target[:got] = self.buffer[:got]
        del self.buffer[:got]
        while got < target.nbytes:
            count = self.sock.recv_into(target[got:], 0, socket.MSG_WAITALL)
            if not count:
                raise ConnectionError("the server closed the connection")
            got += count

    def value(self, head: int, target: memoryview) -> bytes | None | Exception | Landed:
        line = self._line()
        if line[:1] == b"-":
            return ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise _ProtocolError(f"a GET answered {line[:40]!r}")
        size = int(line[1:])
        if size < 0:
            return None
        if size != head + target.nbytes:
            value = self._exact(size)
        else:
            value = Landed(self._exact(head))
            self._into(target)
        if self._exact(2) != b"\r\n":
            raise _ProtocolError("a bulk reply without its CRLF")
        return value
