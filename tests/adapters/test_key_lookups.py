"""Lookups behind a hung store: the queue is bounded (the oldest asks are
answered "nothing found" at once, so their requests compute), and asks whose
request no longer waits are dropped before the store spends time on them."""

from __future__ import annotations

import threading
import time

import pytest

from kvledger.adapters.key_lookups import KeyLookups
from tests.transfers.test_fs_tier import answers

pytestmark = pytest.mark.fast


class HungStore:
    """A `find` that blocks until released, recording what it was asked."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked: list[tuple[bytes, ...]] = []

    def __call__(self, keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
        self.asked.append(keys)
        self.release.wait(30)
        return keys


def test_asks_queued_behind_a_hung_one_are_bounded_and_the_oldest_answered_empty() -> None:
    store = HungStore()
    lookups = KeyLookups(store, "2:valkey", queued_max=8)
    try:
        lookups.submit("hung", (b"k0",))
        deadline = time.monotonic() + 5
        while not store.asked and time.monotonic() < deadline:
            time.sleep(0.001)
        for n in range(2000):
            lookups.submit(n, (b"k%d" % n,))
        assert len(lookups._asks) == 8 and lookups.dropped == 1992
        early = lookups.poll()
        assert [token for token, _, _ in early] == list(range(1992))
        assert all((found, outcome) == ((), "dropped") for _, found, outcome in early)
        store.release.set()
        late = answers(lookups, 9)
        assert [token for token, _, _ in late] == ["hung", *range(1992, 2000)]
        assert all(found == (b"k%d" % token if token != "hung" else b"k0",) and outcome == "answered"
                   for token, found, outcome in late)
        assert lookups.answered() == (9, 9)  # the asks dropped unasked count in neither
    finally:
        store.release.set()
        lookups.close()


def test_a_cancelled_ask_never_reaches_the_store() -> None:
    store = HungStore()
    lookups = KeyLookups(store, "1:fs")
    try:
        lookups.submit("hung", (b"a",))
        lookups.submit("gone", (b"b",))
        lookups.submit("kept", (b"c",))
        lookups.cancel("gone")
        lookups.cancel("never-asked")
        store.release.set()
        assert [token for token, _, _ in answers(lookups, 2)] == ["hung", "kept"]
        assert store.asked == [(b"a",), (b"c",)]
    finally:
        store.release.set()
        lookups.close()


def test_an_ask_the_store_failed_is_answered_empty_and_counts_as_no_query() -> None:
    def find(keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
        if keys == (b"down",):
            raise ConnectionError("the store is down")
        return keys[:1]

    lookups = KeyLookups(find, "2:valkey")
    try:
        lookups.submit("failed", (b"down",))
        lookups.submit("asked", (b"a", b"b"))
        assert answers(lookups, 2) == [("failed", (), "down"), ("asked", (b"a",), "answered")]
        assert lookups.answered() == (2, 1)
    finally:
        lookups.close()
