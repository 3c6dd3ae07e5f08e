"""Which keys a shared tier holds, asked off the scheduler's thread: a stat on
a network file system, or a round trip to a store, can take milliseconds or
hang, and the scheduler's call must not wait on it. The scheduler side's
tiers (`vllm/lower_tiers.py`) hold one per shared tier; no vLLM needed."""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable

import structlog

from kvledger.transfers.copies.backend import BackendClosed
from kvledger.transfers.lower_tiers.contract import Find

_log = structlog.get_logger("kvledger.adapters.key_lookups")

QUEUED_MAX = 256
"""Asks waiting behind a slow or hung one: past this, the oldest is answered "nothing found" at
once (its request computes), so a hung store costs a bounded queue, not every request's wait."""


class KeyLookups:
    """Answers `submit(token, keys)` asks with `find`, one at a time, on a thread of its own."""

    def __init__(self, find: Find, name: str, queued_max: int = QUEUED_MAX) -> None:
        self.find = find
        self.name = name
        self.queued_max = queued_max
        self.dropped = 0  # asks answered "nothing found" because the queue was full
        # Keys in asks the tier answered, and those it holds of them (metrics: vLLM 0.33's chunk
        # queries and hits). Dropped, cancelled and failed asks count in neither.
        self.keys_asked = 0
        self.keys_found = 0
        self._asks: collections.deque[tuple[Hashable, tuple[bytes, ...]] | None] = collections.deque()
        self._cond = threading.Condition()
        # (token, keys found, how it ended: "answered", or a `LOOKUP_FAILURES` reason)
        self._answers: list[tuple[Hashable, tuple[bytes, ...], str]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"kvledger-lookups-{name}", daemon=True)
        self._thread.start()

    def submit(self, token: Hashable, keys: tuple[bytes, ...]) -> None:
        with self._cond:
            if self._closed:
                raise BackendClosed("the key lookups were closed")
            if len(self._asks) >= self.queued_max:
                oldest = self._asks.popleft()
                assert oldest is not None
                self._answers.append((oldest[0], (), "dropped"))
                self.dropped += 1
            self._asks.append((token, tuple(keys)))
            self._cond.notify()

    def cancel(self, token: Hashable) -> None:
        """Drop a queued ask whose request no longer waits (finished, or timed out):
        a store's time goes to requests that still need an answer."""
        with self._cond:
            if any(ask is not None and ask[0] == token for ask in self._asks):
                self._asks = collections.deque(a for a in self._asks if a is None or a[0] != token)

    def answered(self) -> tuple[int, int]:
        """(keys asked, keys found) over every ask the tier answered so far."""
        with self._cond:
            return self.keys_asked, self.keys_found

    def poll(self) -> list[tuple[Hashable, tuple[bytes, ...], str]]:
        with self._cond:
            answers, self._answers = self._answers, []
        return answers

    def close(self, timeout_s: float = 5.0) -> None:
        """Unanswered asks are dropped; a thread stuck on a hung stat is left behind (a daemon)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._asks.clear()
            self._asks.append(None)
            self._cond.notify()
        self._thread.join(timeout_s)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._asks:
                    self._cond.wait()
                ask = self._asks.popleft()
            if ask is None:
                return
            token, keys = ask
            outcome = "answered"
            try:
                found = self.find(keys)
            except Exception as exc:  # a store that is down finds nothing; the request computes
                _log.debug("tier_lookup_failed", tier=self.name, error=repr(exc))
                found, outcome = (), "down"
            with self._cond:
                if not self._closed:
                    self._answers.append((token, found, outcome))
                    if outcome == "answered":
                        self.keys_asked += len(keys)
                        self.keys_found += len(found)
