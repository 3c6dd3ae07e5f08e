"""The canonical layout covers exactly each layer's block bytes, never more."""

from __future__ import annotations

import pytest
import torch

from kvledger.transfers.copies.kv_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvledger.transfers.copies.layout import CanonicalKVCaches, LayoutError, canonicalize
from tests.transfers import layouts
from tests.transfers.layouts import Case, all_cases, byte_addresses, cpu_attention, layer_block_addresses

CASES = all_cases()


def canonical_addresses(layout: CanonicalKVCaches, group: int, block: int) -> torch.Tensor:
    parts = []
    for span in layout.group_spans[group]:
        parts.append(byte_addresses(layout.span_view(span)[block]))
    return torch.cat(parts)


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request) -> Case:
    return request.param


def test_each_group_block_is_exactly_its_layers_bytes(case: Case) -> None:
    layout = canonicalize(case.kv_caches, case.config)
    for group in range(layout.num_groups):
        for block in range(case.num_blocks):
            canonical = canonical_addresses(layout, group, block)
            assert canonical.unique().numel() == canonical.numel(), "a byte is copied twice"
            expected = layer_block_addresses(case, group, block).unique()
            assert torch.equal(canonical.sort().values, expected)


def test_distinct_blocks_never_share_a_byte(case: Case) -> None:
    layout = canonicalize(case.kv_caches, case.config)
    per_block = [
        torch.cat([canonical_addresses(layout, g, b) for g in range(layout.num_groups)]).unique()
        for b in range(case.num_blocks)
    ]
    everything = torch.cat(per_block)
    assert everything.unique().numel() == everything.numel()


def test_slot_bytes_is_the_largest_group_payload(case: Case) -> None:
    layout = canonicalize(case.kv_caches, case.config)
    payloads = [layout_block.numel() for layout_block in (
        layer_block_addresses(case, g, 1).unique() for g in range(layout.num_groups)
    )]
    assert layout.slot_bytes == max(payloads)
    assert all(t.tensor.dtype == torch.int8 and t.tensor.shape[0] == case.num_blocks for t in layout.tensors)


def read_bytes(case: Case, addresses: torch.Tensor) -> torch.Tensor:
    """The byte at each absolute address, read from the raw allocations."""
    out = torch.zeros(addresses.numel(), dtype=torch.int8)
    for raw in case.raws:
        start = raw.data_ptr()
        inside = (addresses >= start) & (addresses < start + raw.numel())
        out[inside] = raw[addresses[inside] - start]
    return out


def test_writing_a_canonical_block_changes_exactly_that_block(case: Case) -> None:
    layout = canonicalize(case.kv_caches, case.config)
    source, target = 2, 3
    for group in range(layout.num_groups):
        before = [raw.clone() for raw in case.raws]
        image = torch.cat([layout.span_view(s)[source] for s in layout.group_spans[group]])
        offset = 0
        for s in layout.group_spans[group]:
            layout.span_view(s)[target].copy_(image[offset : offset + s.nbytes])
            offset += s.nbytes
        for name in case.group_layers(group):
            for view_source, view_target in zip(case.block_views[name](source), case.block_views[name](target)):
                assert torch.equal(
                    read_bytes(case, byte_addresses(view_source)), read_bytes(case, byte_addresses(view_target))
                )
        allowed = layer_block_addresses(case, group, target)
        for raw, old in zip(case.raws, before):
            changed = torch.nonzero(raw != old).flatten() + raw.data_ptr()
            assert torch.isin(changed, allowed).all()
            raw.copy_(old)


def test_hybrid_groups_share_the_overlaid_memory() -> None:
    from tests.transfers.layouts import hybrid_sliding

    case = hybrid_sliding(packing="layer")
    layout = canonicalize(case.kv_caches, case.config)
    assert len(layout.tensors) == 2
    assert [r.tensor_index for r in layout.group_refs[0]] == [r.tensor_index for r in layout.group_refs[1]]


def test_packed_blocks_become_one_row() -> None:
    case = cpu_attention(packing="block", num_layers=3)
    layout = canonicalize(case.kv_caches, case.config)
    assert len(layout.tensors) == 1 and len(layout.group_spans[0]) == 1
    assert layout.tensors[0].page_size_bytes == 3 * case.config.kv_cache_groups[0].kv_cache_spec.page_size_bytes


def test_padding_is_reported_but_not_copied() -> None:
    from tests.transfers.layouts import mla

    case = mla(padded_bytes=256)
    layout = canonicalize(case.kv_caches, case.config)
    ref = layout.group_refs[0][0]
    assert (ref.page_size_bytes, ref.payload_bytes) == (256, 192)
    assert layout.tensors[0].block_stride_bytes == 256


