"""`kvledger replay`, `inspect` and `simulate`: the commands that read or write event logs.

`inspect --at SEQ` and `replay --from SEQ` start at the binary log's latest
snapshot at or before that point (`log_seek`), so they cost at most one
snapshot interval of replay wherever the point lies; the state they reach is
the one a replay from the beginning reaches (tests/adapters/test_seek.py).

Exit status: 0 when the log replays cleanly, 1 when it shows a problem (a
protocol violation, a broken invariant, a digest mismatch), 2 when the input
cannot be used (a missing, truncated or corrupt file, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator

from kvledger import __version__
from kvledger.adapters.log_files import open_log
from kvledger.adapters.log_seek import LogStart, open_log_at
from kvledger.adapters.log_tools import report_series
from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.digest import digest
from kvledger.engine.invariants import InvariantViolation, check
from kvledger.engine.replay import ReplayResult, replay
from kvledger.engine.snapshot import SnapshotError, restore
from kvledger.engine.state import RequestStatus, State
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig
from kvledger.events.log_records import EventRecord, LogError, LogHeader, Record

from . import report

EXIT_OK, EXIT_PROBLEM, EXIT_BAD_INPUT = 0, 1, 2
KEY_PREFIX_DIGITS_MIN = 4
_GROUP_SUFFIX_BYTES = 4  # `engine.hma.group_suffix`: after the block's hash in each group's key


class BadArgument(Exception):
    """An argument the log cannot answer (a key or request it never names): exit 2, one line."""


class Prefix:
    """A log's records read lazily, up to the first damage: a log cut by a crash
    or a full disk still replays up to its tear. `tear` is the damage met, if
    any (a replay that stops earlier, as `--until` does, never meets it)."""

    def __init__(self, records: Iterator[Record]) -> None:
        self._records = records
        self.tear: LogError | None = None
        self.last_seq = -1

    def __iter__(self) -> Iterator[Record]:
        try:
            for record in self._records:
                self.last_seq = record.seq  # type: ignore[attr-defined]
                yield record
        except LogError as exc:
            self.tear = exc


def _load(path: str) -> tuple[LogHeader, Prefix]:
    header, records = open_log(path)
    return header, Prefix(records)


def _load_at(path: str, events_before: int) -> tuple[LogHeader, Prefix, State | None, int]:
    """The log from its latest snapshot after at most `events_before` events: the
    records after it, its restored state (None: the log's beginning) and its seq."""
    start: LogStart = open_log_at(path, events_before)
    if start.snapshot is None:
        return start.header, Prefix(start.records), None, 0
    try:
        state = restore(start.header.config, start.snapshot.data)  # type: ignore[arg-type]
    except SnapshotError as exc:
        raise LogError(f"the snapshot at seq {start.snapshot.seq} cannot be restored: {exc}", source=path) from None
    records = Prefix(start.records)
    records.last_seq = start.snapshot.seq - 1
    return start.header, records, state, start.snapshot.seq


def _report_tear(records: Prefix) -> int:
    """Exit 2 after the good prefix, naming the damage and the last good seq."""
    assert records.tear is not None
    print(f"kvledger: {records.tear}; the records up to seq {records.last_seq} were replayed "
          f"(the summary above stops there)", file=sys.stderr)
    return EXIT_BAD_INPUT


def _parse_key(text: str) -> str:
    """A key, or a prefix of one as the timelines print them, in lower-case hex."""
    digits = text.lower()
    if len(digits) < KEY_PREFIX_DIGITS_MIN or any(c not in "0123456789abcdef" for c in digits):
        raise BadArgument(f"--key takes a key or a prefix of at least {KEY_PREFIX_DIGITS_MIN} hex digits, "
                          f"got {text!r}")
    return digits


def _keys_of(event: ev.Event, effects: tuple[fx.Effect, ...]) -> Iterator[bytes]:
    for effect in effects:
        for group in getattr(effect, "keys", ()):
            yield from (group if isinstance(group, tuple) else (group,))
    yield from getattr(event, "keys", ())


def _mentions(event: ev.Event, effects: tuple[fx.Effect, ...], request_id: str | None,
              key: frozenset[bytes] | None) -> list[str]:
    """Lines worth printing for a request or key timeline (`key`: one block's keys, a key per KV group)."""
    lines = []
    if request_id is not None:
        if getattr(event, "request_id", None) == request_id or (
                isinstance(event, ev.StepScheduled) and request_id in event.request_ids):
            lines.append(_describe(event, request_id))
        for effect in effects:
            if getattr(effect, "request_id", None) == request_id:
                lines.append(f"  -> {_describe_effect(effect)}")
    if key is not None:
        for effect in effects:
            keys = getattr(effect, "keys", ())
            flat = [k for group in keys for k in (group if isinstance(group, tuple) else (group,))]
            if not key.isdisjoint(flat):
                lines.append(f"{event.kind}: -> {_describe_effect(effect)}")
        if not key.isdisjoint(getattr(event, "keys", ())):
            lines.append(_describe(event, None))
    return lines


def _describe(event: ev.Event, request_id: str | None) -> str:
    if isinstance(event, ev.StepScheduled) and request_id is not None:
        i = event.request_ids.index(request_id)
        return (f"step_scheduled step={event.step_index} computed={event.num_computed_tokens[i]} "
                f"scheduled={event.num_scheduled_tokens[i]}")
    fields = {k: v for k, v in _fields(event).items() if k != "request_id"}
    text = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
    return f"{event.kind} {text}".rstrip()


def _describe_effect(effect: fx.Effect) -> str:
    name = type(effect).__name__
    if isinstance(effect, (fx.StartStore, fx.StartLoad)):
        n = sum(len(k) for k in effect.keys)
        return f"{name} job={effect.job_id} keys={n}"
    return f"{name} " + " ".join(f"{k}={_short(v)}" for k, v in _fields(effect).items())


def _fields(obj: object) -> dict:
    return {a.name: getattr(obj, a.name) for a in obj.__attrs_attrs__}  # type: ignore[attr-defined]


def _short(value: object) -> str:
    if isinstance(value, bytes):
        return value.hex()[:12]
    if isinstance(value, tuple):
        text = ",".join(_short(v) for v in value[:6])
        return f"({text}{',…' if len(value) > 6 else ''})"
    return str(value)


def summary(header: LogHeader, result: ReplayResult) -> dict:
    state = result.state
    tier = queries.tier_usage(state)
    problem = result.first_problem
    data = {
        "engine_version": header.engine_version,
        "recorded_by": header.writer,
        "rules": header.config.rules,
        # Where the rules come from: the header (0.2.0 on), or for a 0.1.0 log its records
        # (tiers below host memory) or none needed (every kept rules decide alike without).
        "rules_from": "header" if header.rules_recorded else "records" if header.config.lower_tiers else "alike",
        "events": result.events,
        "steps": result.steps,
        "last_seq": result.last_seq,
        "last_step": queries.position(state).step_index,  # -1: no step was scheduled
        "events_by_kind": dict(sorted(result.by_kind.items())),
        "stats": queries.stats(state),
        "violations": len(result.violations),
        "digests_checked": result.digests_checked,
        "tier": {"used_slots": tier.used_slots, "capacity_slots": tier.capacity_slots,
                 "offered_keys": tier.offered_keys, "evictable_keys": tier.evictable_keys},
        "requests_live": queries.num_requests(state),
        "jobs_in_flight": queries.num_jobs_in_flight(state),
        "final_digest": digest(result.state),
        "ok": problem is None,
        "first_problem": None if problem is None else {"seq": problem.seq, "kind": problem.kind,
                                                       "detail": problem.detail},
    }
    lower = queries.lower_tier_usage(state)
    if lower:  # only with tiers below host memory: other summaries keep their shape
        data["lower_tiers"] = [{"name": t.name, "capacity_blocks": t.capacity_blocks, "held_keys": t.held_keys,
                                **t.counts} for t in lower]
    return data


def _print_summary(data: dict) -> None:
    stats = data["stats"]
    tier = data["tier"]
    if "replayed_from_seq" in data:
        start = data["replayed_from_seq"]
        print(f"from        the snapshot at seq {start}: every count below starts there" if data["from_snapshot"]
              else "from        the beginning: the log has no snapshot at or before the seq asked for")
    print(f"events      {data['events']} in {data['steps']} steps (last seq {data['last_seq']})")
    for kind, count in data["events_by_kind"].items():
        print(f"  {kind:<22} {count}")
    print(f"hits        {stats['hit_tokens']} tokens restored by {stats['loads']} loads "
          f"({stats['keys_loaded']} blocks)")
    print(f"stores      {stats['stores']} jobs, {stats['keys_stored']} blocks stored, "
          f"{stats['store_rejections']} not admitted (tier full)")
    print(f"failures    {stats['store_failures']} stores, {stats['load_failures']} loads, "
          f"{stats['keys_failed']} keys dropped")
    print(f"flushes     {stats['flushes']} ({stats['jobs_flushed']} jobs waited for)")
    resets = data["events_by_kind"].get("cache_reset", 0)
    # The engine's total counts the blocks a reset drops as well (the metrics count them apart).
    dropped = f", to make room or in {resets} cache reset{'s' if resets > 1 else ''}" if resets else ""
    print(f"evictions   {stats['evictions']}{dropped}; preemptions {stats['preemptions']}")
    print(f"tier        {tier['used_slots']}/{tier['capacity_slots']} slots used, "
          f"{tier['offered_keys']} keys offered")
    for lower in data.get("lower_tiers", ()):
        print(f"tier {lower['name']:<6} {lower['held_keys']}/{lower['capacity_blocks']} blocks held; "
              f"{lower['keys_written']} written ({lower['write_failures']} failed), {lower['keys_read']} promoted "
              f"({lower['read_failures']} failed), {lower['keys_found']} found, {lower['evictions']} evicted")
    print(f"digests     {data['digests_checked']} checked")
    if "checked" in data:
        print(f"checks      every invariant after each of {data['checked']['invariants_after_events']} events, "
              f"and {data['checked']['digests']} recorded digests")
    how = {"header": "named in its header", "records": f"not named by {data['engine_version']}: shown by its records",
           "alike": f"not named by {data['engine_version']}: every kept rules decide alike without lower tiers"}
    replayed = f", replayed by kvledger {data['replayed_by']} under them" if "replayed_by" in data else ""
    print(f"versions    recorded by {data['recorded_by']} under engine rules {data['rules']} "
          f"({how[data['rules_from']]}){replayed}")
    if data.get("closed") is True:
        print("log end     closed by its process (its final state checked against the end mark)")
    elif data.get("closed") is False:
        reached = (f"replayed to the end of step {data['last_step']}, the last it wrote whole"
                   if data["last_step"] >= 0 else "it wrote no step")
        print(f"log end     NOT CLOSED: the process did not close this log (it was killed, or still runs); "
              f"{reached}; at its end {data['requests_live']} requests were live and "
              f"{data['jobs_in_flight']} jobs in flight")
    problem = data["first_problem"]
    if "tear" in data:
        print(f"result      TORN after seq {data['tear']['last_good_seq']}: {data['tear']['error']} "
              f"(the good prefix" + (f" has a problem at seq {problem['seq']}: {problem['detail']})" if problem
                                     else " replays cleanly)"))
    elif problem is None:
        print("result      ok")
    else:
        print(f"result      FIRST PROBLEM at seq {problem['seq']} ({problem['kind']}): {problem['detail']}")


def replay_args(log: str, **options: object) -> argparse.Namespace:
    """`kvledger replay LOG` with these options, for callers other than the command line."""
    defaults: dict[str, object] = dict(check=False, until=None, request=None, key=None, json=False, report=None,
                                       start=None, force=False)
    return argparse.Namespace(log=log, **{**defaults, **options})


def _resolve_key(args: argparse.Namespace, prefix: str) -> frozenset[bytes]:
    """The keys of the one block that start with `prefix`, found by a first pass:
    a block has a key per KV group, its chain hash and the group's 4-byte
    suffix (`engine.hma.group_suffix`), so a prefix of the hash names them all."""
    header, records = _load(args.log)
    found: set[bytes] = set()

    def collect(seq: int, event: ev.Event, state: State, effects: tuple[fx.Effect, ...]) -> None:
        found.update(k for k in _keys_of(event, effects) if k.hex().startswith(prefix))

    replay(header.config, records, until_seq=args.until, observe=collect)
    if not found:
        raise BadArgument(f"no key in {args.log} starts with {prefix}")
    blocks = {k[:-_GROUP_SUFFIX_BYTES] for k in found} if len(prefix) <= 2 * (
        len(next(iter(found))) - _GROUP_SUFFIX_BYTES) else {k for k in found}
    if len(blocks) > 1:
        shown = ", ".join(sorted(b.hex() for b in blocks)[:5])
        raise BadArgument(f"--key {prefix} is ambiguous: {len(blocks)} blocks have keys starting with it ({shown}"
                          f"{', ...' if len(blocks) > 5 else ''}); give more digits")
    return frozenset(found)


def cmd_replay(args: argparse.Namespace) -> int:
    if args.start is not None and args.until is not None and args.start > args.until:
        raise BadArgument(f"--from {args.start} is after --until {args.until}")
    if args.report is not None:
        try:
            report.check_report_path(args.report, source=args.log, force=args.force)
        except report.ReportError as exc:
            print(f"kvledger replay: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    key = _resolve_key(args, _parse_key(args.key)) if args.key else None
    if args.start is None:
        header, records, state, started = *_load(args.log), None, 0
    else:
        header, records, state, started = _load_at(args.log, args.start)
    base_stats = queries.stats(state) if state is not None else None  # counts then start from the snapshot
    timeline: list[str] = []
    fold = report_series.SeriesFold(header.config) if args.report is not None else None
    watching = args.request is not None or key is not None
    request_seen = False

    def observe(seq: int, event: ev.Event, state: State, effects: tuple[fx.Effect, ...]) -> None:
        nonlocal request_seen
        if watching:
            for line in _mentions(event, effects, args.request, key):
                timeline.append(f"{seq:>8}  {line}")
            if args.request is not None and not request_seen and getattr(event, "request_id", None) == args.request:
                request_seen = True
        if fold is not None:
            fold.observe(seq, event, state, effects)

    if state is not None and args.check:
        try:
            check(state)
        except InvariantViolation as broken:
            print(f"kvledger: the snapshot at seq {started} breaks an invariant: {broken}", file=sys.stderr)
            return EXIT_PROBLEM
    result = replay(header.config, records if fold is None else fold.records(records),
                    check_invariants=args.check, until_seq=args.until,
                    observe=observe if watching or fold is not None else None, state=state)
    data = summary(header, result)
    if args.request is not None and not request_seen:
        raise BadArgument(f"no event of {args.log} names request {args.request!r}"
                          f"{' in the part replayed' if args.start is not None or args.until is not None else ''} "
                          f"(`kvledger requests {args.log}` lists them)")
    if args.start is not None:
        data["replayed_from_seq"] = started  # every count below starts here: events, kinds, stats
        data["from_snapshot"] = state is not None
        if base_stats is not None:
            data["stats"] = {name: value - base_stats.get(name, 0) for name, value in data["stats"].items()}
    if args.check:
        data["checked"] = {"invariants_after_events": result.events, "digests": result.digests_checked}
    if records.tear is not None:
        data["tear"] = {"error": str(records.tear), "last_good_seq": records.last_seq}
    elif args.until is None and header.schema_version >= 2:  # schema 1 had no end mark
        data["closed"] = result.ends_with_full_digest
    if header.engine_version != __version__:
        data["replayed_by"] = __version__  # under the rules the log names: its decisions, not this build's
    if fold is not None:
        try:
            size = report.write_report(args.report, fold.finish(result), source=args.log, force=args.force)
        except report.ReportError as exc:
            print(f"kvledger replay: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        data["report"] = {"path": args.report, "bytes": size}
    if args.json:
        if watching:
            data["timeline"] = timeline
        print(json.dumps(data, indent=2))
    else:
        if watching:
            print("\n".join(timeline) or "(no events mention it)")
            print()
        _print_summary(data)
        if fold is not None:
            print(f"report      {args.report} ({size / 1e6:.1f} MB)")
    if records.tear is not None:
        return _report_tear(records)
    return EXIT_OK if result.ok else EXIT_PROBLEM


def cmd_requests(args: argparse.Namespace) -> int:
    """Every request the log names, in order of arrival: what `replay --request` takes."""
    header, records = _load(args.log)
    rows: dict[str, dict] = {}

    def observe(seq: int, event: ev.Event, state: State, effects: tuple[fx.Effect, ...]) -> None:
        rid = getattr(event, "request_id", None)
        if rid is None:
            return
        row = rows.get(rid)
        if row is None or isinstance(event, ev.RequestAdded):  # an id may come back after it finished
            row = rows[rid] = {"request_id": rid, "first_seq": seq, "prompt_tokens": None, "preemptions": 0,
                               "ended": None}
        if isinstance(event, ev.RequestAdded):
            row["prompt_tokens"] = event.num_prompt_tokens
        elif isinstance(event, ev.RequestPreempted):
            row["preemptions"] += 1
        elif isinstance(event, (ev.RequestFinished, ev.RequestAborted)):
            row["ended"] = f"{event.kind} at seq {seq}"
        row["last_seq"] = seq

    replay(header.config, records, until_seq=args.until, observe=observe)
    if args.json:
        print(json.dumps(list(rows.values()), indent=2))
    else:
        print(f"{'request':<24} {'first seq':>9} {'last seq':>9} {'prompt':>7} {'preempted':>9}  ended")
        for row in rows.values():
            print(f"{row['request_id']:<24} {row['first_seq']:>9} {row['last_seq']:>9} "
                  f"{row['prompt_tokens'] if row['prompt_tokens'] is not None else '?':>7} "
                  f"{row['preemptions']:>9}  {row['ended'] or 'live at the end'}")
        print(f"{len(rows)} requests")
    if records.tear is not None:
        return _report_tear(records)
    return EXIT_OK


def state_view(state: State) -> dict:
    requests = {}
    views = [queries.request_view(state, rid) for rid in queries.request_ids(state)]
    for r in views:
        assert r is not None
        requests[r.request_id] = {
            "status": r.status.value, "num_tokens": r.num_tokens, "num_computed_tokens": r.num_computed_tokens,
            "blocks_per_group": list(r.blocks_per_group), "table_positions": list(r.table_positions),
            "load_job_id": r.load_job_id, "next_store_position": list(r.next_store_positions),
            "preemptions": r.num_preemptions,
        }
    jobs = {}
    for jid in queries.job_ids(state):
        j = queries.job_view(state, jid)
        assert j is not None
        jobs[str(jid)] = {
            "kind": j.kind, "request_id": j.request_id, "blocks": list(j.blocks_per_group),
            "pending_workers": bin(j.pending_workers), "flushed": j.flushed, "stale": j.stale,
        }
    at = queries.position(state)
    device = queries.device_usage(state)
    tier = queries.tier_usage(state)
    return {
        "step_index": at.step_index, "epoch": at.epoch, "next_job_id": at.next_job_id,
        "requests": requests, "jobs": jobs,
        "by_status": {s.value: sum(1 for r in views if r is not None and r.status is s) for s in RequestStatus},
        "device": {"held_blocks": device.held_blocks, "pinned_blocks": device.pinned_blocks,
                   "blocks_read_by_stores": device.blocks_read_by_stores,
                   "blocks_being_loaded": device.blocks_being_loaded},
        "tier": {"used_slots": tier.used_slots, "offered_keys": tier.offered_keys,
                 "loading_slots": tier.loading_slots, "evictable_keys": tier.evictable_keys},
        "stats": queries.stats(state),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.from_start:
        header, records, state, started = *_load(args.log), None, 0
    else:
        header, records, state, started = _load_at(args.log, args.at + 1)
    events = (r for r in records if isinstance(r, EventRecord))
    result = replay(header.config, events, until_seq=args.at, state=state)
    if max(result.last_seq, started - 1) < args.at:
        where = f"it is torn after seq {records.last_seq} ({records.tear})" if records.tear else (
            f"its last is seq {result.last_seq}")
        print(f"kvledger: --at {args.at} is outside the log: {where}", file=sys.stderr)
        return EXIT_BAD_INPUT
    view = state_view(result.state)
    view["at_seq"] = args.at
    view["replayed_from_seq"] = started  # 0, or the snapshot it started at
    view["violations_replayed"] = len(result.violations)  # among the events from there to at_seq
    if args.json:
        print(json.dumps(view, indent=2))
        return EXIT_OK
    print(f"state after seq {args.at}: step {view['step_index']}, epoch {view['epoch']} "
          f"(replayed from seq {started})")
    print(f"requests    {len(view['requests'])} " + ", ".join(f"{k}={v}" for k, v in view["by_status"].items() if v))
    for rid, r in view["requests"].items():
        print(f"  {rid:<16} {r['status']:<9} tokens={r['num_tokens']} computed={r['num_computed_tokens']} "
              f"blocks={r['blocks_per_group']} load_job={r['load_job_id']}")
    print(f"jobs        {len(view['jobs'])} in flight")
    for jid, j in view["jobs"].items():
        print(f"  job {jid:<6} {j['kind']:<5} {j['request_id']:<16} blocks={j['blocks']} "
              f"pending={j['pending_workers']} flushed={j['flushed']} stale={j['stale']}")
    d, t = view["device"], view["tier"]
    print(f"device      {d['held_blocks']} held, {d['pinned_blocks']} pinned, {d['blocks_read_by_stores']} read "
          f"by stores, {d['blocks_being_loaded']} being loaded")
    print(f"tier        {t['used_slots']} slots used, {t['offered_keys']} keys offered, {t['loading_slots']} "
          f"loading, {t['evictable_keys']} evictable")
    return EXIT_OK


SCENARIOS = {
    "full": dict(groups=[{"group_id": 0, "kind": "full", "block_size": 16}], hash_block_size=16,
                 num_device_blocks=40, num_tier_slots=24),
    "hybrid": dict(groups=[{"group_id": 0, "kind": "full", "block_size": 32},
                           {"group_id": 1, "kind": "sliding", "block_size": 32, "window": 64}],
                   hash_block_size=32, num_device_blocks=48, num_tier_slots=30),
    "mamba": dict(groups=[{"group_id": 0, "kind": "full", "block_size": 32},
                          {"group_id": 1, "kind": "mamba", "block_size": 64}],
                  hash_block_size=32, num_device_blocks=48, num_tier_slots=30, policy="arc"),
}


def cmd_simulate(args: argparse.Namespace) -> int:
    # `simulate` only: the testing wing's simulator, and the live engine host it records through,
    # stay out of the commands that only read logs.
    from kvledger.adapters.engine_host import EngineHost
    from kvledger.adapters.testing.simulator import Simulator, run_random

    data = {"store_jobs": "step", **SCENARIOS[args.scenario]}  # absent, a config reads as an older log's
    if args.protection:
        data["protection"] = args.protection
    config = EngineConfig.from_dict(data)
    with EngineHost(config, log_path=args.out, fmt=args.format, digest_interval=args.digest_interval,
                    strict=True, overwrite=args.force,
                    snapshot_interval_events=args.snapshot_interval_events) as host:
        sim = Simulator(config, host=host)
        run_random(sim, random.Random(args.seed), steps=args.steps, arrivals=0.9, max_tokens=30,
                   completion_rate=0.3, fail_rate=args.fail_rate, check_every=1)
    print(f"wrote {sim.events} events in {sim.step_index + 1} steps to {args.out}")
    return EXIT_OK
