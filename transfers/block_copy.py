"""Batched row copies between canonical views, with torch ops only.

`copy_rows` moves `dst[d[i]] = src[s[i]]` for every piece (a pair of 2-D
int8 views with equal widths) of one group. Two ways, chosen per call:

- direct: when target ids form long consecutive runs, one `index_select`
  per run writes straight into the target rows (one pass over the bytes);
- staged: otherwise gather into a bounded scratch with `index_select`
  (memcpy per row) and scatter with `index_copy_` on the widest dtype the
  alignment allows (torch's scatter loops per element, so 16-byte elements
  make it about 10x faster than int8).

The Python loop runs over runs or scratch chunks, never over single blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DIRECT_MIN_BYTES_PER_CALL = 96 << 10
"""Below this many bytes per `index_select` call, call overhead costs more than
the second pass of the staged path (measured on a 2-core Xeon: direct wins
from 128 KiB pages with no two slots adjacent)."""

CHUNK_BYTES = 8 << 20
"""Scratch bytes per staged chunk: bounds the scratch memory; larger chunks
measured faster than cache-sized ones because each costs a few torch calls."""

_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8)

Piece = tuple[torch.Tensor, torch.Tensor]


def widest_dtype(*views: torch.Tensor) -> torch.dtype:
    """The widest dtype every 2-D int8 view can be reinterpreted as."""
    for dtype in _WIDE:
        size = torch.empty((), dtype=dtype).element_size()
        if all(
            v.shape[-1] % size == 0
            and v.stride(0) % size == 0
            and v.storage_offset() % size == 0
            and v.data_ptr() % size == 0
            for v in views
        ):
            return dtype
    return torch.int8


def as_wide(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return view if dtype is torch.int8 else view.view(dtype)


def merge_columns(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view for column slices that sit side by side in the same rows."""
    first = views[0]
    width = first.shape[1]
    for prev, view in zip(views, views[1:]):
        if (
            view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or view.stride() != first.stride()
            or view.shape[0] != first.shape[0]
            or view.data_ptr() != prev.data_ptr() + prev.shape[1]
        ):
            return None
        width += view.shape[1]
    if width > first.stride(0) and first.shape[0] > 1:
        return None
    return first.as_strided((first.shape[0], width), first.stride())


def copy_rows(pieces: Sequence[Piece], src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """For every piece `(src, dst)`: `dst[dst_ids[i]] = src[src_ids[i]]`."""
    n = int(dst_ids.numel())
    if n == 0 or not pieces:
        return
    _check_ids(src_ids, pieces[0][0].shape[0], "source")
    _check_ids(dst_ids, pieces[0][1].shape[0], "target")
    dst_sorted, order = torch.sort(dst_ids)
    src_sorted = src_ids.index_select(0, order)
    breaks = torch.nonzero(dst_sorted[1:] - dst_sorted[:-1] != 1).flatten() + 1
    num_runs = int(breaks.numel()) + 1
    row_bytes = sum(src.shape[1] for src, _ in pieces)
    calls = num_runs * len(pieces)
    if calls <= 2 * len(pieces) or n * row_bytes >= calls * DIRECT_MIN_BYTES_PER_CALL:
        _copy_direct(pieces, src_sorted, dst_sorted, breaks)
    else:
        _copy_staged(pieces, src_sorted, dst_sorted, row_bytes)


def _check_ids(ids: torch.Tensor, rows: int, what: str) -> None:
    """An out-of-range target would slice to an empty `out=` view and write
    nothing, silently; refuse it (and sources too) before any byte moves."""
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        raise IndexError(f"{what} row ids span [{low}, {high}], outside [0, {rows})")


def _copy_direct(pieces: Sequence[Piece], src: torch.Tensor, dst: torch.Tensor, breaks: torch.Tensor) -> None:
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], int(dst.numel())]
    firsts = dst.index_select(0, torch.tensor(starts, dtype=torch.long)).tolist()
    for start, end, first in zip(starts, ends, firsts):
        ids = src[start:end]
        for src_view, dst_view in pieces:
            torch.index_select(src_view, 0, ids, out=dst_view[first : first + end - start])


def _copy_staged(pieces: Sequence[Piece], src: torch.Tensor, dst: torch.Tensor, row_bytes: int) -> None:
    rows = max(1, CHUNK_BYTES // row_bytes)
    rows = min(rows, int(dst.numel()))
    scratch = torch.empty((rows, row_bytes), dtype=torch.int8, device=src.device if src.is_cuda else "cpu")
    columns, start = [], 0
    for src_view, _ in pieces:
        columns.append(slice(start, start + src_view.shape[1]))
        start += src_view.shape[1]
    gathers = _phase([p[0] for p in pieces], columns, row_bytes)
    scatters = _phase([p[1] for p in pieces], columns, row_bytes)
    for begin in range(0, int(dst.numel()), rows):
        s = src[begin : begin + rows]
        d = dst[begin : begin + rows]
        block = scratch[: s.numel()]
        for view, cols in gathers:
            torch.index_select(view, 0, s, out=block[:, cols])
        for view, cols in scatters:
            part = block[:, cols]
            dtype = widest_dtype(view, part)
            as_wide(view, dtype).index_copy_(0, d, as_wide(part, dtype))


def _phase(views: list[torch.Tensor], columns: list[slice], row_bytes: int) -> list[tuple[torch.Tensor, slice]]:
    """Merge one side's views into a single op when they tile whole scratch rows."""
    if len(views) > 1:
        merged = merge_columns(views)
        if merged is not None and merged.shape[1] == row_bytes:
            return [(merged, slice(0, row_bytes))]
    return list(zip(views, columns))
