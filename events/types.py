"""The facts the engine learns: scheduler actions and transfer outcomes.

One event per vLLM callback per request, carrying tuples of block ids, never
one event per block. Fields are bools, ints, strs, bytes, enums and tuples of them,
so every event compares equal, hashes and serializes without help.

Block ids are vLLM's, shared by every group of one pool. `NULL_BLOCK_ID`
marks a table position with no block (a sliding-window position outside the
window, or a mamba position between boundaries); it is never allocated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Final, Union

import attrs

NULL_BLOCK_ID: Final = 0

BlockIdsByGroup = tuple[tuple[int, ...], ...]


def _block_table(value: Iterable[Iterable[int]]) -> BlockIdsByGroup:
    """A tuple of tuples passes through as it is: the planner builds them so,
    and a step builds dozens of these events (0.1 µs here against 0.3 µs)."""
    if type(value) is tuple:
        for ids in value:
            if type(ids) is not tuple:
                break
        else:
            return value
    return tuple(map(tuple, value))


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _strs(value: object) -> tuple[str, ...]:
    return tuple(value)  # type: ignore[arg-type]


def _bytes_tuple(value: object) -> tuple[bytes, ...]:
    return tuple(value)  # type: ignore[arg-type]


TUPLE_CONVERTERS: Final = frozenset({_block_table, _ints, _strs, _bytes_tuple})
"""The fields' converters, each of which hands back a tuple (of tuples) it is given unchanged:
a log's reader, which decodes to tuples, builds events past them (`log_binary._generated_reader`)."""


@attrs.frozen(kw_only=True)
class RequestAdded:
    """A request arrived. Its chain hashes are at `hash_block_size` granularity."""

    kind: ClassVar[str] = "request_added"
    version: ClassVar[int] = 1
    request_id: str
    num_prompt_tokens: int
    block_hashes: tuple[bytes, ...] = attrs.field(converter=_bytes_tuple)


@attrs.frozen(kw_only=True)
class BlockHashesAppended:
    """The request grew (decoded tokens); new hashes exist for its full blocks."""

    kind: ClassVar[str] = "block_hashes_appended"
    version: ClassVar[int] = 1
    request_id: str
    num_tokens: int
    block_hashes: tuple[bytes, ...] = attrs.field(converter=_bytes_tuple)


@attrs.frozen(kw_only=True)
class BlocksTouched:
    """Prefix-cache blocks already holding this request's tokens were reused."""

    kind: ClassVar[str] = "blocks_touched"
    version: ClassVar[int] = 1
    request_id: str
    block_ids: BlockIdsByGroup = attrs.field(converter=_block_table)


@attrs.frozen(kw_only=True)
class BlocksAllocated:
    """Fresh blocks were appended to the request's table, per group.

    `num_external_tokens > 0` only on the allocation that admits a tier hit;
    those tokens follow the touched prefix and are to be loaded.
    """

    kind: ClassVar[str] = "blocks_allocated"
    version: ClassVar[int] = 1
    request_id: str
    block_ids: BlockIdsByGroup = attrs.field(converter=_block_table)
    num_external_tokens: int = 0


@attrs.frozen(kw_only=True)
class BlocksFreed:
    """vLLM released these blocks of a live request (sliding-window blocks that
    left the window). Their table positions become null."""

    kind: ClassVar[str] = "blocks_freed"
    version: ClassVar[int] = 1
    request_id: str
    block_ids: BlockIdsByGroup = attrs.field(converter=_block_table)


@attrs.frozen(kw_only=True)
class BlocksNearEviction:
    """Free blocks at the eviction end of vLLM's free queue, in eviction order.

    In lazy store mode this is when the engine stores a block: only once it
    is about to be reused, so a workload that fits in the pool never copies.
    """

    kind: ClassVar[str] = "blocks_near_eviction"
    version: ClassVar[int] = 1
    block_ids: tuple[int, ...] = attrs.field(converter=_ints)


