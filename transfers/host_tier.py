"""The host-memory tier: a pool of equal slots, each one canonical block.

Sized in bytes by config. The size is checked against the memory the kernel
says is available before anything is allocated, so an impossible size fails
at start with a message instead of an OOM kill in the middle of serving.
Every page is touched at start (zeroed, or pinned): the memory is then
resident, so no store in the serving path pays the kernel's first-touch
page faults (on vLLM-CPU they took a third of a step's store time), and
memory taken by others later cannot make the tier fail half-way. Zeroing
runs on torch's intra-op threads, a few GB/s per core. With CUDA present
the tier is pinned (registered in place, which avoids the caching host
allocator's rounding to powers of two) so copies to and from the GPU run as
DMA.
"""

from __future__ import annotations

import os

import structlog
import torch

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
    ) -> None:
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
        self._registered = False
        self.pinned = False
        if pin if pin is not None else torch.cuda.is_available():
            self._pin()
        if not self.pinned:
            self.rows.zero_()
        _log.info("host_tier_allocated", num_slots=num_slots, slot_bytes=row_bytes, pinned=self.pinned)

    def _pin(self) -> None:
        try:
            cudart = torch.cuda.cudart()
            status = cudart.cudaHostRegister(self.rows.data_ptr(), self.rows.numel(), 0)
            self._registered = int(status) == 0
        except Exception as exc:  # no CUDA runtime, or registration refused
            _log.warning("host_tier_register_failed", error=repr(exc))
        if not self._registered:
            try:
                self.rows = torch.empty(self.rows.shape, dtype=torch.int8, pin_memory=True)
            except Exception as exc:
                _log.warning("host_tier_pin_failed", error=repr(exc))
                return
        self.pinned = True

    def close(self) -> None:
        """Unregister pinned memory; the rows stay usable as plain memory."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.rows.data_ptr())
            self._registered = False
            self.pinned = False
