"""`kvledger whatif`: the log's traffic under another host capacity, policy or
set of lower tiers, beside what the log recorded (`adapters/log_tools/whatif.py` says
what the prediction keeps as recorded)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import TypeVar

import attrs

from kvledger.adapters.log_files import log_header
from kvledger.adapters.log_tools import fleet, whatif
from kvledger.events.config import RULES, ConfigError, EngineConfig, LowerTierSpec, PolicyName
from kvledger.events.log_records import LogHeader, Record

from .log_commands import EXIT_OK, BadArgument, _load
from .report import ReportError, check_report_path
from .sweep_report import write_sweep_report

SWEEP_FACTORS = (0.125, 0.25, 0.5, 1, 2, 4, 8)
_T = TypeVar("_T")


def cmd_whatif(args: argparse.Namespace) -> int:
    if args.together and args.shared_tier is None:
        raise BadArgument("--together goes with --shared-tier (it puts the replicas' logs side by side)")
    if args.shared_tier is not None:
        return _fleet(args)
    if len(args.logs) > 1:
        raise BadArgument("several logs are the replicas of a fleet: give the tier they would share (--shared-tier)")
    args.log = args.logs[0]
    log = _Log(args.log)
    config = log.header.config
    other = _other_config(args, config)
    if args.report and args.sweep != "capacity":
        raise BadArgument("--report draws the capacity sweep: give --sweep too")
    if args.report:
        _page(check_report_path, args.report, source=args.log, force=args.force)  # before the sweep's work
    with _Passes(args.jobs) as passes:
        predictions = _Predictions(config, log)
        same = predictions.ask(config)
        predicted = predictions.ask(other) if other != config else None
        sweep = (_sweep(config, other, log, passes, predictions) if args.sweep == "capacity" else
                 _sweep_threshold(config, other, predictions) if args.sweep else None)
        predictions.run(passes)
        outcome, records = predictions.recorded, log.records
        data = {"log": args.log, "events": records, "slot_bytes": config.slot_bytes,
                "recorded": outcome.as_dict(), "predicted_as_recorded": same().as_dict(),
                "self_check": _error(same().stats["hit_tokens"], outcome.stats["hit_tokens"])}
        if predicted is not None:
            data["predicted"] = predicted().as_dict()
        if sweep is not None:
            data["sweep"] = sweep()
            data["sweep"]["recorded"]["hit_tokens"] = outcome.stats["hit_tokens"]
    if args.report:
        _page(write_sweep_report, args.report, data, source=args.log, force=args.force)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print(data)
    return EXIT_OK


def _page(write: Callable, *args: object, **kwargs: object) -> None:
    """A page that cannot be written is a bad argument, named, exit 2."""
    try:
        write(*args, **kwargs)
    except ReportError as exc:
        raise BadArgument(str(exc)) from None


def _fleet(args: argparse.Namespace) -> int:
    """The replicas' logs, recorded apart, run again sharing one tier below host memory."""
    for flag in ("capacity_bytes", "capacity_blocks", "policy", "secondary_tiers", "store_threshold",
                 "max_tracker_size", "offload_prompt_only", "sweep", "report"):
        if getattr(args, flag):
            raise BadArgument(f"--{flag.replace('_', '-')} does not go with --shared-tier")
    if args.jobs > 1:
        raise BadArgument("--jobs does not go with --shared-tier (the replicas are interleaved in one pass)")
    replicas = [fleet.Replica(path, *_read_whole(path)) for path in args.logs]
    missing = fleet.untimed(replicas)
    if missing:
        raise BadArgument(f"{', '.join(missing)} record(s) no step times (written before kvledger recorded them): "
                          "the replicas' steps cannot be put in order")
    first = replicas[0].header.config
    try:
        value = json.loads(args.shared_tier)
    except json.JSONDecodeError as exc:
        raise BadArgument(f"--shared-tier is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadArgument('--shared-tier takes one tier, e.g. {"type": "valkey", "capacity_bytes": 10000000000}')
    (tier,) = _tiers(json.dumps([value]), first, "--shared-tier")
    outcomes, shared = fleet.predict_fleet(replicas, tier, together=args.together)
    rows = []
    for replica, outcome in zip(replicas, outcomes):
        config = replica.header.config
        alone = whatif.predict(config, config, replica.records)
        recorded = whatif.recorded(config, replica.records)
        (own,), _ = fleet.predict_fleet([replica], tier)  # the same tier, below this replica alone
        rows.append({"log": replica.name, "recorded_hit_tokens": recorded.stats["hit_tokens"],
                     "predicted_alone_hit_tokens": alone.stats["hit_tokens"],
                     "predicted_own_tier_hit_tokens": own.stats["hit_tokens"],
                     "predicted_shared_hit_tokens": outcome.stats["hit_tokens"],
                     # of those, restored: a promotion of a block another replica's writes evicted fails
                     "predicted_shared_restored_tokens": outcome.misses["restored_tokens"],
                     "blocks_read_from_shared_tier": fleet.promoted_blocks(outcome),
                     "bytes_read_from_shared_tier": fleet.promoted_blocks(outcome) * config.slot_bytes or None,
                     "not_applied": outcome.not_applied,
                     "requests_left_out_of_steps": outcome.requests_dropped,
                     "misses": outcome.misses["missed_by_cause"]})
    data = {"shared_tier": {"name": tier.name, "num_blocks": tier.num_blocks,
                            "capacity_bytes": tier.num_blocks * first.slot_bytes or None,
                            "blocks_written": shared.written, "blocks_read": shared.read_blocks,
                            "blocks_evicted": shared.evicted},
            "replicas": rows,
            "all": {name: sum(row[name] for row in rows) for name in
                    ("recorded_hit_tokens", "predicted_alone_hit_tokens", "predicted_own_tier_hit_tokens",
                     "predicted_shared_hit_tokens", "blocks_read_from_shared_tier")}}
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    print(f"shared tier {tier.name}: {tier.num_blocks} blocks" + (
        f" ({data['shared_tier']['capacity_bytes']} bytes)" if data["shared_tier"]["capacity_bytes"] else "")
        + f"; {shared.written} written, {shared.read_blocks} read, {shared.evicted} evicted")
    print(f"{'replica':<40} {'recorded':>9} {'alone':>9} {'own tier':>9} {'shared':>9} {'read from it':>13}")
    for row in [*rows, {"log": "all", **data["all"]}]:
        print(f"{row['log']:<40} {row['recorded_hit_tokens']:>9} {row['predicted_alone_hit_tokens']:>9} "
              f"{row['predicted_own_tier_hit_tokens']:>9} {row['predicted_shared_hit_tokens']:>9} "
              f"{row['blocks_read_from_shared_tier']:>13}")
    print("(hit tokens: as recorded; predicted with each one's own configuration; with the tier below it alone; "
          "with the tier shared by all. Read from it: blocks promoted from the shared tier.)")
    for row in rows:
        _refusals(row["log"], row)
    return EXIT_OK


class _Passes:
    """Passes over a log, run at once (`jobs` 1) or N at a time in processes; `run`
    gives a future either way."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self._pool = ProcessPoolExecutor(jobs) if jobs > 1 else None

    def __enter__(self) -> _Passes:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def run(self, call: Callable[..., _T], *args: object) -> Future[_T]:
        if self._pool is not None:
            return self._pool.submit(call, *args)
        done: Future[_T] = Future()
        done.set_result(call(*args))
        return done


class _Predictions:
    """Every configuration asked about, predicted in passes over the log that each decode it
    and fold the log's own engine once for all the re-drives they carry (`whatif.predict_many`):
    one pass, or with `--jobs N` N passes in processes, the configurations dealt among them.
    The first pass gives the recorded run too."""

    def __init__(self, recorded: EngineConfig, log: _Log) -> None:
        self._config = recorded
        self._log = log
        self._asked: list[EngineConfig] = []
        self._counted: list[bool] = []  # per configuration asked: whether its misses are kept
        self._outcomes: list[whatif.Outcome] = []
        self.recorded: whatif.Outcome | None = None

    def ask(self, config: EngineConfig, *, counted: bool = True) -> Callable[[], whatif.Outcome]:
        """The prediction under `config`, once `run` has run (a configuration asked twice runs once,
        with its misses where either asked for them). `counted=False`: its misses may be left out."""
        if config not in self._asked:
            self._asked.append(config)
            self._counted.append(counted)
        index = self._asked.index(config)
        self._counted[index] = self._counted[index] or counted
        return lambda: self._outcomes[index]

    def run(self, passes: _Passes) -> None:
        starts = range(min(passes.jobs, len(self._asked)))
        groups = [self._asked[start::passes.jobs] for start in starts]
        futures = [passes.run(_predict_many, self._config, group, self._log, self._counted[start::passes.jobs])
                   for group, start in zip(groups, starts)]
        results = [future.result() for future in futures]
        self.recorded, self._log.records = results[0][0], results[0][2]
        by_group = [outcomes for _, outcomes, _ in results]
        self._outcomes = [by_group[index % len(groups)][index // len(groups)] for index in range(len(self._asked))]


def _predict_many(recorded: EngineConfig, configs: list[EngineConfig], log: _Log,
                  counted: list[bool]) -> tuple[whatif.Outcome, list[whatif.Outcome], int]:
    """One pass (in a process of its own under `--jobs`): the outcomes, and how many records it read."""
    outcome, outcomes = whatif.predict_many(recorded, configs, log, counted=counted)
    return outcome, outcomes, log.records


class _Log:
    """A log read from its file again for each pass over it (the recorded run, each
    prediction), so a pass holds no more of it than a re-drive reads ahead; a torn log is
    refused (a prediction from part of one would read as the whole). `records`: how many
    the last whole pass read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.header = log_header(path)
        self.records = 0

    def __iter__(self) -> Iterator[Record]:
        _header, records = _load(self.path)
        count = 0
        for record in records:
            count += 1
            yield record
        if records.tear is not None:
            raise records.tear
        self.records = count


def _read_whole(path: str) -> tuple[LogHeader, list]:
    """The log's header and records, read once: a fleet's replicas are interleaved by their
    steps' times, so each is held whole. A torn log is refused, as `_Log` refuses it."""
    header, records = _load(path)
    cached = list(records)
    if records.tear is not None:
        raise records.tear
    return header, cached


def _error(predicted: int, recorded: int) -> dict:
    return {"predicted_hit_tokens": predicted, "recorded_hit_tokens": recorded,
            "relative_error": None if not recorded else round((predicted - recorded) / recorded, 4)}


def _other_config(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """The configuration asked about, decided by this build's rules: what it would
    do. (The self-check runs the log's own rules: what the run did.) A log of
    older rules is predicted under this build's even with nothing else changed."""
    changes: dict = {"rules": RULES}
    if args.capacity_bytes is not None:
        changes["num_tier_slots"] = _slots(args.capacity_bytes, config, "--capacity-bytes")
    elif args.capacity_blocks is not None:
        changes["num_tier_slots"] = args.capacity_blocks
    if args.policy is not None:
        changes["policy"] = args.policy
    if args.secondary_tiers is not None:
        changes["lower_tiers"] = _tiers(args.secondary_tiers, config)
    for flag in ("store_threshold", "max_tracker_size", "offload_prompt_only"):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    try:
        return attrs.evolve(config, **changes)
    except ConfigError as exc:
        raise BadArgument(str(exc)) from None


def _slots(capacity_bytes: int, config: EngineConfig, flag: str) -> int:
    if not config.slot_bytes:
        raise BadArgument(f"{flag}: this log does not record its slot size (written before kvledger kept it); "
                          "give the capacity in blocks (--capacity-blocks)")
    slots = capacity_bytes // config.slot_bytes
    if slots < 1:
        raise BadArgument(f"{flag} {capacity_bytes} holds no slot of {config.slot_bytes} bytes")
    return slots


def _tiers(text: str, config: EngineConfig, flag: str = "--secondary-tiers") -> tuple[LowerTierSpec, ...]:
    """vLLM 0.33's `secondary_tiers` shape, read by serving's own parser (`tier_types.parse_tiers`;
    a tier here need not name its directory or server) and sized by serving's rule
    (`tier_types.tier_blocks`: each block its header and its copies, one per shard of the
    ranks' KV, as the log recorded them). `num_blocks` in place of `capacity_bytes` gives the
    size in blocks itself."""
    try:
        tiers = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadArgument(f"{flag} is not JSON: {exc}") from None
    if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
        raise BadArgument(f"{flag} takes a JSON list of objects, e.g. "
                          '[{"type": "fs", "capacity_bytes": 10000000000}]')
    # Only here: the tier types' table loads their I/O and torch, which no other question needs.
    from kvledger.transfers.lower_tiers.tier_types import parse_tiers, tier_blocks

    copies = config.tier_copies or config.world_size  # logs before 0.2.0: one file per rank
    counts = [entry.get("num_blocks") for entry in tiers]
    for index, (entry, counted) in enumerate(zip(tiers, counts), start=1):
        if counted is None and "capacity_bytes" not in entry:
            raise BadArgument(f"{flag}: tier {index} needs capacity_bytes or num_blocks")
        if counted is None and not config.slot_bytes:
            raise BadArgument(f"{flag} tier {index}: this log does not record its slot size (recorded before "
                              f"it was); give num_blocks instead of capacity_bytes")
    # A tier sized in blocks is parsed as any other, its capacity in bytes a placeholder never read.
    entries = [{**{k: v for k, v in entry.items() if k != "num_blocks"}, **({"capacity_bytes": 1} if counted is not None else {})}
               for entry, counted in zip(tiers, counts)]
    try:
        specs = [LowerTierSpec(name=f"{index + 1}:{tier.kind}", num_blocks=counted if counted is not None else
                               tier_blocks(tier, config.slot_bytes, copies, f"secondary_tiers[{index}]"))
                 for index, (tier, counted) in enumerate(zip(parse_tiers(entries, located=False), counts))]
    except ConfigError as exc:
        raise BadArgument(f"{flag}: {exc}") from None
    return tuple(specs)


def _sweep(recorded: EngineConfig, config: EngineConfig, log: _Log, passes: _Passes,
           predictions: _Predictions) -> Callable[[], dict]:
    """Hit tokens against host capacity: the engine driven again at each point, under the
    asked policy and (`by_policy`) under LRU and ARC each, with the blocks each moved; and
    (LRU) the one-pass estimate from stack distances at the same points. The points are
    asked here (the curve's pass started); the returned call gathers them once run."""
    bound = whatif.distinct_keys_bound(recorded, log)
    points = sorted({max(1, min(bound, int(config.num_tier_slots * f))) for f in SWEEP_FACTORS} | {bound})
    # Hits and blocks moved alone: the points' misses are not kept (a point that is also the
    # asked prediction keeps them for it).
    runs = {(slots, policy): predictions.ask(attrs.evolve(config, num_tier_slots=slots, policy=policy), counted=False)
            for slots in points for policy in PolicyName}
    one_pass = config.policy.value == "lru" and not config.lower_tiers
    curve = passes.run(whatif.lru_curve, recorded, log, bound) if one_pass else None

    def gather() -> dict:
        rows = []
        for slots in points:
            by_policy = {}
            for policy in PolicyName:
                outcome = runs[slots, policy]()
                by_policy[policy.value] = {"hit_tokens": outcome.stats["hit_tokens"], "blocks_moved": outcome.moved}
            rows.append({"num_tier_slots": slots, "hit_tokens": by_policy[config.policy.value]["hit_tokens"],
                         "capacity_bytes": slots * recorded.slot_bytes if recorded.slot_bytes else None,
                         "by_policy": by_policy})
        result: dict = {"points": rows, "every_key_fits_at": bound, "policy": config.policy.value,
                        "recorded": {"num_tier_slots": recorded.num_tier_slots, "policy": recorded.policy.value,
                                     "slot_bytes": recorded.slot_bytes}}
        if curve is not None:
            for row, estimate in zip(rows, whatif.hits_at(curve.result(), points)):
                row["lru_one_pass"] = estimate
        return result

    return gather


THRESHOLDS = (1, 2, 3, 4, 6, 8)


def _sweep_threshold(recorded: EngineConfig, config: EngineConfig, predictions: _Predictions) -> Callable[[], dict]:
    """Hit tokens and blocks stored against the store threshold, at the asked capacity
    and policy: what holding one-off prompts back buys before turning it on."""
    runs = {n: predictions.ask(attrs.evolve(config, store_threshold=n)) for n in THRESHOLDS}

    def gather() -> dict:
        rows = []
        for n in THRESHOLDS:
            outcome = runs[n]().as_dict()
            rows.append({"store_threshold": n, "hit_tokens": outcome["hit_tokens"],
                         "blocks_stored": outcome["blocks_moved"].get("stored", 0),
                         "evictions": outcome["evictions"],
                         "below_store_threshold_tokens":
                             outcome["misses"]["missed_by_cause"].get("below_store_threshold", {}).get("tokens", 0)})
        return {"by": "store_threshold", "points": rows, "num_tier_slots": config.num_tier_slots,
                "policy": config.policy.value,
                "recorded": {"store_threshold": recorded.store_threshold, "num_tier_slots": recorded.num_tier_slots}}

    return gather


def _refusals(name: str, outcome: dict) -> None:
    """A prediction whose engine refused events is of part of the traffic: said beside it."""
    if outcome["not_applied"]:
        print(f"warning: {name}: {outcome['not_applied']} events refused by the re-drive, "
              f"{outcome['requests_left_out_of_steps']} of them a step applied without a request out of step "
              "with the log: the prediction leaves that traffic out")


def _print(data: dict) -> None:
    recorded, same = data["recorded"], data["predicted_as_recorded"]
    columns: list[tuple[str, dict]] = [("recorded", recorded), ("predicted, same config", same)]
    if "predicted" in data:
        columns.append(("predicted, other config", data["predicted"]))
    rows: list[tuple[str, Callable[[dict], object]]] = [
        ("host slots", lambda c: c["num_tier_slots"]),
        ("host bytes", lambda c: c.get("capacity_bytes", "?")),
        ("policy", lambda c: c["policy"]),
        ("engine rules", lambda c: c["rules"]),
        ("store threshold", lambda c: c["store_threshold"]),
        ("prompt only", lambda c: "yes" if c["offload_prompt_only"] else "no"),
        ("lower tiers", lambda c: ", ".join(f"{t['name']} ({t['num_blocks']} blocks)" for t in c["lower_tiers"])
         or "none"),
        ("hit tokens", lambda c: c["hit_tokens"]),
        ("computed tokens", lambda c: c["misses"]["missed_tokens"]),
        ("loads", lambda c: c["loads"]),
        ("evictions", lambda c: c["evictions"]),
        ("blocks not admitted", lambda c: c["store_rejections"]),
        ("blocks stored", lambda c: c["blocks_moved"].get("stored", 0)),
        ("blocks loaded", lambda c: c["blocks_moved"].get("loaded", 0)),
    ]
    width = max(len(name) for name, _ in columns) + 2
    print(f"log {data['log']}: {data['events']} records" + (f", {data['slot_bytes']}-byte slots"
                                                            if data["slot_bytes"] else ""))
    print(f"{'':<22}" + "".join(f"{name:>{width}}" for name, _ in columns))
    for label, read in rows:
        print(f"{label:<22}" + "".join(f"{str(read(c)):>{width}}" for _, c in columns))
    causes = _causes(c for _, c in columns)
    if causes:
        print("computed because")
        for cause in causes:
            print(f"  {cause:<20}" + "".join(
                f"{c['misses']['missed_by_cause'].get(cause, {}).get('tokens', 0):>{width}}" for _, c in columns))
    for name, c in columns[1:]:
        _refusals(name, c)
    check = data["self_check"]
    if check["relative_error"] is not None:
        print(f"self-check: the same config predicts {check['predicted_hit_tokens']} hit tokens where the log "
              f"recorded {check['recorded_hit_tokens']} ({check['relative_error']:+.1%}): what the prediction "
              "cannot model (vLLM's schedule, transfer timing, failures)")
    if data.get("sweep", {}).get("by") == "store_threshold":
        sweep = data["sweep"]
        print()
        print(f"at {sweep['num_tier_slots']} host slots, {sweep['policy']}:")
        print(f"{'threshold':>10} {'hit tokens':>11} {'blocks stored':>14} {'evictions':>10} "
              f"{'held back (tokens)':>19}")
        for row in sweep["points"]:
            print(f"{row['store_threshold']:>10} {row['hit_tokens']:>11} {row['blocks_stored']:>14} "
                  f"{row['evictions']:>10} {row['below_store_threshold_tokens']:>19}")
    elif "sweep" in data:
        print()
        print(f"{'host slots':>12} {'host bytes':>14} {'hit tokens':>11} {'LRU one pass':>13}")
        for row in data["sweep"]["points"]:
            size = row["capacity_bytes"] if row["capacity_bytes"] is not None else "?"
            print(f"{row['num_tier_slots']:>12} {size:>14} {row['hit_tokens']:>11} "
                  f"{row.get('lru_one_pass', '-'):>13}")


def _causes(columns: Iterable[dict]) -> list[str]:
    seen: dict[str, int] = {}
    for column in columns:
        for cause, entry in column["misses"]["missed_by_cause"].items():
            seen[cause] = max(seen.get(cause, 0), entry["tokens"])
    return sorted(seen, key=lambda cause: -seen[cause])
