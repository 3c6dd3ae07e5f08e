"""vLLM's KV cache config, translated once into kvledger's own types.

The engine needs the groups (kind, block size, window); the transfers need
the layer specs and backing tensors. Both roles translate the same vLLM
object, so the scheduler's slot count equals the worker's host tier.
"""

from __future__ import annotations

from vllm.v1 import kv_cache_interface as vk

from kvledger.events.config import (
    ConfigError,
    EngineConfig,
    GroupKind,
    GroupSpec,
    LowerTierSpec,
    PolicyName,
    Protection,
    StoreMode,
)
from kvledger.transfers.copies import kv_spec as ks
from kvledger.transfers.copies.host_tier import slots_for


def _layer_spec(spec: vk.KVCacheSpec, where: str) -> ks.LayerSpec:
    if isinstance(spec, vk.MambaSpec):
        return ks.MambaSpec(block_size=spec.block_size, shapes=spec.shapes, dtypes=spec.dtypes,
                            page_size_padded=spec.page_size_padded, mamba_cache_mode=spec.mamba_cache_mode)
    if type(spec) is vk.SlidingWindowSpec:
        return ks.SlidingWindowSpec(
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            dtype=spec.dtype, head_size_v=spec.head_size_v, page_size_padded=spec.page_size_padded,
            sliding_window=spec.sliding_window, extra_retained_tokens=spec.extra_retained_tokens)
    if type(spec) is vk.MLAAttentionSpec:
        return ks.MLAAttentionSpec(
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            dtype=spec.dtype, page_size_padded=spec.page_size_padded, cache_dtype_str=spec.cache_dtype_str)
    if type(spec) is vk.FullAttentionSpec:
        return ks.FullAttentionSpec(
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            dtype=spec.dtype, head_size_v=spec.head_size_v, page_size_padded=spec.page_size_padded,
            sliding_window=spec.sliding_window)
    raise ConfigError(f"{where}: kvledger does not offload {type(spec).__name__} yet")


def _group_spec(spec: vk.KVCacheSpec, where: str) -> ks.GroupSpec:
    if isinstance(spec, vk.UniformTypeKVCacheSpecs):
        return ks.UniformTypeKVCacheSpecs(
            block_size=spec.block_size,
            kv_cache_specs={name: _layer_spec(s, f"{where} layer {name}") for name, s in spec.kv_cache_specs.items()})
    return _layer_spec(spec, where)


def transfer_config(config: vk.KVCacheConfig) -> ks.KVCacheConfig:
    """The layer specs and backing tensors, as the canonical layout reads them."""
    return ks.KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=tuple(
            ks.KVCacheTensor(size=t.size, layers=tuple(t.layers), layer_stride=t.layer_stride,
                             block_stride=t.block_stride, offset=t.offset)
            for t in config.kv_cache_tensors),
        kv_cache_groups=tuple(
            ks.KVCacheGroupSpec(layer_names=tuple(g.layer_names),
                                kv_cache_spec=_group_spec(g.kv_cache_spec, f"KV cache group {i}"))
            for i, g in enumerate(config.kv_cache_groups)),
    )


def slot_bytes(config: ks.KVCacheConfig) -> int:
    """Bytes of one tier slot: the largest per-block payload of any group."""
    return max(
        sum(ks.layer_spec(group, name).unpadded_page_size_bytes for name in group.layer_names)
        for group in config.kv_cache_groups)


def num_tier_slots(capacity_bytes: int, config: ks.KVCacheConfig) -> int:
    """Slots the host tier holds (`HostTier` allocates with the same function)."""
    slots, row = slots_for(capacity_bytes, slot_bytes(config))
    if slots < 1:
        raise ConfigError(f"capacity_bytes={capacity_bytes} holds no slot: one block of every layer of a "
                          f"group takes {row} bytes")
    return slots


def _engine_group(group_id: int, spec: vk.KVCacheSpec) -> GroupSpec:
    if isinstance(spec, vk.UniformTypeKVCacheSpecs):
        kinds = {type(s) for s in spec.kv_cache_specs.values()}
        if len(kinds) != 1:
            raise ConfigError(f"KV cache group {group_id} mixes layer kinds {sorted(k.__name__ for k in kinds)}")
        spec = next(iter(spec.kv_cache_specs.values()))
    if isinstance(spec, vk.MambaSpec):
        return GroupSpec(group_id=group_id, kind=GroupKind.MAMBA, block_size=spec.block_size)
    if type(spec) is vk.SlidingWindowSpec:
        return GroupSpec(group_id=group_id, kind=GroupKind.SLIDING, block_size=spec.block_size,
                         window=spec.sliding_window + spec.extra_retained_tokens)
    if type(spec) in (vk.FullAttentionSpec, vk.MLAAttentionSpec):
        if getattr(spec, "attention_chunk_size", None):
            raise ConfigError(f"KV cache group {group_id}: chunked local attention is not supported")
        return GroupSpec(group_id=group_id, kind=GroupKind.FULL, block_size=spec.block_size)
    raise ConfigError(f"KV cache group {group_id}: kvledger does not offload {type(spec).__name__} yet")


def engine_config(config: vk.KVCacheConfig, *, capacity_bytes: int, policy: PolicyName,
                  world_size: int, block_size: int, protection: Protection = Protection.FLUSH,
                  store_mode: StoreMode = StoreMode.EAGER,
                  lower_tiers: tuple[LowerTierSpec, ...] = (), tier_copies: int = 0, store_threshold: int = 1,
                  max_tracker_size: int = 64_000, offload_prompt_only: bool = False,
                  restore_budget: str = "load") -> EngineConfig:
    groups = tuple(_engine_group(i, g.kv_cache_spec) for i, g in enumerate(config.kv_cache_groups))
    hash_block_size = config.hash_block_size or block_size
    transfer = transfer_config(config)
    return EngineConfig(
        groups=groups,
        hash_block_size=hash_block_size,
        num_device_blocks=config.num_blocks,
        num_tier_slots=num_tier_slots(capacity_bytes, transfer),
        policy=policy,
        protection=protection,
        world_size=world_size,
        store_mode=store_mode,
        lower_tiers=lower_tiers,
        slot_bytes=slot_bytes(transfer),
        tier_copies=tier_copies if lower_tiers else 0,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        offload_prompt_only=offload_prompt_only,
        restore_budget=restore_budget,
    )
