"""Copies between a CUDA device and the pinned host tier.

One stream per direction, each made to wait for the compute stream at
submit: a store then reads KV the step's forward already wrote, and a load
writes its blocks after any zeroing vLLM queued for them. Two ways to move
the bytes, chosen once at start and logged:

- batch: one descriptor per block and span (`copy_descriptors`), one call
  per job, no device memory used. vLLM's `_custom_ops.swap_blocks_batch`
  where the installed vLLM ships it (the adapter hands it in), else
  kvledger's own (`batch_copies`): a Triton kernel on a pinned tier, or the
  driver's `cuMemcpyBatchAsync`;
- torch: per group, a job gathers its blocks' spans into a device staging
  buffer laid out as slots (one `index_select` per span, written in place),
  then moves whole slot rows over DMA, one `cudaMemcpyAsync` per run of
  consecutive slots (loads run the same steps backwards). The staging is
  one buffer per direction of at most `STAGING_BYTES`, allocated at start:
  vLLM sized its KV cache to fill the memory it budgets, so a buffer taken
  mid-serving could make the forward run out of memory; taken at start, a
  shortfall stops vLLM with a message instead.

Completion is an event per job, polled with `query()`, which never blocks;
`wait` polls with a deadline and also orders the caller's stream after the
job, so a forward that follows reads loaded bytes; `order_after` orders the
caller's stream after jobs without blocking the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import attrs
import structlog
import torch

from kvledger.transfers.copies.backend import BackendClosed, CopyJob, Direction, JobOutcome, TransferTimeout
from kvledger.transfers.copies.block_copy import as_wide, widest_dtype
from kvledger.transfers.copies.copy_descriptors import (
    BatchCopy,
    build_descriptors,
    descriptor_tensors,
    span_addresses,
)
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import CanonicalKVCaches, CopySpan

_log = structlog.get_logger("kvledger.transfers.cuda")

STAGING_BYTES = 32 << 20
"""Device staging per direction (torch path only); larger jobs reuse it chunk
by chunk, in stream order. Allocated once, at start."""

class DeviceMemoryError(RuntimeError):
    """The copy path's device memory cannot be had at start."""


@attrs.frozen(eq=False)
class _Launched:
    job: CopyJob
    started: torch.cuda.Event
    done: torch.cuda.Event
    keepalive: tuple[torch.Tensor, ...]  # index and descriptor tensors the stream still reads
    error: str


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, first slot) for each run of consecutive ids in a sorted list."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i, slots[start]))
            start = i
    return runs


