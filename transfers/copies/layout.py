"""Canonical view of the KV caches vLLM registers (vLLM PR #37853).

vLLM hands the worker one tensor per layer (a list of state tensors for a
mamba layer) in whatever shape its attention backend chose: split K/V
`(2, num_blocks, ...)` or `(num_blocks, 2, ...)` with NHD or HND strides, the
CPU backend's `(num_blocks, heads, block_size, 2*head)`, MLA's
`(num_blocks, block_size, latent)`, kernel blocks smaller than manager blocks,
layers packed layer-outermost or block-outermost, and hybrid groups that
overlay the same memory. Copy code should not know any of that.

So the layout is reduced once, from strides alone, to:

- unique int8 tensors `(num_blocks, page_size_bytes)` whose row `b` is the
  bytes of manager block `b` (adjacent pieces of one allocation are merged;
  layers that alias each other appear once);
- per group, references `(tensor, offset, payload)` whose concatenation is
  what a tier slot holds for one block of that group.

Anything the reduction cannot prove safe (a block dim it cannot find, bytes
that disagree with the spec, blocks that would overlap) is refused with the
layer's name, shape and stride.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Union

import attrs
import torch

from kvledger.transfers.copies.kv_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    LayerSpec,
    MambaSpec,
    layer_spec,
)

LayerCaches = Union[torch.Tensor, Sequence[torch.Tensor]]

MAX_REGIONS_PER_TENSOR = 2
"""Split K/V gives two byte runs per block; more means a layout we do not know."""


class LayoutError(ValueError):
    """The registered KV caches cannot be viewed as canonical blocks."""


@attrs.frozen(kw_only=True, eq=False)
class CanonicalTensor:
    """Row `b` of `tensor` holds bytes of device block `b`."""

    tensor: torch.Tensor
    page_size_bytes: int
    block_stride_bytes: int


@attrs.frozen(kw_only=True)
class CanonicalRef:
    """Where one layer's bytes of a block sit inside a canonical row.

    `payload_bytes` are copied; `page_size_bytes` is what the layer occupies
    on the device, padding included when the layer is a single byte run.
    """

    layer_name: str
    tensor_index: int
    offset_bytes: int
    page_size_bytes: int
    payload_bytes: int


@attrs.frozen(kw_only=True)
class CopySpan:
    """Adjacent references merged: one row slice copied to one slot slice."""

    tensor_index: int
    row_offset: int
    slot_offset: int
    nbytes: int


@attrs.frozen(kw_only=True, eq=False)
class CanonicalKVCaches:
    num_blocks: int
    tensors: tuple[CanonicalTensor, ...]
    group_refs: tuple[tuple[CanonicalRef, ...], ...]
    group_spans: tuple[tuple[CopySpan, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.group_refs)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].tensor.device

    def payload_bytes(self, group: int) -> int:
        return sum(ref.payload_bytes for ref in self.group_refs[group])

    @property
    def slot_bytes(self) -> int:
        """A slot holds one block of any one group."""
        return max(self.payload_bytes(g) for g in range(self.num_groups))

    def span_view(self, span: CopySpan) -> torch.Tensor:
        """`(num_blocks, nbytes)` int8 view of one span on the device."""
        rows = self.tensors[span.tensor_index].tensor
        return rows[:, span.row_offset : span.row_offset + span.nbytes]


@attrs.frozen
class _Region:
    """Block `b` of a layer owns bytes `[base + b*stride, ... + nbytes)` of a storage."""

    storage: int  # index into the storages list
    base: int
    stride: int
    nbytes: int


def canonicalize(kv_caches: Mapping[str, LayerCaches], config: KVCacheConfig) -> CanonicalKVCaches:
    """Reduce vLLM's registered caches to canonical tensors and group references."""
    num_blocks = config.num_blocks
    if num_blocks <= 0:
        raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
    if not config.kv_cache_groups:
        raise LayoutError("the KV cache config has no groups")
    storages: list[torch.UntypedStorage] = []
    storage_index: dict[tuple[str, int], int] = {}
    layer_regions: dict[str, list[tuple[_Region, int]]] = {}
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            if name in layer_regions:
                continue
            if name not in kv_caches:
                raise LayoutError(f"layer {name!r} is in the KV cache config but was not registered")
            spec = layer_spec(group, name)
            layer_regions[name] = _layer_regions(name, kv_caches[name], spec, num_blocks, storages, storage_index)
    _check_one_device(storages)
    _check_storages_disjoint(storages)
    unique = sorted({r for regions in layer_regions.values() for r, _ in regions}, key=attrs.astuple)
    same_block_overlaps = _check_blocks_disjoint(unique, num_blocks)
    tensors, placement = _merge_rows(unique, storages, num_blocks)
    group_refs = []
    for g, group in enumerate(config.kv_cache_groups):
        refs = []
        for name in group.layer_names:
            for region, page in layer_regions[name]:
                index, offset = placement[region]
                refs.append(
                    CanonicalRef(
                        layer_name=name,
                        tensor_index=index,
                        offset_bytes=offset,
                        page_size_bytes=page,
                        payload_bytes=region.nbytes,
                    )
                )
        _check_group_disjoint(g, group.layer_names, layer_regions, same_block_overlaps)
        group_refs.append(tuple(refs))
    return CanonicalKVCaches(
        num_blocks=num_blocks,
        tensors=tuple(tensors),
        group_refs=tuple(group_refs),
        group_spans=tuple(_spans(refs) for refs in group_refs),
    )


