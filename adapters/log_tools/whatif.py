"""What a log's traffic would have hit under another configuration (`kvledger whatif`).

The log's requests, their keys and vLLM's own choices (what it scheduled, its
prefix-cache hits, its block tables) are driven again through the engine under
the other configuration. Only kvledger's decisions are made anew: each
admission's hit comes from the engine's lookup, its stores, loads, spills and
evictions from the engine's admission, so the misses are explained by the same
fold as the log's own (`misses.py`).

What it cannot model, and keeps as recorded:
- vLLM's schedule: a longer hit would leave compute to other requests, and a
  shorter one take more (the steps, their order and chunking stay the log's;
  a longer hit takes its request's later allocations early, `_pull_forward`);
- the timing of transfers: a job takes the time its twin in the log took, one
  with no twin ends at the next step, and none fails (a failure of the log's
  is read as an end: `Redrive`);
- a lower tier's lookups: the engine knows what it spilled itself, and the
  keys the log's lookups found, if the tier exists in both configurations.
Run against the log's own configuration, the difference from what the log
recorded measures these (`self_check`).

The LRU curve (`lru_curve`) needs one run: under LRU, a host tier of C slots
holds a key exactly when fewer than C other keys were stored or loaded since it
last was (the stack distance), whatever C is, if every block an admission
restores or computes is stored or loaded. The run is the re-drive with room for
every key; a hit at capacity C is the admission's leading blocks (of its full
attention group) whose keys all lie within distance C.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import islice, zip_longest

import attrs

from kvledger.engine import effects as fx
from kvledger.engine import hma, queries
from kvledger.engine.lookup import lookup
from kvledger.engine.reducer import reduce
from kvledger.engine.replay import replay
from kvledger.engine.state import RequestStatus, State, TierKeyState, initial_state
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupKind, Protection
from kvledger.events.types import NULL_BLOCK_ID

from .misses import MissLedger, Tally

READ_AHEAD = 1 << 18
"""Events a re-drive reads ahead of the one it feeds (it holds at most twice as many): a
longer hit takes its request's later allocations from them, so a prediction is the one
with the whole log in memory wherever a request's allocations lie within this many
events (tests/adapters/test_whatif.py runs both), in memory bounded by it."""

_ADMITTING = queries.ADMITTABLE
_TRANSFER_REPORTS = frozenset((ev.StoreCompleted, ev.StoreFailed, ev.LoadCompleted, ev.LoadFailed))
_ADMISSION_EVENTS = frozenset((ev.RequestAdded, ev.BlocksTouched, ev.BlocksAllocated))
_BREAKS = frozenset((ev.RequestPreempted, ev.RequestFinished, ev.RequestAborted, ev.BlocksTouched))


@attrs.define
class Outcome:
    """One run of the traffic: the log's, or another configuration's."""

    config: EngineConfig
    stats: dict[str, int]
    misses: dict | None  # `misses.totals`; None where not counted (`Redrive`'s `counted`)
    moved: dict[str, int]  # blocks stored to host memory, loaded from it, spilled and promoted per lower tier
    not_applied: int = 0  # events the other configuration's engine refused (a violation)
    requests_dropped: int = 0  # of those, steps applied without a request out of step with the log

    def as_dict(self) -> dict:
        slot = self.config.slot_bytes
        data = {"num_tier_slots": self.config.num_tier_slots, "policy": self.config.policy.value,
                "rules": self.config.rules, "store_threshold": self.config.store_threshold,
                "offload_prompt_only": self.config.offload_prompt_only,
                "lower_tiers": [t.to_dict() for t in self.config.lower_tiers],
                "hit_tokens": self.stats["hit_tokens"], "loads": self.stats["loads"],
                "evictions": self.stats["evictions"], "store_rejections": self.stats["store_rejections"],
                "blocks_moved": self.moved, "misses": self.misses, "not_applied": self.not_applied,
                "requests_left_out_of_steps": self.requests_dropped}
        if slot:
            data["capacity_bytes"] = self.config.num_tier_slots * slot
            data["bytes_moved"] = {name: count * slot for name, count in self.moved.items()}
        return data


def _moved(counts: dict[str, int], effects: Iterable[fx.Effect]) -> None:
    moves = _MOVES
    for effect in effects:
        count = moves[type(effect)]
        if count is not None:
            count(counts, effect)


def _stored(counts: dict[str, int], effect: fx.StartStore) -> None:
    counts["stored"] = counts.get("stored", 0) + sum(map(len, effect.keys))


def _loaded(counts: dict[str, int], effect: fx.StartLoad) -> None:
    counts["loaded"] = counts.get("loaded", 0) + sum(map(len, effect.keys))
    for tiers in effect.promote_tiers:
        for tier in tiers:
            if tier:
                name = f"promoted from tier {tier}"
                counts[name] = counts.get(name, 0) + 1


def _spilled(counts: dict[str, int], effect: fx.StartSpill) -> None:
    name = f"spilled to tier {effect.tier}"
    counts[name] = counts.get(name, 0) + sum(map(len, effect.keys))


# The blocks each effect kind moves; the ignored move none (a DropTierKeys removes, not moves).
_MOVES = fx.dispatch_table("whatif's blocks moved", {
    fx.StartStore: _stored,
    fx.StartLoad: _loaded,
    fx.StartSpill: _spilled,
}, ignored=(fx.DropTierKeys, fx.FlushStores, fx.PinDeviceBlocks, fx.UnpinDeviceBlocks, fx.KeysLoadable,
            fx.KeysUnloadable, fx.KeysNotAdmitted, fx.KeysBelowThreshold, fx.SpillDropped, fx.TransferFailed, fx.JobEnded, fx.ReportViolation, fx.RequestAdmitted, fx.RequestRequeued))


class LogEngine:
    """The log's own engine, folded once for every re-drive that follows it (`predict_many`):
    the twins of their jobs, and the requests the log's vLLM sent back to waiting. With
    `counted`, it also keeps what `recorded` gives: the log's own outcome."""

    def __init__(self, config: EngineConfig, *, counted: bool = False) -> None:
        self.config = config
        self.state = initial_state(config)
        self.effects: tuple[fx.Effect, ...] = ()
        self.seq = 0
        self.tally = Tally() if counted else None
        self.ledger = MissLedger(config, on_admission=self.tally.add) if self.tally is not None else None
        self.moved: dict[str, int] = {}
        self.violations = 0

    def admitting(self, event: ev.Event) -> bool:
        """Whether the log's engine holds this touch's or allocation's request as admittable,
        before the event: with this re-drive's not, vLLM admitted it again."""
        kind = type(event)
        return ((kind is ev.BlocksTouched or kind is ev.BlocksAllocated)
                and queries.request_status(self.state, event.request_id) in _ADMITTING)  # type: ignore[attr-defined]

    def step(self, event: ev.Event) -> None:
        self.state, self.effects = reduce(self.state, event)
        if self.ledger is not None:
            self.ledger.observe(self.seq, event, None, self.effects)
            _moved(self.moved, self.effects)
            self.violations += sum(type(effect) is fx.ReportViolation for effect in self.effects)
        self.seq += 1

    def outcome(self) -> Outcome:
        assert self.ledger is not None and self.tally is not None, "a LogEngine made with counted=True"
        self.ledger.flush()
        return Outcome(self.config, queries.stats(self.state), self.tally.as_dict(), self.moved,
                       not_applied=self.violations)