class CudaBackend:
    def __init__(self, layout: CanonicalKVCaches, tier: HostTier, *, batch_copy: BatchCopy | None = None,
                 staging_bytes: int | None = None) -> None:
        self._check_device(layout)
        if tier.slot_bytes < layout.slot_bytes:
            raise ValueError(f"tier slots of {tier.slot_bytes} bytes cannot hold {layout.slot_bytes}-byte blocks")
        if not tier.pinned:
            _log.warning("host_tier_not_pinned", effect="copies run synchronously")
        self._device = layout.device
        self._tier = tier
        self._spans: list[list[tuple[CopySpan, torch.Tensor]]] = [
            [(span, layout.span_view(span)) for span in layout.group_spans[g]] for g in range(layout.num_groups)
        ]
        self._batch_copy = batch_copy
        self._addresses = span_addresses(layout, tier) if batch_copy is not None else []
        self._staging: dict[Direction, torch.Tensor] = {}
        if batch_copy is None:
            self._staging = self._allocate_staging(STAGING_BYTES if staging_bytes is None else staging_bytes)
        staged = sum(t.numel() for t in self._staging.values())
        _log.info("cuda_copy_path", path=self.copy_path, device_staging_bytes=staged)
        with torch.cuda.device(self._device):
            self._streams = {d: torch.cuda.Stream(device=self._device) for d in Direction}
        self._launched: dict[int, _Launched] = {}
        self._closed = False

    @property
    def copy_path(self) -> str:
        """The batch copy's function name (`swap_blocks_batch`, `triton_copy`, ...), or torch."""
        return "torch" if self._batch_copy is None else getattr(self._batch_copy, "__name__", "batch copy")

    def _allocate_staging(self, staging_bytes: int) -> dict[Direction, torch.Tensor]:
        """One buffer per direction (the two streams run at once), whole slot rows."""
        rows = max(1, staging_bytes // self._tier.slot_bytes)
        nbytes = rows * self._tier.slot_bytes
        try:
            return {d: torch.empty((rows, self._tier.slot_bytes), dtype=torch.int8, device=self._device)
                    for d in Direction}
        except torch.cuda.OutOfMemoryError as exc:
            raise DeviceMemoryError(
                f"kvledger's copy staging needs 2 x {nbytes} bytes of device memory beyond vLLM's KV cache; "
                f"lower gpu_memory_utilization to leave them, or use a vLLM that ships "
                f"_custom_ops.swap_blocks_batch (no staging): {exc}") from exc

    @staticmethod
    def _check_device(layout: CanonicalKVCaches) -> None:
        if layout.device.type != "cuda":
            raise ValueError(f"CudaBackend needs KV caches on a CUDA device, got {layout.device}")

    def submit(self, job: CopyJob) -> None:
        if self._closed:
            raise BackendClosed("the CUDA copy backend was shut down")
        stream = self._streams[job.direction]
        keep: list[torch.Tensor] = []
        error = ""
        with torch.cuda.device(self._device):
            stream.wait_stream(torch.cuda.current_stream(self._device))
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            with torch.cuda.stream(stream):
                try:
                    if self._batch_copy is not None:
                        self._copy_batch(job, keep)
                    elif job.direction is Direction.STORE:
                        self._store(job, keep)
                    else:
                        self._load(job, keep)
                except Exception as exc:
                    error = repr(exc)
                    _log.error("copy_launch_failed", job_id=job.job_id, direction=job.direction.value, error=error)
                # The outcome waits for this event even after an error, so no
                # half-launched copy can still be writing once it is reported.
                done = torch.cuda.Event(enable_timing=True)
                try:
                    done.record(stream)
                except Exception:
                    # No event to wait for: wait for the stream itself, so the
                    # job the runner now rejects has nothing left to write.
                    self._drain_stream(stream, job)
                    raise
        self._launched[job.job_id] = _Launched(job, started, done, tuple(keep), error)

    @staticmethod
    def _drain_stream(stream, job: CopyJob) -> None:
        try:
            stream.synchronize()
        except Exception as exc:  # the context is broken: nothing it queued runs any more
            _log.error("copy_stream_sync_failed", job_id=job.job_id, error=repr(exc))

    def _copy_batch(self, job: CopyJob, keep: list[torch.Tensor]) -> None:
        src, dst, sizes = descriptor_tensors(*build_descriptors(self._addresses, job), pin=False)
        keep += [src, dst, sizes]
        if sizes.numel():
            assert self._batch_copy is not None
            self._batch_copy(src, dst, sizes)

    def _device_ids(self, ids: list[int], keep: list[torch.Tensor]) -> torch.Tensor:
        host = torch.tensor(ids, dtype=torch.long).pin_memory()
        device = host.to(self._device, non_blocking=True)
        keep += [host, device]
        return device

    def _chunks(self, job: CopyJob, keep: list[torch.Tensor]):
        """Per group, slot-sorted pieces that fit the direction's staging buffer.

        The buffer is reused chunk after chunk and job after job: the stream
        orders each chunk's writes to it after the previous chunk's reads.
        """
        staging = self._staging[job.direction]
        rows = staging.shape[0]
        for group in range(len(job.block_ids)):
            if not job.block_ids[group]:
                continue
            pairs = sorted(zip(job.slot_ids[group], job.block_ids[group]))
            for begin in range(0, len(pairs), rows):
                chunk = pairs[begin : begin + rows]
                slots = [s for s, _ in chunk]
                ids = self._device_ids([b for _, b in chunk], keep)
                yield group, slots, ids, staging[: len(chunk)]

    def _store(self, job: CopyJob, keep: list[torch.Tensor]) -> None:
        for group, slots, ids, staging in self._chunks(job, keep):
            for span, view in self._spans[group]:
                part = staging[:, span.slot_offset : span.slot_offset + span.nbytes]
                dtype = widest_dtype(view, part)
                torch.index_select(as_wide(view, dtype), 0, ids, out=as_wide(part, dtype))  # no temporary
            for start, end, first in slot_runs(slots):
                self._tier.rows[first : first + end - start].copy_(staging[start:end], non_blocking=True)

    def _load(self, job: CopyJob, keep: list[torch.Tensor]) -> None:
        for group, slots, ids, staging in self._chunks(job, keep):
            for start, end, first in slot_runs(slots):
                staging[start:end].copy_(self._tier.rows[first : first + end - start], non_blocking=True)
            for span, view in self._spans[group]:
                part = staging[:, span.slot_offset : span.slot_offset + span.nbytes]
                dtype = widest_dtype(view, part)
                as_wide(view, dtype).index_copy_(0, ids, as_wide(part, dtype))

    def poll(self) -> list[JobOutcome]:
        outcomes = []
        for job_id, launched in list(self._launched.items()):
            error = launched.error
            try:
                finished = launched.done.query()
            except Exception as exc:  # an asynchronous CUDA error surfaced here
                finished, error = True, error or repr(exc)
            if not finished:
                continue
            seconds = 0.0
            if not error:
                try:
                    seconds = launched.started.elapsed_time(launched.done) / 1e3
                except Exception as exc:  # the copy ended; only its timing is lost
                    _log.warning("copy_timing_failed", job_id=job_id, error=repr(exc))
            job = launched.job
            failed = job.positions() if error else ()
            outcomes.append(JobOutcome(job_id=job_id, direction=job.direction, failed=failed, error=error,
                                       seconds=seconds))
            del self._launched[job_id]
        return outcomes

    def wait(self, job_ids: Iterable[int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        current = torch.cuda.current_stream(self._device)
        for job_id in job_ids:
            launched = self._launched.get(job_id)
            if launched is None:
                continue
            pause = 1e-5
            while True:
                try:
                    if launched.done.query():
                        break
                except Exception:
                    break  # poll() reports it as the job's failure
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"copy job {job_id} did not finish within {timeout_s:.3g} s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
            current.wait_event(launched.done)

    def order_after(self, job_ids: Iterable[int], timeout_s: float) -> None:
        """The caller's stream waits for these jobs' events on the device; the host goes on."""
        current = torch.cuda.current_stream(self._device)
        for job_id in job_ids:
            launched = self._launched.get(job_id)
            if launched is not None:
                current.wait_event(launched.done)

    def shutdown(self, *, drain: bool, timeout_s: float) -> None:
        """Launched copies cannot be recalled, so both modes wait for them."""
        if self._closed:
            return
        self._closed = True
        self.wait(list(self._launched), timeout_s)