@attrs.frozen(kw_only=True)
class RequestPreempted:
    """vLLM preempted the request and freed every block it held."""

    kind: ClassVar[str] = "request_preempted"
    version: ClassVar[int] = 1
    request_id: str


@attrs.frozen(kw_only=True)
class RequestResumed:
    """A preempted request is being admitted again (its table starts empty)."""

    kind: ClassVar[str] = "request_resumed"
    version: ClassVar[int] = 1
    request_id: str


@attrs.frozen(kw_only=True)
class RequestFinished:
    """The request finished; `block_ids` is its final table, which vLLM frees."""

    kind: ClassVar[str] = "request_finished"
    version: ClassVar[int] = 1
    request_id: str
    block_ids: BlockIdsByGroup = attrs.field(converter=_block_table)


@attrs.frozen(kw_only=True)
class RequestAborted:
    """The request was cancelled. Blocks under an open load stay held until it ends."""

    kind: ClassVar[str] = "request_aborted"
    version: ClassVar[int] = 1
    request_id: str


@attrs.frozen(kw_only=True)
class StepScheduled:
    """A scheduler step was built. Columns are aligned per request.

    `num_computed_tokens` is the count before this step; the KV of
    `num_computed_tokens + num_scheduled_tokens` tokens exists after it.
    `wall_time_us` is when the scheduler built it, in microseconds since the
    Unix epoch (0: not recorded; logs before version 2). An input the engine
    never reads: it places the step in time for readers of the log, and lets
    the logs of several replicas be interleaved (`kvledger whatif`).
    """

    kind: ClassVar[str] = "step_scheduled"
    version: ClassVar[int] = 2
    step_index: int
    request_ids: tuple[str, ...] = attrs.field(converter=_strs)
    num_computed_tokens: tuple[int, ...] = attrs.field(converter=_ints)
    num_scheduled_tokens: tuple[int, ...] = attrs.field(converter=_ints)
    wall_time_us: int = 0

    def __attrs_post_init__(self) -> None:
        if not len(self.request_ids) == len(self.num_computed_tokens) == len(self.num_scheduled_tokens):
            raise ValueError("step_scheduled columns must have equal lengths")


@attrs.frozen(kw_only=True)
class StoreCompleted:
    kind: ClassVar[str] = "store_completed"
    version: ClassVar[int] = 1
    job_id: int
    worker_index: int = 0


@attrs.frozen(kw_only=True)
class StoreFailed:
    """A worker failed to store `keys` of the job; empty `keys` means all of them.
    `reason`: why, in the worker's words (`FAILURE_REASONS`; "" when it gave none)."""

    kind: ClassVar[str] = "store_failed"
    version: ClassVar[int] = 3
    job_id: int
    worker_index: int = 0
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_bytes_tuple)
    reason: str = ""


@attrs.frozen(kw_only=True)
class LoadCompleted:
    kind: ClassVar[str] = "load_completed"
    version: ClassVar[int] = 1
    job_id: int
    worker_index: int = 0


@attrs.frozen(kw_only=True)
class LoadFailed:
    """A worker could not load these target blocks; `keys` are their sources.
    `reason`: why, in the worker's words (`FAILURE_REASONS`; "" when it gave none)."""

    kind: ClassVar[str] = "load_failed"
    version: ClassVar[int] = 2
    job_id: int
    worker_index: int = 0
    block_ids: tuple[int, ...] = attrs.field(converter=_ints)
    keys: tuple[bytes, ...] = attrs.field(converter=_bytes_tuple)
    reason: str = ""


