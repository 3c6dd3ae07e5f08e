"""`kvledger whatif`: the log's traffic under another host capacity, policy or
set of lower tiers, beside what the log recorded (`adapters/whatif.py` says
what the prediction keeps as recorded)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable

import attrs

from kvledger.adapters import whatif
from kvledger.events.config import ConfigError, EngineConfig, LowerTierSpec

from .log_commands import EXIT_OK, BadArgument, _load, _report_tear

SWEEP_FACTORS = (0.125, 0.25, 0.5, 1, 2, 4, 8)


def cmd_whatif(args: argparse.Namespace) -> int:
    header, records = _load(args.log)
    config = header.config
    other = _other_config(args, config)
    cached = list(records)  # read once: each run below goes over it again
    if records.tear is not None:
        return _report_tear(records)
    outcome = whatif.recorded(config, cached)
    same = whatif.predict(config, config, cached)
    data = {"log": args.log, "events": len(cached), "slot_bytes": config.slot_bytes,
            "recorded": outcome.as_dict(), "predicted_as_recorded": same.as_dict(),
            "self_check": _error(same.stats["hit_tokens"], outcome.stats["hit_tokens"])}
    if other != config:
        data["predicted"] = whatif.predict(config, other, cached).as_dict()
    if args.sweep:
        data["sweep"] = _sweep(config, other, cached)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print(data)
    return EXIT_OK


def _error(predicted: int, recorded: int) -> dict:
    return {"predicted_hit_tokens": predicted, "recorded_hit_tokens": recorded,
            "relative_error": None if not recorded else round((predicted - recorded) / recorded, 4)}


def _other_config(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    changes: dict = {}
    if args.capacity_bytes is not None:
        changes["num_tier_slots"] = _slots(args.capacity_bytes, config, "--capacity-bytes")
    elif args.capacity_blocks is not None:
        changes["num_tier_slots"] = args.capacity_blocks
    if args.policy is not None:
        changes["policy"] = args.policy
    if args.secondary_tiers is not None:
        changes["lower_tiers"] = _tiers(args.secondary_tiers, config)
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


def _tiers(text: str, config: EngineConfig) -> tuple[LowerTierSpec, ...]:
    """vLLM 0.33's `secondary_tiers` shape: a list of {"type", "capacity_bytes"}
    (or {"num_blocks"}), in order below host memory."""
    try:
        tiers = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadArgument(f"--secondary-tiers is not JSON: {exc}") from None
    if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
        raise BadArgument('--secondary-tiers takes a JSON list of objects, e.g. [{"type": "fs", '
                          '"capacity_bytes": 10000000000}]')
    specs = []
    for index, tier in enumerate(tiers, start=1):
        kind = tier.get("type")
        if not isinstance(kind, str) or not kind:
            raise BadArgument(f"--secondary-tiers: tier {index} names no type")
        unknown = sorted(set(tier) - {"type", "capacity_bytes", "num_blocks"})
        if unknown:
            raise BadArgument(f"--secondary-tiers: tier {index}: unknown keys {', '.join(unknown)}")
        if "num_blocks" in tier:
            blocks = tier["num_blocks"]
        elif "capacity_bytes" in tier:
            size = tier["capacity_bytes"]
            if not isinstance(size, int) or isinstance(size, bool):
                raise BadArgument(f"--secondary-tiers: tier {index}: capacity_bytes must be an integer")
            blocks = _slots(size, config, f"--secondary-tiers tier {index}")
        else:
            raise BadArgument(f"--secondary-tiers: tier {index} needs capacity_bytes or num_blocks")
        try:
            specs.append(LowerTierSpec(name=f"{index}:{kind}", num_blocks=blocks))
        except ConfigError as exc:
            raise BadArgument(f"--secondary-tiers: tier {index}: {exc}") from None
    return tuple(specs)


def _sweep(recorded: EngineConfig, config: EngineConfig, cached: list) -> dict:
    """Hit tokens against host capacity: the engine driven again at each point,
    and (LRU) the one-pass estimate from stack distances at the same points."""
    bound = whatif.distinct_keys_bound(recorded, cached)
    points = sorted({max(1, min(bound, int(config.num_tier_slots * f))) for f in SWEEP_FACTORS} | {bound})
    rows = []
    for slots in points:
        outcome = whatif.predict(recorded, attrs.evolve(config, num_tier_slots=slots), cached)
        rows.append({"num_tier_slots": slots, "hit_tokens": outcome.stats["hit_tokens"],
                     "capacity_bytes": slots * recorded.slot_bytes if recorded.slot_bytes else None})
    result: dict = {"points": rows, "every_key_fits_at": bound}
    if config.policy.value == "lru" and not config.lower_tiers:
        admissions = whatif.lru_curve(recorded, cached, bound)
        for row, estimate in zip(rows, whatif.hits_at(admissions, points)):
            row["lru_one_pass"] = estimate
    return result


def _print(data: dict) -> None:
    recorded, same = data["recorded"], data["predicted_as_recorded"]
    columns: list[tuple[str, dict]] = [("recorded", recorded), ("predicted, same config", same)]
    if "predicted" in data:
        columns.append(("predicted, other config", data["predicted"]))
    rows: list[tuple[str, Callable[[dict], object]]] = [
        ("host slots", lambda c: c["num_tier_slots"]),
        ("host bytes", lambda c: c.get("capacity_bytes", "?")),
        ("policy", lambda c: c["policy"]),
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
    check = data["self_check"]
    if check["relative_error"] is not None:
        print(f"self-check: the same config predicts {check['predicted_hit_tokens']} hit tokens where the log "
              f"recorded {check['recorded_hit_tokens']} ({check['relative_error']:+.1%}): what the prediction "
              "cannot model (vLLM's schedule, transfer timing, failures)")
    if "sweep" in data:
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
