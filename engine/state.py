"""The block-state model, held as an owned transient.

At 100k device blocks and 1M tier slots, copying a table per event costs
milliseconds, and a persistent map costs several microseconds per update.
So the reducer takes ownership of the state's tables, changes them in place
and returns a new handle; the old handle raises on any use. To a caller
that never keeps old handles this is indistinguishable from an immutable
state. `clone()` gives an independent copy when one is needed (snapshots for
bisect, tests that compare two paths).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from operator import itemgetter
from typing import ClassVar, Final

from mypy_extensions import mypyc_attr

from kvledger.events.config import RULES_UNRESOLVED, EngineConfig, GroupKind, GroupSpec
from kvledger.events.types import NULL_BLOCK_ID

from . import hma
from .key_order import KeyOrder
from .policies import ARC, LRU, make_policy


@mypyc_attr(native_class=False)  # mypyc builds no native subclass of RuntimeError
class StaleStateError(RuntimeError):
    """An old state handle was used after the reducer took ownership of it."""


class IdentityEnum(enum.Enum):
    """An enum hashed by identity: its members are singletons, and `Enum.__hash__` is a
    Python-level call, made each time one keys a dict or is tested in a set."""

    __hash__ = object.__hash__


class RequestStatus(IdentityEnum):
    WAITING = "waiting"  # added or resumed; no blocks yet, or only touched ones
    LOADING = "loading"  # a load into its blocks is in flight
    RUNNING = "running"
    PREEMPTED = "preempted"
    ABORTING = "aborting"  # aborted while loading; blocks held until the load ends


class JobKind(IdentityEnum):
    STORE = "store"  # device blocks -> host slots
    LOAD = "load"  # host slots (promoted from a lower tier first, where needed) -> device blocks
    SPILL = "spill"  # host slots -> a lower tier


class SlotState(enum.IntEnum):
    FREE = 0
    STORING = 1
    STORED = 2  # "loading" is STORED with a load count above zero


class TierKeyState(IdentityEnum):
    """A key's state in one tier below host memory (`LowerTier`): which of its
    tables holds it. "Reading" is HELD with a read count above zero, as a
    loading slot is STORED with a load count."""

    ABSENT = "absent"  # never there, or removed (evicted, failed, reset)
    WRITING = "writing"  # a spill is writing it
    HELD = "held"  # whole there, loadable


class JobStage(IdentityEnum):
    """A transfer's life between its start and its last worker's report."""

    IN_FLIGHT = "in flight"
    FLUSHED = "flushed"  # a store the worker waits for before the step's forward: its sources are free


# Enum members as module constants, for the hot paths here and in the reducer
# and invariants (`from .state import RUNNING as _RUNNING`): a member lookup on
# the class is a descriptor call (~0.1 µs). Final, each is a static of the
# compiled module where a plain global is a lookup in the module's dict.
WAITING: Final = RequestStatus.WAITING
LOADING: Final = RequestStatus.LOADING
RUNNING: Final = RequestStatus.RUNNING
PREEMPTED: Final = RequestStatus.PREEMPTED
ABORTING: Final = RequestStatus.ABORTING
STORE: Final = JobKind.STORE
LOAD: Final = JobKind.LOAD
SPILL: Final = JobKind.SPILL
FREE: Final = SlotState.FREE
STORING: Final = SlotState.STORING
STORED: Final = SlotState.STORED
# The same as plain ints, for the per-key loops: compiled, comparing a bytearray
# item with them is an int compare, with an enum member a rich compare.
STORING_CODE: Final[int] = int(STORING)
STORED_CODE: Final[int] = int(STORED)


# Each class's fields, for its __slots__ and its clone() (a compiled class has no
# __slots__ to read back).
_REQUEST_FIELDS = (
    "request_id", "status", "num_prompt_tokens", "num_tokens", "hashes", "keys",
    "table", "num_computed_tokens", "next_store", "next_store_tokens", "load_job_id",
    "num_preemptions", "capacity_tokens", "step_limit", "free_floor", "next_free_tokens", "hashes_repr",
    "canonical_text",
)

_ALWAYS: Final = -(1 << 62)  # a lag no token count falls below: scan in every step

# A window group as a request's free point reads it: (group id, block size, lag).
FreeRule = tuple[int, int, int]


def free_lag(group: GroupSpec) -> int:
    """vLLM frees a window group's block at position `p` only once the request's
    computed tokens reach `(p + 1) * block_size + lag`.

    A sliding window of W tokens (extra retained tokens included) keeps the
    last W - 1 computed tokens for the next one's attention: vLLM's
    `get_num_skipped_tokens` is `computed - W + 1`. For any other window kind
    no rule is relied on, and the planner scans in every step.
    """
    return group.window - 1 if group.kind is GroupKind.SLIDING else _ALWAYS


def free_rules(groups: tuple[GroupSpec, ...]) -> tuple[FreeRule, ...]:
    """Per window group (any but full attention): (group id, block size, free lag)."""
    return tuple((g.group_id, g.block_size, free_lag(g)) for g in groups if g.kind is not GroupKind.FULL)


class RequestState:
    """A live request as the engine sees it."""

    __slots__ = _REQUEST_FIELDS

    def __init__(self, request_id: str, num_prompt_tokens: int, groups: tuple[GroupSpec, ...],
                 rules: tuple[FreeRule, ...] = ()) -> None:
        """`rules`: the core's `free_rules`, for the free point of a new request's floors."""
        self.request_id = request_id
        self.status = WAITING
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.hashes: list[bytes] = []
        # repr(tuple(hashes)) for the digests, kept while the hashes stay as they are: whoever
        # changes `hashes` sets it to "" (the reducer's append, rewind and reset; a snapshot's restore).
        self.hashes_repr = ""
        self.canonical_text = ""  # canonical_repr() kept until the request changes (`changed`)
        self.keys: list[list[bytes]] = [[] for _ in groups]
        self.table: list[list[int]] = [[] for _ in groups]
        self.num_computed_tokens = 0
        self.next_store = [0] * len(groups)  # next block position to consider storing
        self.next_store_tokens = 0  # no block can become storable below this horizon
        self.load_job_id = -1
        self.num_preemptions = 0
        self.capacity_tokens = 0  # tokens the table covers in every group (derived, kept for speed)
        # The most tokens a step may schedule: capacity_tokens while a step may schedule the
        # request (its status has a `step_scheduled` move in the table), else -1.
        self.step_limit = -1
        self.free_floor = [0] * len(groups)  # positions below are all null (sliding frees go in order)
        # The computed tokens below which vLLM cannot have freed a block above the
        # floors (derived from them): the planner skips a request's scan below it
        # without reading them.
        self.next_free_tokens = self.free_point(rules)

    def clone(self) -> RequestState:
        other = RequestState(self.request_id, self.num_prompt_tokens, ())  # a compiled class has no bare __new__
        for name in _REQUEST_FIELDS:
            setattr(other, name, getattr(self, name))
        other.hashes = list(self.hashes)
        other.keys = [list(k) for k in self.keys]
        other.table = [list(t) for t in self.table]
        other.next_store = list(self.next_store)
        other.free_floor = list(self.free_floor)
        return other

    def table_tokens(self, block_sizes: tuple[int, ...]) -> int:
        """Tokens the table covers in every group (`block_sizes` in group order)."""
        tokens = -1
        for table, block_size in zip(self.table, block_sizes):  # typed: cheaper than min(map(...)) for a few groups
            covered = len(table) * block_size
            if tokens < 0 or covered < tokens:
                tokens = covered
        return max(tokens, 0)

    def table_changed(self, block_sizes: tuple[int, ...]) -> None:
        """After the table grew or shrank: its capacity, and the step limit (a
        request a step may schedule has one of at least 0, and keeps it)."""
        self.capacity_tokens = self.table_tokens(block_sizes)
        if self.step_limit >= 0:
            self.step_limit = self.capacity_tokens

    def free_point(self, free_rules: tuple[FreeRule, ...]) -> int:
        """The lowest free point over the window groups (0 with none)."""
        if not free_rules:
            return 0
        floors = self.free_floor
        return min([(floors[group_id] + 1) * block_size + lag for group_id, block_size, lag in free_rules])

    def floor_changed(self, free_rules: tuple[FreeRule, ...]) -> None:
        """After a free floor moved: its derived free point."""
        self.next_free_tokens = self.free_point(free_rules)

    def set_status(self, status: RequestStatus, steppable: bool) -> None:
        """Move to `status`; `steppable` (may a step schedule it? the reducer asks
        `transitions.REQUEST_MOVES`) keeps `step_limit` in step with it."""
        self.status = status
        self.step_limit = self.capacity_tokens if steppable else -1

    def held_blocks(self) -> list[int]:
        return [b for ids in self.table for b in ids if b != NULL_BLOCK_ID]

    def canonical(self) -> tuple:
        return (
            self.request_id, self.status.value, self.num_prompt_tokens, self.num_tokens,
            tuple(self.hashes), tuple(tuple(t) for t in self.table), self.num_computed_tokens,
            tuple(self.next_store), self.next_store_tokens, self.load_job_id, self.num_preemptions,
        )

    def changed(self) -> None:
        """Drop the kept digest text: the reducer calls it on every request an event
        may change (the one it names, each one a step schedules, a job's at its end,
        all at a reset), before changing it."""
        self.canonical_text = ""

    def canonical_repr(self) -> str:
        """`repr(self.canonical())`, what a digest hashes, kept until `changed`: a digest
        hashes every request, and most wait unchanged between two. The hashes' part (most
        of its cost) is kept until they change. Its fields are `canonical()`'s, spelled out;
        tests/engine/test_digest.py checks the two agree after every event of seeded runs."""
        text = self.canonical_text
        if text:
            return text
        hashes = self.hashes_repr
        if not hashes:
            hashes = self.hashes_repr = repr(tuple(self.hashes))
        text = self.canonical_text = "(" + ", ".join((
            repr(self.request_id), repr(self.status.value), repr(self.num_prompt_tokens), repr(self.num_tokens),
            hashes, repr(tuple(tuple(t) for t in self.table)), repr(self.num_computed_tokens),
            repr(tuple(self.next_store)), repr(self.next_store_tokens), repr(self.load_job_id),
            repr(self.num_preemptions))) + ")"
        return text


_JOB_FIELDS = (
    "job_id", "kind", "request_id", "keys", "block_ids", "slot_ids", "generations",
    "pending_workers", "failed_keys", "failed_blocks", "stage", "stale", "num_tokens",
    "tier", "promote_tiers",
)


def reader_ids(readers: int | list[int]) -> list[int]:
    """The store jobs in one `Core.block_readers` entry, as a list."""
    return [readers] if isinstance(readers, int) else readers


_NO_KEYS: frozenset[bytes] = frozenset()
_NO_BLOCKS: frozenset[int] = frozenset()


class Job:
    """A transfer in flight. Per-group tuples are aligned with `keys`."""

    __slots__ = _JOB_FIELDS

    def __init__(
        self, job_id: int, kind: JobKind, request_id: str, keys: tuple, block_ids: tuple,
        slot_ids: tuple, generations: tuple, pending_workers: int, num_tokens: int = 0,
    ) -> None:
        """Positional or by name; the store planner passes them positionally
        (half the cost of keywords on its hot path)."""
        self.job_id = job_id
        self.kind = kind
        self.request_id = request_id
        self.keys = keys
        self.block_ids = block_ids
        self.slot_ids = slot_ids
        self.generations = generations  # STORE: each source block's generation when planned
        self.pending_workers = pending_workers  # bitmask of workers yet to report
        # Empty until a failure (most jobs have none): the shared empty frozenset, so a
        # job is not two sets the cyclic collector counts; a failure rebinds a new one.
        self.failed_keys: AbstractSet[bytes] = _NO_KEYS
        self.failed_blocks: AbstractSet[int] = _NO_BLOCKS
        self.stage = JobStage.IN_FLIGHT  # moved only as `JOB_MOVES` says (`transitions.start_job`, `flush_job`)
        self.stale = False  # started before a cache reset: its outcome no longer counts
        self.num_tokens = num_tokens  # LOAD: tokens the hit covers
        self.tier = 0  # SPILL: the lower tier written (1 = the first below host memory)
        self.promote_tiers: tuple = ()  # LOAD: per group, per key, the lower tier read first (0: none)

    def clone(self) -> Job:
        other = Job(self.job_id, self.kind, self.request_id, self.keys, self.block_ids, self.slot_ids,
                    self.generations, self.pending_workers)
        for name in _JOB_FIELDS:
            setattr(other, name, getattr(self, name))
        other.failed_keys = self.failed_keys  # never changed in place: shared
        other.failed_blocks = self.failed_blocks
        return other

    @property
    def flushed(self) -> bool:
        """STORE: the worker waited for it; its sources are free to reuse."""
        return self.stage is JobStage.FLUSHED

    def flat_blocks(self) -> list[int]:
        return [b for ids in self.block_ids for b in ids]

    def canonical(self) -> tuple:
        base = (
            self.job_id, self.kind.value, self.request_id, self.keys, self.block_ids, self.slot_ids,
            self.generations, self.pending_workers, tuple(sorted(self.failed_keys)),
            tuple(sorted(self.failed_blocks)), self.flushed, self.stale, self.num_tokens,
        )
        # Only with lower tiers: a log without them keeps its digests.
        return base + (self.tier, self.promote_tiers) if self.tier or self.promote_tiers else base

    def promoted(self) -> list[tuple[int, bytes, int, int]]:
        """LOAD: (tier, key, slot, block) of each key read from a lower tier first."""
        if not self.promote_tiers:
            return []
        return [(tier, key, slot, block)
                for tiers, keys, slots, blocks in zip(self.promote_tiers, self.keys, self.slot_ids, self.block_ids)
                for tier, key, slot, block in zip(tiers, keys, slots, blocks) if tier]


STATS_FIELDS = (
    "hit_tokens", "loads", "keys_loaded", "stores", "keys_stored", "store_rejections",
    "store_failures", "load_failures", "keys_failed", "flushes", "jobs_flushed",
    "evictions", "preemptions", "finished", "aborted",
)


class Stats:
    """Running totals for reports; part of the state, so replay reproduces them."""

    __slots__ = STATS_FIELDS
    hit_tokens: int
    loads: int
    keys_loaded: int
    stores: int
    keys_stored: int
    store_rejections: int
    store_failures: int
    load_failures: int
    keys_failed: int
    flushes: int
    jobs_flushed: int
    evictions: int
    preemptions: int
    finished: int
    aborted: int

    def __init__(self) -> None:
        for name in STATS_FIELDS:
            setattr(self, name, 0)

    def clone(self) -> Stats:
        other = Stats()
        for name in STATS_FIELDS:
            setattr(other, name, getattr(self, name))
        return other

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in STATS_FIELDS}


class OfferTracker:
    """Per key: how many requests offered it, in least recently offered order, and the last of them."""

    __slots__ = ("counts", "last")

    def __init__(self) -> None:
        self.counts: OrderedDict[bytes, int] = OrderedDict()
        self.last: dict[bytes, str] = {}

    def clone(self) -> OfferTracker:
        other = OfferTracker()
        other.counts = OrderedDict(self.counts)
        other.last = dict(self.last)
        return other

    def canonical(self) -> list[tuple[bytes, int, str]]:
        """In order: the order decides what is forgotten next."""
        last = self.last
        return [(key, count, last[key]) for key, count in self.counts.items()]


class LowerTier:
    """What the engine knows of a tier below host memory, which it never reads
    itself: keys whose block is whole there, in least recently used order,
    keys being written, and keys being read (never evicted while read).
    `held` and `writing` never share a key, and together fit in `capacity`.
    A disk's tier holds millions of keys: its order is a `KeyOrder`, which its
    churn never rebuilds whole in one step as it did a dict (244 ms at 4M).
    """

    __slots__ = ("name", "capacity", "held", "writing", "reading", "counts")

    COUNTS: ClassVar[tuple[str, ...]] = ("spills", "keys_written", "write_failures", "write_rejections", "keys_read", "read_failures",
              "evictions", "keys_found")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.held = KeyOrder(capacity=capacity)
        self.writing: dict[bytes, int] = {}  # key -> the spill job writing it
        self.reading: dict[bytes, int] = {}  # key -> open loads promoting it
        self.counts = dict.fromkeys(LowerTier.COUNTS, 0)

    def clone(self) -> LowerTier:
        other = LowerTier(self.name, self.capacity)
        other.held = self.held.copy()
        other.writing = dict(self.writing)
        other.reading = dict(self.reading)
        other.counts = dict(self.counts)
        return other

    def canonical(self) -> tuple:
        return (self.name, self.capacity, tuple(self.held), tuple(sorted(self.writing.items())),
                tuple(sorted(self.reading.items())), tuple(sorted(self.counts.items())))


_CORE_FIELDS = (
    "config", "groups", "alignment", "step_index", "epoch", "next_job_id",
    # derived from the config once (immutable, shared by clones)
    "block_sizes", "key_rules", "store_rules", "free_rules",
    # device pool, indexed by block id (the null block is index 0)
    "block_refs", "block_pins", "block_generation", "block_group", "block_key",
    "block_readers", "block_writer", "lazy_keys",
    # tier
    "slot_of_key", "slot_key", "slot_state", "slot_loads", "free_slots", "next_fresh_slot",
    "policy", "offers", "restore_costs", "pressure",
    # tiers below host memory, and the host slots spills are reading (slot -> count)
    "lower", "spill_reads",
    # requests and jobs
    "requests", "jobs", "stats",
)


class Core:
    """The tables themselves. Only the reducer mutates them."""

    __slots__ = _CORE_FIELDS

    def __init__(self, config: EngineConfig) -> None:
        if config.rules == RULES_UNRESOLVED:
            raise ValueError("the log's decision rules are not resolved: read it with "
                             "kvledger.adapters.log_files.open_log, which resolves them")
        self.config = config
        self.groups = config.groups
        self.alignment = config.alignment_tokens
        self.block_sizes = tuple(g.block_size for g in config.groups)
        # Per group: (hashes per block, key suffix) to derive keys from hashes.
        self.key_rules = hma.key_rules(config)
        # Per group: (group id, block size, reachability pattern or None, its period).
        self.store_rules = tuple(
            (g.group_id, g.block_size, hma.reach_pattern(g, self.alignment), self.alignment // g.block_size)
            for g in config.groups)
        self.free_rules = free_rules(config.groups)
        self.step_index = -1
        self.epoch = 0
        self.next_job_id = 1
        n = config.num_device_blocks
        self.block_refs = [0] * n
        self.block_pins = [0] * n
        self.block_generation = [0] * n
        self.block_group = [-1] * n
        self.block_key: list[bytes | None] = [None] * n
        # block -> the unflushed store job reading it, or a list when several do (rare: one
        # list per stored block would be a container object per block the collector counts)
        self.block_readers: dict[int, int | list[int]] = {}
        self.block_writer: dict[int, int] = {}  # block -> load job writing it
        self.lazy_keys: dict[int, bytes] = {}  # lazy mode: block -> key of its full, reachable content
        m = config.num_tier_slots
        self.slot_of_key: dict[bytes, int] = {}
        self.slot_key: list[bytes | None] = [None] * m
        self.slot_state = bytearray(m)
        self.slot_loads: dict[int, int] = {}
        self.free_slots: list[int] = []
        self.next_fresh_slot = 0
        self.policy: LRU | ARC = make_policy(config.policy, m)
        # vLLM's store threshold (`offers.py`): None unless a block must be offered twice or more
        self.offers: OfferTracker | None = OfferTracker() if config.store_threshold >= 2 else None
        # `restore_budget: "auto"`: the last measured costs (`RestoreCostsMeasured`): compute ns a
        # token, then per tier the fixed us of a load and ns a block; None until measured
        self.restore_costs: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
        # vLLM's `backpressure` (`TierPressure`): per lower tier [the spills dropped, ppm; the drop owed,
        # ppm]; None until a tier is first measured under pressure
        self.pressure: list[list[int]] | None = None
        self.lower = [LowerTier(t.name, t.num_blocks) for t in config.lower_tiers]
        self.spill_reads: dict[int, int] = {}
        self.requests: dict[str, RequestState] = {}
        self.jobs: dict[int, Job] = {}
        self.stats = Stats()

    def clone(self) -> Core:
        other = Core(self.config)  # (no bare __new__ when compiled) its tables are replaced below
        for name in _CORE_FIELDS:
            setattr(other, name, getattr(self, name))
        for name in ("block_refs", "block_pins", "block_generation", "block_group", "block_key",
                     "slot_key", "free_slots"):
            setattr(other, name, list(getattr(self, name)))
        other.block_readers = {b: j if isinstance(j, int) else list(j) for b, j in self.block_readers.items()}
        other.block_writer = dict(self.block_writer)
        other.lazy_keys = dict(self.lazy_keys)
        other.slot_of_key = dict(self.slot_of_key)
        other.slot_state = bytearray(self.slot_state)
        other.slot_loads = dict(self.slot_loads)
        other.policy = self.policy.clone()
        other.offers = self.offers.clone() if self.offers is not None else None
        other.pressure = [list(row) for row in self.pressure] if self.pressure is not None else None
        other.lower = [t.clone() for t in self.lower]
        other.spill_reads = dict(self.spill_reads)
        other.requests = {k: r.clone() for k, r in self.requests.items()}
        other.jobs = {k: j.clone() for k, j in self.jobs.items()}
        other.stats = self.stats.clone()
        return other

    # Tier slot counts, for lookup, spills (`lower.py`) and the queries.

    def num_free_slots(self) -> int:
        return len(self.free_slots) + self.config.num_tier_slots - self.next_fresh_slot

    def num_used_slots(self) -> int:
        return self.config.num_tier_slots - self.num_free_slots()


def counts_of(blocks: list[int]) -> Callable[[list[int]], tuple[int, ...]]:
    """Reads a per-block column (`block_refs`, `block_pins`) at `blocks` in one C-level
    call: an admission or a finish names hundreds. A block past the column's end
    raises IndexError; the caller rules out negative ones (they would wrap around)."""
    if len(blocks) == 1:  # itemgetter of one item returns it bare
        block = blocks[0]
        return lambda column: (column[block],)
    return itemgetter(*blocks)


class State:
    """A handle on the engine state. Read it freely; the reducer consumes it."""

    __slots__ = ("_core",)

    def __init__(self, core: Core) -> None:
        self._core: Core | None = core

    @classmethod
    def initial(cls, config: EngineConfig) -> State:
        return cls(Core(config))

    @property
    def core(self) -> Core:
        core = self._core
        if core is None:
            raise StaleStateError("this state handle was consumed by reduce(); use the returned state")
        return core

    def take(self) -> Core:
        """Move the tables out; this handle becomes stale."""
        core = self._core
        if core is None:
            raise StaleStateError("this state handle was consumed by reduce(); use the returned state")
        self._core = None
        return core

    def restore(self, core: Core) -> None:
        """Give the tables back after a rejected event (they were not changed)."""
        self._core = core

    def clone(self) -> State:
        return State(self.core.clone())

    def __repr__(self) -> str:
        if self._core is None:
            return "State(<consumed>)"
        c = self._core
        return (f"State(step={c.step_index}, epoch={c.epoch}, requests={len(c.requests)}, "
                f"jobs={len(c.jobs)}, tier_used={c.num_used_slots()}/{c.config.num_tier_slots})")


def initial_state(config: EngineConfig) -> State:
    return State.initial(config)


__all__ = [
    "Core", "Job", "JobKind", "LowerTier", "RequestState", "RequestStatus", "SlotState", "State", "StaleStateError",
    "Stats", "initial_state",
]
