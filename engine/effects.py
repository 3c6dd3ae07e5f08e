"""What the engine asks the outside world to do, and where each is done.

Effects only describe work; the effect runner (transfers/) and the adapter
perform it, and outcomes come back as events. They hold no callables, so they
compare equal and serialize. Commands are imperatives (`StartStore`);
notifications are past-tense facts (`KeysLoadable`, `KeysUnloadable`,
`KeysNotAdmitted`, `KeysBelowThreshold`, `SpillDropped`, `TransferFailed`, `JobEnded`, `RequestAdmitted`, `RequestRequeued`,
`ReportViolation`) for logs, KV events, metrics and the
lower tiers' lookups, and ask for no work: whoever keeps a view of what the
engine decided translates them, and never reads the state around a step.

`ROUTES` says where each kind is carried out; `route` splits a step's
effects by it. A kind missing from the table fails at import, so a new
effect cannot be silently dropped by one of its consumers.

Per-group fields are aligned: `keys[g][i]` moves between
`source_*[g][i]` and `target_*[g][i]`. A slot holds one block of one group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeVar, Union

import attrs

from .state import IdentityEnum

KeysByGroup = tuple[tuple[bytes, ...], ...]
IdsByGroup = tuple[tuple[int, ...], ...]


@attrs.frozen(kw_only=True)
class StartStore:
    """Copy device blocks into tier slots, after this step's forward wrote them."""

    job_id: int
    request_id: str
    keys: KeysByGroup
    source_block_ids: IdsByGroup
    target_slot_ids: IdsByGroup


@attrs.frozen(kw_only=True)
class StartLoad:
    """Copy tier slots into device blocks, before any forward reads them.

    `promote_tiers[g][i]`, when given, is the lower tier the key is first read
    from into its slot (0: the slot already holds it). A promoted key's slot is
    -1 when no host slot could be had: that block fails at once (recomputed).
    """

    job_id: int
    request_id: str
    keys: KeysByGroup
    source_slot_ids: IdsByGroup
    target_block_ids: IdsByGroup
    promote_tiers: IdsByGroup = ()


@attrs.frozen(kw_only=True)
class StartSpill:
    """Write these host slots to a lower tier (write-through: the host keeps them)."""

    job_id: int
    tier: int
    keys: KeysByGroup
    source_slot_ids: IdsByGroup


class Reason(IdentityEnum):
    """Why keys left a tier (`KeysUnloadable`, `DropTierKeys`): metrics count each apart."""

    EVICTED = "evicted"  # to make room for other keys
    FAILED = "failed"  # a transfer of theirs failed
    RESET = "reset"  # a cache reset dropped them (or, in a lower tier, the spill a reset made stale)


@attrs.frozen(kw_only=True)
class DropTierKeys:
    """Remove these keys from a lower tier, for `reason`."""

    tier: int
    keys: tuple[bytes, ...]
    reason: Reason


@attrs.frozen(kw_only=True)
class FlushStores:
    """Wait for these stores before this step's forward: their source blocks
    were just handed to someone else."""

    job_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class PinDeviceBlocks:
    """Take a block-pool reference so vLLM cannot reallocate these blocks."""

    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class UnpinDeviceBlocks:
    """Release references taken by `PinDeviceBlocks`, exactly once each."""

    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class KeysLoadable:
    """Notification: these keys became loadable in tier `tier` (0: host memory):
    a store or promotion ended there, a spill was written, a lookup or the
    start-up scan found them. Each was not loadable there before."""

    tier: int
    keys: tuple[bytes, ...]


@attrs.frozen(kw_only=True)
class KeysUnloadable:
    """Notification: these keys, loadable in tier `tier` until now, no longer
    are, for `reason`. With `KeysLoadable`, the exact history of what each
    tier can serve: folding the two gives `queries.is_loadable`/`tier_holds`."""

    tier: int
    keys: tuple[bytes, ...]
    reason: Reason


@attrs.frozen(kw_only=True)
class KeysNotAdmitted:
    """Notification: these keys were offered to host memory for storing and will
    not be stored: no slot was free and none could be evicted (with lower tiers,
    their request ended or was preempted while they waited for slots)."""

    keys: tuple[bytes, ...]


@attrs.frozen(kw_only=True)
class KeysBelowThreshold:
    """Notification: `request_id` offered these keys for storing and they will not
    be stored now: fewer than `store_threshold` requests have offered them."""

    request_id: str
    keys: tuple[bytes, ...]


@attrs.frozen(kw_only=True)
class SpillDropped:
    """Notification: these host keys were not written to lower tier `tier`: the tier
    is under pressure (`TierPressure`) and its policy dropped this spill."""

    tier: int
    keys: tuple[bytes, ...]


@attrs.frozen(kw_only=True)
class TransferFailed:
    """Notification: a worker reported these keys of a transfer failed (all of
    them when it named none), with the request it served ("" for a spill)."""

    job_id: int
    kind: str  # "store", "load" or "spill"
    request_id: str
    tier: int  # the lower tier a spill wrote to; 0 for stores and loads
    worker_index: int
    keys: tuple[bytes, ...]
    reason: str = ""  # the worker's (`events.types.FAILURE_REASONS`; "" when it gave none)


@attrs.frozen(kw_only=True)
class JobEnded:
    """Notification: the last worker reported on this job, so it is gone. The
    outcome a consumer would otherwise read from the state after a report:
    which keys failed (a failed key's request may be admitted again), and
    whether a cache reset made the outcome void (`stale`)."""

    job_id: int
    kind: str  # "store", "load" or "spill"
    request_id: str  # "" for a spill and a lazy store
    tier: int  # the lower tier a spill wrote to; 0 for stores and loads
    keys: KeysByGroup
    failed_keys: tuple[bytes, ...]  # sorted; empty when every worker completed
    stale: bool


