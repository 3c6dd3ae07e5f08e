"""Batch-copy descriptors give the same bytes as the torch path.

vLLM's `swap_blocks_batch` runs only on a GPU; here a memcpy per
descriptor (ctypes.memmove) applies them to host tensors, and the result is
compared with the CPU backend's copy of the same job.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvledger.transfers.copies.backend import CopyJob, Direction
from kvledger.transfers.copies.copy_descriptors import build_descriptors, descriptor_tensors, span_addresses
from kvledger.transfers.copies.cpu_backend import CpuBackend
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import canonicalize
from tests.transfers import layouts


def memmove_batch(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
    """`swap_blocks_batch` on host memory."""
    assert src.dtype == dst.dtype == sizes.dtype == torch.int64 and src.device.type == "cpu"
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


BUILDERS = [
    lambda: layouts.cpu_attention(packing="block", num_layers=3),
    lambda: layouts.flash_attention(kv_outer=True, hnd=True),
    lambda: layouts.flash_attention(kv_outer=False, hnd=False, kernel=2),
    lambda: layouts.mla(padded_bytes=256),
    lambda: layouts.mamba(),
    lambda: layouts.hybrid_sliding(packing="layer"),
    lambda: layouts.hybrid_mamba(),
    lambda: layouts.packed_uniform(),
]


def _job(case, direction: Direction, job_id: int = 1) -> CopyJob:
    groups = len(case.config.kv_cache_groups)
    blocks = [[1, 3, 2], [5, 4]][:groups] if groups == 2 else [[1, 3, 2, 5]]
    slots = [[7, 0, 1], [3, 12]][:groups] if groups == 2 else [[8, 0, 1, 9]]
    return CopyJob(job_id=job_id, direction=direction, block_ids=blocks, slot_ids=slots)


def _tier(layout) -> HostTier:
    return HostTier(capacity_bytes=16 * -(-layout.slot_bytes // 64) * 64, slot_bytes=layout.slot_bytes, pin=False)


@pytest.mark.parametrize("build", BUILDERS)
def test_descriptors_store_and_load_the_bytes_the_torch_path_does(build) -> None:
    case = build()
    layout = canonicalize(case.kv_caches, case.config)
    by_torch, by_batch = _tier(layout), _tier(layout)
    CpuBackend(layout, by_torch).copy_now(_job(case, Direction.STORE))
    store = _job(case, Direction.STORE)
    src, dst, sizes = build_descriptors(span_addresses(layout, by_batch), store)
    assert len(sizes) == sum(len(ids) * len(layout.group_spans[g]) for g, ids in enumerate(store.block_ids))
    memmove_batch(*descriptor_tensors(src, dst, sizes, pin=False))
    assert torch.equal(by_batch.rows, by_torch.rows)

    generator = torch.Generator().manual_seed(1)
    for raw in case.raws:
        raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=generator))
    load = _job(case, Direction.LOAD)
    expected = [raw.clone() for raw in case.raws]
    CpuBackend(layout, by_torch).copy_now(load)
    loaded_by_torch = [raw.clone() for raw in case.raws]
    for raw, before in zip(case.raws, expected):
        raw.copy_(before)
    memmove_batch(*descriptor_tensors(*build_descriptors(span_addresses(layout, by_batch), load), pin=False))
    for raw, want in zip(case.raws, loaded_by_torch):
        assert torch.equal(raw, want)


def test_multi_span_layouts_give_one_descriptor_per_block_and_span() -> None:
    case = layouts.flash_attention(kv_outer=True, hnd=True)  # split K/V: two byte runs per block
    layout = canonicalize(case.kv_caches, case.config)
    tier = _tier(layout)
    spans = layout.group_spans[0]
    assert len(spans) > 1
    job = CopyJob(job_id=1, direction=Direction.STORE, block_ids=[[2, 5]], slot_ids=[[4, 0]])
    src, dst, sizes = build_descriptors(span_addresses(layout, tier), job)
    expected = [(layout.span_view(span).data_ptr() + block * layout.span_view(span).stride(0),
                 tier.rows.data_ptr() + slot * tier.slot_bytes + span.slot_offset, span.nbytes)
                for span in spans for block, slot in ((2, 4), (5, 0))]
    assert list(zip(src.tolist(), dst.tolist(), sizes.tolist())) == expected
    empty = build_descriptors(span_addresses(layout, tier),
                              CopyJob(job_id=2, direction=Direction.LOAD, block_ids=[[]], slot_ids=[[]]))
    assert all(a.size == 0 for a in empty)
