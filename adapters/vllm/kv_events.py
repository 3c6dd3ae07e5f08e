"""KV cache events for the CPU tier: `BlockStored` and `BlockRemoved`.

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
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
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

    def __init__(self, groups: Sequence[GroupEventSpec]) -> None:
        self._groups = tuple(groups)
        self._advertised: set[bytes] = set()
        self._pending: list[KVCacheEvent] = []

    @property
    def advertised(self) -> frozenset[bytes]:
        return frozenset(self._advertised)

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
                candidates.update(self._advertised)
        for effect in notifications:
            if isinstance(effect, fx.KeysEvicted):
                candidates.update(effect.keys)
        loadable = {k for k in candidates if queries.is_loadable(state, k)}
        stored = sorted(k for k in candidates if k not in self._advertised and k in loadable)
        removed = sorted(k for k in candidates if k in self._advertised and k not in loadable)
        for key in removed:
            self._advertised.discard(key)
        if removed:
            for group, hashes in self._by_group(removed).items():
                self._pending.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU, group_idx=group))
        for key in stored:
            self._advertised.add(key)
            group = int.from_bytes(key[-_SUFFIX:], "big")
            spec = self._groups[group]
            self._pending.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(key[:-_SUFFIX])], parent_block_hash=None, token_ids=[],
                block_size=spec.block_size, lora_id=None, medium=MEDIUM_CPU, lora_name=None, group_idx=group,
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
