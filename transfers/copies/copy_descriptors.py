"""Raw copy descriptors for a batch copy: one (source, target, bytes) per block and span.

vLLM ships `_custom_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes)`: one
driver call (`cuMemcpyBatchAsync` on CUDA 12.8+) for every pointer pair,
with no device staging and no compute units used. This module computes
those pointers from the canonical layout; it needs no device, so its
arithmetic is checked on host memory with a memcpy standing in for the DMA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from kvledger.transfers.copies.backend import CopyJob, Direction
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import CanonicalKVCaches

BatchCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""`swap_blocks_batch(src_ptrs, dst_ptrs, sizes)`: CPU int64 tensors of raw
pointers and byte counts, copied on the current stream."""


@attrs.frozen
class SpanAddresses:
    """Block `b`'s bytes of a span start at `device_base + b * device_stride`;
    slot `s`'s at `host_base + s * host_stride`; both `nbytes` long."""

    device_base: int
    device_stride: int
    host_base: int
    host_stride: int
    nbytes: int


def span_addresses(layout: CanonicalKVCaches, tier: HostTier) -> list[list[SpanAddresses]]:
    """Per group, the addresses of each span, from the views the torch path copies."""
    groups = []
    for spans in layout.group_spans:
        addresses = []
        for span in spans:
            view = layout.span_view(span)
            if view.stride(1) != 1:
                raise ValueError(f"span {span} is not contiguous within a block row: stride {view.stride()}")
            addresses.append(SpanAddresses(
                device_base=view.data_ptr(), device_stride=view.stride(0),
                host_base=tier.rows.data_ptr() + span.slot_offset, host_stride=tier.rows.stride(0),
                nbytes=span.nbytes))
        groups.append(addresses)
    return groups


def build_descriptors(groups: Sequence[Sequence[SpanAddresses]], job: CopyJob,
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sources, targets, sizes) as int64 arrays, one entry per block and span of the job."""
    src, dst, sizes = [], [], []
    for spans, blocks, slots in zip(groups, job.block_ids, job.slot_ids):
        if not blocks:
            continue
        block_ids = np.asarray(blocks, dtype=np.int64)
        slot_ids = np.asarray(slots, dtype=np.int64)
        for a in spans:
            device = a.device_base + block_ids * a.device_stride
            host = a.host_base + slot_ids * a.host_stride
            store = job.direction is Direction.STORE
            src.append(device if store else host)
            dst.append(host if store else device)
            sizes.append(np.full(block_ids.size, a.nbytes, dtype=np.int64))
    if not sizes:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(src), np.concatenate(dst), np.concatenate(sizes)


def descriptor_tensors(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, *, pin: bool,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU int64 tensors, as `swap_blocks_batch` takes them (pinned when asked)."""
    tensors = tuple(torch.from_numpy(a) for a in (src, dst, sizes))
    if pin:
        tensors = tuple(t.pin_memory() for t in tensors)
    return tensors  # type: ignore[return-value]
