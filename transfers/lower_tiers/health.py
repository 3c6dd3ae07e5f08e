"""Whether a tier's server is up, as its I/O and the scheduler's lookups see it: a circuit
breaker every tier on a server shares (Valkey's; `vllm:kvledger_tiering_up`).
"""

from __future__ import annotations

import threading
import time

import structlog

_log = structlog.get_logger("kvledger.transfers.valkey_tier")  # the name its lines have always carried


FIRST_RETRY_S = 0.125
"""After a first failure, how long the tier stays down before a batch tries the server again: a
stall of the host (the soak saw machine-wide ones of 0.1-2 s) costs an eighth of a second of tier."""

RETRY_S = 1.0
"""The most the tier stays down before a batch tries again, while the server stays down."""


class Health:
    """Whether the server is up, shared by a tier's threads (a circuit breaker).
    One failure marks it down, so a dead server costs each job nothing, not a
    timeout. When the wait is over one batch at a time tries the server (for
    its `timeout_s` and a margin at most); the others fail at once until it
    has answered. A failure of work begun before the tier last went down is
    that same outage (every thread's batch fails with it): it neither extends
    the wait nor doubles the next. Times are `time.perf_counter()`'s, as the
    batches' spans are."""

    def __init__(self, name: str, where: str, timeout_s: float) -> None:
        self.name = name
        self.where = where
        self.probe_s = timeout_s + RETRY_S
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._went_down = float("-inf")
        self._downs = 0  # outages in a row, each tried again and failed
        self.up = True

    def usable(self) -> bool:
        """Whether to try the server: up, or down and this caller is the one to try it."""
        if self.up:
            return True
        with self._lock:
            if self.up:  # came up meanwhile
                return True
            now = time.perf_counter()
            if now < self._down_until:
                return False
            self._down_until = now + self.probe_s  # the others wait for this try
            return True

    def failed(self, error: str, since: float) -> None:
        """`since`: when the failed work began."""
        with self._lock:
            now = time.perf_counter()
            if self.up or since >= self._went_down:
                self._went_down = now
                self._downs += 1
                self._down_until = now + min(RETRY_S, FIRST_RETRY_S * 2 ** min(self._downs - 1, 16))
            was, self.up = self.up, False
            retry_s = round(self._down_until - now, 3)
        if was:
            _log.error("valkey_tier_down", tier=self.name, server=self.where, error=error, retry_s=retry_s)

    def worked(self) -> None:
        with self._lock:
            was, self.up, self._downs = self.up, True, 0
        if not was:
            _log.warning("valkey_tier_up", tier=self.name, server=self.where)
