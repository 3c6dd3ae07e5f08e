"""A Valkey (or Redis) cluster as its nodes, each read as one server is
(`store.ValkeyStore`): the same bounded replies, and one deadline for a whole
batch however many nodes its keys span, so a lying or trickling node costs
what one server does.

Each key goes to the master of its slot, from the slot map (`CLUSTER SLOTS`,
asked of the seed nodes, then of the nodes last known, read bounded like every
reply). No command is retried or redirected: a MOVED or ASK (a slot moved, or
moving) fails its key alone, as a missing value does (a load recomputes, a
store is skipped), and the map is read again before the next batch. A node
that fails fails the batch (`StoreDown`), as one server's failure does: the
tier's breaker counts the cluster down until a batch gets through, after the
map is read again (a replica promoted in the meantime).

A `ClusterStore` is one thread's, as a `ValkeyStore` is: its connections
(one per node) and its map are its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
from valkey.crc import VALKEY_CLUSTER_HASH_SLOTS, key_slot
from valkey.exceptions import ResponseError

from kvledger.transfers.lower_tiers.valkey.store import (
    BadCertificate,
    Landed,
    StoreDown,
    ValkeyServer,
    ValkeyStore,
)

Address = tuple[str, int]
_T = TypeVar("_T")


class ClusterStore:
    """The commands `ValkeyStore` has, over a cluster's masters."""

    def __init__(self, server: ValkeyServer) -> None:
        self.server = server
        self._owners: list[Address | None] | None = None  # per slot, the master serving it
        self._nodes: dict[Address, ValkeyStore] = {}
        self._stale = True  # the map is read again before the next command

    # -- the slot map --------------------------------------------------------------------------------

    def _node(self, address: Address) -> ValkeyStore:
        store = self._nodes.get(address)
        if store is None:
            store = self._nodes[address] = ValkeyStore(attrs.evolve(self.server, nodes=(address,), cluster=False))
        return store

    def _map(self, deadline: float) -> list[Address | None]:
        if self._stale or self._owners is None:
            known = [] if self._owners is None else [a for a in dict.fromkeys(self._owners) if a is not None]
            self._owners = self._read_map(dict.fromkeys([*self.server.nodes, *known]), deadline)
            self._stale = False
            masters = set(self._owners)
            for address in [a for a in self._nodes if a not in masters]:
                self._nodes.pop(address).close()
        return self._owners

    def _read_map(self, asked: Sequence[Address], deadline: float) -> list[Address | None]:
        """The map from the first node that answers `CLUSTER SLOTS` with one; a
        certificate that did not verify is said so, before any other failure."""
        failures: list[StoreDown] = []
        for address in asked:
            if time.monotonic() >= deadline:
                break
            try:
                return owners_of(self._node(address).cluster_slots(deadline), address)
            except StoreDown as exc:
                failures.append(StoreDown(f"{address[0]}:{address[1]}: {exc}"))
                if isinstance(exc, BadCertificate):
                    failures[-1] = BadCertificate(str(failures[-1]))
        if not failures:
            raise StoreDown("the batch took longer than timeout_s before a node was asked for the slot map")
        first = next((f for f in failures if isinstance(f, BadCertificate)), failures[0])
        raise type(first)(f"no node gave the slot map ({'; '.join(str(f) for f in failures)})")

    def masters(self, deadline: float | None = None) -> list[Address]:
        """The masters serving slots, by the map (read first where stale)."""
        return [a for a in dict.fromkeys(self._map(self._deadline(deadline))) if a is not None]

    def _deadline(self, deadline: float | None) -> float:
        return time.monotonic() + self.server.timeout_s if deadline is None else deadline

    # -- a batch -------------------------------------------------------------------------------------

    def _spread(self, keys: Sequence[bytes], deadline: float | None,
                call: Callable[[ValkeyStore, list[int], float], list[_T]], unserved: _T) -> list[_T]:
        """`call(node, positions, deadline)` on each master, for the positions of
        the keys it serves, one node after another within one deadline. A slot no
        master serves answers `unserved`."""
        if not keys:
            return []
        deadline = self._deadline(deadline)
        try:
            owners = self._map(deadline)
        except StoreDown:
            self._stale = True
            raise
        groups: dict[Address | None, list[int]] = {}
        for position, key in enumerate(keys):
            groups.setdefault(owners[key_slot(key)], []).append(position)
        answers: list[_T] = [unserved] * len(keys)
        for owner, positions in groups.items():
            if owner is None:
                self._stale = True
                continue
            node = self._node(owner)
            try:
                got = call(node, positions, deadline)
            except StoreDown:
                self._stale = True
                raise
            self._stale = self._stale or node.redirected
            for position, answer in zip(positions, got):
                answers[position] = answer
        return answers

    def set_many(self, items: Sequence[tuple[bytes, bytes, memoryview]],
                 deadline: float | None = None) -> list[str | None]:
        return self._spread([key for key, _, _ in items], deadline,
                            lambda node, at, by: node.set_many([items[n] for n in at], by),
                            "no master serves the key's slot")

    def get_into(self, keys: Sequence[bytes], heads: Sequence[int], targets: Sequence[memoryview],
                 deadline: float | None = None) -> list[bytes | None | Exception | Landed]:
        return self._spread(keys, deadline,
                            lambda node, at, by: node.get_into([keys[n] for n in at], [heads[n] for n in at],
                                                               [targets[n] for n in at], by),
                            ResponseError("no master serves the key's slot"))

    def exists_each(self, keys: Sequence[bytes], deadline: float | None = None) -> list[bool]:
        return self._spread(keys, deadline, lambda node, at, by: node.exists_each([keys[n] for n in at], by), False)

    # -- the rare commands ---------------------------------------------------------------------------

    def ping(self, deadline: float | None = None) -> None:
        """Every master answers, within one timeout."""
        deadline = self._deadline(deadline)
        for address in self.masters(deadline):
            try:
                self._node(address).ping(deadline)
            except StoreDown:
                self._stale = True
                raise

    def _owner(self, key: bytes) -> ValkeyStore:
        address = self._map(self._deadline(None))[key_slot(key)]
        if address is None:
            self._stale = True
            raise StoreDown(f"no master serves the slot of {key[:64]!r}")
        return self._node(address)

    def _on_owner(self, key: bytes, command: Callable[[ValkeyStore], _T]) -> _T:
        try:
            return command(self._owner(key))
        except StoreDown:
            self._stale = True  # a MOVED among them: valkey-py raises it
            raise

    def hset(self, name: bytes, field: str, value: str) -> None:
        self._on_owner(name, lambda node: node.hset(name, field, value))

    def hash_fields(self, name: bytes, most: int) -> dict[bytes, bytes]:
        return self._on_owner(name, lambda node: node.hash_fields(name, most))

    def count_keys(self, pattern: bytes, budget_s: float) -> tuple[int, bool]:
        """How many keys match `pattern` on every master, counted for at most `budget_s` in all."""
        deadline = time.monotonic() + budget_s
        total, whole = 0, True
        for address in self.masters():
            left = deadline - time.monotonic()
            if left <= 0:
                return total, False
            count, complete = self._node(address).count_keys(pattern, left)
            total, whole = total + count, whole and complete
        return total, whole

    def close(self) -> None:
        for store in self._nodes.values():
            store.close()
        self._nodes.clear()
        self._owners, self._stale = None, True