def recorded(config: EngineConfig, records: Iterable[object]) -> Outcome:
    """The log as it happened (`predict_many` gives it too, from the same read of the log)."""
    moved: dict[str, int] = {}

    def observe(seq: int, event: ev.Event, state: State, effects: tuple[fx.Effect, ...]) -> None:
        ledger.observe(seq, event, state, effects)
        _moved(moved, effects)

    tally = Tally()
    ledger = MissLedger(config, on_admission=tally.add)
    result = replay(config, records, observe=observe)
    ledger.flush()
    return Outcome(config, queries.stats(result.state), tally.as_dict(), moved, not_applied=len(result.violations))


class Redrive:
    """The log's events through an engine of `config`, kvledger's decisions made anew.

    Transfers take the log's time: a job this engine starts where the log's
    engine started one of the same kind (same event, same order) ends where the
    log's did, each worker's report where the log has it (a failure read as an
    end: none fails here). One with no such twin ends after the next step."""

    def __init__(self, recorded: EngineConfig, config: EngineConfig, *, on_admission=None, on_effects=None,
                 log: LogEngine | None = None, counted: bool = True) -> None:
        """`counted`: keep what it missed and why (`Outcome.misses`). A capacity sweep's points
        read only the hits and the blocks moved; the ledger took two fifths of a re-drive's
        engine and ledger together (py-spy over a sweep)."""
        self.config = config
        # The log's own engine, in step: for the twins, and because where a load of the log
        # failed vLLM admitted its request again, so one this engine loaded for is sent
        # back to waiting first. Shared by re-drives run together (`predict_many`), which
        # step it once an event; a re-drive alone steps its own (`feed`).
        self.log = LogEngine(recorded) if log is None else log
        # Device blocks past the log's: where a longer hit than the log's needs a block the log
        # allocates only later, vLLM would have allocated one at once (`_spare_blocks`).
        limit = config.num_device_blocks
        self.state = initial_state(attrs.evolve(config, num_device_blocks=2 * limit))
        self._spares = list(range(2 * limit - 1, limit - 1, -1))  # free spare blocks, the lowest last
        self._renamed: dict[int, int] = {}  # the log's block -> the spare holding its content here
        self._spared: set[str] = set()  # requests whose table holds spares the log allocates later
        self.tally = Tally()
        self.ledger = MissLedger(config, on_admission=self.tally.add) if counted else None
        self.moved: dict[str, int] = {}
        self.not_applied = 0
        self.requests_dropped = 0  # a request left out of a step the engine refused for it alone
        self.seq = 0
        self.steps = 0
        self.twins: dict[int, int] = {}  # the log's job -> this engine's
        self.untimed: dict[int, tuple[bool, int]] = {}  # this engine's job with no twin -> (is a load, step)
        self.started: list[fx.Effect] = []  # the jobs the event being fed started
        self._events: list[ev.Event] = []  # the events read ahead: `_events[0]` is event `_base` of the log
        self._base = 0
        self._later: dict[str, list[int]] = {}  # request -> the indices of its allocations (`run`)
        # Where a request's admission may end: its preemption, end or prefix touch (an admission
        # again), and any failed load (its request may be admitted again).
        self._breaks: dict[str, list[int]] = {}
        self._load_failures: list[int] = []
        self._index = -1
        self._pulled: set[int] = set()  # the indices of allocations taken early by a longer hit
        self._promotions: dict[int, list[tuple[bytes, int, int]]] = {}  # load job -> (key, block, tier) it promotes
        self._load_steps: dict[int, int] = {}  # this engine's loads in flight -> the step that started them
        self._step_loads: dict[int, int] = {}  # host slot -> the loads this step's admissions started reading it
        self._early: dict[str, tuple[int, int]] = {}  # admitted this step, loaded in the log alone: (local, tokens)
        self._admitted: list[str] = []  # the requests admitted in this step, in order
        # Admitted this step with a load the log did not have: (local, computed after it); moved a step
        # later, with their loads (job ids) kept running past this step.
        self._late: dict[str, tuple[int, int]] = {}
        # Requests whose first step after their load computes from less than the log's: what they hold.
        self._deferred: dict[str, int] = {}
        self._held_frees: dict[str, list[ev.BlocksFreed]] = {}  # a deferred request's frees, until its step
        self._held_blocks: set[int] = set()  # the blocks those frees name
        self._waiting: set[int] = set()  # the late requests' loads, kept running past this step
        self.shared: SharedTier | None = None  # tier 1, when several replicas share it (`fleet.py`)
        self.on_admission = on_admission  # (state, request_id, local) before an admission is applied
        self.on_effects = on_effects  # (effects) after each event

    @property
    def recorded(self) -> State:
        return self.log.state

    def run(self, events: Iterable[ev.Event], *, ahead: int = READ_AHEAD) -> None:
        """Feed every event, reading at least `ahead` events ahead of the one fed (and at most
        twice that many held): a longer hit than the log's can take the blocks its request was
        allocated in later steps (`_admission`), as far ahead as the events read."""
        run_together([self], events, ahead=ahead)

    def prepare(self, events: list[ev.Event], *, base: int = 0) -> None:
        """The log's events from event `base` on, to be fed in order by `feed_at` (several
        logs' in turn: `fleet.py`; a window of one log's: `run`)."""
        self._later = later = {}
        self._breaks = breaks = {}
        self._load_failures = failures = []
        self._pulled = {index for index in self._pulled if index >= base}
        self._base = base
        for index, event in enumerate(events, start=base):  # (a type's test per event: `run` calls it per window)
            kind = type(event)
            if kind is ev.BlocksAllocated:
                later.setdefault(event.request_id, []).append(index)  # type: ignore[attr-defined]
            elif kind in _BREAKS:
                breaks.setdefault(event.request_id, []).append(index)  # type: ignore[attr-defined]
            elif kind is ev.LoadFailed:
                failures.append(index)
        self._events = events

    def share_window(self, other: Redrive) -> None:
        """`other`'s window of the log (read only once prepared), for a re-drive fed in step with it."""
        self._later, self._breaks, self._load_failures = other._later, other._breaks, other._load_failures
        self._events, self._base = other._events, other._base
        self._pulled = {index for index in self._pulled if index >= other._base}

    @property
    def events(self) -> list[ev.Event]:
        return self._events

    def feed_at(self, index: int) -> None:
        self._index = index
        self.feed(self._events[index - self._base])

    def feed(self, event: ev.Event) -> None:
        """The event, with the log's engine stepped here (a re-drive alone)."""
        admitting = self.log.admitting(event)
        self.log.step(event)
        self.follow(event, admitting)

    def follow(self, event: ev.Event, admitting: bool) -> None:
        """The event, once the log's engine has taken it (`admitting`: its `admitting` before)."""
        if self._index in self._pulled:  # an allocation an earlier, longer hit took at once
            return
        kind = type(event)  # (type tests, not isinstance: a re-drive makes several per event)
        readmitted = admitting and queries.request_status(self.state, event.request_id) not in _ADMITTING  # type: ignore[attr-defined]
        recorded_effects = self.log.effects
        if kind in _TRANSFER_REPORTS:
            if self.untimed and (kind is ev.StoreCompleted or kind is ev.StoreFailed):
                # vLLM's worker reports a step's finished loads before its finished stores: the loads of
                # earlier steps with no twin end before this store (their blocks back in the policy first).
                self._end_untimed(loads=True, before=self.steps)
            twin = self.twins.get(event.job_id)
            self.started = []
            if twin is not None and queries.job_view(self.state, twin) is not None:
                load = kind is ev.LoadCompleted or kind is ev.LoadFailed
                if load and self.untimed:  # loads of its step started before it, with no twin, end first
                    self._end_loads_before(twin, only_untimed=True)
                self._complete(twin, event.worker_index, load, event)
            self._pair(recorded_effects)  # the spills a store's end starts, twinned with the log's
            self._adopt()
            for effect in recorded_effects:  # a failed load sent its request back to waiting: its blocks
                if isinstance(effect, fx.TransferFailed) and effect.kind == "load":  # are vLLM's again
                    self._send_back(effect.request_id)
            return
        if (kind is ev.TierKeysFound or kind is ev.TierLookupFailed) and event.tier > len(self.config.lower_tiers):
            return
        if self._renamed or self._spared or self._held_blocks:
            event = self._with_spares(event, kind)
        rid = getattr(event, "request_id", None)
        if kind is ev.BlocksFreed and rid in self._deferred:
            # Blocks the log's vLLM freed once the request had computed past them (a window's): here it
            # computes them in the next step that schedules it, and frees them after that step (a block
            # the log hands another request meanwhile is a spare here: `_with_spares`).
            self._held_frees.setdefault(rid, []).append(event)
            self._held_blocks.update(b for ids in event.block_ids for b in ids if b != NULL_BLOCK_ID)
            return
        if self._deferred and self.untimed and rid in self._deferred:
            self._end_untimed(loads=True)  # a request moved a step later: its load ends before its next event
        if rid in self._held_frees and kind is not ev.BlocksAllocated and kind is not ev.BlocksTouched:
            self._release_frees(rid)  # after its load's end: a loading request frees nothing
        if readmitted:
            self._send_back(event.request_id, as_the_log=False)
        if kind is ev.BlocksTouched:
            self._whole([b for ids in event.block_ids for b in ids if b != NULL_BLOCK_ID])
        if kind is ev.BlocksAllocated:
            if self.config.protection is Protection.PIN:
                self._unpin([b for ids in event.block_ids for b in ids if b != NULL_BLOCK_ID])
            if queries.request_status(self.state, event.request_id) in _ADMITTING:
                self._admitted.append(event.request_id)
                if not admitting:  # sent back here alone: the log's request kept the blocks it had
                    event = self._with_the_logs_table(event)
                event = self._admission(event)
        step = kind is ev.StepScheduled
        if step:
            if self._deferred:
                event = self._with_deferred_prefills(event)
            if self._early:
                event = self._with_early_prefills(event)
            if self._late:
                event = self._without_late_prefills(event)
            self._admitted = []
        if self.untimed and kind not in _ADMISSION_EVENTS:  # a load with no twin ends before anything
            self._end_untimed(loads=True)  # else happens to its request: the log's schedule runs it
        self.started = []
        self._apply(event)
        self._pair(recorded_effects)
        self._adopt()
        if step and self._held_frees:
            for held in [held for held in self._held_frees if held not in self._deferred]:
                self._release_frees(held)
        if step:
            self.steps += 1
            self._step_loads.clear()
            self._waiting.clear()  # their loads end before the next step's events, as vLLM's worker reports them
            if self.untimed:
                self._end_untimed(loads=False)

    def outcome(self) -> Outcome:
        """At the end: what the drive restored, moved and (counted) missed."""
        misses = None
        if self.ledger is not None:
            self.ledger.flush()
            misses = self.tally.as_dict()
        return Outcome(self.config, queries.stats(self.state), misses, self.moved, self.not_applied,
                       self.requests_dropped)

    def _pair(self, recorded_effects: tuple[fx.Effect, ...]) -> None:
        """The jobs just started, each the twin of the log's started by the same event, or untimed."""
        started, self.started = self.started, []
        if started:  # (with none of its own, nothing to twin: most events)
            for kind in (fx.StartStore, fx.StartLoad, fx.StartSpill):
                mine = [e for e in started if isinstance(e, kind)]
                theirs = [e for e in recorded_effects if isinstance(e, kind)]
                for own, twin in zip(mine, theirs):
                    self.twins[twin.job_id] = own.job_id  # type: ignore[attr-defined]
                for own in mine[len(theirs):]:
                    self.untimed[own.job_id] = (kind is fx.StartLoad, self.steps)  # type: ignore[attr-defined]
        if self.config.protection is Protection.PIN and self.untimed:
            # A store with no twin pins blocks the log's vLLM was free to reuse at once: it ends now.
            self._end_untimed(loads=False, every=True)

    def _end_untimed(self, *, loads: bool, every: bool = False, before: int | None = None) -> None:
        """Jobs with no twin: a load ends before the next event that is not an admission, a store or
        spill after the step after the one that started it. A worker ends a step's loads in the
        order they started, so loads of the same step started before an untimed one end with it
        (twins too, earlier than the log has them): the order their blocks go back to the
        eviction policy in is the order vLLM's worker gave them."""
        due = [(job, step) for job, (load, step) in self.untimed.items()
               if load == loads and (loads or every or step < self.steps - 1) and job not in self._waiting
               and (before is None or step < before)]
        self.started = []
        for job, _ in due:
            if loads:
                self._end_loads_before(job)
            self._finish(job)
        self._adopt()

    def _end_loads_before(self, job: int, *, only_untimed: bool = False) -> None:
        """End the loads its step started before `job` (a worker ends them in that order)."""
        step = self._load_steps.get(job)
        for earlier in [j for j, s in self._load_steps.items() if s == step and j < job and j not in self._waiting
                        and (not only_untimed or j in self.untimed)]:
            self._finish(earlier)

    def _send_back(self, rid: str, *, as_the_log: bool = True) -> None:
        """The log's engine has this request waiting again (its load failed): so has this one."""
        if as_the_log and queries.request_status(self.recorded, rid) not in _ADMITTING:
            return
        if queries.request_status(self.state, rid) in (RequestStatus.RUNNING, RequestStatus.LOADING):
            self._end_jobs_on(rid, loads_only=True)
            self._apply(ev.RequestPreempted(request_id=rid))
            self._apply(ev.RequestResumed(request_id=rid))

    def _end_jobs_on(self, rid: str | None, *, loads_only: bool = False) -> None:
        """End the jobs in flight on this request's keys (None: every job, spills too)."""
        keys = {k for group in queries.request_keys(self.state, rid) for k in group} if rid is not None else None
        self.started = []
        for job in queries.job_ids(self.state):
            view = queries.job_view(self.state, job)
            if view is None or keys is not None and (view.kind not in ("store", "load") or keys.isdisjoint(view.keys)):
                continue
            if loads_only and (view.kind != "load" or view.request_id != rid):
                continue
            self._finish(job)
        self._adopt()

    def _finish(self, job: int) -> None:
        """Every worker yet to report on the job reports its end now."""
        self.untimed.pop(job, None)
        view = queries.job_view(self.state, job)
        if view is None:
            return
        for worker in range(self.config.world_size):
            if view.pending_workers >> worker & 1:
                self._complete(job, worker, view.kind == "load")

    def _complete(self, job: int, worker: int, load: bool, reported: ev.Event | None = None) -> None:
        """A worker's report that the job ended: a load whose promoted blocks a shared tier no
        longer holds (another replica's writes evicted them) fails for those; and one whose
        twin failed in the log fails for the keys the log's failed where this engine's tier
        no longer holds them either (a reset dropped them while they were read)."""
        if not load:
            self._apply(ev.transfer_report(job, worker, load=False))
            return
        shared = self.shared
        failed = frozenset(reported.keys) if type(reported) is ev.LoadFailed else frozenset()
        gone = [(key, block) for key, block, tier in self._promotions.get(job, ())
                if (shared is not None and tier == 1 and not shared.holds(key))
                or (key in failed and queries.tier_key_state(self.state, tier, key) is TierKeyState.ABSENT)]
        self._apply(ev.transfer_report(job, worker, load=True, block_ids=[b for _, b in gone], keys=[k for k, _ in gone]))

    def _adopt(self) -> None:
        """Jobs started by ending others (a store's spills): they have no twin."""
        for effect in self.started:
            job_id = effect.job_id  # type: ignore[attr-defined]
            if queries.job_view(self.state, job_id) is not None:
                self.untimed[job_id] = (isinstance(effect, fx.StartLoad), self.steps)
        self.started = []

    def _with_the_logs_table(self, event: ev.BlocksAllocated) -> ev.BlocksAllocated:
        """A load that failed here alone (a shared tier's block another replica's writes evicted)
        sent the request back to waiting, and its blocks with it; in the log it kept them, and this
        allocation only extends its table. Admitted again here, it takes the blocks of the log's
        table this engine's lacks, where they are free: without them its table stays short of every
        step the log schedules it in (each of which would then be refused whole)."""
        logged = queries.request_table(self.recorded, event.request_id)
        mine = queries.request_table(self.state, event.request_id)
        if not logged or not mine:
            return event
        ids = tuple(table[len(own):] for table, own in zip(logged, mine))
        if ids == event.block_ids or not queries.blocks_free(self.state, [b for group in ids for b in group if b]):
            return event
        return attrs.evolve(event, block_ids=ids)

    def _pull_forward(self, event: ev.BlocksAllocated, first: tuple[int, ...], local: int,
                      hit: int) -> ev.BlocksAllocated:
        """vLLM allocates a new request's blocks for the tokens it computes in its first step
        (a share of the step's token budget) and for its hit; a longer hit than the log's
        gets more blocks at once. They are the ones the log shows it allocating in its next
        steps, taken now while they are free (and left out of those allocations later)."""
        ids = [list(group) for group in event.block_ids]
        breaks = self._breaks.get(event.request_id, [])
        named: set[int] = set()  # the blocks the events after this one name, up to `scanned`
        scanned = self._index
        for index in self._later.get(event.request_id, ()):
            if index <= self._index or index in self._pulled:
                continue
            # Only this admission's own later allocations: none past a break (a new admission's are its own).
            if (bisect.bisect_right(breaks, index) > bisect.bisect_right(breaks, self._index)
                    or bisect.bisect_left(self._load_failures, index) > bisect.bisect_right(self._load_failures,
                                                                                            self._index)):
                break
            later = self._events[index - self._base]
            assert isinstance(later, ev.BlocksAllocated)
            blocks = [b for group in later.block_ids for b in group if b]
            present = {b for group in ids for b in group}
            # Only blocks no event names until that allocation (another request's use of them, a free,
            # vLLM naming them near eviction) and free now.
            scanned = self._name_blocks(named, scanned, index - 1)
            if not present.isdisjoint(blocks) or not queries.blocks_free(self.state, blocks) or not named.isdisjoint(
                    blocks):
                break
            for group, more in zip(ids, later.block_ids):
                group.extend(more)
            self._pulled.add(index)
            event = attrs.evolve(event, block_ids=tuple(tuple(group) for group in ids))
            if _table_takes(self.config, event.block_ids, first, local, hit):
                break
        return event

    def _spare_blocks(self, event: ev.BlocksAllocated, first: tuple[int, ...], local: int,
                      hit: int) -> ev.BlocksAllocated:
        """A hit longer than the log's, whose blocks the log allocates only in a later step (and
        another request used in between): vLLM would allocate blocks for it at once. Spare blocks
        (past the log's) stand for them; the blocks the log allocates there later are renamed to
        them in every event after (`_with_spares`)."""
        groups = []
        for group, ids, start in zip(self.config.groups, event.block_ids, first):
            needed = set(hma.needed_range(group, local, local + hit))
            end = (local + hit) // group.block_size
            more = [NULL_BLOCK_ID if p not in needed else -1 for p in range(start + len(ids), end)]
            if sum(b == -1 for b in more) > len(self._spares):
                return event
            groups.append((*ids, *(self._spares.pop() if b == -1 else b for b in more)))
        self._spared.add(event.request_id)
        return attrs.evolve(event, block_ids=tuple(groups))

    def _with_spares(self, event: ev.Event, kind: type) -> ev.Event:
        """The event with the log's blocks that spares hold here renamed. A block the log
        allocates afresh is its own again; the blocks the log allocates a request at positions
        its table here already holds (spares) are left out of the allocation, and renamed to
        those spares from here on."""
        renamed = self._renamed
        rid = getattr(event, "request_id", None)
        if kind is ev.BlocksAllocated and rid in self._spared:
            mine = queries.request_table(self.state, rid)
            logged = queries.request_table(self.recorded, rid)
            groups = []
            for ids, own, theirs in zip(event.block_ids, mine, logged):
                before = len(theirs) - len(ids)  # the log's table before this allocation
                ahead = max(0, min(len(own) - before, len(ids)))
                for block, spare in zip(ids[:ahead], own[before:before + ahead]):
                    if block != NULL_BLOCK_ID and block != spare:
                        renamed[block] = spare
                groups.append(ids[ahead:])
            event = attrs.evolve(event, block_ids=tuple(groups))
        if kind is ev.BlocksAllocated:
            fresh = [b for ids in event.block_ids for b in ids if b in renamed]
            for block in fresh:  # the log's block holds new content: the spare is free again, once it is here
                spare = renamed.pop(block)
                if queries.blocks_free(self.state, [spare]):
                    self._spares.append(spare)
            held = self._held_blocks
            if held and not held.isdisjoint(b for ids in event.block_ids for b in ids):
                for block in [b for ids in event.block_ids for b in ids if b in held]:
                    if not self._spares:
                        return event  # (refused: the blocks are still held here)
                    renamed[block] = self._spares.pop()  # the log's block, still held here: a spare for it
                return attrs.evolve(event, block_ids=tuple(tuple(renamed.get(b, b) if b in held else b for b in ids)
                                                           for ids in event.block_ids))
            return event
        if kind is ev.RequestFinished and rid in self._spared:
            self._spared.discard(rid)  # its final table is this engine's (spares in it)
            return attrs.evolve(event, block_ids=queries.request_table(self.state, rid))
        if kind is ev.BlocksNearEviction:  # (a block a held free names is not free here yet)
            held = self._held_blocks
            return attrs.evolve(event, block_ids=tuple(renamed.get(b, b) for b in event.block_ids if b not in held))
        if kind in (ev.BlocksFreed, ev.BlocksTouched, ev.RequestFinished):
            return attrs.evolve(event, block_ids=tuple(tuple(renamed.get(b, b) for b in ids)
                                                       for ids in event.block_ids))
        return event

    def _release_frees(self, rid: str) -> None:
        for freed in self._held_frees.pop(rid):
            self._held_blocks.difference_update(b for ids in freed.block_ids for b in ids)
            self._apply(freed)

    def _name_blocks(self, named: set[int], after: int, end: int) -> int:
        """Add to `named` the device blocks the events in (after, end] name; gives `end`. Read
        from the window when a longer hit looks ahead (rarely): an index of every mention,
        built for each window, was a fifth of a re-drive's time."""
        for event in self._events[after + 1 - self._base:end + 1 - self._base]:
            ids = getattr(event, "block_ids", None)
            if ids:
                for group in (ids if type(ids[0]) is tuple else (ids,)):
                    named.update(group)
        return max(after, end)

    def _whole(self, blocks: list[int]) -> None:
        """The log's vLLM found these blocks in its prefix cache, so whole: a load of this
        engine still writing them (a hit here the log computed, or loaded sooner) ends first."""
        self._end_jobs_on_blocks(blocks, "load")

    def _unpin(self, blocks: list[int]) -> None:
        """The log's vLLM reuses these blocks, so no job of its held them pinned: a job of
        this engine that does (it stored what the log's did not) ends first."""
        self._end_jobs_on_blocks(blocks, "store")

    def _end_jobs_on_blocks(self, blocks: list[int], kind: str) -> None:
        for job in queries.jobs_on_blocks(self.state, blocks):
            view = queries.job_view(self.state, job)
            if view is not None and view.kind == kind:
                self._finish(job)
        self._adopt()

    def _admission(self, event: ev.BlocksAllocated) -> ev.BlocksAllocated:
        view = queries.request_view(self.state, event.request_id)
        assert view is not None
        local = view.num_computed_tokens  # what vLLM's own cache held (touched before)
        if self.on_admission is not None:
            self.on_admission(self.state, event.request_id, local)
        if self.shared is not None:  # what a lookup in the shared tier finds that this engine does not know
            found = tuple(dict.fromkeys(
                k for group in queries.request_keys(self.state, event.request_id) for k in group
                if self.shared.holds(k) and not queries.tier_holds(self.state, 1, k)))
            if found:
                self._apply(ev.TierKeysFound(tier=1, keys=found))
        answer = lookup(self.state, event.request_id, local, step_loads=self._step_loads)
        if not answer.ready:
            # A key it needs is still being stored, or loaded for another request, or the hit's
            # promotions wait for host slots that transfers hold: vLLM would have waited for
            # those transfers, which the log's schedule did not; they end now.
            self._end_jobs_on(event.request_id)
            answer = lookup(self.state, event.request_id, local, step_loads=self._step_loads)
            for _ in range(3):  # (ending a store starts its spills, which hold host slots a moment)
                if answer.ready or not queries.has_jobs_in_flight(self.state):
                    break
                self._end_jobs_on(None)
                answer = lookup(self.state, event.request_id, local, step_loads=self._step_loads)
        hit = answer.num_hit_tokens if answer.ready else 0
        # The log's block table is the one vLLM allocated for the recorded hit: a window
        # group leaves null the blocks before that hit's end it did not need. A hit here
        # is cut to what the table can take (only ever shorter than the recorded one).
        alignment = self.config.alignment_tokens
        offered = hit
        if hit and not _table_takes(self.config, event.block_ids, view.table_positions, local, hit):
            event = self._pull_forward(event, view.table_positions, local, hit)
        if hit and not _table_takes(self.config, event.block_ids, view.table_positions, local, hit):
            event = self._spare_blocks(event, view.table_positions, local, hit)
        while hit and not _table_takes(self.config, event.block_ids, view.table_positions, local, hit):
            hit -= alignment
        if hit < offered and self.ledger is not None:
            self.ledger.cut[event.request_id] = offered
        if hit and not event.num_external_tokens:
            self._late[event.request_id] = (local, local + hit)
        elif 0 < hit < event.num_external_tokens:  # both wait for a load: the rest is computed here
            self._deferred[event.request_id] = local + hit
        if not hit and event.num_external_tokens:
            # Nothing to load here: vLLM computes the prompt in this step, in the blocks the
            # log allocates it in its next steps (taken now, where free).
            size = self.config.hash_block_size
            prompt = -(-view.num_tokens // size) * size - local
            event = self._pull_forward(event, view.table_positions, local, prompt)
            covered = prompt if _table_takes(self.config, event.block_ids, view.table_positions, local, prompt) \
                else event.num_external_tokens
            self._early[event.request_id] = (local, min(covered, view.num_tokens - local))
        return attrs.evolve(event, num_external_tokens=hit)

    def _without_late_prefills(self, event: ev.StepScheduled) -> ev.StepScheduled:
        """The requests admitted in this step that this engine loads for and the log computed at
        once: vLLM waits for a load, so they leave this step and compute in the next
        (`_with_deferred_prefills`), their loads running until then."""
        late, self._late = self._late, {}
        rows = _rows(event)
        kept = []
        for row in rows:
            rid, done, _ = row
            view = queries.request_view(self.state, rid) if rid in late and done == late[rid][0] else None
            if view is None or view.load_job_id not in self.untimed:
                kept.append(row)
                continue
            self._waiting.add(view.load_job_id)
            self._deferred[rid] = late[rid][1]
        return event if len(kept) == len(rows) else _step_of(event, kept)

    def _with_deferred_prefills(self, event: ev.StepScheduled) -> ev.StepScheduled:
        """The requests whose first step after their load computes from less than the log's
        did: those `_without_late_prefills` left out of an earlier step, and those that loaded
        less here than in the log. In the first step that schedules one, it computes from what
        it loaded to where the log's request is after that step."""
        deferred = self._deferred
        rows = []
        for rid, done, scheduled in _rows(event):
            computed = deferred.pop(rid, None)
            if computed is not None and done > computed:  # from what it loaded to the log's horizon
                done, scheduled = computed, done + scheduled - computed
            rows.append((rid, done, scheduled))
        for rid in [rid for rid in deferred if queries.request_status(self.state, rid) is None]:
            del deferred[rid]  # gone before a step scheduled it
        return _step_of(event, rows)

    def _with_early_prefills(self, event: ev.StepScheduled) -> ev.StepScheduled:
        """The requests admitted in this step that the log loaded for and this engine computes:
        the log's vLLM waited for their loads and computes them from the next step, where one
        with nothing to load computes in the step it is admitted. Their blocks the log loaded
        are computed in this step here, so stored when the real run would store them; the rest
        of the prompt keeps the log's step."""
        early, self._early = self._early, {}
        order = {rid: i for i, rid in enumerate(self._admitted)}
        rows = _rows(event)
        added = False
        for rid, (local, tokens) in early.items():
            view = queries.request_view(self.state, rid)
            if (rid in event.request_ids or view is None or view.status is not RequestStatus.RUNNING
                    or view.num_computed_tokens != local):
                continue
            # vLLM schedules the step's new requests in the order it admitted them (the order
            # the engine plans their stores in): before the first one admitted after it.
            at = next((i for i, (other, _, _) in enumerate(rows) if order.get(other, -1) > order[rid]), len(rows))
            rows.insert(at, (rid, local, tokens))
            added = True
        return _step_of(event, rows) if added else event

    def _apply(self, event: ev.Event) -> None:
        self.state, effects = reduce(self.state, event)
        if type(event) is ev.StepScheduled and effects and type(effects[0]) is fx.ReportViolation:
            event, effects = self._without_the_refused(event, effects)
        if self.ledger is not None:
            self.ledger.observe(self.seq, event, None, effects)
        self.seq += 1
        _moved(self.moved, effects)
        if self.on_effects is not None:
            self.on_effects(effects)
        fx.dispatch(_FOLLOW, self, effects)

    def _without_the_refused(self, event: ev.StepScheduled,
                             effects: tuple[fx.Effect, ...]) -> tuple[ev.StepScheduled, tuple[fx.Effect, ...]]:
        """A step refused for one request this engine has out of step with the log (its
        table short of what the step computes) is applied without it: the others' steps go
        on, where refusing the step whole would leave every request behind from here on.
        (The engine checks a whole step before changing anything.) The refusal is counted."""
        self.not_applied += 1
        refused = effects[0]
        while type(refused) is fx.ReportViolation and refused.request_id in event.request_ids:
            self.requests_dropped += 1
            event = _step_of(event, [row for row in _rows(event) if row[0] != refused.request_id])
            self.state, effects = reduce(self.state, event)
            refused = effects[0] if effects else None
        return event, effects if type(refused) is not fx.ReportViolation else effects[1:]

    def _refused(self, effect: fx.ReportViolation) -> None:
        self.not_applied += 1

    def _started(self, effect: fx.StartStore | fx.StartSpill) -> None:
        self.started.append(effect)

    def _load_started(self, effect: fx.StartLoad) -> None:
        self.started.append(effect)
        self._load_steps[effect.job_id] = self.steps
        step_loads = self._step_loads
        for tiers, slots in zip_longest(effect.promote_tiers, effect.source_slot_ids, fillvalue=()):
            for index, slot in enumerate(slots):
                if not (tiers and tiers[index]) and slot >= 0:  # a host slot this load reads in place
                    step_loads[slot] = step_loads.get(slot, 0) + 1
        if effect.promote_tiers:
            self._promotions[effect.job_id] = [
                (key, block, tier) for tiers, keys, blocks in zip(effect.promote_tiers, effect.keys, effect.target_block_ids)
                for tier, key, block in zip(tiers, keys, blocks) if tier]
            if self.shared is not None:  # a shared tier (tier 1) counts what its readers read
                self.shared.read([key for key, _, tier in self._promotions[effect.job_id] if tier == 1])

    def _job_over(self, effect: fx.JobEnded) -> None:
        self._promotions.pop(effect.job_id, None)
        self._load_steps.pop(effect.job_id, None)

    def _loadable(self, effect: fx.KeysLoadable) -> None:
        if effect.tier == 1 and self.shared is not None:
            self.shared.write(effect.keys)  # a spill written (or a lookup's find: already there)


class SharedTier:
    """A tier several replicas share (Valkey): blocks in least-recently-used order, as
    Valkey's `allkeys-lru` keeps them, and what was written to and read from it."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.written = 0
        self.read_blocks = 0
        self.evicted = 0

    def holds(self, key: bytes) -> bool:
        return key in self.blocks

    def write(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            self.written += 1
            self.blocks[key] = None
            if len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)
                self.evicted += 1

    def read(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if key in self.blocks:
                self.blocks.move_to_end(key)
                self.read_blocks += 1


def _rows(event: ev.StepScheduled) -> list[tuple[str, int, int]]:
    """A step's columns as rows: (request, computed before the step, scheduled in it)."""
    return list(zip(event.request_ids, event.num_computed_tokens, event.num_scheduled_tokens))


def _step_of(event: ev.StepScheduled, rows: list[tuple[str, int, int]]) -> ev.StepScheduled:
    ids, done, scheduled = zip(*rows) if rows else ((), (), ())
    return attrs.evolve(event, request_ids=tuple(ids), num_computed_tokens=tuple(done),
                        num_scheduled_tokens=tuple(scheduled))


def _table_takes(config: EngineConfig, block_ids: tuple[tuple[int, ...], ...], first: tuple[int, ...],
                 local: int, hit: int) -> bool:
    """Every block the hit [local, local + hit) loads is in the allocation (not null)."""
    for group, ids, start in zip(config.groups, block_ids, first):
        for position in hma.needed_range(group, local, local + hit):
            index = position - start
            if not 0 <= index < len(ids) or ids[index] == NULL_BLOCK_ID:
                return False
    return True


def events_of(records: Iterable[object]) -> list[ev.Event]:
    """A log's events, its digest records left out."""
    return list(events_in(records))


def events_in(records: Iterable[object]) -> Iterator[ev.Event]:
    """A log's events as they are read, its digest records left out."""
    return (event for event in (getattr(record, "event", None) for record in records) if event is not None)


def predict(recorded_config: EngineConfig, config: EngineConfig, records: Iterable[object]) -> Outcome:
    drive = Redrive(recorded_config, config)
    drive.run(events_in(records))
    return drive.outcome()


def predict_many(recorded_config: EngineConfig, configs: list[EngineConfig], records: Iterable[object], *,
                 ahead: int = READ_AHEAD, counted: list[bool] | None = None) -> tuple[Outcome, list[Outcome]]:
    """The log as recorded, and its traffic under each configuration, from one read of the
    log: it is decoded once, the log's engine folded once, and every re-drive follows it
    (each the same as `predict` alone: tests/adapters/test_whatif.py). `counted`: per
    configuration, whether its misses are kept (all, by default)."""
    log = LogEngine(recorded_config, counted=True)
    counts = [True] * len(configs) if counted is None else counted
    drives = [Redrive(recorded_config, config, log=log, counted=count)
              for config, count in zip(configs, counts, strict=True)]
    run_together(drives, events_in(records), ahead=ahead)
    return log.outcome(), [drive.outcome() for drive in drives]


def run_together(drives: list[Redrive], events: Iterable[ev.Event], *, ahead: int = READ_AHEAD) -> None:
    """Feed every event to each re-drive, the log's engine they share stepped once an event;
    reading at least `ahead` events ahead of the one fed and holding at most twice that many
    (`Redrive.run`)."""
    lead = drives[0]
    log = lead.log
    assert all(drive.log is log for drive in drives), "re-drives run together share the log's engine"
    stream = iter(events)
    base = 0
    held = list(islice(stream, 2 * ahead))
    while True:
        lead.prepare(held, base=base)
        for drive in drives[1:]:
            drive.share_window(lead)
        done = len(held) < 2 * ahead  # the stream ended: feed the rest
        for index, event in enumerate(held if done else held[:ahead], start=base):
            admitting = log.admitting(event)
            log.step(event)
            for drive in drives:
                drive._index = index
                drive.follow(event, admitting)
        if done:
            return
        held = held[ahead:] + list(islice(stream, ahead))
        base += ahead


def distinct_keys_bound(config: EngineConfig, records: Iterable[object]) -> int:
    """At most how many keys the log's requests name (a host tier this large never evicts)."""
    hashes = 0
    for record in records:
        event = getattr(record, "event", None)
        if isinstance(event, (ev.RequestAdded, ev.BlockHashesAppended)):
            hashes += len(event.block_hashes)
    return max(1, hashes * len(config.groups))


class _Distances:
    """LRU stack distances: how many distinct keys were accessed since a key last was."""

    def __init__(self) -> None:
        self.tree: list[int] = [0]  # a Fenwick tree over access times (1, 2, ...): 1 where a key's last access is
        self.last: dict[bytes, int] = {}
        self.live = 0

    def _add(self, index: int, delta: int) -> None:
        while index < len(self.tree):
            self.tree[index] += delta
            index += index & -index

    def _prefix(self, index: int) -> int:
        total = 0
        while index > 0:
            total += self.tree[index]
            index -= index & -index
        return total

    def distance(self, key: bytes) -> float:
        last = self.last.get(key)
        return float("inf") if last is None else self.live - self._prefix(last)

    def access(self, key: bytes) -> None:
        index = len(self.tree)  # this access's time: the tree grows by one node per access
        self.tree.append(self._prefix(index - 1) - self._prefix(index - (index & -index)))  # what it covers
        last = self.last.get(key)
        if last is not None:
            self._add(last, -1)
        else:
            self.live += 1
        self._add(index, 1)
        self.last[key] = index


def lru_curve(config: EngineConfig, records: Iterable[object], bound: int) -> list[tuple[list[float], list[int]]]:
    """For each admission, the capacities (in slots) a hit needs, from one
    re-drive with room for every key: `hits_at` reads them at any capacity.

    A hit ending at token e needs every key the engine's lookup needs for it
    (all of a full-attention group's blocks before e, a window group's blocks
    near e) within the capacity; each such end is listed with that largest
    distance (plus one), sorted, beside the longest hit any end so far gives."""
    roomy = attrs.evolve(config, num_tier_slots=bound, policy="lru", lower_tiers=())
    alignment = config.alignment_tokens
    distances = _Distances()
    admissions: list[tuple[list[float], list[int]]] = []

    def on_admission(state: State, rid: str, local: int) -> None:
        view = queries.request_view(state, rid)
        assert view is not None
        keys = queries.request_keys(state, rid)
        most = (view.num_tokens - 1) // alignment * alignment
        full_worst = 0.0
        full_seen = [local // g.block_size for g in config.groups]
        ends: list[tuple[float, int]] = []
        for end in range(local + alignment, most + 1, alignment):
            worst = 0.0
            for group in config.groups:
                group_keys = keys[group.group_id]
                if group.kind is GroupKind.FULL:  # a prefix: only the new positions
                    for position in range(full_seen[group.group_id], end // group.block_size):
                        full_worst = max(full_worst, _distance(distances, group_keys, position))
                    full_seen[group.group_id] = end // group.block_size
                    continue
                for position in hma.needed_range(group, local, end):
                    worst = max(worst, _distance(distances, group_keys, position))
            needed = max(worst, full_worst) + 1  # a capacity of this many slots holds them all
            if full_worst == float("inf"):
                break
            ends.append((needed, end - local))
        ends.sort()
        longest: list[int] = []
        for _, tokens in ends:
            longest.append(max(tokens, longest[-1]) if longest else tokens)
        admissions.append(([needed for needed, _ in ends], longest))

    def on_effects(effects: tuple[fx.Effect, ...]) -> None:
        # A key is in host memory from its store's end (as the engine's index has it), and a
        # load refreshes it.
        accesses = _ACCESSES
        for effect in effects:
            keys = accesses[type(effect)]
            if keys is not None:
                for key in keys(effect):
                    distances.access(key)

    drive = Redrive(config, roomy, on_admission=on_admission, on_effects=on_effects, counted=False)
    drive.run(events_in(records))
    return admissions


def _distance(distances: _Distances, keys: tuple[bytes, ...], position: int) -> float:
    return distances.distance(keys[position]) if position < len(keys) else float("inf")


def hits_at(admissions: list[tuple[list[float], list[int]]], capacities: list[int]) -> list[int]:
    """Hit tokens at each capacity (in slots), from `lru_curve`'s admissions."""
    out = []
    for capacity in capacities:
        total = 0
        for needs, longest in admissions:
            fits = bisect.bisect_right(needs, capacity)
            if fits:
                total += longest[fits - 1]
        out.append(total)
    return out


# What the re-drive follows of each effect kind.
_FOLLOW = fx.dispatch_table("whatif's re-drive", {
    fx.ReportViolation: Redrive._refused,
    fx.StartStore: Redrive._started,
    fx.StartSpill: Redrive._started,
    fx.StartLoad: Redrive._load_started,
    fx.KeysLoadable: Redrive._loadable,  # tier 1, for a fleet's shared tier
    fx.JobEnded: Redrive._job_over,
}, ignored=(fx.DropTierKeys, fx.FlushStores, fx.PinDeviceBlocks, fx.UnpinDeviceBlocks, fx.KeysUnloadable,
            fx.KeysNotAdmitted, fx.KeysBelowThreshold, fx.SpillDropped, fx.TransferFailed, fx.RequestAdmitted, fx.RequestRequeued))


def _host_loadable(effect: fx.KeysLoadable) -> tuple[bytes, ...]:
    return effect.keys if effect.tier == 0 else ()


def _loaded_keys(effect: fx.StartLoad) -> list[bytes]:
    return [key for group in effect.keys for key in group]


# The keys each effect kind makes recently used in host memory, for the one-pass LRU estimate.
# A store's keys are in host memory from its end (KeysLoadable), not its start.
_ACCESSES = fx.dispatch_table("whatif's LRU estimate", {
    fx.KeysLoadable: _host_loadable,
    fx.StartLoad: _loaded_keys,
}, ignored=(fx.StartStore, fx.StartSpill, fx.DropTierKeys, fx.FlushStores, fx.PinDeviceBlocks, fx.UnpinDeviceBlocks,
            fx.KeysUnloadable, fx.KeysNotAdmitted, fx.KeysBelowThreshold, fx.SpillDropped, fx.TransferFailed, fx.JobEnded, fx.ReportViolation, fx.RequestAdmitted, fx.RequestRequeued))
