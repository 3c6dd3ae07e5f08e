"""A tier whose reads start late, on purpose: a busy disk or a far store, for the
benchmarks and tests of `restore_budget: "auto"` (`fault_injection.tier_read_delay_s`).

Each read is handed to the tier `delay_s` after it was asked for, from a timer
thread; the worker goes on meanwhile, as with any read in flight. Writes,
removals and outcomes pass straight through.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from kvledger.engine.effects import IdsByGroup, KeysByGroup
from kvledger.transfers.lower_tiers.tier_jobs import TierIO


class SlowedTierIO:
    def __init__(self, inner: TierIO, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s
        self._timers: dict[int, threading.Timer] = {}  # reads not yet handed to the tier

    def read(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        timer = threading.Timer(self._delay_s, self._inner.read, (job_id, keys, slot_ids))
        timer.daemon = True
        timer.start()
        self._timers[job_id] = timer

    def write(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._inner.write(job_id, keys, slot_ids)

    def delete(self, keys: Iterable[bytes]) -> None:
        self._inner.delete(keys)

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """The reads' delays first, then the tier's own wait, within `timeout_s` in all."""
        job_ids = tuple(job_ids)
        deadline = time.monotonic() + timeout_s
        for job_id in job_ids:
            timer = self._timers.get(job_id)
            if timer is not None:
                timer.join(max(0.0, deadline - time.monotonic()))
        self._inner.wait(job_ids, max(0.0, deadline - time.monotonic()))  # type: ignore[attr-defined]

    def poll(self) -> list:
        self._timers = {job_id: timer for job_id, timer in self._timers.items() if timer.is_alive()}
        return self._inner.poll()

    def shutdown(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._inner.shutdown(drain=drain, timeout_s=timeout_s)
