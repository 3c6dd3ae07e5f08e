"""vLLM's batch copy, looked up here because only the adapter imports vLLM.

`vllm._custom_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes,
is_src_access_order_any=False)` (vLLM 0.32 and 0.33) submits every pointer
pair in one driver call on the current stream. The transfers layer takes it
as a plain function; without it (no such op in the installed build, or not
on CUDA), kvledger's own copy paths run, and the backend logs which one does.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog
import torch

from kvledger.transfers.copies.copy_descriptors import BatchCopy
from kvledger.transfers.copies.layout import LayerCaches

_log = structlog.get_logger("kvledger.adapters.vllm.batch_copy")
_FALLBACK = "kvledger's own batch copy (transfers/copies/batch_copies.py)"


def _device_type(kv_caches: Mapping[str, LayerCaches]) -> str:
    first = next(iter(kv_caches.values()))
    return (first if isinstance(first, torch.Tensor) else first[0]).device.type


def vllm_batch_copy(kv_caches: Mapping[str, LayerCaches]) -> BatchCopy | None:
    """`swap_blocks_batch` where the caches are on CUDA and the built op exists; else None."""
    if not kv_caches or _device_type(kv_caches) != "cuda":
        return None
    try:
        from vllm import _custom_ops as ops  # a CUDA build's kernels: vLLM-CPU has none to import
    except ImportError as exc:
        _log.warning("swap_blocks_batch_unavailable", reason=repr(exc), effect=_FALLBACK)
        return None
    function = getattr(ops, "swap_blocks_batch", None)
    built = hasattr(getattr(torch.ops, "_C_cache_ops", None), "swap_blocks_batch")
    if function is None or not built:
        _log.warning("swap_blocks_batch_unavailable", python_wrapper=function is not None, built_op=built,
                     effect=_FALLBACK)
        return None
    _log.info("swap_blocks_batch_used")
    return function
