"""A seeded stand-in for vLLM that drives the engine with legal event sequences.

It plays the scheduler (admission, chunked prefill, decode, preemption,
sliding-window frees, finish, abort), the block pool (free queue, prefix
cache, pins) and the workers (copies that run late unless flushed, and that
can fail). Every device block and tier slot carries a shadow of its content,
and so does each lower tier (a disk: key -> content), so the simulator can
check what matters end to end: whenever a request is scheduled, every block
its layers read holds the right content. A store that read a reused block, a
load of the wrong slot, or a promoted block that was corrupted on disk and
served anyway, shows up there. Lower tiers can be damaged (a key removed or
its bytes corrupted) and written by another process (then found by a lookup).

Used by the stateful property tests, the benchmarks and the golden logs.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable

from kvledger.adapters.engine_host import EngineHost
from kvledger.engine import effects as fx
from kvledger.engine import hma, queries
from kvledger.engine.invariants import check, check_event
from kvledger.engine.lookup import LookupResult, lookup
from kvledger.engine.reducer import reduce
from kvledger.engine.state import RequestStatus, SlotState, State, initial_state
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupKind, RestoreBudget, StoreMode
from kvledger.events.types import NULL_BLOCK_ID


class SimulationError(AssertionError):
    """The engine did something the contract forbids, seen from vLLM's side."""


