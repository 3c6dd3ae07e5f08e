"""Eviction policies over the tier's evictable keys.

A policy only ever holds keys that may be evicted right now: stored, indexed
and not pinned by a load. The tier removes a key when a load pins it and
inserts it again (as reused) when the last load ends, so eviction never has
to skip a busy slot.

Order is the insertion order of `dict`, which depends only on the sequence of
calls, never on `PYTHONHASHSEED`.
"""

from __future__ import annotations

from itertools import islice
from typing import Protocol

from kvledger.events.config import PolicyName


class Policy(Protocol):
    def insert(self, key: bytes, reused: bool) -> None: ...
    def insert_many(self, keys: list[bytes], reused: bool) -> None: ...
    def admit_many(self, keys: list[bytes]) -> None: ...
    def remove(self, key: bytes) -> None: ...
    def remove_many(self, keys: list[bytes]) -> None: ...
    def admit(self, key: bytes) -> None: ...
    def evict(self, count: int) -> list[bytes] | None: ...
    def clear(self) -> None: ...
    def clone(self) -> Policy: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: bytes) -> bool: ...
    def holds_any(self, keys: list[bytes]) -> bool: ...
    def canonical(self) -> tuple: ...
    def canonical_part(self, part: int, parts: int) -> tuple: ...


class LRU:
    """Least recently stored or loaded goes first."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: dict[bytes, None] = {}

    def insert(self, key: bytes, reused: bool) -> None:
        self._order[key] = None

    def insert_many(self, keys: list[bytes], reused: bool) -> None:
        """`insert` of each key in turn."""
        order = self._order
        for key in keys:
            order[key] = None

    def remove(self, key: bytes) -> None:
        del self._order[key]

    def remove_many(self, keys: list[bytes]) -> None:
        """`remove` of each key in turn (one call for a load's keys)."""
        order = self._order
        for key in keys:
            del order[key]

    def admit(self, key: bytes) -> None:
        """A new key is being stored; LRU has nothing to learn from it."""

    def admit_many(self, keys: list[bytes]) -> None:
        """`admit` of each key in turn."""

    def evict(self, count: int) -> list[bytes] | None:
        """Atomic: either `count` victims, or None and no change."""
        if count > len(self._order):
            return None
        order = self._order
        victims: list[bytes] = []
        for key in order:
            if len(victims) == count:
                break
            victims.append(key)
        for key in victims:
            del order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()

    def clone(self) -> LRU:
        other = LRU()
        other._order = dict(self._order)
        return other

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def holds_any(self, keys: list[bytes]) -> bool:
        return not self._order.keys().isdisjoint(keys)

    def canonical(self) -> tuple:
        return ("lru", tuple(self._order))

    def canonical_part(self, part: int, parts: int) -> tuple:
        """`canonical` with each order cut to its `part`-th of `parts` slices."""
        return ("lru", _slice(self._order, part, parts))


class ARC:
    """Adaptive Replacement Cache (Megiddo & Modha), in integers.

    T1 holds keys seen once, T2 keys reused (loaded). B1/B2 remember keys
    evicted from T1/T2; storing a key again that sits in a ghost list moves
    the target size `p` of T1 towards the list that would have kept it.
    """

    __slots__ = ("capacity", "p", "t1", "t2", "b1", "b2")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0
        self.t1: dict[bytes, None] = {}
        self.t2: dict[bytes, None] = {}
        self.b1: dict[bytes, None] = {}
        self.b2: dict[bytes, None] = {}

    def admit(self, key: bytes) -> None:
        if key in self.b1:
            self.p = min(self.capacity, self.p + max(len(self.b2) // len(self.b1), 1))
            del self.b1[key]
        elif key in self.b2:
            self.p = max(0, self.p - max(len(self.b1) // len(self.b2), 1))
            del self.b2[key]

    def admit_many(self, keys: list[bytes]) -> None:
        if self.b1 or self.b2:  # nothing to learn while no key was ever evicted
            for key in keys:
                self.admit(key)

    def insert(self, key: bytes, reused: bool) -> None:
        (self.t2 if reused else self.t1)[key] = None

    def insert_many(self, keys: list[bytes], reused: bool) -> None:
        target = self.t2 if reused else self.t1
        for key in keys:
            target[key] = None

    def remove(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]

    def remove_many(self, keys: list[bytes]) -> None:
        for key in keys:
            self.remove(key)

    def evict(self, count: int) -> list[bytes] | None:
        if count > len(self.t1) + len(self.t2):
            return None
        # Chosen one at a time (T1 while it is above its target), taken from one pass
        # over each list: a dict's first key is found past every entry deleted before it,
        # so asking for it once a victim cost a full tier's step milliseconds
        # (bench/policy_churn.py). `p` does not change while evicting.
        t1, t2 = self.t1, self.t2
        left1, left2 = len(t1), len(t2)
        firsts1, firsts2 = iter(t1), iter(t2)
        from1: list[bytes] = []
        from2: list[bytes] = []
        victims: list[bytes] = []
        for _ in range(count):
            if left1 and (left1 > self.p or not left2):
                key = next(firsts1)
                left1 -= 1
                from1.append(key)
            else:
                key = next(firsts2)
                left2 -= 1
                from2.append(key)
            victims.append(key)
        for key in from1:
            del t1[key]
            self.b1[key] = None
        for key in from2:
            del t2[key]
            self.b2[key] = None
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        """The oldest ghosts go: B1 down to the capacity, then B2 until both fit in it."""
        b1, b2 = self.b1, self.b2
        for key in list(islice(b1, max(0, len(b1) - self.capacity))):
            del b1[key]
        for key in list(islice(b2, max(0, len(b1) + len(b2) - self.capacity))):
            del b2[key]

    def clear(self) -> None:
        self.p = 0
        for part in (self.t1, self.t2, self.b1, self.b2):
            part.clear()

    def clone(self) -> ARC:
        other = ARC(self.capacity)
        other.p = self.p
        other.t1, other.t2 = dict(self.t1), dict(self.t2)
        other.b1, other.b2 = dict(self.b1), dict(self.b2)
        return other

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: bytes) -> bool:
        return key in self.t1 or key in self.t2

    def holds_any(self, keys: list[bytes]) -> bool:
        return not (self.t1.keys().isdisjoint(keys) and self.t2.keys().isdisjoint(keys))

    def canonical(self) -> tuple:
        return ("arc", self.p, tuple(self.t1), tuple(self.t2), tuple(self.b1), tuple(self.b2))

    def canonical_part(self, part: int, parts: int) -> tuple:
        return ("arc", self.p, *(_slice(order, part, parts) for order in (self.t1, self.t2, self.b1, self.b2)))


def _slice(order: dict[bytes, None], part: int, parts: int) -> tuple:
    """The `part`-th of `parts` even slices of an order, with its length (so
    that a key moving between slices changes some slice's digest)."""
    n = len(order)
    return (n, tuple(islice(order, n * part // parts, n * (part + 1) // parts)))


def make_policy(name: PolicyName, capacity: int) -> LRU | ARC:
    return ARC(capacity) if name is PolicyName.ARC else LRU()
