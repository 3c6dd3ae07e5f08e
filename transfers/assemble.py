"""Builds the whole transfer side from what vLLM registers: one call for the adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from kvledger.transfers.copies.backend import CopyBackend, Direction
from kvledger.transfers.copies.copy_descriptors import BatchCopy
from kvledger.transfers.copies.cpu_backend import CpuBackend
from kvledger.transfers.copies.faults import DelayingBackend, FaultInjectingBackend, FaultPlan
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.kv_spec import KVCacheConfig
from kvledger.transfers.copies.layout import CanonicalKVCaches, LayerCaches, canonicalize
from kvledger.transfers.lower_tiers.tier_jobs import TierIO
from kvledger.transfers.runner import TransferRunner

LowerTierFactory = Callable[[HostTier, CanonicalKVCaches], Mapping[int, TierIO]]


@attrs.frozen(kw_only=True, eq=False)
class Transfers:
    layout: CanonicalKVCaches
    tier: HostTier
    runner: TransferRunner


def open_transfers(
    kv_caches: Mapping[str, LayerCaches],
    config: KVCacheConfig,
    *,
    capacity_bytes: int,
    worker_index: int = 0,
    faults: FaultPlan | Sequence[FaultPlan] | None = None,
    store_hold_polls: int = 0,
    inline_cpu_copies: bool = False,
    timeout_s: float = 60.0,
    load_timeout_s: float = 30.0,
    lower_tiers: LowerTierFactory | None = None,
    batch_copy: BatchCopy | None = None,
) -> Transfers:
    """Canonical layout, host tier and runner, with the backend the device calls for;
    `lower_tiers` opens the tiers below host memory once the host tier exists;
    `batch_copy` (vLLM's `swap_blocks_batch`, on CUDA) replaces kvledger's own copy paths."""
    layout = canonicalize(kv_caches, config)
    tier = HostTier(capacity_bytes=capacity_bytes, slot_bytes=layout.slot_bytes)
    backend: CopyBackend
    if layout.device.type == "cuda":
        # On a GPU only: the CUDA backend and its batch copies load Triton or the driver's API.
        from kvledger.transfers.copies.batch_copies import own_batch_copy
        from kvledger.transfers.copies.cuda_backend import CudaBackend

        backend = CudaBackend(layout, tier, batch_copy=batch_copy or own_batch_copy(layout, tier))
    else:
        backend = CpuBackend(layout, tier, inline=inline_cpu_copies)
    if store_hold_polls:
        backend = DelayingBackend(backend, Direction.STORE, store_hold_polls)
    runner = make_runner(layout, tier, backend, faults=faults, worker_index=worker_index, timeout_s=timeout_s,
                         load_timeout_s=load_timeout_s, lower_tiers=lower_tiers(tier, layout) if lower_tiers is not None else None)
    return Transfers(layout=layout, tier=tier, runner=runner)


def make_runner(
    layout: CanonicalKVCaches, tier: HostTier, backend: CopyBackend, *,
    faults: FaultPlan | Sequence[FaultPlan] | None = None, worker_index: int = 0, timeout_s: float = 60.0,
    load_timeout_s: float = 30.0, lower_tiers: Mapping[int, TierIO] | None = None,
) -> TransferRunner:
    """Wraps `backend` in fault injection when asked (one layer per plan), then in the runner."""
    plans = (faults,) if isinstance(faults, FaultPlan) else tuple(faults or ())
    for plan in plans:
        backend = FaultInjectingBackend(backend, plan, layout)
    return TransferRunner(
        backend,
        num_groups=layout.num_groups,
        num_device_blocks=layout.num_blocks,
        num_slots=tier.num_slots,
        worker_index=worker_index,
        timeout_s=timeout_s,
        load_timeout_s=load_timeout_s,
        lower_tiers=lower_tiers,
    )
