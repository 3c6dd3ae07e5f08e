"""KV cache events for the CPU tier and the tiers below it (medium
`STORAGE`, as vLLM 0.33's file-system tier reports): `BlockStored` and
`BlockRemoved`.

A router that reads these events will send requests here expecting a hit,
so an event must never advertise a block that cannot be loaded. A block is
advertised once its store has completed (on every worker) and the engine
holds it as stored; it is withdrawn as soon as it stops being loadable:
evicted, dropped after a failed transfer, or cleared by a cache reset.
Both directions are decided by asking the engine state after the events,
never by guessing from the events alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import attrs
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.state import State
from kvledger.events import types as ev

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
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    specs = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs.append(GroupEventSpec(block_size=spec.block_size, kind=get_kv_cache_spec_kind(spec).value,
                                    sliding_window=getattr(spec, "sliding_window", None)))
    return tuple(specs)


class TierEvents:
    """Turns engine transitions into vLLM KV events, and holds them until taken."""

    def __init__(self, groups: Sequence[GroupEventSpec], num_lower_tiers: int = 0) -> None:
        self._groups = tuple(groups)
        # Per medium (the CPU tier, then each lower tier): the keys advertised there.
        self._media = [MEDIUM_CPU] + [MEDIUM_STORAGE] * num_lower_tiers
        self._advertised_in: list[set[bytes]] = [set() for _ in self._media]
        self._advertised = self._advertised_in[0]
        self._pending: list[KVCacheEvent] = []

    @property
    def advertised(self) -> frozenset[bytes]:
        return frozenset(self._advertised)

    def advertised_in(self, tier: int) -> frozenset[bytes]:
        """Keys advertised in tier `tier` (0: host memory)."""
        return frozenset(self._advertised_in[tier])

    def observe(self, events: Iterable[ev.Event], job_keys: Iterable[bytes], notifications: Iterable[fx.Effect],
                state: State) -> None:
        """Reconcile every key these transitions may have changed with the state after them.

        `job_keys` are the keys of the jobs the events report on, read before
        they were applied (a job is gone once it ends); `notifications` are
        the effects the engine produced (only `KeysEvicted` names keys).
        """
        candidates = set(job_keys)
        for event in events:
            candidates.update(getattr(event, "keys", ()))
            if isinstance(event, ev.CacheReset):
                for advertised in self._advertised_in:
                    candidates.update(advertised)
        for effect in notifications:
            if isinstance(effect, (fx.KeysEvicted, fx.DropTierKeys)):
                candidates.update(effect.keys)
        for tier, (medium, advertised) in enumerate(zip(self._media, self._advertised_in)):
            if tier:
                loadable = {k for k in candidates if queries.tier_holds(state, tier, k)}
            else:
                loadable = {k for k in candidates if queries.is_loadable(state, k)}
            self._reconcile(candidates, loadable, advertised, medium)

    def _reconcile(self, candidates: set[bytes], loadable: set[bytes], advertised: set[bytes],
                   medium: str) -> None:
        stored = sorted(k for k in candidates if k not in advertised and k in loadable)
        removed = sorted(k for k in candidates if k in advertised and k not in loadable)
        for key in removed:
            advertised.discard(key)
        if removed:
            for group, hashes in self._by_group(removed).items():
                self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
        for key in stored:
            advertised.add(key)
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
