"""Why each prompt block was restored or computed, from a log alone.

A fold over the events and what the engine answered each with, never the
engine's state: the notifications say all it needs (`RequestAdmitted`,
`JobEnded`, `RequestRequeued`, ...), so the same fold runs over a replay and
live, on the connector's own effects (`adapters/miss_counter.py`). Each admission of a request (its allocation
while waiting or preempted) splits its tokens into those vLLM's own prefix
cache held, those kvledger restored (from which tier, by which load), and
those computed, each computed block with the fact that made it a miss: the
key was first seen, evicted at seq N to make room for another request's store,
dropped by a reset, never admitted, still being stored, and so on. The facts
come from the engine's notifications (`KeysLoadable`, `KeysUnloadable`,
`KeysNotAdmitted`, `TransferFailed`) and its commands (`StartStore`,
`StartLoad`), which the simulator checks against the state after every event.

What a log cannot say, and so this does not: why a lower tier's lookup found
nothing (the tier was down, or timed out, or never held the key) when no
event records that lookup.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from functools import partial
from itertools import chain, groupby, islice, repeat
from typing import Any, Final

import attrs

from kvledger.engine import effects as fx
from kvledger.engine import hma
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupKind, StoreMode

from .admissions import Admission, Run

# Every cause a computed block can have, and what it means. The names are
# stable: the JSON output and the metrics' labels use them.
CAUSES: Final[dict[str, str]] = {
    "first_seen": "first time seen: no earlier request had this block",
    "tier_down": "first seen here, while a shared tier that may hold it was down: its lookup for this request "
                 "failed",
    "lookup_timed_out": "first seen here; a shared tier's lookup for this request did not answer in time",
    "lookup_dropped": "first seen here; a shared tier's lookups queued too deep, so this request's was answered "
                      "empty",
    "evicted": "evicted to make room for other blocks",
    "spill_dropped": "evicted from host memory, never written below it: that tier was under pressure and its "
                     "backpressure policy dropped the write",
    "reset": "dropped by a cache reset",
    "transfer_failed": "dropped when a transfer of it failed",
    "store_failed": "its store failed",
    "not_admitted": "not admitted: the tier was full of blocks it could not evict",
    "below_store_threshold": "not stored: fewer than `store_threshold` requests had offered it",
    "decode_not_offloaded": "a block of generated tokens, not stored under `offload_prompt_only`",
    "stored_too_late": "still being stored when this request was admitted",
    "not_computed_yet": "another request had it, but had not computed and stored it yet",
    "request_ended": "the request that computed it ended before its store",
    "lazy_not_offloaded": "lazy store mode: not offloaded yet (only blocks vLLM is about to evict are)",
    "after_gap": "restorable, but an earlier block of the prompt was not (a restore is a prefix)",
    "bounded_by_group": "restorable in full attention, but a sliding-window or Mamba group lacked a block the "
                        "hit's end needs (often one it never kept: such a group stores only the blocks its "
                        "layers read)",
    "no_host_slot": "restorable, but a longer hit would promote more blocks than host memory holds",
    "load_slower_than_compute": "restorable, but loading it was estimated slower than computing it "
                                "(`restore_budget: \"auto\"`)",
    "load_failed": "restored, then its load failed: recomputed",
    "promotion_failed": "restored from a tier below host memory, then reading it from that tier failed (the "
                        "report says why): recomputed",
    "partial_block": "the prompt's partial last block and last token: always computed, by design",
    "log_table": "what-if only: the log's block table, allocated for a shorter hit, lacks window blocks "
                 "this longer one needs",
    "unexplained": "the log holds no fact that explains this miss",
}
HOST: Final = 0


class MissLedger:
    """The fold. Feed it `observe(seq, event, state, effects)` for each event, then
    read `admissions`.

    Streamed (`on_admission` given), no admission is kept: each goes to
    `on_admission` once it can no longer change (at once, or when its load
    ends; `flush` sends those whose load the log never ends). Live, `bound`
    (called after each batch) keeps at most about `max_keys` entries of each
    fact, the oldest forgotten first; a key forgotten and named again counts
    as first seen if nothing newer is known about it. `keep`, where given,
    says which requests' admissions `admissions` keeps (`explain --request`).
    """

    def __init__(self, config: EngineConfig, *, on_admission: Callable[[Admission], None] | None = None,
                 max_keys: int = 0, keep: Callable[[str], bool] | None = None) -> None:
        self.config = config
        self.keep = keep
        self.first_timed_us = 0  # the wall time of the first admission after a timed step (0: none yet)
        self.on_admission = on_admission
        self.max_keys = max_keys
        self.groups = config.groups
        axis = [g for g in config.groups if g.kind is GroupKind.FULL]
        self.axis = axis[0].group_id if axis else 0  # blocks are counted in this group's size
        self.block_size = config.groups[self.axis].block_size
        self.alignment = config.alignment_tokens
        self.lazy = config.store_mode is StoreMode.LAZY
        # What the log has said about each key so far, one table per fact, each updated a notification
        # at a time (no object and no Python step per key where a C-level update does: the live
        # counter folds on the scheduler's thread). `keys`: the request that named each key first.
        self.keys: dict[bytes, str] = {}
        self._held: list[set[bytes]] = [set() for _ in range(1 + len(config.lower_tiers))]  # per tier, now
        # tier, seq, reason, job, request, and the worker's word for a failure (`FAILURE_REASONS`)
        self._gone: dict[bytes, tuple[int, int, fx.Reason, int, str, str]] = {}
        self._storing: dict[bytes, tuple[int, int, str]] = {}  # seq, job, request of its last store (in
        # flight while its job is in `_jobs`)
        self._store_failed: dict[bytes, tuple[int, int, str]] = {}  # seq, job, the worker's reason
        self._refused: dict[bytes, int] = {}  # seq of the last refusal
        self._below: dict[bytes, tuple[int, str]] = {}  # seq and request of the last offer below the threshold
        self._spill_dropped: dict[bytes, tuple[int, int]] = {}  # seq and tier of the last spill dropped for pressure
        # Under `offload_prompt_only`: keys first named past their request's prompt -> that request
        self._decode_named: dict[bytes, str] = {}
        self._prompt_tokens: dict[str, int] = {}  # the same: each live request's prompt length
        self.admissions: list[Admission] = []
        self._key_rules = hma.key_rules(config)
        self._hashes: dict[str, int] = {}  # request -> hashes it has named keys from so far
        self._ended: dict[str, int] = {}  # request -> seq it finished or was aborted
        self._unanswered: dict[str, tuple[int, int, str]] = {}  # request -> its lookup's failure: tier, seq, reason
        # request -> the budget's cut of its next admission, and that event's seq
        self._budgeted: dict[str, tuple[ev.RestoreBudgeted, int]] = {}
        self._attempts: dict[str, int] = {}
        self._jobs: dict[int, str] = {}  # the stores and loads in flight -> their kind
        self._ended_jobs: list[int] = []  # the jobs this event ended (`JobEnded`), folded after its other facts
        self._loads: dict[int, tuple[Admission, tuple[bytes, ...]]] = {}  # load job -> the admission it
        # restores, and that admission's keys (in the group blocks are counted in)
        self._requeued: set[int] = set()  # load jobs whose failure sent their request back to waiting
        self._late: dict[int, list[Run]] = {}  # store job -> runs "stored_too_late" waiting for its end
        # load job -> the first report's seq, every failed key, and the first report's worker and reason
        self._load_failures: dict[int, tuple[int, set[bytes], int, str]] = {}
        self._wall_us = 0
        self.cut: dict[str, int] = {}  # what-if: request -> the hit its lookup offered, cut to fit the log's table
        # Key generations (`ev.FirstGenerationHashes`): each key named after a rekeying reset -> the same
        # block's key in generation 0; each block a rekeying reset dropped, by its generation-0 key -> the
        # tier, the reset's seq and the generation it was stored under. The last `_name`: request, start, hashes.
        self._generation = 0
        self._rekeyed_at = -1  # the seq of the last rekeying reset
        self._first_keys: dict[bytes, bytes] = {}
        self._reset_lost: dict[bytes, tuple[int, int, int]] = {}
        self._last_named: tuple[str, int, tuple[bytes, ...]] = ("", -1, ())

    # The fold.

    def observe(self, seq: int, event: ev.Event, state: object, effects: tuple[fx.Effect, ...]) -> None:
        """One event and the effects the engine answered it with (its own, not its step's). The
        state is not read: the signature is replay's `observe`'s, so a replay calls this directly
        (no wrapper call an event)."""
        follow = _FOLLOW.get(type(event))
        if follow is not None and not (effects and type(effects[0]) is fx.ReportViolation):  # applied
            follow(self, seq, event)
        facts = _FACTS
        for effect in effects:
            handle = facts[type(effect)]
            if handle is not None:
                handle(self, seq, effect, effects)
        if self._ended_jobs:
            ended, self._ended_jobs = self._ended_jobs, []
            for job_id in ended:  # after the event's other facts (a store's end makes its keys loadable)
                self._job_ended(seq, job_id)

    def bound(self) -> None:
        """Live: past `max_keys` entries, a table forgets its oldest until a quarter of it is free
        again (the ended requests too: many requests may name few keys). What each tier holds is
        not bounded here: it is what the tier holds, bounded by the tier's own size."""
        most = self.max_keys
        if not most:  # unbounded (a replay's explain)
            return
        for table in (self.keys, self._gone, self._storing, self._store_failed, self._refused, self._below,
                      self._spill_dropped, self._first_keys, self._reset_lost,
                      self._decode_named, self._ended, self._unanswered):
            _bound(table, most)

    def flush(self) -> None:
        """Streamed: send the admissions whose load has not ended (the log ends first), as a
        replay's `admissions` holds them."""
        if self.on_admission is not None:
            for admission, _keys in sorted(self._loads.values(), key=lambda loading: loading[0].seq):
                self.on_admission(admission)
        self._loads.clear()

    # What the ledger follows of the events themselves: the keys each request names (derived
    # from its hashes as the engine derives them), its end, and the steps' times.

    def _added(self, seq: int, event: ev.RequestAdded) -> None:
        self._hashes[event.request_id] = 0
        if self.config.offload_prompt_only:
            self._prompt_tokens[event.request_id] = event.num_prompt_tokens
        self._name(event.request_id, event.block_hashes)

    def _appended(self, seq: int, event: ev.BlockHashesAppended) -> None:
        self._name(event.request_id, event.block_hashes)

    def _name(self, rid: str, hashes: tuple[bytes, ...]) -> None:
        """Name the keys of the blocks whose last hash is among these (`hma.append_keys`'s rule)."""
        start = self._hashes.get(rid, 0)
        self._hashes[rid] = start + len(hashes)
        if self._generation:
            self._last_named = (rid, start, hashes)
        name = self.keys.setdefault  # the first to name a key keeps it; C-level loops, no per-key step
        prompt = self._prompt_tokens.get(rid, -1)  # under `offload_prompt_only` alone
        for group, (per_block, suffix) in zip(self.groups, self._key_rules):
            last = _last_hashes(hashes, start, per_block)
            if last:
                _drain(map(name, map(bytes.__add__, last, repeat(suffix)) if suffix else last, repeat(rid)))
                if prompt >= 0:
                    self._name_decode(rid, start // per_block, last, suffix, prompt // group.block_size)

    def _name_decode(self, rid: str, first: int, last: tuple[bytes, ...], suffix: bytes, prompt_blocks: int) -> None:
        """Keys this request named first past its prompt's whole blocks (block `first` on): never
        stored under `offload_prompt_only`."""
        named = self.keys
        for position, hashed in enumerate(last, first):
            key = hashed + suffix
            if position >= prompt_blocks and named.get(key) == rid:
                self._decode_named.setdefault(key, rid)

    def _first_generation(self, seq: int, event: ev.FirstGenerationHashes) -> None:
        """The generation-0 keys of the blocks just named, by the same rule (`_name`)."""
        rid, start, hashes = self._last_named
        if rid != event.request_id or start != event.first or len(hashes) != len(event.block_hashes):
            return  # not beside the hashes it names: nothing to pair
        for per_block, suffix in self._key_rules:
            now, then = _last_hashes(hashes, start, per_block), _last_hashes(event.block_hashes, start, per_block)
            if suffix:
                now, then = tuple(h + suffix for h in now), tuple(h + suffix for h in then)
            self._first_keys.update(zip(now, then))

    def _rewound(self, seq: int, event: ev.BlockHashesRewound) -> None:
        self._hashes[event.request_id] = event.num_hashes

    def _budget(self, seq: int, event: ev.RestoreBudgeted) -> None:
        self._budgeted[event.request_id] = (event, seq)

    def _lookup_failed(self, seq: int, event: ev.TierLookupFailed) -> None:
        self._unanswered.setdefault(event.request_id, (event.tier, seq, event.reason))

    def _request_ended(self, seq: int, event: ev.RequestFinished | ev.RequestAborted) -> None:
        rid = event.request_id
        self._ended[rid] = seq
        self._prompt_tokens.pop(rid, None)
        self._budgeted.pop(rid, None)
        self._unanswered.pop(rid, None)
        self._hashes.pop(rid, None)
        self._attempts.pop(rid, None)

    def _step(self, seq: int, event: ev.StepScheduled) -> None:
        self._wall_us = event.wall_time_us

    def _reset(self, seq: int, event: ev.CacheReset) -> None:
        if event.rekeyed:  # every request's keys start again, under a new generation
            self._hashes = dict.fromkeys(self._hashes, 0)
            self._generation += 1
            self._rekeyed_at = seq

    def _became_loadable(self, seq: int, effect: fx.KeysLoadable, effects: tuple[fx.Effect, ...]) -> None:
        self._held[effect.tier].update(effect.keys)

    def _unloadable(self, seq: int, effect: fx.KeysUnloadable, effects: tuple[fx.Effect, ...]) -> None:
        job, room = _room(effects)
        self._held[effect.tier].difference_update(effect.keys)
        if seq == self._rekeyed_at and effect.reason is fx.Reason.RESET:  # lost to the new generation
            first = self._first_keys.get
            lost = (effect.tier, seq, self._generation - 1)
            self._reset_lost.update((first(key, key), lost) for key in effect.keys)
        why = _failure_reason(effects) if effect.reason is fx.Reason.FAILED else ""
        self._gone.update(dict.fromkeys(effect.keys, (effect.tier, seq, effect.reason, job, room, why)))

    def _store_started(self, seq: int, effect: fx.StartStore, effects: tuple[fx.Effect, ...]) -> None:
        self._jobs[effect.job_id] = "store"
        self._storing.update(dict.fromkeys(chain.from_iterable(effect.keys), (seq, effect.job_id, effect.request_id)))

    def _load_started(self, seq: int, effect: fx.StartLoad, effects: tuple[fx.Effect, ...]) -> None:
        self._jobs[effect.job_id] = "load"

    def _tiers_holding(self, key: bytes) -> int:
        """The tiers that hold the key now, one bit each (bit 0: host memory)."""
        bits = 0
        for tier, held in enumerate(self._held):
            if key in held:
                bits |= 1 << tier
        return bits

    def _job_over(self, seq: int, effect: fx.JobEnded, effects: tuple[fx.Effect, ...]) -> None:
        if effect.job_id in self._jobs:
            self._ended_jobs.append(effect.job_id)

    def _requeue(self, seq: int, effect: fx.RequestRequeued, effects: tuple[fx.Effect, ...]) -> None:
        self._requeued.add(effect.job_id)

    def _not_admitted(self, seq: int, effect: fx.KeysNotAdmitted, effects: tuple[fx.Effect, ...]) -> None:
        self._refused.update(dict.fromkeys(effect.keys, seq))

    def _spill_was_dropped(self, seq: int, effect: fx.SpillDropped, effects: tuple[fx.Effect, ...]) -> None:
        self._spill_dropped.update(dict.fromkeys(effect.keys, (seq, effect.tier)))

    def _below_threshold(self, seq: int, effect: fx.KeysBelowThreshold, effects: tuple[fx.Effect, ...]) -> None:
        self._below.update(dict.fromkeys(effect.keys, (seq, effect.request_id)))

    def _failed(self, seq: int, effect: fx.TransferFailed, effects: tuple[fx.Effect, ...]) -> None:
        if effect.kind == "store":
            self._store_failed.update(dict.fromkeys(effect.keys, (seq, effect.job_id, effect.reason)))
        elif effect.kind == "load":
            seen = self._load_failures.get(effect.job_id)
            if seen is None:
                self._load_failures[effect.job_id] = (seq, set(effect.keys), effect.worker_index, effect.reason)
            else:  # another worker's: the first report's seq, worker and reason stand
                seen[1].update(effect.keys)
        # a spill's failure: its keys stay in host memory, and `KeysUnloadable` says if they leave

    def _job_ended(self, seq: int, job_id: int) -> None:
        if self._jobs.pop(job_id) == "store":  # its keys' `_storing` lapse with it
            for run in self._late.pop(job_id, ()):
                run.detail = f"its store ended at seq {seq}"
        else:
            self._load_ended(seq, job_id)

    def _load_ended(self, seq: int, job_id: int) -> None:
        loading = self._loads.pop(job_id, None)
        failure = self._load_failures.pop(job_id, None)
        requeued = job_id in self._requeued
        self._requeued.discard(job_id)
        if loading is None:
            return
        admission, keys = loading
        if failure is not None:
            self._load_failed(seq, job_id, admission, keys, failure, requeued)
        if self.on_admission is not None:
            self.on_admission(admission)

    def _load_failed(self, seq: int, job_id: int, admission: Admission, keys: tuple[bytes, ...],
                     failure: tuple[int, set[bytes], int, str], requeued: bool) -> None:
        """With a failure, the request either recomputes from the first failed
        block or, sent back to waiting (`RequestRequeued`), is admitted again. A
        block restored from a lower tier whose report names a tier's reason failed
        in its read there (`promotion_failed`); a report with no reason (logs
        before 0.3.0) or a copy's says only that the load failed."""
        failed_seq, failed, worker, reason = failure
        if requeued:
            admission.superseded_at = seq  # its next admission counts instead
            return
        if self._ended.get(admission.request_id, -1) > admission.seq:  # aborted while loading: nothing was
            return  # computed after all
        split: list[Run] = []
        for run in admission.runs:
            bad = [p for p in range(run.first_block, run.last_block + 1) if p < len(keys) and keys[p] in failed]
            if run.outcome != "restored" or not bad:
                split.append(run)
                continue
            first = min(bad)  # the engine recomputes from the first failed block on
            if first > run.first_block:
                split.append(attrs.evolve(run, last_block=first - 1, end_token=first * self.block_size))
            promoted = run.tier > HOST and reason not in ("", "copy_failed")
            split.append(attrs.evolve(run, first_block=first, first_token=first * self.block_size,
                                      outcome="missed", cause="promotion_failed" if promoted else "load_failed",
                                      seq=failed_seq, job_id=job_id,
                                      detail=f"worker {worker} reported it failed" + _reason_words(reason, ": ")))
        admission.runs = split

    # An admission, classified before this event's own effects are folded in.

    def _admit(self, seq: int, admitted: fx.RequestAdmitted, effects: tuple[fx.Effect, ...]) -> None:
        rid = admitted.request_id
        keys = admitted.keys
        ext = admitted.hit_tokens
        local = admitted.local_tokens
        n = admitted.num_tokens
        most = (n - 1) // self.alignment * self.alignment
        size = self.block_size
        self._attempts[rid] = attempt = self._attempts.get(rid, 0) + 1
        admission = Admission(rid, seq, admitted.step_index, n, attempt, self._wall_us)
        load = next((e for e in effects if isinstance(e, fx.StartLoad)), None)
        promoted: dict[bytes, int] = {}
        job = -1
        if load is not None:
            admission.load_job = job = load.job_id
            self._loads[job] = (admission, keys[self.axis])
            for tiers, group_keys in zip(load.promote_tiers, load.keys):
                promoted.update((k, t) for k, t in zip(group_keys, tiers) if t)
        axis_keys = keys[self.axis]
        runs = admission.runs
        if local >= size:
            runs.append(Run(0, local // size - 1, 0, local // size * size, "device"))
        restored = [(promoted.get(axis_keys[p], HOST), seq, job) for p in range(local // size, (local + ext) // size)]
        _merge(runs, local // size, size, "restored", restored)
        first_missed = (local + ext) // size
        budgeted, budget_seq = self._budgeted.pop(rid, (None, -1))
        cut_end = (local + budgeted.offered_tokens) // size if budgeted is not None else -1
        fast = self._never_stored_run(axis_keys, first_missed, most // size, rid) if budgeted is None else None
        whys: list[_Why] = [] if fast is None else fast
        for p in range(first_missed, most // size) if fast is None else ():
            key = axis_keys[p] if p < len(axis_keys) else b""
            loadable = self._tiers_holding(key)
            if loadable and p < cut_end:
                assert budgeted is not None
                why = ("load_slower_than_compute", -1, budget_seq, -1, "",
                       f"load estimated {_duration(budgeted.load_us)} against compute "
                       f"{_duration(budgeted.compute_us)}")
            elif loadable:
                if p == first_missed and self.cut.get(rid, -1) > ext:
                    why = ("log_table", -1, -1, -1, "", f"its lookup offered {self.cut[rid]} tokens")
                elif p == first_missed:
                    why = self._bounded(keys, p, loadable)
                else:
                    why = ("after_gap", -1, -1, -1, "", f"block {first_missed} was not restorable")
            else:
                why = self._why_not(key, rid, self.groups[self.axis].kind)
            whys.append(why)
        _merge(runs, first_missed, size, "missed", whys)
        start = max(most, local + ext)
        if n > start:
            runs.append(Run(start // size, (n - 1) // size, start, n, "missed", cause="partial_block"))
        self.cut.pop(rid, None)
        if self._wall_us and not self.first_timed_us:
            self.first_timed_us = self._wall_us
        if self.on_admission is None:
            if self.keep is not None and not self.keep(rid):
                return
            self.admissions.append(admission)  # in order of admission; a load's end only amends it
            for run in runs:
                if run.cause == "stored_too_late":
                    self._late.setdefault(run.job_id, []).append(run)
        elif load is None:
            self.on_admission(admission)

    def _never_stored_run(self, axis_keys: tuple[bytes, ...], first: int, end: int, rid: str) -> list[_Why] | None:
        """The whys of blocks `first` to `end` when no fact names any of their keys
        (the common miss: blocks never stored), found in C-level set and map steps
        rather than a Python step per block; None where a fact does (`_why_not` then)."""
        if end > len(axis_keys) or first >= end:
            return None if first < end else []
        keys = axis_keys[first:end]
        if not all(map(set.isdisjoint, self._held, repeat(keys))):
            return None
        for facts in (self._storing, self._gone, self._store_failed, self._refused, self._below, self._decode_named):
            if facts and not facts.keys().isdisjoint(keys):
                return None
        if self._reset_lost and not self._reset_lost.keys().isdisjoint(map(self._first_keys.get, keys, keys)):
            return None  # held under an earlier key generation
        kind = self.groups[self.axis].kind
        whys: list[_Why] = []
        for named_by, same in groupby(map(self.keys.get, keys)):
            if named_by is None:
                return None  # a key no request named: unexplained (`_why_not`)
            whys.extend(repeat(self._never_stored(named_by, rid, kind), len(list(same))))
        return whys

    def _why_not(self, key: bytes, rid: str, kind: GroupKind) -> _Why:
        """A key loadable nowhere: the latest fact about it."""
        storing = self._storing.get(key)
        if storing is not None and storing[1] in self._jobs:
            seq, job, other = storing
            return ("stored_too_late", -1, seq, job, other, "")
        gone = self._gone.get(key)
        store_failed = self._store_failed.get(key)
        refused = self._refused.get(key, -1)
        below = self._below.get(key)
        latest = max(gone[1] if gone else -1, store_failed[0] if store_failed else -1, refused,
                     below[0] if below else -1)
        if gone is not None and gone[1] == latest:
            tier, seq, reason, job, room, why = gone
            dropped = self._spill_dropped.get(key)
            if reason is fx.Reason.EVICTED and tier == HOST and dropped is not None and dropped[0] < seq:
                return ("spill_dropped", dropped[1], dropped[0], -1, "", f"evicted from host memory at seq {seq}")
            if reason is fx.Reason.EVICTED:
                return ("evicted", tier, seq, job, room,
                        f"policy {self.config.policy.value}" if tier == HOST else "by the tier's own eviction")
            return ("reset" if reason is fx.Reason.RESET else "transfer_failed", tier, seq, -1, "",
                    _reason_words(why))
        if store_failed is not None and store_failed[0] == latest:
            seq, job, why = store_failed
            return ("store_failed", -1, seq, job, "", _reason_words(why))
        if refused >= 0 and refused == latest:
            return ("not_admitted", -1, refused, -1, "", "")
        if below is not None:
            return ("below_store_threshold", -1, below[0], -1, below[1],
                    f"store_threshold {self.config.store_threshold}")
        decoded_by = self._decode_named.get(key)
        if decoded_by is not None:
            return ("decode_not_offloaded", -1, -1, -1, decoded_by, "")
        named_by = self.keys.get(key)
        if named_by is None and not key:
            return ("unexplained", -1, -1, -1, "", "")
        return self._never_stored(named_by or "", rid, kind, self._first_keys.get(key))

    def _never_stored(self, named_by: str, rid: str, kind: GroupKind, key_first: bytes | None = None) -> _Why:
        """`key_first`: the key's generation-0 key, where it was named after a rekeying reset."""
        if named_by in ("", rid):
            unanswered = self._unanswered.get(rid)
            if unanswered is not None:  # the one place it may have been: the shared tier, unasked
                tier, seq, reason = unanswered
                return (_LOOKUP_CAUSES[reason], tier, seq, -1, "", "")
            if key_first is not None:  # new under this key generation: was it held under an earlier one?
                lost = self._reset_lost.get(key_first)
                if lost is not None:
                    tier, seq, generation = lost
                    return ("reset", tier, seq, -1, "", f"stored under key generation {generation}")
            return ("first_seen", -1, -1, -1, "", "")
        if kind is not GroupKind.FULL:
            return ("never kept by its group", -1, -1, -1, "", "")
        if self.lazy:
            return ("lazy_not_offloaded", -1, -1, -1, "", "")
        if named_by in self._ended:
            return ("request_ended", -1, self._ended[named_by], -1, named_by, "")
        return ("not_computed_yet", -1, -1, -1, named_by, "")

    def _bounded(self, keys: tuple[tuple[bytes, ...], ...], position: int, loadable: int) -> _Why:
        """The first missed block's key was loadable: what else stopped the hit."""
        end = (position + 1) * self.block_size
        for group in self.groups:
            if group.group_id == self.axis:
                continue
            for p in hma.needed_range(group, 0, end):
                key = keys[group.group_id][p] if p < len(keys[group.group_id]) else b""
                if not self._tiers_holding(key):
                    cause, _, seq, _, request, _ = self._why_not(key, "", group.kind)
                    return ("bounded_by_group", -1, seq, -1, request,
                            f"group {group.group_id} ({group.kind.value}) block {p}: {cause}")
        if end % self.alignment:
            return ("bounded_by_group", -1, -1, -1, "",
                    f"a hit must end on a multiple of {self.alignment} tokens (every group's block)")
        if self.config.lower_tiers:
            return ("no_host_slot", (loadable & -loadable).bit_length() - 1, -1, -1, "",
                    f"host memory has {self.config.num_tier_slots} slots")
        return ("unexplained", -1, -1, -1, "", "")


_LOOKUP_CAUSES: Final = {"down": "tier_down", "timed_out": "lookup_timed_out", "dropped": "lookup_dropped"}
assert set(_LOOKUP_CAUSES) == set(ev.LOOKUP_FAILURES) and set(_LOOKUP_CAUSES.values()) <= set(CAUSES)

# Why a block was computed, or where it was restored from: a run's fields after its outcome.
_Why = tuple[str, int, int, int, str, str]


def _merge(runs: list[Run], first: int, size: int, outcome: str, whys: list) -> None:
    """Runs of consecutive blocks from `first` on with equal whys (for
    restored blocks: tier, seq, job)."""
    start, last = first, None
    for p, why in enumerate(whys, first):
        if why != last:
            if last is not None:
                runs.append(_run(start, p - 1, size, outcome, last))
            start, last = p, why
    if last is not None:
        runs.append(_run(start, first + len(whys) - 1, size, outcome, last))


def _run(first: int, last: int, size: int, outcome: str, why: tuple) -> Run:
    if outcome == "restored":
        tier, seq, job = why
        return Run(first, last, first * size, (last + 1) * size, outcome, tier=tier, seq=seq, job_id=job)
    return Run(first, last, first * size, (last + 1) * size, outcome, *why)


_drain: Callable[[Iterable[object]], object] = partial(deque, maxlen=0)  # runs an iterator of C-level calls to its end, keeping nothing


def _last_hashes(hashes: tuple[bytes, ...], start: int, per_block: int) -> tuple[bytes, ...]:
    """Of a request's hashes from hash `start` on, the last of each block of `per_block`
    hashes (`hma.append_keys`'s rule): a group's keys are these, with its suffix."""
    return hashes[(start // per_block + 1) * per_block - 1 - start::per_block]


def _bound(memory: dict, most: int) -> None:
    """Live: past `most` entries, forget the oldest until a quarter of it is free again."""
    if len(memory) > most:
        for key in list(islice(memory, len(memory) - most * 3 // 4)):
            del memory[key]


def _failure_reason(effects: tuple[fx.Effect, ...]) -> str:
    """The worker's reason for the failure that dropped keys (the event's `TransferFailed`)."""
    for effect in effects:
        if type(effect) is fx.TransferFailed:
            return effect.reason
    return ""


def _duration(us: int) -> str:
    """An estimate in words: 40 us, 1.2 ms, 3.40 s."""
    if us < 1000:
        return f"{us} us"
    return f"{us / 1000:.1f} ms" if us < 1_000_000 else f"{us / 1e6:.2f} s"


def _reason_words(reason: str, lead: str = "") -> str:
    """A worker's failure reason for a run's detail: the word and what it means ("" for none)."""
    if not reason:
        return ""
    return f"{lead}{reason} ({ev.FAILURE_REASONS.get(reason, 'a reason this build does not know')})"


def _room(effects: tuple[fx.Effect, ...]) -> tuple[int, str]:
    """The job an eviction made room for: the store or load started with it."""
    for effect in effects:
        if isinstance(effect, (fx.StartStore, fx.StartLoad)):
            return effect.job_id, effect.request_id
    return -1, ""


class Tally:
    """Tokens by outcome and missed tokens by cause, added an admission at a time:
    `explain` folds a log of any length in the memory of one admission."""

    def __init__(self) -> None:
        self.admissions = 0
        self.superseded = 0
        self.superseded_restored = 0
        self.prompt_tokens = 0
        self.device_tokens = 0
        self.restored_tokens = 0
        self.missed_tokens = 0
        self.restored_by_tier: dict[str, int] = {}
        self.by_cause: dict[str, dict[str, int]] = {}

    def add(self, admission: Admission) -> None:
        if admission.superseded_at >= 0:  # a failed load sent its request back: the next admission counts
            self.superseded += 1
            self.superseded_restored += admission.tokens("restored")
            return
        self.admissions += 1
        self.prompt_tokens += admission.num_tokens
        seen: set[str] = set()
        for run in admission.runs:
            tokens = run.tokens
            if run.outcome == "device":
                self.device_tokens += tokens
            elif run.outcome == "restored":
                self.restored_tokens += tokens
                name = "host" if run.tier == HOST else f"tier {run.tier}"
                self.restored_by_tier[name] = self.restored_by_tier.get(name, 0) + tokens
            else:
                self.missed_tokens += tokens
                entry = self.by_cause.get(run.cause)
                if entry is None:
                    entry = self.by_cause[run.cause] = {"tokens": 0, "blocks": 0, "admissions": 0}
                entry["tokens"] += tokens
                entry["blocks"] += run.last_block - run.first_block + 1
                if run.cause not in seen:
                    seen.add(run.cause)
                    entry["admissions"] += 1

    def as_dict(self) -> dict:
        by_cause = self.by_cause
        missed_load = sum(by_cause.get(cause, {}).get("tokens", 0) for cause in ("load_failed", "promotion_failed"))
        return {
            "admissions": self.admissions,
            # Admissions whose load failed and sent the request back to waiting: its next one counts
            # instead; what they restored was recomputed there.
            "superseded": {"admissions": self.superseded, "restored_tokens": self.superseded_restored},
            "prompt_tokens": self.prompt_tokens,
            "device_tokens": self.device_tokens,
            "restored_tokens": self.restored_tokens,
            "restored_by_tier": dict(sorted(self.restored_by_tier.items())),
            "missed_tokens": self.missed_tokens,
            "missed_by_cause": {cause: dict(entry) for cause, entry in
                                sorted(by_cause.items(), key=lambda item: (-item[1]["tokens"], item[0]))},
            # What the engine counts as hit tokens (at each load's start): these restores, those
            # whose load then failed, and the superseded admissions'.
            "hit_tokens": self.restored_tokens + self.superseded_restored + missed_load,
        }


def totals(admissions: Iterable[Admission]) -> dict:
    """Tokens by outcome and missed tokens by cause, over admissions that count."""
    tally = Tally()
    for admission in admissions:
        tally.add(admission)
    return tally.as_dict()


# What each effect kind tells the ledger about a key's history. Ignored: a spill (the key stays
# loadable from host memory meanwhile), removed copies (`KeysUnloadable` carries why), the rest.
_FACTS: dict[type, Callable[[MissLedger, int, Any, tuple[fx.Effect, ...]], None] | None] = fx.dispatch_table("misses", {
    fx.KeysLoadable: MissLedger._became_loadable,
    fx.KeysUnloadable: MissLedger._unloadable,
    fx.StartStore: MissLedger._store_started,
    fx.StartLoad: MissLedger._load_started,
    fx.KeysNotAdmitted: MissLedger._not_admitted,
    fx.KeysBelowThreshold: MissLedger._below_threshold,
    fx.SpillDropped: MissLedger._spill_was_dropped,
    fx.TransferFailed: MissLedger._failed,
    fx.JobEnded: MissLedger._job_over,
    fx.RequestAdmitted: MissLedger._admit,
    fx.RequestRequeued: MissLedger._requeue,
}, ignored=(fx.StartSpill, fx.DropTierKeys, fx.FlushStores, fx.PinDeviceBlocks, fx.UnpinDeviceBlocks,
            fx.ReportViolation))

# What the ledger follows of the events themselves (the rest it learns from the effects).
_FOLLOW: dict[type, Callable[[MissLedger, int, Any], None]] = {
    ev.RequestAdded: MissLedger._added,
    ev.BlockHashesAppended: MissLedger._appended,
    ev.BlockHashesRewound: MissLedger._rewound,
    ev.RequestFinished: MissLedger._request_ended,
    ev.RequestAborted: MissLedger._request_ended,
    ev.StepScheduled: MissLedger._step,
    ev.CacheReset: MissLedger._reset,
    ev.TierLookupFailed: MissLedger._lookup_failed,
    ev.RestoreBudgeted: MissLedger._budget,
    ev.FirstGenerationHashes: MissLedger._first_generation,
}