def chain_hash(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


class SimRequest:
    __slots__ = ("rid", "doc", "status", "num_prompt_tokens", "num_tokens", "hashes", "first_hashes", "table",
                 "computed", "max_tokens", "num_output", "load_job")

    def __init__(self, rid: str, doc: int, num_prompt_tokens: int, hashes: list[bytes], groups: int,
                 max_tokens: int, first_hashes: list[bytes]) -> None:
        self.rid = rid
        self.doc = doc
        self.status = "waiting"
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.hashes = hashes  # under the current key generation
        self.first_hashes = first_hashes  # under generation 0 (the same hashes until a rekeying reset)
        self.table: list[list[int]] = [[] for _ in range(groups)]
        self.computed = 0
        self.max_tokens = max_tokens
        self.num_output = 0
        self.load_job = -1


class SimJob:
    __slots__ = ("effect", "pending", "copied", "failed", "unread")

    def __init__(self, effect: fx.StartStore | fx.StartLoad | fx.StartSpill, workers: int) -> None:
        self.effect = effect
        self.pending = set(range(workers))
        self.copied = False
        self.failed: set[int] = set()  # LOAD: target blocks that failed
        self.unread = ""  # LOAD: why a promoted block could not be read from its tier ("" if none failed)


class Simulator:
    def __init__(self, config: EngineConfig, *, prefix_caching: bool = True, chunk_tokens: int = 0,
                 record: Callable[[ev.Event], None] | None = None, check_every_event: bool = False,
                 check_content: bool = True, host: EngineHost | None = None,
                 lazy_target_blocks: int = 8,
                 observe: Callable[[int, ev.Event, State, tuple[fx.Effect, ...]], None] | None = None,
                 record_truth: bool = False, start_us: int = 1_800_000_000_000_000, step_us: int = 25_000) -> None:
        self.config = config
        self.groups = config.groups
        self.prefix_caching = prefix_caching
        self.chunk_tokens = chunk_tokens  # 0: prefill in one step
        self.record = record
        self.check_every_event = check_every_event
        self.check_content = check_content  # off only for large benchmark traces
        self.lazy_target_blocks = lazy_target_blocks  # lazy mode: free blocks offered per step
        self.host = host  # when set, it runs the engine and writes the log
        self.state: State = host.state if host is not None else initial_state(config)
        n = config.num_device_blocks
        self.free: dict[int, None] = dict.fromkeys(range(1, n))  # vLLM's free queue, eviction end first
        self.holders = [0] * n  # request references + pins
        self.content: list[object] = [None] * n
        self.cached: dict[bytes, int] = {}  # prefix cache: key -> block
        self.answers: dict[str, LookupResult] = {}  # each request's last lookup, given back as vLLM's adapter does
        self.cached_key: dict[int, bytes] = {}
        self.dirty: set[int] = set()
        self.slot_content: dict[int, object] = {}
        self.disks: list[dict[bytes, object]] = [{} for _ in config.lower_tiers]  # per lower tier
        # What the engine's notifications say each tier (0: host memory) can serve.
        self.announced: list[set[bytes]] = [set() for _ in range(1 + len(config.lower_tiers))]
        self.damaged: set[bytes] = set()  # keys removed from a disk behind the engine's back
        self.requests: dict[str, SimRequest] = {}
        self.jobs: dict[int, SimJob] = {}
        self._last_reported: dict[int, fx.StartStore | fx.StartLoad | fx.StartSpill] = {}
        self._admitting: tuple[str, int, int] | None = None  # the admission being emitted: request, local, hit
        self._requeues: set[int] = set()  # loads announced as sending their request back to waiting
        self.step_index = -1
        self.epoch = 0
        self.next_request = 0
        self.events = 0
        self.load_failures = 0
        self.observe = observe  # called after each event, as a replay's `observe` is (seq: the event's count)
        # A simulated clock for the steps' wall time: a fixed start and a fixed step length.
        self.start_us = start_us
        self.step_us = step_us
        # What this simulator knows of its own misses, for `adapters/log_tools/misses.py`'s tests: at each
        # admission, which prompt blocks were restorable and whose keys this request named first;
        # and the stores it failed and the resets it made.
        self.truth: list[dict] | None = [] if record_truth else None
        self.first_named: dict[bytes, str] = {}
        self.failed_jobs: set[int] = set()
        self.failed_reports: dict[int, list[int]] = {}  # a failed job -> the seqs of its failing reports
        self.unanswered: dict[str, tuple[str, int]] = {}  # request -> its lookup's failure: reason, seq
        # Each key's last removal from a tier (seq, reason, tier) and last refusal (seq), as this
        # simulator saw the engine's notifications while carrying them out.
        self.gone_at: dict[bytes, tuple[int, fx.Reason, int]] = {}
        self.refused_at: dict[bytes, int] = {}
        self.below_at: dict[bytes, int] = {}  # each key's last offer below the store threshold (seq)
        self.pressured: dict[int, int] = {}  # lower tier -> the share of its spills dropped (ppm)
        self.spill_dropped_at: dict[bytes, tuple[int, int]] = {}  # key -> its last dropped spill: seq, tier
        self.decode_named: set[bytes] = set()  # keys first named past their request's prompt
        self.ended_at: dict[str, int] = {}  # request -> the seq it finished or was aborted
        self.started_at: dict[int, int] = {}  # job -> the seq of the event that started it
        self.reset_seqs: list[int] = []
        # Key generations: a rekeying reset (`reset(rekey=True)`, as the connector's with tiers below host
        # memory) keys every block anew. Each key of a later generation -> its generation-0 key, and each
        # block such a reset dropped, by its generation-0 key -> (seq, tier, the generation it was stored under).
        self.generation = 0
        self._rekeying = False  # while a rekeying reset's event is applied
        # A live request's key before a rekeying reset -> its key now: the same tokens' KV, renamed
        # (`reset`), also when a load planned before the reset reads it from a tier after it.
        self.renamed: dict[object, object] = {}
        self.first_key_of: dict[bytes, bytes] = {}
        self.reset_lost: dict[bytes, tuple[int, int, int]] = {}
        # The last finished requests (doc, hashes, tokens), for conversations' next turns (`add_turn`).
        self.finished_turns: list[tuple[int, list[bytes], int]] = []
        self.next_doc = 1 << 20  # the texts of turns' replies (docs of `add_request` are small ints)

    # Driving the engine.

    def emit(self, event: ev.Event) -> tuple[fx.Effect, ...]:
        before = self.state.core.next_job_id
        if self.host is not None:
            effects = self.host.apply(event)
            self.state = self.host.state
        else:
            self.state, effects = reduce(self.state, event, strict=True)
        self.events += 1
        if self.record is not None:
            self.record(event)
        if self.observe is not None:
            self.observe(self.events - 1, event, self.state, effects)
        if self.truth is not None and isinstance(event, (ev.RequestAdded, ev.BlockHashesAppended)):
            request = self.requests[event.request_id]
            for group in self.groups:
                prompt_blocks = request.num_prompt_tokens // group.block_size
                keys = self.keys(request, group.group_id)
                for position, key in enumerate(keys):
                    if self.first_named.setdefault(key, request.rid) == request.rid and position >= prompt_blocks:
                        self.decode_named.add(key)
                if self.generation:
                    self.first_key_of.update(zip(keys, self.keys(request, group.group_id, request.first_hashes)))
        elif self.truth is not None and isinstance(event, (ev.RequestFinished, ev.RequestAborted)):
            self.ended_at[event.request_id] = self.events - 1
        for effect in effects:
            self._perform(effect)
        if self.check_every_event:
            check_event(self.state, event, before)
            self._check_announced()
        return effects

    def _check_announced(self) -> None:
        """The notifications so far, folded, are exactly what each tier can serve."""
        if self.announced[0] != set(queries.loadable_keys(self.state)):
            raise SimulationError("host memory: the notifications disagree with the loadable keys")
        usage = queries.lower_tier_usage(self.state)
        for tier, announced in enumerate(self.announced[1:], start=1):
            if any(not queries.tier_holds(self.state, tier, key) for key in announced):
                raise SimulationError(f"tier {tier}: a key announced loadable is not held")
            if len(announced) != usage[tier - 1].held_keys:
                raise SimulationError(f"tier {tier}: a held key was never announced")

    def _perform(self, effect: fx.Effect) -> None:
        _PERFORM[type(effect)](self, effect)

    def _start(self, effect: fx.StartStore | fx.StartLoad | fx.StartSpill) -> None:
        self.jobs[effect.job_id] = SimJob(effect, self.config.world_size)
        if self.truth is not None:
            self.started_at[effect.job_id] = self.events - 1

    def _drop(self, effect: fx.DropTierKeys) -> None:
        disk = self.disks[effect.tier - 1]
        for key in effect.keys:
            disk.pop(key, None)

    def _flush(self, effect: fx.FlushStores) -> None:
        for job_id in effect.job_ids:
            self._copy(self.jobs[job_id])

    def _pin(self, effect: fx.PinDeviceBlocks) -> None:
        for block in effect.block_ids:
            self._hold(block)

    def _unpin(self, effect: fx.UnpinDeviceBlocks) -> None:
        for block in effect.block_ids:
            self._release(block)

    def _violation(self, effect: fx.ReportViolation) -> None:  # strict mode raises first
        raise SimulationError(f"violation: {effect}")

    def _loadable(self, effect: fx.KeysLoadable) -> None:
        announced = self.announced[effect.tier]
        if not announced.isdisjoint(effect.keys):
            raise SimulationError(f"tier {effect.tier}: keys announced loadable twice")
        announced.update(effect.keys)

    def _unloadable(self, effect: fx.KeysUnloadable) -> None:
        announced = self.announced[effect.tier]
        if not announced.issuperset(effect.keys):
            raise SimulationError(f"tier {effect.tier}: keys announced unloadable that were not loadable")
        announced.difference_update(effect.keys)
        if self.truth is not None:
            seq = self.events - 1
            self.gone_at.update(dict.fromkeys(effect.keys, (seq, effect.reason, effect.tier)))
            if effect.reason is fx.Reason.RESET and self._rekeying:
                lost = (seq, effect.tier, self.generation - 1)
                self.reset_lost.update((self.first_key_of.get(k, k), lost) for k in effect.keys)

    def _failed(self, effect: fx.TransferFailed) -> None:
        """A notification for logs; the job's own reports carry the outcome."""

    def _ended(self, effect: fx.JobEnded) -> None:
        """Announced exactly when the job's last worker reported, as its own start named it."""
        if effect.job_id in self.jobs:
            raise SimulationError(f"job {effect.job_id} announced ended while a worker has yet to report")
        if effect.job_id not in self._last_reported:
            raise SimulationError(f"job {effect.job_id} announced ended by an event that was not its last report")
        started = self._last_reported.pop(effect.job_id)
        if effect.keys != started.keys or effect.kind != _KIND[type(started)]:
            raise SimulationError(f"job {effect.job_id} announced ended with other keys or kind than it started with")
        failed = set(effect.failed_keys)
        if (effect.job_id in self.failed_jobs) != bool(failed):
            raise SimulationError(f"job {effect.job_id}: its end names failed keys {bool(failed)}, its workers said "
                                  f"{effect.job_id in self.failed_jobs}")

    def _admitted(self, effect: fx.RequestAdmitted) -> None:
        """Announced for each admission this simulator makes, with the hit it chose."""
        expected = self._admitting
        if expected is None or expected != (effect.request_id, effect.local_tokens, effect.hit_tokens):
            raise SimulationError(f"admission announced as {effect}, made as {expected}")
        view = queries.request_view(self.state, effect.request_id)  # the engine's, just after the admission
        assert view is not None
        if (effect.num_tokens, effect.keys, effect.step_index) != (
                view.num_tokens, queries.request_keys(self.state, effect.request_id), self.state.core.step_index):
            raise SimulationError(f"{effect.request_id}: admission announced with other tokens, keys or step "
                                  "than the engine's state holds")
        self._admitting = None

    def _requeued(self, effect: fx.RequestRequeued) -> None:
        self._requeues.add(effect.job_id)

    def _not_admitted(self, effect: fx.KeysNotAdmitted) -> None:
        """Only a key host memory does not hold can be refused (one it holds is never offered)."""
        if not effect.keys or not self.announced[0].isdisjoint(effect.keys):
            raise SimulationError(f"keys refused that host memory holds, or none: {effect}")
        if self.truth is not None:
            self.refused_at.update(dict.fromkeys(effect.keys, self.events - 1))

    def _below_threshold(self, effect: fx.KeysBelowThreshold) -> None:
        """Only a key host memory does not hold is offered, and only under a threshold."""
        if (not effect.keys or not self.announced[0].isdisjoint(effect.keys)
                or self.config.store_threshold < 2):
            raise SimulationError(f"keys held back that host memory holds, or none, or with no threshold: {effect}")
        if self.truth is not None:
            self.below_at.update(dict.fromkeys(effect.keys, self.events - 1))

    def _spill_dropped(self, effect: fx.SpillDropped) -> None:
        """Only a tier told it is under pressure drops spills."""
        if not effect.keys or not self.pressured.get(effect.tier):
            raise SimulationError(f"a spill dropped to a tier under no pressure, or of no key: {effect}")
        if self.truth is not None:
            self.spill_dropped_at.update(dict.fromkeys(effect.keys, (self.events - 1, effect.tier)))

    def pressure(self, rng: random.Random) -> None:
        """vLLM's backpressure: a lower tier's writes measured slow (or well again)."""
        tier = rng.randrange(1, 1 + len(self.config.lower_tiers))
        drop = rng.choice([0, 500_000, 1_000_000])
        self.pressured[tier] = drop
        self.emit(ev.TierPressure(tier=tier, drop_ppm=drop, latency_ns_per_mib=rng.randrange(10**8)))

    def _copy(self, job: SimJob) -> None:
        """The worker's copy; the simulator runs it as late as it may."""
        if job.copied:
            return
        job.copied = True
        _COPY[type(job.effect)](self, job)

    def _copy_store(self, job: SimJob) -> None:
        effect = job.effect
        assert isinstance(effect, fx.StartStore)
        for blocks, slots in zip(effect.source_block_ids, effect.target_slot_ids):
            for block, slot in zip(blocks, slots):
                self.slot_content[slot] = self.content[block]

    def _copy_spill(self, job: SimJob) -> None:
        effect = job.effect
        assert isinstance(effect, fx.StartSpill)
        disk = self.disks[effect.tier - 1]
        for keys, slots in zip(effect.keys, effect.source_slot_ids):
            for key, slot in zip(keys, slots):
                disk[key] = self.slot_content.get(slot)

    def _copy_load(self, job: SimJob) -> None:
        effect = job.effect
        assert isinstance(effect, fx.StartLoad)
        self._promote(job, effect)
        for slots, blocks in zip(effect.source_slot_ids, effect.target_block_ids):
            for slot, block in zip(slots, blocks):
                self.dirty.discard(block)  # the load stream runs after the zeroing
                self.content[block] = None if block in job.failed else self.slot_content.get(slot)

    def _promote(self, job: SimJob, effect: fx.StartLoad) -> None:
        """Read promoted keys into their slots, as a worker checks a block file:
        a missing or corrupted block, or one with no slot, fails its target."""
        for tiers, keys, slots, blocks in zip(effect.promote_tiers, effect.keys, effect.source_slot_ids,
                                              effect.target_block_ids):
            for tier, key, slot, block in zip(tiers, keys, slots, blocks):
                if not tier:
                    continue
                content = self.disks[tier - 1].get(key)
                if slot < 0 or content != key:  # the header and checksum catch anything else
                    job.unread = job.unread or ("rejected" if slot < 0 else "missing" if content is None else "corrupt")
                    job.failed.add(block)
                    if slot >= 0:
                        self.slot_content[slot] = None
                else:
                    # A load planned before a rekeying reset reads its key's block, which may have
                    # been written after it (another process still on the earlier keys): the same
                    # tokens' KV that the reset renamed in this process's own copies.
                    self.slot_content[slot] = self.renamed.get(content, content)

    # The block pool.

    def _hold(self, block: int) -> None:
        self.holders[block] += 1
        self.free.pop(block, None)

    def _release(self, block: int) -> None:
        self.holders[block] -= 1
        assert self.holders[block] >= 0
        if self.holders[block] == 0:
            self.free[block] = None

    def _allocate(self) -> int:
        block = next(iter(self.free))
        del self.free[block]
        key = self.cached_key.pop(block, None)
        if key is not None and self.cached.get(key) == block:
            del self.cached[key]
        self.holders[block] = 1
        self.dirty.add(block)  # zeroed or overwritten by the next forward, after any flush
        return block

    def _free_table(self, request: SimRequest) -> None:
        for ids in request.table:
            for block in reversed(ids):
                if block != NULL_BLOCK_ID:
                    self._release(block)
        request.table = [[] for _ in self.groups]

    def _cache(self, key: bytes, block: int) -> None:
        if self.prefix_caching and key not in self.cached:
            self.cached[key] = block
            self.cached_key[block] = key

    # Requests.

    def keys(self, request: SimRequest, group_id: int, hashes: list[bytes] | None = None) -> list[bytes]:
        """The request's keys in a group (from `hashes`, its generation-0 hashes say, where given)."""
        hashes = request.hashes if hashes is None else hashes
        group = self.groups[group_id]
        per = group.block_size // self.config.hash_block_size
        suffix = group_id.to_bytes(4, "big")
        return [hashes[(i + 1) * per - 1] + suffix for i in range(len(hashes) // per)]

    def _keyed(self, first: bytes) -> bytes:
        """A block's hash under the current key generation, from its generation-0 hash."""
        return chain_hash("generation", self.generation, first) if self.generation else first

    def _tell(self, event: ev.RequestAdded | ev.BlockHashesAppended, first: list[bytes]) -> None:
        """Hashes named, and after a rekeying reset the same blocks' generation-0 hashes."""
        self.emit(event)
        if self.generation and first:
            request = self.requests[event.request_id]
            self.emit(ev.FirstGenerationHashes(request_id=request.rid, first=len(request.hashes) - len(first),
                                               block_hashes=tuple(first)))

    def add_request(self, doc: int, num_prompt_tokens: int, max_tokens: int) -> str:
        rid = f"req-{self.next_request}"
        self.next_request += 1
        size = self.config.hash_block_size
        first = [chain_hash(doc, i) for i in range(num_prompt_tokens // size)]
        hashes = [self._keyed(h) for h in first]
        self.requests[rid] = SimRequest(rid, doc, num_prompt_tokens, hashes, len(self.groups), max_tokens, first)
        self._tell(ev.RequestAdded(request_id=rid, num_prompt_tokens=num_prompt_tokens, block_hashes=hashes), first)
        return rid

    def add_turn(self, previous: tuple[int, list[bytes], int], extra_tokens: int, max_tokens: int) -> str:
        """A conversation's next turn: a finished request's whole blocks, its reply's among them,
        then `extra_tokens` of new text (`previous` from `finished_turns`)."""
        doc, hashes, num_tokens = previous
        rid = f"req-{self.next_request}"
        self.next_request += 1
        size = self.config.hash_block_size
        num_prompt_tokens = num_tokens + extra_tokens
        kept = hashes[:num_tokens // size]  # generation 0's (`finished_turns`)
        first = kept + [chain_hash("turn", rid, i) for i in range(len(kept), num_prompt_tokens // size)]
        self.next_doc += 1  # its reply continues a text of its own
        keyed = [self._keyed(h) for h in first]
        request = SimRequest(rid, self.next_doc, num_prompt_tokens, keyed, len(self.groups), max_tokens, first)
        self.requests[rid] = request
        self._tell(ev.RequestAdded(request_id=rid, num_prompt_tokens=num_prompt_tokens, block_hashes=keyed), first)
        return rid

    def waiting(self) -> list[str]:
        return [r.rid for r in self.requests.values() if r.status in ("waiting", "preempted")]

    def abortable(self) -> list[str]:
        """Requests a client may still cancel (an aborting one already was)."""
        return sorted(r.rid for r in self.requests.values() if r.status != "aborting")

    def running(self) -> list[str]:
        return [r.rid for r in self.requests.values() if r.status == "running"]

    def _local_hit(self, request: SimRequest) -> int:
        if not self.prefix_caching:
            return 0
        alignment = self.config.alignment_tokens
        keys = [self.keys(request, g.group_id) for g in self.groups]
        end = (request.num_tokens - 1) // alignment * alignment
        while end > 0:
            if all(p < len(keys[g.group_id]) and keys[g.group_id][p] in self.cached
                   for g in self.groups for p in hma.needed_range(g, 0, end)):
                return end
            end -= alignment
        return 0

    def admit(self, rid: str) -> bool:
        """vLLM's WAITING loop for one request: local hit, tier lookup, allocation."""
        request = self.requests[rid]
        local = self._local_hit(request)
        result = lookup(self.state, rid, local, 0, self.answers.get(rid))
        if result is self.answers.get(rid):  # a kept answer: it must be what a fresh walk finds
            fresh = lookup(self.state, rid, local)
            if fresh != result:
                raise AssertionError(f"{rid}: kept lookup answer {result} but a fresh lookup finds {fresh}")
        self.answers[rid] = result
        if not result.ready:
            return False
        ext = result.num_hit_tokens
        self._check_hit(request, local, ext)
        touched: list[list[int]] = []
        fresh_count = 0
        plans: list[list[bool]] = []
        for group in self.groups:
            gid = group.group_id
            keys = self.keys(request, gid)
            needed_local = set(hma.needed_range(group, 0, local))
            touched.append([self.cached[keys[p]] if p in needed_local else NULL_BLOCK_ID
                            for p in range(local // group.block_size)])
            needed_ext = set(hma.needed_range(group, local, local + ext))
            first_ext = local // group.block_size
            end_ext = (local + ext) // group.block_size
            total = hma.cdiv(request.num_tokens, group.block_size)
            plan = [p >= end_ext or p in needed_ext for p in range(first_ext, total)]
            plans.append(plan)
            fresh_count += sum(plan)
        new_touch = sum(1 for ids in touched for b in ids if b != NULL_BLOCK_ID and self.holders[b] == 0)
        if fresh_count > len(self.free) - new_touch:
            return False
        budgeted = None
        if result.budget is not None:  # restore_budget "auto" cut the hit: on the record first
            offered, load_us, compute_us = result.budget
            self.emit(ev.RestoreBudgeted(request_id=rid, offered_tokens=offered, kept_tokens=ext, load_us=load_us,
                                         compute_us=compute_us))
            budgeted = (offered, self.events - 1)
        if request.status == "preempted":
            self.emit(ev.RequestResumed(request_id=rid))
        if local:
            for ids in touched:
                for block in ids:
                    if block != NULL_BLOCK_ID:
                        self._hold(block)
            self.emit(ev.BlocksTouched(request_id=rid, block_ids=touched))
        allocated = [[self._allocate() if fresh else NULL_BLOCK_ID for fresh in plan] for plan in plans]
        request.table = [t + a for t, a in zip(touched, allocated)]
        if self.truth is not None:
            self._note_truth(request, local, ext, budgeted)
        request.computed = local + ext
        request.status = "loading" if ext else "running"
        self._admitting = (rid, local, ext)
        effects = self.emit(ev.BlocksAllocated(request_id=rid, block_ids=allocated, num_external_tokens=ext))
        if self._admitting is not None:
            raise SimulationError(f"{rid}: admitted without a RequestAdmitted")
        loads = [e for e in effects if isinstance(e, fx.StartLoad)]
        if ext:
            if len(loads) != 1:
                raise SimulationError(f"{rid}: a hit of {ext} tokens started {len(loads)} loads")
            request.load_job = loads[0].job_id
        del self.answers[rid]
        return True

    def measure_costs(self, rng: random.Random) -> None:
        """`restore_budget: "auto"`: what loads and prefills cost, as a server measures them (drawn)."""
        tiers = 1 + len(self.config.lower_tiers)
        self.emit(ev.RestoreCostsMeasured(
            compute_ns_per_token=rng.choice([1_000, 20_000, 200_000]),
            load_fixed_us=tuple(rng.choice([0, 200, 5_000]) for _ in range(tiers)),
            load_ns_per_block=tuple(rng.choice([10_000, 500_000, 5_000_000]) for _ in range(tiers))))

    def _note_truth(self, request: SimRequest, local: int, ext: int,
                    budgeted: tuple[int, int] | None = None) -> None:
        """The admission about to be emitted, as this simulator sees it (`truth`)."""
        assert self.truth is not None
        full = [g.group_id for g in self.groups if g.kind is GroupKind.FULL]
        axis = full[0] if full else 0
        size = self.groups[axis].block_size
        view = queries.request_view(self.state, request.rid)  # its tokens as the log has them (hashed or reported)
        assert view is not None
        num_tokens = view.num_tokens
        most = (num_tokens - 1) // self.config.alignment_tokens * self.config.alignment_tokens
        keys = self.keys(request, axis)[:most // size]
        storing: dict[bytes, tuple[int, int]] = {}  # key -> the last store in flight on it: job, its start's seq
        for job_id in sorted(self.jobs):
            effect = self.jobs[job_id].effect
            if isinstance(effect, fx.StartStore):
                storing.update(dict.fromkeys((k for group in effect.keys for k in group),
                                             (job_id, self.started_at[job_id])))
        tiers = range(1, 1 + len(self.config.lower_tiers))

        def loadable(key: bytes) -> bool:
            return queries.is_loadable(self.state, key) or any(queries.tier_holds(self.state, t, key) for t in tiers)

        # The first block after the hit: where it was loadable, the first block another group
        # needs for a hit through it that is not (what bounded the hit), as the state has it.
        first = (local + ext) // size
        bounded_by = None
        if first < len(keys) and loadable(keys[first]):
            end = (first + 1) * size
            for group in self.groups:
                if group.group_id == axis:
                    continue
                group_keys = self.keys(request, group.group_id)
                lacking = [p for p in hma.needed_range(group, 0, end)
                           if p >= len(group_keys) or not loadable(group_keys[p])]
                if lacking:
                    bounded_by = (group.group_id, lacking[0])
                    break
        self.truth.append({
            "request_id": request.rid, "seq": self.events, "local": local, "ext": ext,
            "num_tokens": num_tokens, "keys": keys,
            "loadable": [loadable(k) for k in keys],
            "bounded_by": bounded_by,
            "named_first": [self.first_named.get(k) == request.rid for k in keys],
            "named_by": [self.first_named.get(k) for k in keys],
            "ended_at": dict(self.ended_at),
            "unanswered": self.unanswered.get(request.rid),
            "gone": [self.gone_at.get(k) for k in keys],
            "reset_lost": [self.reset_lost.get(self.first_key_of.get(k)) for k in keys],  # type: ignore[arg-type]
            "refused": [self.refused_at.get(k, -1) for k in keys],
            "below": [self.below_at.get(k, -1) for k in keys],
            "budgeted": budgeted,
            "spill_dropped": [self.spill_dropped_at.get(k) for k in keys],
            "decode_named": [k in self.decode_named for k in keys],
            "storing": [storing.get(k) for k in keys]})

    def _check_hit(self, request: SimRequest, local: int, ext: int) -> None:
        """Lookup soundness: every key the hit needs is stored with the right content."""
        if ext == 0:
            return
        alignment = self.config.alignment_tokens
        if (local + ext) % alignment or local + ext >= request.num_tokens:
            raise SimulationError(f"{request.rid}: hit [{local}, {local + ext}) is unaligned or total")
        core = self.state.core
        for group in self.groups:
            keys = self.keys(request, group.group_id)
            for position in hma.needed_range(group, local, local + ext):
                slot = core.slot_of_key.get(keys[position], -1)
                if slot < 0 and any(keys[position] in tier.held for tier in core.lower):
                    continue  # promoted: its bytes are checked when read (they may be damaged)
                if slot < 0 or core.slot_state[slot] != SlotState.STORED:
                    raise SimulationError(f"{request.rid}: hit needs key at {position} that is not stored")
                if self.slot_content.get(slot) != keys[position]:
                    raise SimulationError(f"{request.rid}: slot {slot} does not hold the key it is offered for")

    def preempt(self, rid: str) -> None:
        request = self.requests[rid]
        self._free_table(request)
        request.computed = 0
        request.status = "preempted"
        self.emit(ev.RequestPreempted(request_id=rid))

    def abort(self, rid: str) -> None:
        request = self.requests[rid]
        self.emit(ev.RequestAborted(request_id=rid))
        if request.status == "loading":
            request.status = "aborting"
            return
        self._free_table(request)
        del self.requests[rid]

    def damage_tier(self, rng: random.Random, *, remove: bool) -> bytes | None:
        """Corrupt (or remove) one block a lower tier holds, behind the engine's back."""
        disks = [(i, k) for i, disk in enumerate(self.disks) for k in sorted(disk)]
        if not disks:
            return None
        index, key = rng.choice(disks)
        self.damaged.add(key)
        if remove:
            del self.disks[index][key]
        else:
            self.disks[index][key] = ("corrupt", key)
        return key

    def foreign_write(self, rng: random.Random, docs: int) -> None:
        """Another process stores blocks of a document to lower tier 1; a lookup finds them."""
        if not self.disks:
            return
        doc = rng.randrange(docs)
        size = self.config.hash_block_size
        hashes = [chain_hash(doc, i) for i in range(rng.randint(1, 4) * self.config.alignment_tokens // size)]
        found = []
        for group in self.groups:
            per = group.block_size // size
            suffix = group.group_id.to_bytes(4, "big")
            for i in range(len(hashes) // per):
                key = hashes[(i + 1) * per - 1] + suffix
                self.disks[0][key] = key
                found.append(key)
        self.emit(ev.TierKeysFound(tier=1, keys=tuple(found)))

    def lookup_failed(self, rid: str, reason: str) -> None:
        """Lower tier 1, shared, could not answer this request's lookup (down, timed out,
        dropped): asked once per request, as the connector asks."""
        self.unanswered[rid] = (reason, self.events)
        self.emit(ev.TierLookupFailed(tier=1, request_id=rid, reason=reason))

    def reset(self, *, sleep: bool = False, rekey: bool = False, keep: bool = False) -> None:
        """A cache reset; with `sleep`, then vLLM's sleep, which discards the KV
        cache: every free block loses its content and leaves the prefix cache.
        (vLLM sleeps with no request running, so a held block keeps its content
        here: a store still reading one must not be cut short.) With `rekey`, a
        new key generation begins, as the connector's does with tiers below host
        memory: every live request's blocks are keyed anew and told again. With
        `keep`, the tiers below host memory keep their blocks (`key_generations`
        "kept")."""
        self.epoch += 1
        self.reset_seqs.append(self.events)
        if rekey:
            self.generation += 1
        self._rekeying = rekey
        self.emit(ev.CacheReset(epoch=self.epoch, rekeyed=rekey, keep_lower=keep))
        self._rekeying = False
        if rekey:
            # The same tokens' KV under the new keys: a block, slot or file holding a live request's
            # block holds it under its new key (a load in flight still copies it to the request).
            renamed: dict[object, object] = {}
            for request in list(self.requests.values()):
                before = [self.keys(request, g.group_id) for g in self.groups]
                request.hashes = [self._keyed(h) for h in request.first_hashes]
                for group, old in zip(self.groups, before):
                    renamed.update(zip(old, self.keys(request, group.group_id)))
            self.renamed = {old: renamed.get(new, new) for old, new in self.renamed.items()}
            self.renamed.update(renamed)
            self.content = [renamed.get(c, c) for c in self.content]  # type: ignore[arg-type]
            self.slot_content = {slot: renamed.get(c, c) for slot, c in self.slot_content.items()}  # type: ignore[arg-type]
            self.disks = [{key: renamed.get(c, c) for key, c in disk.items()} for disk in self.disks]  # type: ignore[arg-type]
            for request in list(self.requests.values()):
                if request.hashes and request.status != "aborting":  # vLLM tells a cancelled request nothing
                    self._tell(ev.BlockHashesAppended(request_id=request.rid, num_tokens=request.num_tokens,
                                                      block_hashes=tuple(request.hashes)), request.first_hashes)
        if sleep:
            for block in self.free:
                self.content[block] = ("discarded by sleep", block)
                key = self.cached_key.pop(block, None)
                if key is not None and self.cached.get(key) == block:
                    del self.cached[key]

    # A scheduler step.

    def step(self, rids: list[str]) -> list[str]:
        """Schedule these running requests (preempting others for room), run
        the forward, sample. Returns the requests that ran."""
        scheduled: list[tuple[SimRequest, int]] = []
        pending = [r for r in rids if r in self.requests and self.requests[r].status == "running"]
        while pending:
            request = self.requests[pending.pop(0)]
            if request.status != "running":
                continue
            count = request.num_tokens - request.computed
            if self.chunk_tokens:
                count = min(count, self.chunk_tokens)
            if count <= 0:
                continue
            self._free_skipped(request)
            if not self._grow(request, request.computed + count, pending, scheduled):
                continue
            scheduled.append((request, count))
        if self.config.store_mode is StoreMode.LAZY:
            near = tuple(itertools.islice(self.free, self.lazy_target_blocks))
            if near:
                self.emit(ev.BlocksNearEviction(block_ids=near))
        self.step_index += 1
        self.emit(ev.StepScheduled(
            step_index=self.step_index, request_ids=[r.rid for r, _ in scheduled],
            num_computed_tokens=[r.computed for r, _ in scheduled],
            num_scheduled_tokens=[c for _, c in scheduled],
            wall_time_us=self.start_us + self.step_index * self.step_us))
        for block in self.dirty:  # the worker zeroes new blocks after handle_preemptions
            self.content[block] = None
        self.dirty.clear()
        for request, count in scheduled:
            if self.check_content:
                self._check_inputs(request)
            self._forward(request, count)
        for request, _ in scheduled:
            self._sample(request)
        return [r.rid for r, _ in scheduled]

    def _free_skipped(self, request: SimRequest) -> None:
        """vLLM's remove_skipped_blocks: sliding blocks wholly before the window."""
        freed: list[tuple[int, ...]] = []
        for group in self.groups:
            ids: list[int] = []
            if group.kind is GroupKind.SLIDING:
                skipped = max(0, request.computed - group.window + 1) // group.block_size
                table = request.table[group.group_id]
                for position in range(min(skipped, len(table))):
                    if table[position] != NULL_BLOCK_ID:
                        ids.append(table[position])
                        self._release(table[position])
                        table[position] = NULL_BLOCK_ID
            freed.append(tuple(ids))
        if any(freed):
            self.emit(ev.BlocksFreed(request_id=request.rid, block_ids=freed))

    def _grow(self, request: SimRequest, tokens: int, pending: list[str],
              scheduled: list[tuple[SimRequest, int]]) -> bool:
        need = [max(0, hma.cdiv(tokens, g.block_size) - len(request.table[g.group_id])) for g in self.groups]
        while sum(need) > len(self.free):
            victims = [r for r in self.running() if r != request.rid and r not in {s.rid for s, _ in scheduled}]
            victim = victims[-1] if victims else request.rid
            if victim in pending:
                pending.remove(victim)
            self.preempt(victim)
            if victim == request.rid:
                return False
        if not any(need):
            return True
        new = [[self._allocate() for _ in range(n)] for n in need]
        for group, ids in zip(self.groups, new):
            request.table[group.group_id].extend(ids)
        self.emit(ev.BlocksAllocated(request_id=request.rid, block_ids=new))
        return True

    def _check_inputs(self, request: SimRequest) -> None:
        """What the layers read before computing from `computed` is correct:
        the property behind "output with restored KV equals recompute"."""
        start = request.computed
        for group in self.groups:
            keys = self.keys(request, group.group_id)
            table = request.table[group.group_id]
            if group.kind is GroupKind.FULL:
                positions = range(0, start // group.block_size)
            elif group.kind is GroupKind.SLIDING:
                positions = range(max(0, start - group.window + 1) // group.block_size, start // group.block_size)
            else:
                continue
            for position in positions:
                if position >= len(keys):
                    continue
                block = table[position]
                if block == NULL_BLOCK_ID or self.content[block] != keys[position]:
                    raise SimulationError(
                        f"{request.rid}: group {group.group_id} position {position} reads block {block} "
                        f"holding {self.content[block]!r:.40} instead of its key")

    def _forward(self, request: SimRequest, count: int) -> None:
        for group in self.groups:
            keys = self.keys(request, group.group_id)
            table = request.table[group.group_id]
            size = group.block_size
            for position in range(request.computed // size, (request.computed + count) // size):
                block = table[position]
                if position < len(keys):
                    self.content[block] = keys[position]
                    self._cache(keys[position], block)
                else:
                    self.content[block] = ("unhashed", request.rid, position)
        request.computed += count

    def _sample(self, request: SimRequest) -> None:
        if request.computed < request.num_tokens:
            return  # chunked prefill continues
        request.num_output += 1
        if request.num_output >= request.max_tokens:
            self.finished_turns.append((request.doc, list(request.first_hashes), request.num_tokens))
            del self.finished_turns[:-16]
            final = [tuple(t) for t in request.table]
            self.emit(ev.RequestFinished(request_id=request.rid, block_ids=final))
            self._free_table(request)
            del self.requests[request.rid]
            return
        request.num_tokens += 1
        size = self.config.hash_block_size
        if request.num_tokens // size > len(request.hashes):
            first = chain_hash(request.doc, request.num_prompt_tokens, len(request.hashes))
            request.first_hashes.append(first)
            request.hashes.append(self._keyed(first))
            self._tell(ev.BlockHashesAppended(request_id=request.rid, num_tokens=request.num_tokens,
                                              block_hashes=(request.hashes[-1],)), [first])

    # The workers.

    def complete(self, job_id: int, worker: int, fail: bool, rng: random.Random | None = None) -> None:
        job = self.jobs[job_id]
        effect = job.effect
        if isinstance(effect, fx.StartLoad) and fail:
            flat = [b for ids in effect.target_block_ids for b in ids]
            chosen = {b for b in flat if rng is None or rng.random() < 0.5} or {flat[0]}
            job.failed |= chosen
        if isinstance(effect, fx.StartSpill) and fail:
            job.copied = True  # a failed write leaves nothing on disk
        self._copy(job)
        # Why, as a worker says it: a promoted block its tier could not give, else the copy.
        reason = job.unread or ("copy_failed" if fail else "")
        fail = fail or bool(job.failed)  # a promoted block that could not be read
        if fail:
            self.failed_jobs.add(job_id)
            self.failed_reports.setdefault(job_id, []).append(self.events)  # the seq the report gets
        job.pending.discard(worker)
        last = not job.pending
        if last:
            del self.jobs[job_id]
            self._last_reported[job_id] = effect  # its JobEnded must come with this report
        if isinstance(effect, (fx.StartStore, fx.StartSpill)):
            self.emit(ev.transfer_report(job_id, worker, load=False, failed=fail,
                                         reason="unwritable" if isinstance(effect, fx.StartSpill) and fail else reason))
        else:
            keys = [k for ks, bs in zip(effect.keys, effect.target_block_ids) for k, b in zip(ks, bs) if b in job.failed]
            self.emit(ev.transfer_report(job_id, worker, load=True, failed=fail, block_ids=sorted(job.failed),
                                         keys=keys, reason=reason))
        if self._last_reported.pop(job_id, None) is not None:
            raise SimulationError(f"job {job_id}: its last worker reported and no JobEnded announced its end")
        if last and isinstance(effect, fx.StartLoad):
            self._load_ended(job, effect)
        if self._requeues:
            raise SimulationError(f"loads {sorted(self._requeues)} announced their request requeued; it was not")

    def _load_ended(self, job: SimJob, effect: fx.StartLoad) -> None:
        request = self.requests.get(effect.request_id)
        if request is None or request.load_job != effect.job_id:
            return
        request.load_job = -1
        if request.status == "aborting":
            self._free_table(request)
            del self.requests[request.rid]
            return
        request.status = "running"
        if job.failed:
            self.load_failures += 1
            if len(self.groups) > 1:  # vLLM 0.32: failed_recving; blocks freed, admitted again
                self._requeue(request, effect.job_id)
                return
            group = self.groups[0]
            first = min(request.table[0].index(b) for b in job.failed)
            if first == 0:  # no valid token left: vLLM frees the table too
                self._requeue(request, effect.job_id)
                return
            request.computed = min(request.computed, first * group.block_size)
        for blocks, keys in zip(effect.target_block_ids, effect.keys):
            for block, key in zip(blocks, keys):
                if block not in job.failed:
                    self._cache(key, block)

    def _requeue(self, request: SimRequest, job_id: int) -> None:
        if job_id not in self._requeues:
            raise SimulationError(f"{request.rid}: sent back to waiting by load {job_id}, not announced")
        self._requeues.discard(job_id)
        self._free_table(request)
        request.computed = 0
        request.status = "waiting"

    # The model check.

    def check(self) -> None:
        check(self.state)
        core = self.state.core
        status_map = {"waiting": RequestStatus.WAITING, "running": RequestStatus.RUNNING,
                      "loading": RequestStatus.LOADING, "preempted": RequestStatus.PREEMPTED,
                      "aborting": RequestStatus.ABORTING}
        if set(core.requests) != set(self.requests):
            raise SimulationError(f"requests differ: {sorted(set(core.requests) ^ set(self.requests))}")
        for rid, request in self.requests.items():
            mine = core.requests[rid]
            if mine.status is not status_map[request.status]:
                raise SimulationError(f"{rid}: engine says {mine.status.value}, vLLM says {request.status}")
            if mine.table != request.table:
                raise SimulationError(f"{rid}: block tables differ")
        for block in range(1, self.config.num_device_blocks):
            if core.block_refs[block] + core.block_pins[block] != self.holders[block]:
                raise SimulationError(f"block {block}: engine refs+pins != vLLM holders")
        if set(core.jobs) != set(self.jobs):
            raise SimulationError("in-flight jobs differ")
        for key, slot in core.slot_of_key.items():
            if core.slot_state[slot] == SlotState.STORED and self.slot_content.get(slot) != key:
                raise SimulationError(f"slot {slot} is offered for a key it does not hold")
        for index, (tier, disk) in enumerate(zip(core.lower, self.disks), start=1):
            lost = [k for k in tier.held if k not in disk and k not in self.damaged]
            if lost:
                raise SimulationError(f"tier {index}: holds {len(lost)} keys no write put there")


def run_random(sim: Simulator, rng: random.Random, *, steps: int, arrivals: float = 0.5,
               docs: int = 3, max_prompt_blocks: int = 6, max_tokens: int = 6, fail_rate: float = 0.05,
               reset_rate: float = 0.0, abort_rate: float = 0.02, completion_rate: float = 0.4,
               check_every: int = 0, damage_rate: float = 0.0, foreign_rate: float = 0.0,
               lookup_fail_rate: float = 0.0, turn_rate: float = 0.0, pressure_rate: float = 0.0,
               keep_rate: float = 0.0) -> None:
    """A seeded workload: arrivals, admissions, steps and completions in random order;
    with lower tiers, blocks damaged on disk, blocks another process wrote, and
    lookups of tier 1 that go unanswered; with `turn_rate`, conversations' next turns;
    with `keep_rate`, resets that keep the lower tiers' blocks (of those not rekeying)."""
    size = sim.config.hash_block_size
    for n in range(steps):
        if damage_rate and sim.disks and rng.random() < damage_rate:  # no draw without lower tiers
            sim.damage_tier(rng, remove=rng.random() < 0.5)
        if foreign_rate and sim.disks and rng.random() < foreign_rate:
            sim.foreign_write(rng, docs)
        if rng.random() < arrivals:
            prompt = rng.randint(1, max_prompt_blocks) * size + rng.randrange(size)
            sim.add_request(rng.randrange(docs), prompt, rng.randint(1, max_tokens))
        if turn_rate and sim.finished_turns and rng.random() < turn_rate:  # no draw without turns
            sim.add_turn(rng.choice(sim.finished_turns), rng.randrange(1, 2 * size), rng.randint(1, max_tokens))
        if sim.config.restore_budget is RestoreBudget.AUTO and rng.random() < 0.1:  # no draw without the budget
            sim.measure_costs(rng)
        if pressure_rate and sim.disks and rng.random() < pressure_rate:  # no draw without lower tiers
            sim.pressure(rng)
        for rid in sim.waiting():
            if (lookup_fail_rate and sim.disks and rid not in sim.unanswered and sim.requests[rid].status == "waiting"
                    and rng.random() < lookup_fail_rate):
                sim.lookup_failed(rid, rng.choice(ev.LOOKUP_FAILURES))
            if not sim.admit(rid):
                break
        if rng.random() < abort_rate and sim.abortable():
            sim.abort(rng.choice(sim.abortable()))
        sim.step(sim.running())
        for job_id in sorted(sim.jobs):
            if rng.random() < completion_rate:
                job = sim.jobs[job_id]
                worker = rng.choice(sorted(job.pending))
                sim.complete(job_id, worker, rng.random() < fail_rate, rng)
        if reset_rate and rng.random() < reset_rate:
            sleep, rekey = rng.random() < 0.5, bool(sim.disks) and rng.random() < 0.5
            keep = bool(keep_rate) and bool(sim.disks) and not rekey and rng.random() < keep_rate  # no draw without it
            sim.reset(sleep=sleep, rekey=rekey, keep=keep)
        if check_every and n % check_every == 0:
            sim.check()


# Every effect kind, carried out as vLLM and the workers would (the checks of
# `engine.effects.ROUTES` in one place: a new kind must be simulated too).
_PERFORM = {
    fx.StartStore: Simulator._start,
    fx.StartLoad: Simulator._start,
    fx.FlushStores: Simulator._flush,
    fx.PinDeviceBlocks: Simulator._pin,
    fx.UnpinDeviceBlocks: Simulator._unpin,
    fx.ReportViolation: Simulator._violation,
    fx.KeysLoadable: Simulator._loadable,
    fx.KeysUnloadable: Simulator._unloadable,
    fx.TransferFailed: Simulator._failed,
    fx.JobEnded: Simulator._ended,
    fx.RequestAdmitted: Simulator._admitted,
    fx.RequestRequeued: Simulator._requeued,
    fx.KeysNotAdmitted: Simulator._not_admitted,
    fx.KeysBelowThreshold: Simulator._below_threshold,
    fx.SpillDropped: Simulator._spill_dropped,
    fx.StartSpill: Simulator._start,
    fx.DropTierKeys: Simulator._drop,
}
assert set(_PERFORM) == set(fx.EFFECT_TYPES), "the simulator must carry out every effect kind"

_KIND = {fx.StartStore: "store", fx.StartLoad: "load", fx.StartSpill: "spill"}

# Each job's copy, by the effect that started it: every kind `_PERFORM` starts as a job.
_COPY = {
    fx.StartStore: Simulator._copy_store,
    fx.StartSpill: Simulator._copy_spill,
    fx.StartLoad: Simulator._copy_load,
}
assert set(_COPY) == {kind for kind, perform in _PERFORM.items() if perform is Simulator._start}, \
    "every kind the simulator starts as a job needs its copy"