@attrs.frozen(kw_only=True)
class CacheReset:
    """The tier was reset; jobs started before it no longer change the tier.

    `forget_device`: what the device blocks hold is unknown from here on (vLLM
    resets before a sleep discards the KV cache and before new weights make it
    stale), so no block is stored or matched by what it held. `rekeyed`: block
    keys change from here on (a new key generation), so every live request's
    keys are forgotten, to be told again. `keep_lower`: the tiers below host
    memory keep what they hold (vLLM 0.33's secondary tiers across a reset), for
    a deployment whose weights do not change under a reset; never with `rekeyed`."""

    kind: ClassVar[str] = "cache_reset"
    version: ClassVar[int] = 3
    epoch: int
    forget_device: bool = True
    rekeyed: bool = False
    keep_lower: bool = False


@attrs.frozen(kw_only=True)
class TierKeysFound:
    """A lower tier (1 = the first below host memory) holds these keys: found
    at start, or by a lookup of keys another process wrote. Oldest first."""

    kind: ClassVar[str] = "tier_keys_found"
    version: ClassVar[int] = 1
    tier: int
    keys: tuple[bytes, ...] = attrs.field(converter=_bytes_tuple)


LOOKUP_FAILURES = ("down", "timed_out", "dropped")
"""Why a lower tier's lookup for a request went unanswered: the tier raised
(unreachable, refused, or marked down), the request stopped waiting for it,
or its queue was full (the oldest ask is answered "nothing" at once)."""


@attrs.frozen(kw_only=True)
class TierLookupFailed:
    """A shared lower tier was asked which of a request's keys it holds and did
    not answer (`reason`, one of `LOOKUP_FAILURES`): the request was admitted
    without what that tier may hold. A fact for `explain`; the engine keeps
    nothing of it."""

    kind: ClassVar[str] = "tier_lookup_failed"
    version: ClassVar[int] = 1
    tier: int
    request_id: str
    reason: str


@attrs.frozen(kw_only=True)
class BlockHashesRewound:
    """vLLM dropped the request's hashes from index `num_hashes` on: a streaming
    session's next input replaced its last sampled token, and the hashes of the
    blocks that token was in are computed again (they follow as appended)."""

    kind: ClassVar[str] = "block_hashes_rewound"
    version: ClassVar[int] = 1
    request_id: str
    num_hashes: int


@attrs.frozen(kw_only=True)
class RestoreCostsMeasured:
    """What a restore costs and what a recompute costs, as measured while serving
    (`restore_budget: "auto"`): the engine decides each hit by these numbers, so
    they enter as an event and a replay decides as the run did. Per tier (0: host
    memory, then each lower tier), a load of n blocks that reads from it takes
    `load_fixed_us[t] + n * load_ns_per_block[t] / 1000` microseconds; a token
    computed in a prefill takes `compute_ns_per_token` nanoseconds."""

    kind: ClassVar[str] = "restore_costs_measured"
    version: ClassVar[int] = 1
    compute_ns_per_token: int
    load_fixed_us: tuple[int, ...]
    load_ns_per_block: tuple[int, ...]


@attrs.frozen(kw_only=True)
class RestoreBudgeted:
    """A request's hit cut short because loading the rest was estimated slower than
    computing it (`restore_budget: "auto"`): of `offered_tokens` restorable beyond the
    local hit, `kept_tokens` are loaded; the rest would have taken `load_us` to load
    against `compute_us` to compute. A fact for `explain`; the engine keeps nothing of it."""

    kind: ClassVar[str] = "restore_budgeted"
    version: ClassVar[int] = 1
    request_id: str
    offered_tokens: int
    kept_tokens: int
    load_us: int
    compute_us: int


@attrs.frozen(kw_only=True)
class TierPressure:
    """A lower tier's writes measured slow (vLLM 0.33's `backpressure`): of the spills
    to tier `tier` from here on, this fraction (parts per million) is dropped, as the
    configured policy decides from the latency's moving average (`latency_ns_per_mib`,
    for the record); 0 when the tier recovered. The engine keeps the fraction and
    drops spills by it, so a replay drops the same ones."""

    kind: ClassVar[str] = "tier_pressure"
    version: ClassVar[int] = 1
    tier: int
    drop_ppm: int
    latency_ns_per_mib: int


