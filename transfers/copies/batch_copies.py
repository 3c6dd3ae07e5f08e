"""kvledger's own batch copy for a CUDA worker that vLLM hands none.

Measured on an H100 with 32 KiB spans (bench/history/2026-11-26.md, 256 MiB jobs, one
direction): the Triton kernel 39-44 GB/s, the driver's `cuMemcpyBatchAsync`
27-35, the torch path 22-26 (its launches, 64 per staging chunk, set the
pace). Both batch copies need the tier pinned: the kernel reaches the tier
through its device mapping, and the driver's stream-ordered batch copy is
for pinned host memory. An unpinned tier keeps the torch path, which copies
synchronously and says so at start.
"""

from __future__ import annotations

from kvledger.transfers.copies.copy_descriptors import BatchCopy, span_addresses
from kvledger.transfers.copies.driver_copy import driver_batch_copy
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import CanonicalKVCaches
from kvledger.transfers.copies.triton_copy import triton_batch_copy


def own_batch_copy(layout: CanonicalKVCaches, tier: HostTier) -> BatchCopy | None:
    """The Triton kernel (where the layout moves in 8-byte words), else the driver's
    batch copy, else None (the torch path)."""
    if not tier.pinned:
        return None
    kernel = triton_batch_copy() if moves_in_words(layout, tier) else None
    return kernel or driver_batch_copy()


def moves_in_words(layout: CanonicalKVCaches, tier: HostTier) -> bool:
    """Every descriptor of every job starts, and spans, a multiple of 8 bytes: its
    addresses are a base plus a multiple of a stride, on both sides."""
    return all(not (a.device_base | a.device_stride | a.host_base | a.host_stride | a.nbytes) & 7
               for spans in span_addresses(layout, tier) for a in spans)
