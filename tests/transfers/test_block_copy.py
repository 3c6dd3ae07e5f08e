"""Both copy paths move exactly the named rows, for any ids, widths and alignments."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.transfers import block_copy
from kvledger.transfers.block_copy import copy_rows, merge_columns, widest_dtype


@st.composite
def problems(draw):
    num_src, num_dst = draw(st.integers(2, 24)), draw(st.integers(2, 24))
    n = draw(st.integers(0, min(num_src, num_dst)))
    widths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    src_pad = draw(st.integers(0, 17))
    src_ids = draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n))
    if draw(st.booleans()):
        first = draw(st.integers(0, num_dst - n))
        dst_ids = list(range(first, first + n))
    else:
        dst_ids = draw(st.permutations(range(num_dst)))[:n]
    return num_src, num_dst, widths, src_pad, src_ids, dst_ids, draw(st.integers(0, 2**31))


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(["auto", "direct", "staged"]))
def test_rows_land_exactly_where_named(problem, path) -> None:
    num_src, num_dst, widths, pad, src_ids, dst_ids, seed = problem
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)  # noqa: E731
    total = sum(widths)
    src_rows = rand(num_src, total + pad + 3)
    dst_rows = rand(num_dst, total + 5)
    pieces, a, b = [], pad, 0
    for w in widths:  # sources at odd offsets, targets side by side in one row
        pieces.append((src_rows[:, a : a + w], dst_rows[:, b : b + w]))
        a, b = a + w, b + w
    expected_rows = dst_rows.clone()
    for (src, _), (lo, hi) in zip(pieces, _columns(widths)):
        for s, d in zip(src_ids, dst_ids):
            expected_rows[d, lo:hi] = src[s]
    s_ids, d_ids = torch.tensor(src_ids, dtype=torch.long), torch.tensor(dst_ids, dtype=torch.long)
    if path == "auto":
        copy_rows(pieces, s_ids, d_ids)
    elif d_ids.numel():
        d_sorted, order = torch.sort(d_ids)
        s_sorted = s_ids[order]
        breaks = torch.nonzero(d_sorted[1:] - d_sorted[:-1] != 1).flatten() + 1
        if path == "direct":
            block_copy._copy_direct(pieces, s_sorted, d_sorted, breaks)
        else:
            block_copy._copy_staged(pieces, s_sorted, d_sorted, total)
    assert torch.equal(dst_rows, expected_rows)


def _columns(widths):
    out, start = [], 0
    for w in widths:
        out.append((start, start + w))
        start += w
    return out


def test_staged_path_chunks_large_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copy, "CHUNK_BYTES", 64)
    src, dst = torch.randint(-128, 128, (50, 48), dtype=torch.int8), torch.zeros(60, 48, dtype=torch.int8)
    ids = torch.randperm(50)[:40]
    targets = torch.randperm(60)[:40]
    block_copy._copy_staged([(src, dst)], ids, targets, 48)
    assert torch.equal(dst[targets], src[ids])


def test_widest_dtype_follows_alignment() -> None:
    rows = torch.zeros(4, 64, dtype=torch.int8)
    assert widest_dtype(rows) is torch.complex128
    assert widest_dtype(rows[:, 8:40]) is torch.int64
    assert widest_dtype(rows[:, 2:6]) is torch.int16
    assert widest_dtype(rows[:, 1:8]) is torch.int8


def test_merge_columns_only_merges_neighbours() -> None:
    rows = torch.zeros(4, 64, dtype=torch.int8)
    merged = merge_columns([rows[:, 0:16], rows[:, 16:40]])
    assert merged is not None and merged.data_ptr() == rows.data_ptr() and merged.shape == (4, 40)
    assert merge_columns([rows[:, 0:16], rows[:, 24:40]]) is None
    assert merge_columns([rows[:, 0:16], torch.zeros(4, 16, dtype=torch.int8)]) is None


@pytest.mark.parametrize("src_ids, dst_ids, words", [([0, 1], [2, 9], "target row ids span [2, 9]"),
                                                     ([-1, 1], [2, 3], "source row ids span [-1, 1]")])
def test_out_of_range_rows_are_refused_before_any_byte_moves(src_ids, dst_ids, words) -> None:
    src = torch.arange(8 * 16, dtype=torch.int8).reshape(8, 16)
    dst = torch.zeros((4, 16), dtype=torch.int8)
    with pytest.raises(IndexError, match=re.escape(words)):
        copy_rows([(src, dst)], torch.tensor(src_ids), torch.tensor(dst_ids))
    assert not dst.any()