@attrs.frozen(kw_only=True)
class FirstGenerationHashes:
    """After a cache reset that began a new key generation (`CacheReset.rekeyed`), the
    request's hashes as key generation 0 has them, for its blocks from position `first`
    on, told beside the hashes it just named (`RequestAdded`, `BlockHashesAppended`): the
    same tokens' hashes before any reset. A block stored under an earlier generation is
    never found under the new keys; with these, `explain` says that the reset lost it
    rather than that it was never seen. A fact for `explain`; the engine keeps nothing of it."""

    kind: ClassVar[str] = "first_generation_hashes"
    version: ClassVar[int] = 1
    request_id: str
    first: int
    block_hashes: tuple[bytes, ...] = attrs.field(converter=_bytes_tuple)


Event = Union[
    RequestAdded,
    BlockHashesAppended,
    BlocksTouched,
    BlocksAllocated,
    BlocksFreed,
    BlocksNearEviction,
    RequestPreempted,
    RequestResumed,
    RequestFinished,
    RequestAborted,
    StepScheduled,
    StoreCompleted,
    StoreFailed,
    LoadCompleted,
    LoadFailed,
    CacheReset,
    TierKeysFound,
    BlockHashesRewound,
    TierLookupFailed,
    RestoreCostsMeasured,
    RestoreBudgeted,
    TierPressure,
    FirstGenerationHashes,
]

TransferEvent = Union[StoreCompleted, StoreFailed, LoadCompleted, LoadFailed]
"""A transfer's outcome, as a worker reports it to the scheduler."""


FAILURE_REASONS = {
    "missing": "the block was not in the tier (removed, or evicted by another process)",
    "truncated": "the stored block was shorter than its header says",
    "foreign": "the stored block belongs to another key, layout or deployment",
    "corrupt": "the stored block's checksum did not match",
    "forged": "the stored block's seal did not verify under the deployment's secret",
    "unreadable": "the tier could not read it (an I/O error)",
    "unwritable": "the tier could not write it (an I/O error)",
    "disk_full": "the tier's file system had no room",
    "unreachable": "the tier's store was down or did not answer in time",
    "timed_out": "the transfer outlived its timeout (load_timeout_s, a tier's read timeout)",
    "rejected": "the worker refused the job (shut down, asleep, or a bad slot or tier)",
    "copy_failed": "the copy between host and device memory failed",
}
"""Why a transfer failed, as a worker's report says: `StoreFailed.reason` and
`LoadFailed.reason` hold one of these, or "" (a report that named none)."""


def transfer_report(job_id: int, worker_index: int, *, load: bool, failed: bool = False,
                    block_ids: Iterable[int] = (), keys: Iterable[bytes] = (), reason: str = "") -> TransferEvent:
    """What a worker says when its part of a job ends: the one model of that report, for the
    runner and for everything that stands in for vLLM's workers (the simulator, whatif's
    re-drive, the benchmarks). A store (or spill) fails whole (`failed`) or in `keys`; a load
    fails in `block_ids`, the targets it could not fill, whose sources are `keys`; a failure
    says why (`reason`, one of `FAILURE_REASONS`)."""
    keys = tuple(keys)
    if not load:
        if failed or keys:
            return StoreFailed(job_id=job_id, worker_index=worker_index, keys=keys, reason=reason)
        return StoreCompleted(job_id=job_id, worker_index=worker_index)
    block_ids = tuple(block_ids)
    if failed or block_ids:
        return LoadFailed(job_id=job_id, worker_index=worker_index, block_ids=block_ids, keys=keys, reason=reason)
    return LoadCompleted(job_id=job_id, worker_index=worker_index)

EVENT_TYPES: tuple[type, ...] = Event.__args__  # type: ignore[attr-defined]
KIND_TO_TYPE: dict[str, type] = {t.kind: t for t in EVENT_TYPES}  # type: ignore[attr-defined]
