"""A tier type from outside kvledger's table, for tests: blocks kept in this process's
memory, a dict from (namespace, key) to bytes. It shows what adding a type takes: its
settings and parser, its I/O on `ThreadedTierIO`, and one row, registered
(`tier_types.register_tier_type`). With vLLM in one process (the scheduler and the
worker share the dict), it serves restores like the disk and Valkey tiers.

`{"type": "test-memory", "capacity_bytes": N}` in `secondary_tiers`, once `register()`
ran in the process that parses the settings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs
import torch

from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.contract import Lookup, TierType, WorkerSite
from kvledger.transfers.lower_tiers.tier_io import Block, ThreadedTierIO, TierJob
from kvledger.transfers.lower_tiers.tier_settings import TierSecret
from kvledger.transfers.lower_tiers.tier_types import register_tier_type

STORE: dict[tuple[bytes, bytes], bytes] = {}
"""(namespace, key) -> a block's payload, for every tier of this type in the process."""
_LOCK = threading.Lock()


@attrs.frozen(kw_only=True)
class MemoryTierSettings:
    capacity_bytes: int
    secret: TierSecret = TierSecret()
    shared: ClassVar[bool] = False  # no other process can write it: nothing to look up
    kind: ClassVar[str] = "test-memory"


def parse_memory_tier(where: str, entry: Mapping[str, Any], *, located: bool = True) -> MemoryTierSettings:
    capacity = entry.get("capacity_bytes")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ConfigError(f"{where}.capacity_bytes must be a positive int, got {capacity!r}")
    return MemoryTierSettings(capacity_bytes=capacity)


class MemoryTierIO(ThreadedTierIO):
    what = "the memory tier"

    def __init__(self, *, namespace: bytes, rows: torch.Tensor, payload_bytes: tuple[int, ...]) -> None:
        self.namespace = namespace
        super().__init__(rows=rows, payload_bytes=payload_bytes, threads=1, name="test-memory")

    def _items(self, job: TierJob, blocks: list[Block]) -> list:
        return [(job, block) for block in blocks]

    def _run(self, item: Any, context: Any) -> None:
        job, (g, i, key, slot) = item
        row = self._array[slot, :self.payload_bytes[g]]
        with _LOCK:
            if job.kind == "write":
                STORE[(self.namespace, key)] = row.tobytes()
                reason = None
            else:
                data = STORE.get((self.namespace, key))
                reason = "missing" if data is None or len(data) != row.nbytes else None
                if reason is None:
                    row[:] = memoryview(data).cast("b")
        self._settle(job, g, i, reason)

    def _cancel(self, item: Any) -> None:
        job, (g, i, _key, _slot) = item
        self._settle(job, g, i, "cancelled")

    def _settle(self, job: TierJob, g: int, i: int, reason: str | None) -> None:
        with self._cond:
            outcome = job.settle([(g, i, reason, "memory")] if reason else [], 0 if reason else 1,
                                 0 if reason else self.payload_bytes[g], None)
            if not self._settled(job, outcome):
                return
        job.finished(outcome)

    def delete(self, keys: tuple[bytes, ...]) -> None:
        with _LOCK:
            for key in keys:
                STORE.pop((self.namespace, bytes(key)), None)


def _open(tier: MemoryTierSettings, site: WorkerSite) -> MemoryTierIO:
    return MemoryTierIO(namespace=site.namespace, rows=site.rows, payload_bytes=site.payload_bytes)


ROW = TierType(
    settings=MemoryTierSettings, keys=("capacity_bytes",), parse=parse_memory_tier,
    check=lambda where, tier: None, header_bytes=lambda tier: 0, where=lambda tier: {"store": "this process"},
    lookup=lambda tier, name, namespaces: Lookup(find=lambda keys: ()), scan=None, open_io=_open,
    tombstones=False)


def register() -> Callable[[], None]:
    """Make `test-memory` a tier type in this process; the function returned takes it back."""
    return register_tier_type(ROW)
