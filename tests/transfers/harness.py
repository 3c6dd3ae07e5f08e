"""A runner over a small layout, plus helpers to read and scramble its device bytes."""

from __future__ import annotations

import threading

import attrs
import torch

from kvledger.engine.effects import StartLoad, StartStore
from kvledger.transfers.assemble import make_runner
from kvledger.transfers.copies.backend import CopyJob
from kvledger.transfers.copies.cpu_backend import CpuBackend
from kvledger.transfers.copies.faults import FaultPlan
from kvledger.transfers.copies.host_tier import HostTier
from kvledger.transfers.copies.layout import CanonicalKVCaches, canonicalize
from kvledger.transfers.runner import TransferRunner
from tests.transfers.layouts import Case, layer_block_addresses


class _OneByOne(CpuBackend):
    """Jobs queued together still run one at a time, so a test can hold or fail one."""

    def _run_batch(self, direction, batch: list[CopyJob]) -> None:
        self._run_each(direction, batch)


class GatedBackend(_OneByOne):
    """Copies of a gated job wait until its gate opens; others run at once."""

    def __init__(self, *args, gates: dict[int, threading.Event], **kwargs) -> None:
        self.gates = gates
        super().__init__(*args, **kwargs)

    def _execute(self, job: CopyJob) -> None:
        gate = self.gates.get(job.job_id)
        if gate is not None and not gate.wait(30):
            raise RuntimeError("gate never opened")
        super()._execute(job)


class RaisingBackend(_OneByOne):
    """A copy of a job in `failing` raises inside the worker thread."""

    def __init__(self, *args, failing: set[int], **kwargs) -> None:
        self.failing = failing
        super().__init__(*args, **kwargs)

    def _execute(self, job: CopyJob) -> None:
        if job.job_id in self.failing:
            raise RuntimeError(f"disk on fire in job {job.job_id}")
        super()._execute(job)


@attrs.define
class Rig:
    case: Case
    layout: CanonicalKVCaches
    tier: HostTier
    backend: object
    runner: TransferRunner

    def snapshot(self) -> list[torch.Tensor]:
        return [raw.clone() for raw in self.case.raws]

    def scramble(self, seed: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        for raw in self.case.raws:
            raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=generator))
        return self.snapshot()

    def block_mask(self, blocks_by_group: dict[int, list[int]]) -> list[torch.Tensor]:
        """Per raw allocation, True where a byte belongs to one of these (group, block)s."""
        addresses = [
            layer_block_addresses(self.case, g, b) for g, blocks in blocks_by_group.items() for b in blocks
        ]
        wanted = torch.cat(addresses) if addresses else torch.empty(0, dtype=torch.long)
        masks = []
        for raw in self.case.raws:
            mask = torch.zeros(raw.numel(), dtype=torch.bool)
            inside = wanted[(wanted >= raw.data_ptr()) & (wanted < raw.data_ptr() + raw.numel())]
            mask[inside - raw.data_ptr()] = True
            masks.append(mask)
        return masks


def make_rig(
    case: Case,
    *,
    num_slots: int = 16,
    worker_index: int = 3,
    backend_cls=CpuBackend,
    faults: FaultPlan | None = None,
    timeout_s: float = 10.0,
    **backend_kwargs,
) -> Rig:
    layout = canonicalize(case.kv_caches, case.config)
    tier = HostTier(capacity_bytes=num_slots * -(-layout.slot_bytes // 64) * 64, slot_bytes=layout.slot_bytes, pin=False)
    runner = make_runner(layout, tier, backend_cls(layout, tier, **backend_kwargs), faults=faults,
                         worker_index=worker_index, timeout_s=timeout_s)
    return Rig(case=case, layout=layout, tier=tier, backend=runner.backend, runner=runner)


def keys_for(job_id: int, ids_by_group) -> tuple[tuple[bytes, ...], ...]:
    return tuple(tuple(f"k{job_id}-{g}-{i}".encode() for i in range(len(ids))) for g, ids in enumerate(ids_by_group))


def store(job_id: int, blocks, slots, request_id: str = "r") -> StartStore:
    blocks = tuple(tuple(b) for b in blocks)
    return StartStore(
        job_id=job_id,
        request_id=request_id,
        keys=keys_for(job_id, blocks),
        source_block_ids=blocks,
        target_slot_ids=tuple(tuple(s) for s in slots),
    )


def load(job_id: int, slots, blocks, request_id: str = "r") -> StartLoad:
    blocks = tuple(tuple(b) for b in blocks)
    return StartLoad(
        job_id=job_id,
        request_id=request_id,
        keys=keys_for(job_id, blocks),
        source_slot_ids=tuple(tuple(s) for s in slots),
        target_block_ids=blocks,
    )
