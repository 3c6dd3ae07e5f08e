"""Folds a replayed log into plain per-step series, for the replay report.

`SeriesFold` rides along a replay (its `records` wrapper and its `observe`
hook). Counts per step are differences of the engine's own running totals
(`queries.stats`), so they add up to exactly what `kvledger replay`
prints. The log holds no byte sizes, so transfers are counted in blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvledger.adapters.log_tools.misses import MissLedger, totals
from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.replay import ReplayResult, replay
from kvledger.engine.state import State
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig

MAX_REQUESTS_DRAWN = 200
# Per-step counters taken from the engine's running totals.
_STAT_SERIES = ("hit_tokens", "keys_loaded", "store_failures", "load_failures", "flushes", "keys_failed")
# Per-step counters of each tier below host memory, from its running totals.
_TIER_COUNTS = ("keys_written", "keys_read", "write_failures", "read_failures", "keys_found", "evictions")


class SeriesFold:
    """Folds a replay into per-step series. Use `records` and `observe` on one replay, then `finish`.

    A column is opened per step index the log records (the events that lead
    up to a step carry its index), so every series lines up with `steps`.
    """

    def __init__(self, config: EngineConfig, *, max_requests: int = MAX_REQUESTS_DRAWN) -> None:
        self.config = config
        self.max_requests = max_requests
        self._record_step = 0
        self.steps: list[int] = []
        self._stats_end: list[dict[str, int]] = []  # the engine's totals after each column's last event
        self._used_slots: list[int] = []
        self._seq_ranges: list[list[int]] = []  # first and last seq replayed in each column
        self._tokens_computed: list[int] = []
        self._prompt_tokens_computed: list[int] = []
        self._store_blocks: list[int] = []
        self._violations: list[int] = []
        self._cache_resets: list[int] = []
        self._resets: list[list[int]] = []  # [step, seq] of each cache reset, for the lines marking them
        self._timelines: dict[str, dict] = {}
        self._status: dict[str, str] = {}
        self._load_ended_for: str | None = None  # the request whose load this event ended (`JobEnded`)
        self.num_requests = 0
        # Per tier below host memory, per column: its usage after the column's last event.
        self._lower: list[list[queries.LowerTierUsage]] = []
        self._misses = MissLedger(config)  # why each admission's computed tokens were not restored
        self._admitted_in: list[int] = []  # each admission's column

    def records(self, records: Iterable[object]) -> Iterator[object]:
        """Pass the records through, noting each one's step index for `observe`."""
        for record in records:
            self._record_step = getattr(record, "step_index", self._record_step)
            yield record

    def observe(self, seq: int, event: ev.Event, state: State, effects: tuple[fx.Effect, ...]) -> None:
        if not self.steps or self.steps[-1] != self._record_step:
            self.steps.append(self._record_step)
            for column in (self._tokens_computed, self._prompt_tokens_computed, self._store_blocks,
                           self._violations, self._cache_resets):
                column.append(0)
            self._stats_end.append({})
            self._used_slots.append(0)
            self._seq_ranges.append([seq, seq])
        self._seq_ranges[-1][1] = seq
        self._misses.observe(seq, event, state, effects)
        self._admitted_in.extend([len(self.steps) - 1] * (len(self._misses.admissions) - len(self._admitted_in)))
        self._stats_end[-1] = queries.stats(state)
        self._used_slots[-1] = queries.tier_usage(state).used_slots
        if self.config.lower_tiers:
            usage = queries.lower_tier_usage(state)
            if len(self._lower) < len(self.steps):
                self._lower.append(usage)
            else:
                self._lower[-1] = usage
        fx.dispatch(_SERIES, self, effects)
        if isinstance(event, ev.StepScheduled):
            self._step_tokens(event, state)
        elif isinstance(event, ev.CacheReset) and not _rejected(effects):
            self._cache_resets[-1] += 1
            self._resets.append([self.steps[-1], seq])
        self._follow_request(seq, event, state, effects)

    def _store_started(self, effect: fx.StartStore) -> None:
        self._store_blocks[-1] += sum(len(keys) for keys in effect.keys)

    def _job_over(self, effect: fx.JobEnded) -> None:
        if effect.kind == "load":
            self._load_ended_for = effect.request_id

    def _violation(self, effect: fx.ReportViolation) -> None:
        self._violations[-1] += 1

    def _step_tokens(self, event: ev.StepScheduled, state: State) -> None:
        prompt = 0
        for rid, computed, scheduled in zip(event.request_ids, event.num_computed_tokens,
                                            event.num_scheduled_tokens):
            request = queries.request_view(state, rid)
            if request is not None:
                prompt += max(0, min(computed + scheduled, request.num_prompt_tokens) - computed)
        self._tokens_computed[-1] += sum(event.num_scheduled_tokens)
        self._prompt_tokens_computed[-1] += prompt

    def _follow_request(self, seq: int, event: ev.Event, state: State, effects: tuple[fx.Effect, ...]) -> None:
        """Note the request's status after the event, if the event can change it."""
        rid = getattr(event, "request_id", None)
        if isinstance(event, (ev.LoadCompleted, ev.LoadFailed)):  # only its load's end moves a request on
            rid, self._load_ended_for = self._load_ended_for, None
        if rid is None:
            return
        if isinstance(event, ev.RequestAdded) and not _rejected(effects):
            self.num_requests += 1
            if len(self._timelines) < self.max_requests:
                self._timelines[rid] = {"request_id": rid, "segments": [], "end": None, "end_step": None,
                                        "end_seq": None}
        timeline = self._timelines.get(rid)
        if timeline is None:
            return
        current = queries.request_status(state, rid)
        if current is not None:
            status = current.value
        elif isinstance(event, ev.RequestFinished):
            status = "finished"
        elif isinstance(event, (ev.RequestAborted, ev.LoadCompleted, ev.LoadFailed)):
            status = "aborted"  # aborted, or an aborted request's load ended
        else:
            return
        if self._status.get(rid) == status:
            return
        self._status[rid] = status
        step, segments = self.steps[-1], timeline["segments"]
        if segments and timeline["end"] is None:  # the state it leaves ends here
            segments[-1].update(end=step, end_seq=seq)
        if status in ("finished", "aborted"):
            timeline.update(end=status, end_step=step, end_seq=seq)
        else:
            timeline.update(end=None, end_step=None, end_seq=None)  # an id used again after it ended
            segments.append({"status": status, "start": step, "end": step, "start_seq": seq, "end_seq": seq})

    def finish(self, result: ReplayResult) -> dict:
        """The series, as plain data. Call once the replay has returned."""
        stats_end = self._stats_end
        per_step: dict[str, list[int]] = {name: [] for name in _STAT_SERIES}
        before = dict.fromkeys(_STAT_SERIES, 0)
        for after in stats_end:
            for name in _STAT_SERIES:
                per_step[name].append(after[name] - before[name])
            before = after
        last_step = self.steps[-1] if self.steps else 0
        timelines = []
        for timeline in self._timelines.values():
            if timeline["segments"] and timeline["end"] is None:
                # A live request's state lasts past the end of the log (end_seq None).
                timeline["segments"][-1].update(end=last_step + 1, end_seq=None)
            timelines.append(timeline)
        problem = result.first_problem
        series = {
            "steps": list(self.steps),
            "seq_ranges": [list(r) for r in self._seq_ranges],
            "capacity_slots": self.config.num_tier_slots,
            "used_slots": list(self._used_slots),
            "hit_tokens": per_step["hit_tokens"],
            "prompt_tokens_computed": list(self._prompt_tokens_computed),
            "tokens_computed": list(self._tokens_computed),
            "store_blocks": list(self._store_blocks),
            "load_blocks": per_step["keys_loaded"],
            "keys_failed": per_step["keys_failed"],
            "store_failures": per_step["store_failures"],
            "load_failures": per_step["load_failures"],
            "flushes": per_step["flushes"],
            "violations": list(self._violations),
            "cache_resets": list(self._cache_resets),
            "resets": [list(r) for r in self._resets],
            "requests": {"total": self.num_requests, "max_drawn": self.max_requests, "timelines": timelines},
            "totals": queries.stats(result.state),
            "config": self.config.to_dict(),
            "replay": {"events": result.events, "steps": result.steps, "last_seq": result.last_seq,
                       "digests_checked": result.digests_checked, "violations": len(result.violations),
                       "first_problem": None if problem is None else
                       {"seq": problem.seq, "kind": problem.kind, "detail": problem.detail}},
        }
        if self.config.lower_tiers:
            series["lower_tiers"] = self._lower_series()
        series["misses"] = self._miss_series()
        return series

    def _miss_series(self) -> dict:
        """Per cause, the computed prompt tokens of the admissions of each step (`kvledger explain`)."""
        admissions = self._misses.admissions
        by_cause: dict[str, list[int]] = {}
        for admission, column in zip(admissions, self._admitted_in):
            if admission.superseded_at >= 0:
                continue
            for run in admission.runs:
                if run.outcome == "missed":
                    by_cause.setdefault(run.cause, [0] * len(self.steps))[column] += run.tokens
        return {"by_cause": by_cause, "totals": totals(admissions)}

    def _lower_series(self) -> list[dict]:
        """Per tier below host memory: blocks held after each step, and per step the
        blocks written, promoted, failed (either way), found and evicted."""
        tiers = []
        for index, spec in enumerate(self.config.lower_tiers):
            before = dict.fromkeys(_TIER_COUNTS, 0)
            per_step: dict[str, list[int]] = {name: [] for name in _TIER_COUNTS}
            held = []
            for usage in self._lower:
                tier = usage[index]
                held.append(tier.held_keys)
                for name in _TIER_COUNTS:
                    per_step[name].append(tier.counts[name] - before[name])
                    before[name] = tier.counts[name]
            tiers.append({"name": spec.name, "capacity_blocks": spec.num_blocks, "held": held, **per_step})
        return tiers


