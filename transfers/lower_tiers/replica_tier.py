"""A tier as seen by a rank whose KV another rank writes: read-only.

Tensor-parallel ranks whose KV is byte-identical (an MLA latent) share one
copy of each block on a tier. One rank writes and removes it; the others
read it like their own. A write here has nothing to add: it ends at once,
successful and empty, and the block counts as written only once the writer's
own report arrives too (the engine waits for every rank). A removal is the
writer's to do.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvledger.engine.effects import IdsByGroup, KeysByGroup
from kvledger.transfers.lower_tiers.tier_io import TierIoOutcome
from kvledger.transfers.lower_tiers.tier_jobs import TierIO


class ReplicaTierIO:
    def __init__(self, inner: TierIO) -> None:
        self._inner = inner
        self._written: list[TierIoOutcome] = []

    def write(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._written.append(TierIoOutcome(job_id=job_id, kind="write", failed=(), reasons=(), seconds=0.0,
                                           nbytes=0))

    def read(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None:
        self._inner.read(job_id, keys, slot_ids)

    def delete(self, keys: Iterable[bytes]) -> None:
        return

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """Unknown or finished ids count as finished (a write here is finished at once)."""
        self._inner.wait(job_ids, timeout_s)  # type: ignore[attr-defined]

    def poll(self) -> list:
        written, self._written = self._written, []
        return written + self._inner.poll()

    def shutdown(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        self._written.clear()
        self._inner.shutdown(drain=drain, timeout_s=timeout_s)
