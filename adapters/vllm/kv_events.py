"""KV cache events for the CPU tier and the tiers below it (medium
`STORAGE`, as vLLM 0.33's file-system tier reports): `BlockStored` and
`BlockRemoved`.

With `self_describing_kv_events` (vLLM 0.33's setting), a full-attention
block this process stored is announced as vLLM's own prefix cache announces
it: vLLM's block hashes (not kvledger's keys, which a tier below host memory
chains under its own root), the parent hash, the block's token ids, and the
tier's locality (host memory and a disk `LOCAL`, Valkey `REMOTE`), so a
KV-aware router that knows nothing of kvledger can score a replica by what it
holds below GPU memory. The payload is taken when the store starts, while its
request is alive, and kept while a tier announces the block; a block this
process did not store (found in a shared tier) and a sliding-window or Mamba
block keep the plain form, as vLLM's own tracker keeps them.

A router that reads these events will send requests here expecting a hit,
so an event must never advertise a block that cannot be loaded. The engine
announces exactly that: `KeysLoadable` once a block can be loaded from a tier
(its store completed on every worker, a spill was written, a lookup found
it), `KeysUnloadable` as soon as it cannot (evicted, dropped after a failed
transfer, cleared by a cache reset). Each event here is one of those
notifications, translated; nothing is kept or compared.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

from kvledger.engine import effects as fx

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

_SUFFIX = 4  # a key is the chain hash followed by the group id in 4 bytes
_DESCRIBED_KINDS = ("full_attention", "mla_attention")  # as vLLM's own tracker: no window, no state


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


@attrs.frozen
class Described:
    """A stored block as vLLM's prefix cache announces it."""

    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]


class TierEvents:
    """Turns the engine's notifications into vLLM KV events, and holds them until taken.
    `localities`: each lower tier's, announced when `self_describing`."""

    def __init__(self, groups: Sequence[GroupEventSpec], num_lower_tiers: int = 0, *,
                 self_describing: bool = False, localities: Sequence[str] = (), hash_block_size: int = 0) -> None:
        self._groups = tuple(groups)
        self._media = [MEDIUM_CPU] + [MEDIUM_STORAGE] * num_lower_tiers  # by tier (0: host memory)
        self.self_describing = self_describing
        self._localities: list[str | None] = (["LOCAL", *localities] if self_describing
                                              else [None] * (1 + num_lower_tiers))
        self._hash_block_size = hash_block_size
        self._described: dict[bytes, Described] = {}  # key -> its payload, from its store's start
        self._announced: dict[bytes, int] = {}  # key -> the tiers announcing its payload, a bit each
        self._pending: list[KVCacheEvent] = []

    def observe(self, effects: Iterable[fx.Effect]) -> None:
        fx.dispatch(_TRANSLATE, self, effects)

    def describe_stores(self, stores: Iterable[fx.StartStore], requests: Mapping[str, Any],
                        tables: Sequence[Mapping[str, Sequence[Any]]], scheduled: Iterable[str]) -> None:
        """Self-describing: each full-attention block a store copies, as its request holds it now
        (vLLM's `Request`, its blocks in `tables`: each group's `req_to_blocks`). A step-wide store
        names no request: its blocks are found among the step's `scheduled` requests."""
        if not self.self_describing:
            return
        scheduled = list(scheduled)
        for store in stores:
            rids = [store.request_id] if store.request_id else scheduled
            for group, (keys, blocks) in enumerate(zip(store.keys, store.source_block_ids)):
                spec = self._groups[group]
                if spec.kind not in _DESCRIBED_KINDS or not keys:
                    continue
                wanted = {block: key for block, key in zip(blocks, keys) if key not in self._described}
                for rid in rids:
                    table, request = tables[group].get(rid), requests.get(rid)
                    if not wanted:
                        break
                    if table is None or request is None:
                        continue
                    for position in range(len(table) - 1, -1, -1):  # new blocks are at the end
                        key = wanted.pop(table[position].block_id, None)
                        if key is not None:
                            self._described[key] = self._payload(request, position, spec.block_size)
                            if not wanted:
                                break

    def _payload(self, request: Any, position: int, block_size: int) -> Described:
        per_block = block_size // (self._hash_block_size or block_size)
        hashes = request.block_hashes
        first = position * per_block
        return Described(block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:first + per_block]],
                         parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                         token_ids=list(request.all_token_ids[position * block_size:(position + 1) * block_size]))

    def _loadable(self, effect: fx.KeysLoadable) -> None:
        self._stored(effect.keys, effect.tier)

    def _unloadable(self, effect: fx.KeysUnloadable) -> None:
        medium, locality, bit = self._media[effect.tier], self._localities[effect.tier], 1 << effect.tier
        plain = effect.keys
        if self._described:
            plain = []
            for key in effect.keys:
                held = self._announced.get(key, 0)
                if not held & bit:
                    plain.append(key)
                    continue
                described = self._described[key]
                group = int.from_bytes(key[-_SUFFIX:], "big")
                self._pending.append(BlockRemoved(block_hashes=described.block_hashes, medium=medium,
                                                  group_idx=group, locality=locality))
                if held == bit:  # no tier announces it any more
                    del self._announced[key], self._described[key]
                else:
                    self._announced[key] = held & ~bit
        for group, hashes in self._by_group(plain).items():
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group, locality=locality))

    def forget_unstored(self, keys: Iterable[bytes]) -> None:
        """Keys whose store failed: their payload goes unless a tier announces them."""
        for key in keys:
            if key in self._described and not self._announced.get(key):
                del self._described[key]

    def _stored(self, keys: Iterable[bytes], tier: int) -> None:
        medium, locality = self._media[tier], self._localities[tier]
        for key in keys:
            group = int.from_bytes(key[-_SUFFIX:], "big")
            spec = self._groups[group]
            described = self._described.get(key)
            if described is not None:
                self._announced[key] = self._announced.get(key, 0) | 1 << tier
                self._pending.append(BlockStored(
                    block_hashes=described.block_hashes, parent_block_hash=described.parent_block_hash,
                    token_ids=described.token_ids, block_size=spec.block_size, lora_id=None, medium=medium,
                    lora_name=None, group_idx=group, kv_cache_spec_kind=spec.kind,
                    kv_cache_spec_sliding_window=spec.sliding_window, locality=locality))
                continue
            self._pending.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(key[:-_SUFFIX])], parent_block_hash=None, token_ids=[],
                block_size=spec.block_size, lora_id=None, medium=medium, lora_name=None, group_idx=group,
                kv_cache_spec_kind=spec.kind, kv_cache_spec_sliding_window=spec.sliding_window,
                locality=locality))

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
            fx.UnpinDeviceBlocks, fx.KeysNotAdmitted, fx.KeysBelowThreshold, fx.SpillDropped, fx.TransferFailed, fx.JobEnded, fx.ReportViolation, fx.RequestAdmitted, fx.RequestRequeued))
