"""When the worker submits a step's stores, and what orders them before the
next writes to their source blocks.

vLLM's two GPU model runners call the connector in different orders
relative to the writes they queue on the compute stream for the blocks a
step hands out (zeroing of new blocks when `needs_kv_cache_zeroing`:
mamba layers or mixed-precision KV; copy-on-write copies for partial
prefix hits):

- the V1 runner (`gpu_model_runner.py`) calls `handle_preemptions` before
  `_update_states` queues them, so a flush there waits in time;
- the V2 runner (`gpu/model_runner.py`, 0.33's default) queues them in
  `update_requests`, before `pre_forward` calls `handle_preemptions`: a flush
  waiting there on the host is too late, the zeroing is already on the
  stream, and a store still reading a reused block would copy zeros.

Hence three timings:

- NOW (host memory): the copy ends inside submit, nothing to order;
- DEFERRED (V1 runner on CUDA): the stores a step starts in `wait_for_save`
  are submitted at the next step's first hook, `handle_preemptions`, before
  its flush and before any zeroing, so their copies queue behind the
  sampler's and not ahead of it (as vLLM's own offloading worker does);
- ORDERED (V2 runner on CUDA with flush protection): the stores are
  submitted in `wait_for_save` (V2 has already queued the sampler's copy
  then) and the compute stream is made to wait for them on the device, so
  anything the next step queues there, zeroing and copy-on-write included,
  runs after they read their blocks. Correct whatever the next step hands
  out, at the cost of the next step's GPU work waiting for the store copies.
  With pin protection no reused block can be one a store reads, so V2 with
  pin needs no ordering.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import structlog

from kvledger.engine.effects import Effect, StartStore
from kvledger.events.config import Protection
from kvledger.transfers.runner import TransferRunner

_log = structlog.get_logger("kvledger.adapters.vllm.store_timing")


class StoreTiming(enum.Enum):
    NOW = "now"
    DEFERRED = "deferred"
    ORDERED = "ordered"


def uses_v2_model_runner(vllm_config: Any) -> bool:
    """vLLM's own decision (`VllmConfig.use_v2_model_runner`); without it, V1."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False)) if vllm_config is not None else False


def store_timing(device_type: str, *, v2_runner: bool, protection: Protection) -> StoreTiming:
    if device_type != "cuda":
        return StoreTiming.NOW
    if not v2_runner:
        return StoreTiming.DEFERRED
    return StoreTiming.ORDERED if protection is Protection.FLUSH else StoreTiming.NOW


class StoreQueue:
    """The worker's stores, submitted at the time `timing` says."""

    def __init__(self, timing: StoreTiming) -> None:
        self.timing = timing
        self._deferred: list[Effect] = []

    def after_forward(self, runner: TransferRunner, effects: Sequence[Effect]) -> None:
        """`wait_for_save`: the step's stores, whose blocks the forward wrote."""
        if not effects:  # most steps fill no block
            return
        if self.timing is StoreTiming.DEFERRED:
            self._deferred.extend(effects)
            return
        runner.submit(effects)
        if self.timing is StoreTiming.ORDERED:
            stores = [e.job_id for e in effects if isinstance(e, StartStore)]
            if stores:
                runner.order_after(stores)

    def before_step(self, runner: TransferRunner) -> None:
        """The next step's first hook: submit what was deferred, before any
        flush of this step waits for it and before this step writes a block."""
        if self._deferred:
            effects, self._deferred = self._deferred, []
            runner.submit(effects)

    @property
    def deferred(self) -> int:
        return len(self._deferred)
