"""Commands on a Valkey (or Redis) server or cluster, as the Valkey tier needs
them: pipelined SET, GET and EXISTS, with bounded timeouts and no retries of
the client's own, so a dead or paused server costs one timeout and then
counts as down (`StoreDown`) for its caller to handle.

The client is valkey-py with libvalkey's parser (bench/valkey_clients.py
compares it with valkey-glide and redis-py; bench/RESULTS.md has the numbers).
A `ValkeyStore` is one thread's: each I/O thread holds its own connection.
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def set_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[str | None]:
        """SET each; per item None, or why the server refused it (a full server: OOM)."""
        return [None if ok is True else _describe(ok) for ok in self._pipeline("set", items)]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None | Exception]:
        return self._pipeline("get", [(k,) for k in keys])

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
