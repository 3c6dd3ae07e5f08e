"""Pinning host memory in place: `cudaHostRegister` in bounded chunks.

As vLLM's offloading worker does (`kv_offload/cpu/host_register.py` and
`pin_mmap_region`): each call registers at most `MAX_CHUNK_BYTES` (drivers
refuse or stall on larger single registrations), chunks end on slot-row
boundaries so no block copy straddles two registrations, a failed chunk
rolls back the chunks already registered, and every failed call is
followed by `cudaGetLastError`, which clears the error the runtime keeps:
left pending, it is returned by the next unrelated CUDA call (the first
copy, or vLLM's own next call) as if that call had failed.

The runtime is reached through ctypes, in the copy of libcudart that torch
already loaded (torch's own `cudart()` binding has no `cudaGetLastError`).
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import structlog

_log = structlog.get_logger("kvledger.transfers.host_register")

MAX_CHUNK_BYTES = 64 << 30


class CudaRuntime(Protocol):
    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int: ...  # noqa: N802 (CUDA's names)
    def cudaHostUnregister(self, ptr: int) -> int: ...  # noqa: N802
    def cudaGetLastError(self) -> int: ...  # noqa: N802


class _LoadedCudart:
    """The three calls, on the libcudart mapped into this process."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.argtypes = []
        self._last_error.restype = ctypes.c_int

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        return int(self._register(ptr, size, flags))

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return int(self._unregister(ptr))

    def cudaGetLastError(self) -> int:  # noqa: N802
        return int(self._last_error())


SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
"""Tried when no libcudart is mapped yet: the dynamic loader returns the copy
already loaded under that name, if any."""


def loaded_cudart(maps_path: str = "/proc/self/maps", sonames: tuple[str, ...] = SONAMES) -> CudaRuntime | None:
    """The libcudart this process mapped (torch loads it with CUDA), else one by
    its usual names, or None."""
    try:
        with open(maps_path) as maps:
            paths = list(dict.fromkeys(line.split()[-1] for line in maps if "libcudart" in line and "/" in line))
    except OSError:
        paths = []
    for path in [*paths, *sonames]:
        try:
            return _LoadedCudart(path)
        except (OSError, AttributeError) as exc:
            _log.warning("cudart_unusable", path=path, error=repr(exc))
    return None


def chunk_ranges(total_bytes: int, row_bytes: int, max_chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """(offset, size) pieces of at most `max_chunk_bytes` (default `MAX_CHUNK_BYTES`; at least one
    row), ending on row boundaries."""
    max_chunk_bytes = MAX_CHUNK_BYTES if max_chunk_bytes is None else max_chunk_bytes
    rows_per_chunk = max(1, max_chunk_bytes // row_bytes)
    chunk = rows_per_chunk * row_bytes
    return [(offset, min(chunk, total_bytes - offset)) for offset in range(0, total_bytes, chunk)]


def register(cudart: CudaRuntime, base: int, total_bytes: int, row_bytes: int,
             max_chunk_bytes: int | None = None) -> list[int]:
    """Register `[base, base + total_bytes)`; the registered chunk addresses,
    or [] (with nothing left registered and no error pending) if any chunk failed."""
    addresses: list[int] = []
    for offset, size in chunk_ranges(total_bytes, row_bytes, max_chunk_bytes):
        status = cudart.cudaHostRegister(base + offset, size, 0)
        if status == 0:
            addresses.append(base + offset)
            continue
        cudart.cudaGetLastError()
        _log.warning("host_register_failed", code=status, offset=offset, size=size, total=total_bytes,
                     effect="rolled back; the tier is not pinned this way")
        unregister(cudart, addresses)
        return []
    return addresses


def unregister(cudart: CudaRuntime, addresses: list[int]) -> None:
    """Unregister in reverse order; a failure is logged and its error cleared."""
    for address in reversed(addresses):
        status = cudart.cudaHostUnregister(address)
        if status != 0:
            cudart.cudaGetLastError()
            _log.warning("host_unregister_failed", code=status, address=address)
