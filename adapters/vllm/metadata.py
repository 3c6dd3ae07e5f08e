"""What crosses between vLLM's scheduler and worker processes, per step.

Plain frozen values (effects and events), so vLLM can pickle them between
processes; nothing here holds a tensor or a callable. The step's worker
effects travel as the engine made them, split by phase (`engine.effects.ROUTES`),
each phase run by the vLLM hook that owns that moment of the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvledger.engine import effects as fx
from kvledger.events.types import TransferEvent


@attrs.frozen(kw_only=True)
class KVLedgerMetadata(KVConnectorMetadata):
    """Scheduler to worker: this step's transfers, by phase.

    `before_step` (flushes) runs in `handle_preemptions`, before the step's
    forward (and, under vLLM's V1 model runner, before it zeroes new blocks;
    the V2 runner zeroes them earlier, which `store_timing` provides for); `loads` in `start_load_kv`, once the
    step's new blocks are set up (their requests are not in the batch);
    `after_forward` (stores) in `wait_for_save`, after the forward wrote
    the blocks.
    """

    before_step: tuple[fx.Effect, ...] = ()
    loads: tuple[fx.Effect, ...] = ()
    after_forward: tuple[fx.Effect, ...] = ()
    idle: bool = False  # the step computes nothing: vLLM stepped only to hear of transfers

    @classmethod
    def from_effects(cls, effects: Sequence[fx.Effect], *, idle: bool = False) -> KVLedgerMetadata:
        if not effects:  # most decode steps: one shared empty value (it is frozen)
            return _IDLE if idle else _NO_WORK
        routed = fx.route(effects)
        return cls(before_step=tuple(routed[fx.Phase.BEFORE_STEP]), loads=tuple(routed[fx.Phase.LOADS]),
                   after_forward=tuple(routed[fx.Phase.AFTER_FORWARD]), idle=idle)


_NO_WORK = KVLedgerMetadata()
_IDLE = KVLedgerMetadata(idle=True)


@attrs.frozen(kw_only=True)
class KVLedgerWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker to scheduler: transfer outcomes, each naming its worker."""

    events: tuple[TransferEvent, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVLedgerWorkerMetadata:
        assert isinstance(other, KVLedgerWorkerMetadata)
        return KVLedgerWorkerMetadata(events=self.events + other.events)
