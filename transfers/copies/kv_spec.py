"""The parts of vLLM's KV cache config that the canonical layout reads.

These mirror the fields of `vllm.v1.kv_cache_interface` so the layout and its
tests run without vLLM installed; the adapter converts vLLM's objects into
these once, at registration. Page sizes follow vLLM's formulas exactly:
`page_size_bytes` includes padding, `unpadded_page_size_bytes` is the payload.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Union

import attrs
import torch


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _padded(payload: int, page_size_padded: int | None) -> int:
    if page_size_padded is None:
        return payload
    if page_size_padded < payload:
        raise ValueError(f"page_size_padded {page_size_padded} is smaller than the payload {payload}")
    return page_size_padded


@attrs.frozen(kw_only=True)
class FullAttentionSpec:
    """Separate K and V of `head_size` / `head_size_v` per token and head."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None
    page_size_padded: int | None = None
    sliding_window: int | None = None

    @property
    def unpadded_page_size_bytes(self) -> int:
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        return self.block_size * self.num_kv_heads * (self.head_size + head_size_v) * _dtype_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return _padded(self.unpadded_page_size_bytes, self.page_size_padded)


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int | None = None
    extra_retained_tokens: int = 0


@attrs.frozen(kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """One latent vector per token (no separate V), as vLLM's MLA stores it."""

    head_size_v: int | None = 0
    cache_dtype_str: str | None = None


@attrs.frozen(kw_only=True)
class MambaSpec:
    """Per-block recurrent state: one tensor per entry of `shapes` (conv, ssm)."""

    block_size: int
    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda v: tuple(tuple(s) for s in v))
    dtypes: tuple[torch.dtype, ...] = attrs.field(converter=tuple)
    page_size_padded: int | None = None
    mamba_cache_mode: str = "none"

    @property
    def unpadded_page_size_bytes(self) -> int:
        return sum(math.prod(s) * _dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        return _padded(self.unpadded_page_size_bytes, self.page_size_padded)


LayerSpec = Union[FullAttentionSpec, MambaSpec]


@attrs.frozen(kw_only=True)
class UniformTypeKVCacheSpecs:
    """One group whose layers share a type but not a shape (per-layer specs)."""

    block_size: int
    kv_cache_specs: Mapping[str, LayerSpec]

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())


GroupSpec = Union[FullAttentionSpec, MambaSpec, UniformTypeKVCacheSpecs]


@attrs.frozen(kw_only=True)
class KVCacheTensor:
    """One backing allocation; `layers` are placed in it at the given strides."""

    size: int
    layers: tuple[str, ...] = attrs.field(converter=tuple)
    layer_stride: int = 0
    block_stride: int = 0
    offset: int = 0


@attrs.frozen(kw_only=True)
class KVCacheGroupSpec:
    layer_names: tuple[str, ...] = attrs.field(converter=tuple)
    kv_cache_spec: GroupSpec


@attrs.frozen(kw_only=True)
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...] = attrs.field(default=(), converter=tuple)
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = attrs.field(converter=tuple)


def layer_spec(group: KVCacheGroupSpec, layer_name: str) -> LayerSpec:
    """The spec of one layer, looking inside a per-layer (uniform-type) group."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec
