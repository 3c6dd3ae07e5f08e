"""What crosses between vLLM's scheduler and worker processes, per step.

Plain frozen values (effects and events), so vLLM can pickle them between
processes; nothing here holds a tensor or a callable.
"""

from __future__ import annotations

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvledger.engine import effects as fx
from kvledger.events.types import TransferEvent


@attrs.frozen(kw_only=True)
class KVLedgerMetadata(KVConnectorMetadata):
    """Scheduler to worker: this step's transfers.

    `flush` are stores to wait for in `handle_preemptions`, before the step
    overwrites their source blocks; `stores` start after the forward wrote
    them; `loads` start after the forward (their requests are not scheduled).
    """

    flush: tuple[int, ...] = ()
    stores: tuple[fx.StartStore, ...] = ()
    loads: tuple[fx.StartLoad, ...] = ()

    @classmethod
    def from_effects(cls, effects: list[fx.Effect]) -> KVLedgerMetadata:
        flush: list[int] = []
        stores: list[fx.StartStore] = []
        loads: list[fx.StartLoad] = []
        for effect in effects:
            if isinstance(effect, fx.FlushStores):
                flush.extend(effect.job_ids)
            elif isinstance(effect, fx.StartStore):
                stores.append(effect)
            elif isinstance(effect, fx.StartLoad):
                loads.append(effect)
        return cls(flush=tuple(sorted(set(flush))), stores=tuple(stores), loads=tuple(loads))


@attrs.frozen(kw_only=True)
class KVLedgerWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker to scheduler: transfer outcomes, each naming its worker."""

    events: tuple[TransferEvent, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVLedgerWorkerMetadata:
        assert isinstance(other, KVLedgerWorkerMetadata)
        return KVLedgerWorkerMetadata(events=self.events + other.events)