def owners_of(reply: object, asked: Address) -> list[Address | None]:
    """Per slot, its master's address, from a `CLUSTER SLOTS` reply (given by the
    node at `asked`): each entry `[first, last, [host, port, ...], replicas...]`.
    An empty host is the asked node's; `?` (an endpoint not known) serves nothing."""
    if not isinstance(reply, list) or not reply:
        raise StoreDown(f"CLUSTER SLOTS answered {_brief(reply)}, not a slot map")
    owners: list[Address | None] = [None] * VALKEY_CLUSTER_HASH_SLOTS
    for entry in reply:
        if not (isinstance(entry, list) and len(entry) >= 3 and isinstance(entry[0], int)
                and isinstance(entry[1], int) and 0 <= entry[0] <= entry[1] < VALKEY_CLUSTER_HASH_SLOTS
                and isinstance(entry[2], list) and len(entry[2]) >= 2 and isinstance(entry[2][0], bytes)
                and isinstance(entry[2][1], int) and 0 < entry[2][1] < 65536 and len(entry[2][0]) <= 255):
            raise StoreDown(f"CLUSTER SLOTS answered an entry {_brief(entry)}, not a slot range and its master")
        host = entry[2][0].decode("ascii", errors="replace")
        address = None if host == "?" else (host or asked[0], entry[2][1])
        owners[entry[0]:entry[1] + 1] = [address] * (entry[1] - entry[0] + 1)
    return owners


def _brief(value: object) -> str:
    return repr(value)[:80]


def open_store(server: ValkeyServer) -> ValkeyStore | ClusterStore:
    """A thread's store for the tier's server: one server's, or a cluster's."""
    return ClusterStore(server) if server.cluster else ValkeyStore(server)