def _spec() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)


def _config(num_blocks: int, names=("layer.x",), spec=None) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec or _spec())],
    )


def _assert_refused(tensor: torch.Tensor, config: KVCacheConfig, why: str) -> None:
    with pytest.raises(LayoutError) as info:
        canonicalize({"layer.x": tensor}, config)
    message = str(info.value)
    assert "layer.x" in message and str(tuple(tensor.shape)) in message and str(tuple(tensor.stride())) in message
    assert why in message


def test_heads_outside_blocks_are_refused() -> None:
    # (heads, num_blocks, ...) permuted to look block-major: four byte runs per block.
    tensor = torch.zeros(4, 6, 4, 8).permute(1, 0, 2, 3)
    _assert_refused(tensor, _config(6), "contiguous byte runs")


def test_a_block_dim_that_does_not_divide_is_refused() -> None:
    _assert_refused(torch.zeros(7, 2, 4, 16), _config(6), "not a multiple of num_blocks")


def test_overlapping_blocks_are_refused() -> None:
    raw = torch.zeros(6 * 512)
    tensor = torch.as_strided(raw, (6, 2, 4, 16), (64, 64, 16, 1))
    _assert_refused(tensor, _config(6), "")


def test_bytes_that_disagree_with_the_spec_are_refused() -> None:
    _assert_refused(torch.zeros(6, 2, 4, 8), _config(6), "spec says a page holds 512 bytes")


def test_ambiguous_split_layout_is_refused() -> None:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    _assert_refused(torch.zeros(2, 2, 4, 2, 8, dtype=torch.float16), _config(2, spec=spec), "cannot tell")


def test_a_missing_layer_is_refused() -> None:
    with pytest.raises(LayoutError, match="was not registered"):
        canonicalize({}, _config(6))


def test_two_layers_of_one_group_sharing_memory_are_refused() -> None:
    tensor = torch.zeros(6, 2, 4, 16)
    with pytest.raises(LayoutError, match="share memory"):
        canonicalize({"a": tensor, "b": tensor}, _config(6, names=("a", "b")))


def test_canonical_rows_hold_only_registered_bytes(case: Case) -> None:
    layout = canonicalize(case.kv_caches, case.config)
    registered = torch.cat(
        [layer_block_addresses(case, g, b) for g in range(layout.num_groups) for b in range(case.num_blocks)]
    ).unique()
    rows = torch.cat([byte_addresses(t.tensor) for t in layout.tensors])
    assert torch.isin(rows, registered).all()


def _two_layers(offset_elems: int) -> tuple[dict, KVCacheConfig]:
    """Two 256-byte-per-block layers in one allocation at a 512-byte block stride."""
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=32, dtype=torch.float32)
    raw = torch.zeros(6 * 128 + 256)
    a = torch.as_strided(raw, (6, 1, 1, 64), (128, 64, 64, 1), 0)
    b = torch.as_strided(raw, (6, 1, 1, 64), (128, 64, 64, 1), offset_elems)
    return {"a": a, "b": b}, _config(6, names=("a", "b"), spec=spec)


def test_layers_whose_blocks_interleave_are_refused() -> None:
    kv_caches, config = _two_layers(offset_elems=160)  # b's block 0 overlaps a's block 1
    with pytest.raises(LayoutError, match="blocks of different ids overlap"):
        canonicalize(kv_caches, config)


def test_layers_of_one_group_overlapping_in_a_block_are_refused() -> None:
    kv_caches, config = _two_layers(offset_elems=32)
    with pytest.raises(LayoutError, match="overlap within a block"):
        canonicalize(kv_caches, config)


def test_layers_side_by_side_in_a_block_are_accepted() -> None:
    kv_caches, config = _two_layers(offset_elems=64)
    layout = canonicalize(kv_caches, config)
    assert len(layout.tensors) == 1 and layout.tensors[0].page_size_bytes == 512
    assert layout.group_spans[0] == (layout.group_spans[0][0],) and layout.group_spans[0][0].nbytes == 512


def test_relocated_cases_keep_their_geometry(case: Case) -> None:
    """The helper that rebuilds cases on a GPU, checked here on the CPU."""
    moved = layouts.on_device(case, "cpu")
    layout = canonicalize(moved.kv_caches, moved.config)
    for group in range(layout.num_groups):
        canonical = canonical_addresses(layout, group, 1).sort().values
        assert torch.equal(canonical, layer_block_addresses(moved, group, 1).unique())
        assert not torch.isin(canonical, layer_block_addresses(case, group, 1)).any()
