"""The CUDA driver's own batch copy, for when vLLM's `swap_blocks_batch` is missing.

`cuMemcpyBatchAsync` (driver API, CUDA 12.8+) takes one (source, target,
bytes) triple per block and span and runs them all on the copy engines from
one call, with no device staging and no compute units used. The torch path
needs a kernel launch per span and a DMA per run of slots, and on a model of
64 spans per block its launches, not the bus, set the pace (bench/history/2026-11-26.md).

It is looked up in the driver library (`libcuda.so.1`) through
`cuGetProcAddress`, asking for the CUDA 12.8 signature (the one with
`failIdx`), so neither the CUDA toolkit nor cuda-python is needed.
"""

from __future__ import annotations

import ctypes

import structlog
import torch

from kvledger.transfers.copies.copy_descriptors import BatchCopy

_log = structlog.get_logger("kvledger.transfers.driver_copy")

_SIGNATURE_VERSION = 12080
"""cuGetProcAddress returns the entry point with this CUDA version's signature."""
_SRC_ACCESS_ORDER_STREAM = 1
"""Sources are read in stream order: a store reads what the forward before it wrote."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_BatchAsync = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # dsts, srcs, sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,  # attrs, attrsIdxs, numAttrs
    ctypes.c_void_p,  # failIdx
    ctypes.c_void_p,  # stream
)


def _entry_point(library: str) -> _BatchAsync | None:
    try:
        driver = ctypes.CDLL(library)
        lookup = driver.cuGetProcAddress_v2
    except (OSError, AttributeError) as exc:
        _log.info("driver_batch_copy_unavailable", reason=repr(exc))
        return None
    lookup.restype = ctypes.c_int
    lookup.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                       ctypes.POINTER(ctypes.c_int)]
    address, found = ctypes.c_void_p(), ctypes.c_int()
    result = lookup(b"cuMemcpyBatchAsync", ctypes.byref(address), _SIGNATURE_VERSION, 0, ctypes.byref(found))
    if result != 0 or not address.value:
        _log.info("driver_batch_copy_unavailable", reason=f"cuGetProcAddress returned {result}, found {found.value}",
                  needs="a CUDA 12.8 driver or newer")
        return None
    return _BatchAsync(address.value)


def driver_batch_copy(library: str = "libcuda.so.1") -> BatchCopy | None:
    """A `BatchCopy` on the current CUDA stream, or None where the driver has no batch copy."""
    function = _entry_point(library)
    if function is None:
        return None
    attributes = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
    first = ctypes.c_size_t(0)  # the one attributes entry applies from copy 0 on

    def cu_memcpy_batch_async(sources: torch.Tensor, targets: torch.Tensor, sizes: torch.Tensor) -> None:
        failed_at = ctypes.c_size_t(0)
        result = function(targets.data_ptr(), sources.data_ptr(), sizes.data_ptr(), sizes.numel(),
                          ctypes.addressof(attributes), ctypes.byref(first), 1, ctypes.byref(failed_at),
                          torch.cuda.current_stream().cuda_stream)
        if result != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync returned CUresult {result} at copy {failed_at.value} "
                               f"of {sizes.numel()}")

    return cu_memcpy_batch_async