@attrs.frozen(kw_only=True)
class RequestAdmitted:
    """Notification: a waiting (or preempted) request was given its blocks. What
    explaining its misses needs, as the engine saw it at that moment: the tokens
    vLLM's own cache held (`local_tokens`), the hit kvledger restores
    (`hit_tokens`, loaded by the `StartLoad` that follows for this request), and
    its keys so far per group. Comes first among its event's effects."""

    request_id: str
    step_index: int
    num_tokens: int
    local_tokens: int
    hit_tokens: int
    keys: KeysByGroup


@attrs.frozen(kw_only=True)
class RequestRequeued:
    """Notification: a failed load sent its request back to waiting (several
    groups, or no valid token left): it is admitted again, from scratch."""

    request_id: str
    job_id: int


@attrs.frozen(kw_only=True)
class ReportViolation:
    """Notification: the caller broke the protocol; the event was not applied.
    `keys` are the named job's, when the violation names one still in flight."""

    code: str
    message: str
    event_kind: str
    request_id: str = ""
    job_id: int = -1
    keys: tuple[bytes, ...] = ()


Effect = Union[StartStore, StartLoad, FlushStores, PinDeviceBlocks, UnpinDeviceBlocks, KeysLoadable, KeysUnloadable,
               KeysNotAdmitted, KeysBelowThreshold, SpillDropped, TransferFailed, JobEnded, RequestAdmitted,
               RequestRequeued, ReportViolation, StartSpill, DropTierKeys]

EFFECT_TYPES: tuple[type, ...] = Effect.__args__  # type: ignore[attr-defined]


class Phase(IdentityEnum):
    """Where, and when in a step, an effect is carried out."""

    SCHEDULER = "scheduler"  # by the scheduler half, at once (block-pool references)
    BEFORE_STEP = "before_step"  # by each worker before the step touches a block (vLLM: handle_preemptions)
    LOADS = "loads"  # by each worker once the step's new blocks are set up (vLLM: start_load_kv)
    AFTER_FORWARD = "after_forward"  # by each worker after the forward wrote its blocks (vLLM: wait_for_save)
    NOTIFICATION = "notification"  # no work: a fact for logs, KV events and metrics


PHASES: Final[tuple[Phase, ...]] = tuple(Phase)  # iterating the enum class is a Python-level generator


ROUTES: dict[type, Phase] = {
    PinDeviceBlocks: Phase.SCHEDULER,
    UnpinDeviceBlocks: Phase.SCHEDULER,
    FlushStores: Phase.BEFORE_STEP,
    StartLoad: Phase.LOADS,
    StartStore: Phase.AFTER_FORWARD,
    StartSpill: Phase.AFTER_FORWARD,  # reads host slots only: any worker phase would do
    DropTierKeys: Phase.AFTER_FORWARD,
    KeysLoadable: Phase.NOTIFICATION,
    KeysUnloadable: Phase.NOTIFICATION,
    KeysNotAdmitted: Phase.NOTIFICATION,
    KeysBelowThreshold: Phase.NOTIFICATION,
    SpillDropped: Phase.NOTIFICATION,
    TransferFailed: Phase.NOTIFICATION,
    JobEnded: Phase.NOTIFICATION,
    RequestAdmitted: Phase.NOTIFICATION,
    RequestRequeued: Phase.NOTIFICATION,
    ReportViolation: Phase.NOTIFICATION,
}
assert set(ROUTES) == set(EFFECT_TYPES), "every effect kind needs a route"

WORKER_PHASES = (Phase.BEFORE_STEP, Phase.LOADS, Phase.AFTER_FORWARD)


_H = TypeVar("_H")


def dispatch_table(consumer: str, handlers: Mapping[type, _H], ignored: Iterable[type]) -> dict[type, _H | None]:
    """A consumer's handler for each effect kind it acts on, and `None` for each kind it
    names as `ignored`. Checked when the consumer is imported: every kind named exactly
    once, so a new kind is a decision in each consumer, never a silent skip."""
    named = [*handlers, *ignored]
    missing = [kind.__name__ for kind in EFFECT_TYPES if kind not in named]
    twice = sorted({kind.__name__ for kind in named if isinstance(kind, type) and named.count(kind) > 1})
    strays = [kind.__name__ if isinstance(kind, type) else repr(kind) for kind in named if kind not in EFFECT_TYPES]
    if missing or twice or strays:
        raise AssertionError(f"{consumer}: its effect table must name every effect kind once"
                             + (f"; missing {', '.join(missing)}" if missing else "")
                             + (f"; named twice {', '.join(twice)}" if twice else "")
                             + (f"; not effect kinds: {', '.join(strays)}" if strays else ""))
    return {**dict.fromkeys(ignored), **handlers}


def dispatch(table: Mapping[type, Any], owner: object, effects: Iterable[Effect]) -> None:
    """Hand each effect to `owner`'s handler for its kind in `table` (a consumer's
    `dispatch_table`), skipping the kinds it names as ignored."""
    for effect in effects:
        handle = table[type(effect)]
        if handle is not None:
            handle(owner, effect)


def route(effects: Iterable[Effect]) -> dict[Phase, list[Effect]]:
    """The effects by phase, each phase in the order the engine produced them."""
    routed: dict[Phase, list[Effect]] = {phase: [] for phase in PHASES}
    routes = ROUTES
    for effect in effects:
        routed[routes[type(effect)]].append(effect)
    return routed
