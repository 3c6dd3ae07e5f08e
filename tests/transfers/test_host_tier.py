"""The host tier sizes itself from bytes and refuses what memory cannot hold."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os

import pytest
import torch
from structlog.testing import capture_logs

from kvledger.transfers.copies import host_register
from kvledger.transfers.copies.host_tier import HostTier, HostTierError, available_memory_bytes


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


class FakeCudart:
    """The three runtime calls, failing from registration number `fail_at` on.
    Like the real runtime, a failed call leaves an error pending until
    `cudaGetLastError` reads it (the driver itself cannot run here)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.pending_error = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, size))
        if self.fail_at is not None and len(self.calls) > self.fail_at:
            self.pending_error = 2  # cudaErrorMemoryAllocation
            return 2
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, self.registered.pop(ptr)))
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802
        error, self.pending_error = self.pending_error, 0
        return error


def test_chunks_are_bounded_and_end_on_rows() -> None:
    assert host_register.chunk_ranges(10 * 96, 96, max_chunk_bytes=300) == [(0, 288), (288, 288), (576, 288),
                                                                              (864, 96)]
    assert host_register.chunk_ranges(200, 100, max_chunk_bytes=50) == [(0, 100), (100, 100)]  # a row at least
    assert host_register.chunk_ranges(3 << 30, 1 << 20) == [(0, 3 << 30)]  # 64 GiB by default


def test_the_tier_registers_in_chunks_and_unregisters_them_at_close(monkeypatch) -> None:
    monkeypatch.setattr(host_register, "MAX_CHUNK_BYTES", 4096)
    cudart = FakeCudart()
    tier = HostTier(capacity_bytes=16 * 1024, slot_bytes=1024, pin=True, cudart=cudart)
    base = tier.rows.data_ptr()
    assert tier.pinned
    assert cudart.calls == [("register", base + offset, 4096) for offset in range(0, 16384, 4096)]
    tier.close()
    assert not tier.pinned and cudart.registered == {}
    assert [c[1] for c in cudart.calls[4:]] == [base + offset for offset in (12288, 8192, 4096, 0)]
    tier.close()  # once only
    assert len(cudart.calls) == 8


def test_a_failed_chunk_rolls_back_and_clears_the_error(monkeypatch) -> None:
    monkeypatch.setattr(host_register, "MAX_CHUNK_BYTES", 4096)
    cudart = FakeCudart(fail_at=2)  # the third chunk fails
    with capture_logs() as logs:
        tier = HostTier(capacity_bytes=16 * 1024, slot_bytes=1024, pin=True, cudart=cudart)
    assert cudart.registered == {} and cudart.pending_error == 0
    assert [kind for kind, *_ in cudart.calls] == ["register"] * 3 + ["unregister"] * 2
    assert "host_register_failed" in [entry["event"] for entry in logs]
    # Then torch's pinned allocator; without CUDA it refuses, and the tier is plain memory.
    assert tier.pinned is torch.cuda.is_available()
    tier.rows[3] = 5
    assert int(tier.rows[3].sum()) == 5 * 1024


def test_the_pinned_fallback_is_not_taken_beyond_the_memory_checked() -> None:
    """torch's pinned allocator rounds 3 MiB up to 4 MiB; 3.5 MiB are available."""
    with capture_logs() as logs:
        tier = HostTier(capacity_bytes=3 << 20, slot_bytes=1 << 20, pin=True, cudart=FakeCudart(fail_at=0),
                        available_bytes=(7 << 20) // 2)
    assert not tier.pinned
    skipped = [entry for entry in logs if entry["event"] == "host_tier_not_pinned"]
    assert skipped and skipped[0]["needed_bytes"] == 4 << 20
    assert "host_tier_pin_failed" not in [entry["event"] for entry in logs]  # never tried


def test_a_tier_never_closed_is_unregistered_when_collected() -> None:
    cudart = FakeCudart()
    tier = HostTier(capacity_bytes=8 * 1024, slot_bytes=1024, pin=True, cudart=cudart)
    assert cudart.registered
    del tier
    gc.collect()
    assert cudart.registered == {}


def test_the_runtime_is_found_among_loaded_libraries_only(tmp_path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert host_register.loaded_cudart(str(maps), sonames=("libcudart-not-here.so",)) is None
    assert host_register.loaded_cudart(str(tmp_path / "missing"), sonames=()) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_tier_is_registered_with_the_real_runtime() -> None:
    torch.cuda.init()
    assert host_register.loaded_cudart() is not None
    tier = HostTier(capacity_bytes=8 << 20, slot_bytes=1 << 20, pin=True)
    assert tier.pinned and tier.rows.is_pinned()
    tier.close()
    assert not tier.rows.is_pinned()