def _rejected(effects: tuple[fx.Effect, ...]) -> bool:
    return any(isinstance(e, fx.ReportViolation) for e in effects)


def collect(config: EngineConfig, records: Iterable[object], *, max_requests: int = MAX_REQUESTS_DRAWN,
            **replay_options: object) -> tuple[ReplayResult, dict]:
    """Replay the records and return the result with its series (for callers without their own observer)."""
    fold = SeriesFold(config, max_requests=max_requests)
    result = replay(config, fold.records(records), observe=fold.observe, **replay_options)  # type: ignore[arg-type]
    return result, fold.finish(result)




# What each effect kind adds to the per-step series (None: nothing; the miss ledger and the
# engine's stats, read each step, carry the rest).
_SERIES = fx.dispatch_table("the report's series", {
    fx.StartStore: SeriesFold._store_started,
    fx.ReportViolation: SeriesFold._violation,
    fx.JobEnded: SeriesFold._job_over,  # a load's end moves its request on
}, ignored=(fx.StartSpill, fx.DropTierKeys, fx.FlushStores, fx.PinDeviceBlocks, fx.UnpinDeviceBlocks,
            fx.KeysLoadable, fx.KeysUnloadable, fx.KeysNotAdmitted, fx.KeysBelowThreshold, fx.SpillDropped, fx.TransferFailed, fx.StartLoad, fx.RequestAdmitted, fx.RequestRequeued))
