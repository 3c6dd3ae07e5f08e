"""The worker's jobs on tiers below host memory: spills, the reads that
promote a load's keys into host slots, and removals.

Each lower tier is an I/O object (`FsTierIO` for a file system) that moves
blocks between host slots and its store on threads of its own. This module
maps a job's (group, index) positions onto it and back: a spill ends as a
store outcome, a promotion hands the runner the positions that could not be
read, so that the runner copies only the others to the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

import attrs
import structlog

from kvledger.engine.effects import DropTierKeys, IdsByGroup, KeysByGroup, StartLoad, StartSpill
from kvledger.events.keys import hex_keys
from kvledger.events.types import StoreCompleted, StoreFailed
from kvledger.transfers.copies.backend import TransferTimeout
from kvledger.transfers.lower_tiers.block_errors import report_reason

_log = structlog.get_logger("kvledger.transfers.tier_jobs")

Position = tuple[int, int]


class TierIO(Protocol):
    def write(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None: ...
    def read(self, job_id: int, keys: KeysByGroup, slot_ids: IdsByGroup) -> None: ...
    def delete(self, keys: tuple[bytes, ...]) -> None: ...
    def poll(self) -> list: ...
    def wait(self, job_ids: tuple[int, ...], timeout_s: float) -> None: ...
    def shutdown(self, *, drain: bool = True, timeout_s: float = 30.0) -> None: ...


@attrs.frozen
class TierStat:
    """One finished tier job, for metrics."""

    tier: int
    kind: str  # "write" (a spill) or "read" (a promotion)
    nbytes: int
    seconds: float
    ok: bool
    unreachable: int = 0  # blocks failed because the tier's store was down or too slow
    forged: int = 0  # blocks a tier with a secret refused: not sealed with it


@attrs.define
class _Promotion:
    effect: StartLoad
    waiting: set[int]  # tiers still reading
    positions: dict[int, list[Position]]  # tier -> the load's positions, in the order submitted
    failed: set[Position]
    started_s: float = 0.0
    reasons: list[str] = attrs.Factory(list)  # the failed blocks' reasons, in the order their reads ended


class LowerTierJobs:
    """`read_timeout_s` (0: none) bounds a promotion's reads: one that has not
    ended by then fails (recomputed), and the host slots it reads into stay out
    of use (`quarantined`) until its thread lets them go, however late: a read
    stuck in the kernel (a hung network file system) may still write them."""

    def __init__(self, tiers: Mapping[int, TierIO], num_slots: int, worker_index: int, *,
                 read_timeout_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._tiers = dict(tiers)
        self._num_slots = num_slots
        self.worker_index = worker_index
        self.read_timeout_s = read_timeout_s
        self._clock = clock
        self._spills: dict[int, StartSpill] = {}
        self._promotions: dict[int, _Promotion] = {}
        self._stray: dict[tuple[int, int], list[int]] = {}  # (tier, job) -> slots a timed-out read may write
        self._quarantined: frozenset[int] = frozenset()  # their union, kept as they change: read per job
        self._stats: list[TierStat] = []

    @property
    def in_flight(self) -> frozenset[int]:
        return frozenset(self._spills) | frozenset(self._promotions)

    @property
    def active(self) -> bool:
        """Whether a poll can find anything: a tier's I/O reports on its own clock."""
        return bool(self._tiers)

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._spills or job_id in self._promotions

    @property
    def quarantined(self) -> frozenset[int]:
        """Host slots a timed-out read may still write: no job may use them."""
        return self._quarantined

    def _stray_changed(self) -> None:
        self._quarantined = frozenset(slot for slots in self._stray.values() for slot in slots)

    def spill(self, effect: StartSpill) -> StoreFailed | None:
        """Start writing; a spill that cannot start fails whole, at once."""
        io = self._tiers.get(effect.tier)
        problem = None
        if io is None:
            problem = f"this worker has no tier {effect.tier}"
        elif effect.job_id in self:
            problem = f"job {effect.job_id} is already in flight"
        elif any(not 0 <= s < self._num_slots for slots in effect.source_slot_ids for s in slots):
            problem = f"a source slot is outside [0, {self._num_slots})"
        if problem is not None:
            keys = tuple(k for group in effect.keys for k in group)
            _log.warning("spill_rejected", job_id=effect.job_id, tier=effect.tier, keys=hex_keys(keys),
                         problem=problem)
            return StoreFailed(job_id=effect.job_id, worker_index=self.worker_index, keys=keys, reason="rejected")
        assert io is not None
        self._spills[effect.job_id] = effect
        io.write(effect.job_id, effect.keys, effect.source_slot_ids)
        return None

    def drop(self, effect: DropTierKeys) -> None:
        io = self._tiers.get(effect.tier)
        if io is None:
            _log.warning("drop_rejected", tier=effect.tier, keys=hex_keys(effect.keys),
                         problem=f"this worker has no tier {effect.tier}")
            return
        io.delete(effect.keys)

    def promote(self, effect: StartLoad) -> set[Position] | None:
        """Start reading the load's promoted keys into their host slots. Returns
        the positions failed at once (no slot, no such tier: refused) when nothing
        is left to read, else None: `poll` hands the load back when the reads end."""
        failed: set[Position] = set()
        by_tier: dict[int, list[Position]] = {}
        for g, (tiers, slots) in enumerate(zip(effect.promote_tiers, effect.source_slot_ids)):
            for i, (tier, slot) in enumerate(zip(tiers, slots)):
                if not tier:
                    continue
                if slot < 0 or tier not in self._tiers:
                    failed.add((g, i))
                else:
                    by_tier.setdefault(tier, []).append((g, i))
        if not by_tier:
            return failed
        self._promotions[effect.job_id] = _Promotion(effect, set(by_tier), by_tier, failed, self._clock())
        groups = len(effect.keys)
        for tier, positions in by_tier.items():
            keys = tuple(tuple(effect.keys[g][i] for g, i in positions if g == group) for group in range(groups))
            slots = tuple(tuple(effect.source_slot_ids[g][i] for g, i in positions if g == group)
                          for group in range(groups))
            self._tiers[tier].read(effect.job_id, keys, slots)
        return None

    def wait_reads(self, deadline: float) -> bool:
        """Block until every promotion's reads ended, or the monotonic `deadline`
        passed (False); `poll` then hands the loads back."""
        for job_id, promotion in list(self._promotions.items()):
            for tier in tuple(promotion.waiting):
                try:
                    self._tiers[tier].wait((job_id,), max(0.0, deadline - time.monotonic()))
                except TransferTimeout:
                    return False
        return True

    def poll(self) -> tuple[list[StoreCompleted | StoreFailed], list[tuple[StartLoad, set[Position], str]]]:
        """(spill outcomes, promoted loads whose reads all ended with their failed positions and
        why they failed)."""
        spilled: list[StoreCompleted | StoreFailed] = []
        promoted: list[tuple[StartLoad, set[Position], str]] = []
        for tier, io in self._tiers.items():
            for outcome in io.poll():
                self._stats.append(TierStat(tier, outcome.kind, outcome.nbytes, outcome.seconds, outcome.ok,
                                           outcome.reasons.count("unreachable"), outcome.reasons.count("forged")))
                if outcome.kind == "write":
                    effect = self._spills.pop(outcome.job_id, None)
                    if effect is None:
                        _log.warning("unknown_tier_outcome", tier=tier, job_id=outcome.job_id, kind=outcome.kind)
                        continue
                    if outcome.ok:
                        spilled.append(StoreCompleted(job_id=outcome.job_id, worker_index=self.worker_index))
                    else:
                        keys = tuple(effect.keys[g][i] for g, i in outcome.failed)
                        spilled.append(StoreFailed(job_id=outcome.job_id, worker_index=self.worker_index, keys=keys,
                                                   reason=outcome.reason))
                    continue
                if self._stray.pop((tier, outcome.job_id), None) is not None:
                    self._stray_changed()
                    _log.info("timed_out_tier_read_ended", tier=tier, job_id=outcome.job_id, ok=outcome.ok,
                              effect="its host slots are in use again")
                    continue
                promotion = self._promotions.get(outcome.job_id)
                if promotion is None or tier not in promotion.waiting:
                    _log.warning("unknown_tier_outcome", tier=tier, job_id=outcome.job_id, kind=outcome.kind)
                    continue
                mine = _own_positions(promotion.positions[tier])
                promotion.failed.update(mine[position] for position in outcome.failed)
                promotion.reasons.extend(outcome.reasons)
                promotion.waiting.discard(tier)
                if not promotion.waiting:
                    del self._promotions[outcome.job_id]
                    # Its reads' reason; positions refused before any read (no slot) say "rejected".
                    reason = report_reason(promotion.reasons) or ("rejected" if promotion.failed else "")
                    promoted.append((promotion.effect, promotion.failed, reason))
        promoted.extend(self._time_out_reads())
        return spilled, promoted

    def _time_out_reads(self) -> list[tuple[StartLoad, set[Position], str]]:
        if not self.read_timeout_s or not self._promotions:
            return []
        now = self._clock()
        late = [p for p in self._promotions.values() if now - p.started_s > self.read_timeout_s]
        ended = []
        for promotion in late:
            effect = promotion.effect
            del self._promotions[effect.job_id]
            for tier in promotion.waiting:
                positions = promotion.positions[tier]
                promotion.failed.update(positions)
                self._stray[(tier, effect.job_id)] = [effect.source_slot_ids[g][i] for g, i in positions]
            self._stats.append(TierStat(min(promotion.waiting), "read", 0, now - promotion.started_s, False))
            _log.error("tier_read_timed_out", job_id=effect.job_id, request_id=effect.request_id,
                       tiers=sorted(promotion.waiting), timeout_s=self.read_timeout_s,
                       keys=hex_keys(k for group in effect.keys for k in group),
                       effect="the request is recomputed; the read's host slots wait until it ends")
            ended.append((effect, promotion.failed, "timed_out"))
        if late:
            self._stray_changed()
        return ended

    def take_stats(self) -> list[TierStat]:
        stats, self._stats = self._stats, []
        return stats

    def shutdown(self, *, drain: bool, timeout_s: float) -> None:
        for io in self._tiers.values():
            io.shutdown(drain=drain, timeout_s=timeout_s)


def _own_positions(positions: list[Position]) -> dict[Position, Position]:
    """The I/O's (group, index within the submitted group) -> the load's position."""
    mapping: dict[Position, Position] = {}
    counts: dict[int, int] = {}
    for g, i in positions:
        index = counts.get(g, 0)
        mapping[(g, index)] = (g, i)
        counts[g] = index + 1
    return mapping
