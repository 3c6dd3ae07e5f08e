"""KV cache events for the CPU tier and the tiers below it (medium
`STORAGE`, as vLLM 0.33's file-system tier reports): `BlockStored` and
`BlockRemoved`.

A router that reads these events will send requests here expecting a hit,
so an event must never advertise a block that cannot be loaded. The engine
announces exactly that: `KeysLoadable` once a block can be loaded from a tier
(its store completed on every worker, a spill was written, a lookup found
it), `KeysUnloadable` as soon as it cannot (evicted, dropped after a failed
transfer, cleared by a cache reset). Each event here is one of those
notifications, translated; nothing is kept or compared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import attrs
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

from kvledger.engine import effects as fx

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

_SUFFIX = 4  # a key is the chain hash followed by the group id in 4 bytes


@attrs.frozen
class GroupEventSpec:
    """What a `BlockStored` says about its group, as vLLM's own tier reports it."""

    block_size: int
    kind: str | None = None
    sliding_window: int | None = None


def group_event_specs(kv_cache_config: KVCacheConfig) -> tuple[GroupEventSpec, ...]:

    specs = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs.append(GroupEventSpec(block_size=spec.block_size, kind=get_kv_cache_spec_kind(spec).value,
                                    sliding_window=getattr(spec, "sliding_window", None)))
    return tuple(specs)


class TierEvents:
    """Turns the engine's notifications into vLLM KV events, and holds them until taken."""

    def __init__(self, groups: Sequence[GroupEventSpec], num_lower_tiers: int = 0) -> None:
        self._groups = tuple(groups)
        self._media = [MEDIUM_CPU] + [MEDIUM_STORAGE] * num_lower_tiers  # by tier (0: host memory)
        self._pending: list[KVCacheEvent] = []

    def observe(self, effects: Iterable[fx.Effect]) -> None:
        fx.dispatch(_TRANSLATE, self, effects)

    def _loadable(self, effect: fx.KeysLoadable) -> None:
        self._stored(effect.keys, self._media[effect.tier])

    def _unloadable(self, effect: fx.KeysUnloadable) -> None:
        medium = self._media[effect.tier]
        for group, hashes in self._by_group(effect.keys).items():
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))

    def _stored(self, keys: Iterable[bytes], medium: str) -> None:
        for key in keys:
            group = int.from_bytes(key[-_SUFFIX:], "big")
            spec = self._groups[group]
            self._pending.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(key[:-_SUFFIX])], parent_block_hash=None, token_ids=[],
                block_size=spec.block_size, lora_id=None, medium=medium, lora_name=None, group_idx=group,
                kv_cache_spec_kind=spec.kind, kv_cache_spec_sliding_window=spec.sliding_window))

    @staticmethod
    def _by_group(keys: Iterable[bytes]) -> dict[int, list]:
        groups: dict[int, list] = {}
        for key in keys:
            groups.setdefault(int.from_bytes(key[-_SUFFIX:], "big"), []).append(
                maybe_convert_block_hash(key[:-_SUFFIX]))
        return groups

    def take(self) -> list[KVCacheEvent]:
        events, self._pending = self._pending, []
        return events


# The KV events each effect kind becomes: what each tier can serve, and nothing else.
_TRANSLATE = fx.dispatch_table("KV events", {
    fx.KeysLoadable: TierEvents._loadable,
    fx.KeysUnloadable: TierEvents._unloadable,
}, ignored=(fx.StartStore, fx.StartLoad, fx.StartSpill, fx.DropTierKeys, fx.FlushStores, fx.PinDeviceBlocks,
            fx.UnpinDeviceBlocks, fx.KeysNotAdmitted, fx.KeysBelowThreshold, fx.TransferFailed, fx.JobEnded, fx.ReportViolation, fx.RequestAdmitted, fx.RequestRequeued))
