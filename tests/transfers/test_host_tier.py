"""The host tier sizes itself from bytes and refuses what memory cannot hold."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

from kvledger.transfers.host_tier import HostTier, HostTierError, available_memory_bytes


def test_slots_are_capacity_over_aligned_slot_bytes() -> None:
    tier = HostTier(capacity_bytes=10_000, slot_bytes=1000, pin=False)
    assert (tier.slot_bytes, tier.num_slots) == (1024, 9)
    assert tier.rows.shape == (9, 1024) and tier.rows.dtype == torch.int8
    assert tier.rows.data_ptr() % 64 == 0 or tier.rows.stride(0) % 64 == 0


def test_a_tier_larger_than_available_memory_fails_at_start() -> None:
    with pytest.raises(HostTierError, match=r"needs 4096 bytes .* only 4000 bytes of memory are available"):
        HostTier(capacity_bytes=4096, slot_bytes=1024, available_bytes=4000, pin=False)
    with pytest.raises(HostTierError, match="needs .* available"):
        HostTier(capacity_bytes=available_memory_bytes() * 2, slot_bytes=1 << 20, pin=False)


def test_a_capacity_below_one_slot_is_refused() -> None:
    with pytest.raises(HostTierError, match="smaller than one slot"):
        HostTier(capacity_bytes=100, slot_bytes=1000, pin=False)


def _resident_pages(address: int, nbytes: int) -> int:
    """Pages of [address, address + nbytes) in memory now (the "present" bit of
    /proc/self/pagemap), whatever the rest of the process frees or takes meanwhile."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = address // page, (address + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    return sum(int.from_bytes(entries[i:i + 8], "little") >> 63 for i in range(0, len(entries), 8))


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="reads /proc/self/pagemap")
def test_the_tier_is_resident_from_the_start() -> None:
    """Every page touched at start: no first-touch fault in a store, and no
    memory the tier was promised can be taken by others later. (A VmRSS
    delta once measured this, and failed when other memory was freed meanwhile.)"""
    tier = HostTier(capacity_bytes=128 << 20, slot_bytes=1 << 20, pin=False)
    nbytes = tier.rows.numel()
    assert _resident_pages(tier.rows.data_ptr(), nbytes) * os.sysconf("SC_PAGE_SIZE") >= nbytes
    assert tier.num_slots == 128 and not tier.rows.any()
    fresh = mmap.mmap(-1, 32 << 20)  # the check can fail: a fresh mapping is not resident until touched
    start = ctypes.c_char.from_buffer(fresh)
    assert _resident_pages(ctypes.addressof(start), len(fresh)) == 0
    fresh[len(fresh) // 2] = 1
    assert _resident_pages(ctypes.addressof(start), len(fresh)) == 1
    del start


def test_available_memory_reads_meminfo(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:     512 kB\n")
    assert available_memory_bytes(str(meminfo)) == 512 * 1024
    assert available_memory_bytes(str(tmp_path / "missing")) > 0


def test_no_pinning_without_cuda() -> None:
    tier = HostTier(capacity_bytes=1 << 20, slot_bytes=4096)
    assert tier.pinned is torch.cuda.is_available()
    tier.close()
