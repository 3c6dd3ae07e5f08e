"""Keys in the order they entered, as a dict of keys keeps them, but never
rebuilt whole.

A dict never reuses a deleted entry's place: once its entries are used up, an
insertion rebuilds the whole table, in that one call. A tier that evicts and
reads all day deletes and inserts all day, so a dict holding its order is
rebuilt again and again, each time in one step of the scheduler: a lower
tier's order of 4M keys, 64 spilled and 300 read a step, stalled a step 244 ms
every few thousand steps, and one of 1M keys 61 ms (`bench/policy_churn.py`).

Here the keys sit in runs of at most `RUN_KEYS` insertions each, the runs in
order, and the run that holds a key is found in one of a few small dicts
(shards) by the key's hash. A rebuild is one run's or one shard's, never the
whole order's. The order, and every answer, is the dict's: iteration, a key
entering again keeping its place, a key moved to the end. Which shard holds a
key depends on the process's hash seed; nothing that is iterated does.

The price is a run and a shard to reach a key instead of one table: a full
host tier's LRU churned in it cost 0.24 ms a step against 0.16 at 192k slots
and 0.52 against 0.28 at 1M (its stalls, 15 and 56 ms, gone). Host memory's
orders stay dicts, stalling about as long as the host index's own rebuilds
(14 ms at 192k); a lower tier's, larger, use this.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Final

RUN_KEYS: Final = 4096
"""Insertions a run takes before the next key opens a new one: a run's table
never holds more entries than this, so its rebuild is a few thousand entries' work."""

SHARD_KEYS: Final = 4096
"""Keys a shard is sized for: an order made for `capacity` keys has about
`capacity / SHARD_KEYS` shards (a power of two, 1 to `MAX_SHARDS`)."""

MAX_SHARDS: Final = 4096


def _shards_for(capacity: int) -> int:
    shards = 1
    while shards < MAX_SHARDS and shards * SHARD_KEYS < capacity:
        shards *= 2
    return shards


class _Run:
    """Some consecutive keys of the order, and where the run sits among the others."""

    __slots__ = ("keys", "run_id")

    def __init__(self, run_id: int) -> None:
        self.keys: dict[bytes, None] = {}
        self.run_id = run_id


class KeyOrder:
    """`add` a key at the end (where absent), `remove` it, `move_to_end`; iterate
    in order. `capacity`: the keys it is sized for (any number fits); `run_keys`:
    insertions a run takes (tests make it small)."""

    __slots__ = ("_mask", "_where", "_runs", "_tail", "_tail_room", "_size", "_run_keys")

    def __init__(self, keys: Iterable[bytes] = (), capacity: int = 0, run_keys: int = RUN_KEYS) -> None:
        shards = _shards_for(capacity)
        self._run_keys = run_keys
        self._mask = shards - 1
        # Per shard, each key's run (the run itself: an id would be an int allocated a key).
        self._where: list[dict[bytes, _Run]] = [{} for _ in range(shards)]
        self._tail = _Run(0)
        self._runs: dict[int, _Run] = {0: self._tail}  # in order: ids only grow
        self._tail_room = run_keys
        self._size = 0
        for key in keys:
            self.add(key)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._where[hash(key) & self._mask]

    def __iter__(self) -> Iterator[bytes]:
        return chain.from_iterable([run.keys for run in self._runs.values()])

    def add(self, key: bytes) -> None:
        """At the end; a key already here keeps its place (a dict's `d[key] = None`)."""
        where = self._where[hash(key) & self._mask]
        if key in where:
            return
        tail = self._tail
        if not self._tail_room:
            tail = self._tail = _Run(tail.run_id + 1)
            self._runs[tail.run_id] = tail
            self._tail_room = self._run_keys
        where[key] = tail
        tail.keys[key] = None
        self._tail_room -= 1
        self._size += 1

    def remove(self, key: bytes) -> None:
        """KeyError where absent (a dict's `del d[key]`)."""
        run = self._where[hash(key) & self._mask].pop(key)
        keys = run.keys
        del keys[key]
        self._size -= 1
        if run is not self._tail:
            left = len(keys)
            if not left:
                del self._runs[run.run_id]
            elif left <= self._run_keys // 4 and not left & (left - 1):
                # A dict does not shrink as it empties: a run's table is made again at
                # each power of two it falls to, in order, for a few of its keys' cost.
                run.keys = dict(keys)

    def move_to_end(self, key: bytes) -> None:
        """The most recent now (KeyError where absent)."""
        self.remove(key)
        self.add(key)

    def isdisjoint(self, keys: Iterable[bytes]) -> bool:
        return not any(map(self.__contains__, keys))

    def clear(self) -> None:
        for where in self._where:
            where.clear()
        self._tail = _Run(self._tail.run_id + 1)
        self._runs = {self._tail.run_id: self._tail}
        self._tail_room = self._run_keys
        self._size = 0

    def copy(self) -> KeyOrder:
        """The same keys in the same order (in runs laid out anew)."""
        return KeyOrder(self, capacity=len(self._where) * SHARD_KEYS, run_keys=self._run_keys)

    def __repr__(self) -> str:
        return f"KeyOrder({list(self)!r})"