def _layer_regions(
    name: str,
    caches: LayerCaches,
    spec: LayerSpec,
    num_blocks: int,
    storages: list[torch.UntypedStorage],
    storage_index: dict[tuple[str, int], int],
) -> list[tuple[_Region, int]]:
    tensors = [caches] if isinstance(caches, torch.Tensor) else list(caches)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise LayoutError(f"layer {name!r}: expected a tensor or a list of tensors, got {type(caches).__name__}")
    if len(tensors) > 1 and not isinstance(spec, MambaSpec):
        raise LayoutError(f"layer {name!r}: only a mamba layer (MambaSpec) registers several state tensors")
    regions: list[_Region] = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in storage_index:
            storage_index[key] = len(storages)
            storages.append(storage)
        elif storages[storage_index[key]].nbytes() < storage.nbytes():
            storages[storage_index[key]] = storage
        regions += _tensor_regions(name, tensor, spec, num_blocks, storage_index[key])
    total = sum(r.nbytes for r in regions)
    if total not in (spec.unpadded_page_size_bytes, spec.page_size_bytes):
        raise LayoutError(
            f"layer {name!r}: a block spans {total} bytes, but its spec says a page holds "
            f"{spec.unpadded_page_size_bytes} bytes (padded {spec.page_size_bytes}); "
            f"{_describe(tensors)}"
        )
    if len(regions) == 1:
        return [(regions[0], max(spec.page_size_bytes, regions[0].nbytes))]
    return [(r, r.nbytes) for r in regions]


def _tensor_regions(
    name: str, tensor: torch.Tensor, spec: LayerSpec, num_blocks: int, storage: int
) -> list[_Region]:
    """Byte runs of manager block 0 in one tensor, found from its strides."""

    def refuse(why: str) -> LayoutError:
        return LayoutError(f"layer {name!r}: unsupported KV cache layout ({why}); {_describe([tensor])}")

    if tensor.dim() == 0 or tensor.numel() == 0:
        raise refuse("empty tensor")
    block_dim = _block_dim(tensor, spec, num_blocks, refuse)
    per_manager = tensor.shape[block_dim] // num_blocks
    esize = tensor.element_size()
    kernel_stride = tensor.stride(block_dim) * esize
    block_stride = kernel_stride * per_manager
    if block_stride <= 0:
        raise refuse("the block dimension has no positive stride")
    dims = [(tensor.shape[d], tensor.stride(d) * esize) for d in range(tensor.dim()) if d != block_dim]
    if per_manager > 1:
        dims.append((per_manager, kernel_stride))
    dims = sorted(((size, stride) for size, stride in dims if size > 1), key=lambda d: (d[1], d[0]))
    run = esize
    while dims and dims[0][1] == run:
        run *= dims.pop(0)[0]
    if any(stride < run for _, stride in dims):
        raise refuse("elements of one block overlap or interleave")
    if math.prod(size for size, _ in dims) > MAX_REGIONS_PER_TENSOR:
        raise refuse("a block is not one or two contiguous byte runs")
    offsets = sorted(sum(i * s for i, (_, s) in zip(idx, dims)) for idx in itertools.product(*(range(n) for n, _ in dims)))
    if any(b - a < run for a, b in zip(offsets, offsets[1:])):
        raise refuse("byte runs of one block overlap")
    if run > block_stride and num_blocks > 1:
        raise refuse("consecutive blocks overlap")
    base = tensor.storage_offset() * esize
    return [_Region(storage, base + off, block_stride, run) for off in offsets]


def _block_dim(tensor: torch.Tensor, spec: LayerSpec, num_blocks: int, refuse) -> int:
    """Dim 0, except FlashAttention's split `(2, num_blocks, block, heads, head)`."""
    shape = tuple(tensor.shape)
    block_dim = 0
    split_kv = isinstance(spec, FullAttentionSpec) and spec.head_size_v != 0 and tensor.dim() == 5
    if split_kv and shape[0] == 2:
        if shape[1] == 2:
            raise refuse("cannot tell (2, num_blocks, ...) from (num_blocks, 2, ...) when both are 2")
        block_dim = 1
    if shape[block_dim] % num_blocks:
        raise refuse(f"dim {block_dim} of size {shape[block_dim]} is not a multiple of num_blocks={num_blocks}")
    return block_dim


def _describe(tensors: Sequence[torch.Tensor]) -> str:
    return "; ".join(
        f"shape={tuple(t.shape)} stride={tuple(t.stride())} dtype={t.dtype} storage_offset={t.storage_offset()}"
        for t in tensors
    )


def _check_one_device(storages: list[torch.UntypedStorage]) -> None:
    devices = {str(s.device) for s in storages}
    if len(devices) > 1:
        raise LayoutError(f"KV caches live on several devices: {sorted(devices)}")


def _check_storages_disjoint(storages: list[torch.UntypedStorage]) -> None:
    """Aliasing is only understood within one allocation."""
    spans = sorted((s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise LayoutError("two different allocations overlap in memory; register views of one allocation")


def _overlap_shifts(a: _Region, b: _Region, num_blocks: int) -> range:
    """Block shifts m for which block i of `a` overlaps block i+m of `b`."""
    d = b.base - a.base
    s = a.stride
    lo = (-b.nbytes - d) // s + 1
    hi = -((d - a.nbytes) // s) - 1
    return range(max(lo, -(num_blocks - 1)), min(hi, num_blocks - 1) + 1)


def _check_blocks_disjoint(regions: list[_Region], num_blocks: int) -> set[tuple[_Region, _Region]]:
    """Distinct block ids must never share a byte; returns same-block overlaps."""
    same_block: set[tuple[_Region, _Region]] = set()
    for r in regions:
        if r.nbytes > r.stride and num_blocks > 1:
            raise LayoutError(f"consecutive blocks overlap: {r.nbytes} bytes per block at stride {r.stride}")
    for a, b in itertools.combinations(regions, 2):
        if a.storage != b.storage:
            continue
        if a.stride != b.stride:
            a_end = a.base + (num_blocks - 1) * a.stride + a.nbytes
            b_end = b.base + (num_blocks - 1) * b.stride + b.nbytes
            if a.base < b_end and b.base < a_end:
                raise LayoutError(
                    f"layers with block strides {a.stride} and {b.stride} interleave in one allocation"
                )
            continue
        shifts = _overlap_shifts(a, b, num_blocks)
        if any(m != 0 for m in shifts):
            raise LayoutError(
                f"blocks of different ids overlap: runs at byte {a.base} and {b.base}, stride {a.stride}"
            )
        if 0 in shifts:
            same_block.add((a, b))
            same_block.add((b, a))
    return same_block


def _check_group_disjoint(group: int, layer_names, layer_regions, same_block_overlaps) -> None:
    regions = [r for name in layer_names for r, _ in layer_regions[name]]
    if len(set(regions)) != len(regions):
        raise LayoutError(f"group {group}: two of its layers share memory")
    for a, b in itertools.combinations(regions, 2):
        if (a, b) in same_block_overlaps:
            raise LayoutError(f"group {group}: bytes of two of its layers overlap within a block")


def _merge_rows(
    regions: list[_Region], storages: list[torch.UntypedStorage], num_blocks: int
) -> tuple[list[CanonicalTensor], dict[_Region, tuple[int, int]]]:
    """Adjacent runs of one allocation and stride become one canonical row."""
    tensors: list[CanonicalTensor] = []
    placement: dict[_Region, tuple[int, int]] = {}
    keyed = sorted(regions, key=lambda r: (r.storage, r.stride, r.base, r.nbytes))
    for (storage, stride), members in itertools.groupby(keyed, key=lambda r: (r.storage, r.stride)):
        rows: list[list[_Region]] = []
        start = end = 0
        for r in members:
            if rows and r.base <= end and max(end, r.base + r.nbytes) - start <= stride:
                rows[-1].append(r)
                end = max(end, r.base + r.nbytes)
            else:
                rows.append([r])
                start, end = r.base, r.base + r.nbytes
        for row in rows:
            start = row[0].base
            width = max(r.base + r.nbytes for r in row) - start
            view = torch.empty(0, dtype=torch.int8, device=storages[storage].device)
            view.set_(storages[storage], start, (num_blocks, width), (stride, 1))
            for r in row:
                placement[r] = (len(tensors), r.base - start)
            tensors.append(CanonicalTensor(tensor=view, page_size_bytes=width, block_stride_bytes=stride))
    return tensors, placement


def _spans(refs: tuple[CanonicalRef, ...]) -> tuple[CopySpan, ...]:
    spans: list[CopySpan] = []
    slot_offset = 0
    for ref in refs:
        last = spans[-1] if spans else None
        if last and last.tensor_index == ref.tensor_index and last.row_offset + last.nbytes == ref.offset_bytes:
            spans[-1] = attrs.evolve(last, nbytes=last.nbytes + ref.payload_bytes)
        else:
            spans.append(
                CopySpan(
                    tensor_index=ref.tensor_index,
                    row_offset=ref.offset_bytes,
                    slot_offset=slot_offset,
                    nbytes=ref.payload_bytes,
                )
            )
        slot_offset += ref.payload_bytes
    return tuple(spans)
