"""`kvledger explain`: why each prompt token was restored or computed.

Exit status as `replay`'s: 0 clean, 1 when the replay shows a problem (the
explanation then stops being trustworthy where it does), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvledger.adapters.log_tools.misses import CAUSES, HOST, Admission, MissLedger, Run, Tally
from kvledger.engine.replay import replay

from .log_commands import EXIT_OK, EXIT_PROBLEM, BadArgument, _load, _report_tear


def cmd_explain(args: argparse.Namespace) -> int:
    """One pass over the log, in the memory of its facts about keys: each admission is
    tallied once it can no longer change and then dropped (but `--request`'s)."""
    header, records = _load(args.log)
    tally = Tally()
    windows = _Windows(args.window, args.window_seconds) if args.window or args.window_seconds else None

    def admitted(admission: Admission) -> None:
        tally.add(admission)
        if windows is not None:
            windows.add(admission, ledger.first_timed_us)

    if args.request is None:
        ledger = MissLedger(header.config, on_admission=admitted)
    else:
        ledger = MissLedger(header.config, keep=args.request.__eq__)
    result = replay(header.config, records, until_seq=args.until, observe=ledger.observe)
    ledger.flush()
    admissions = ledger.admissions
    if args.request is not None:
        if not admissions:
            raise BadArgument(f"{args.log} admits no request {args.request!r} (`kvledger requests {args.log}` "
                              "lists them; a request never allocated has nothing to explain)")
        for admission in admissions:
            admitted(admission)
    data = {"log": args.log, "events": result.events, "last_seq": result.last_seq,
            "policy": header.config.policy.value, "block_size": ledger.block_size,
            "tiers": ["host"] + [t.name for t in header.config.lower_tiers],
            **tally.as_dict()}
    if result.first_problem is not None:
        problem = result.first_problem
        data["problem"] = {"seq": problem.seq, "kind": problem.kind, "detail": problem.detail}
    if windows is not None:
        if args.window_seconds and windows.seen and not ledger.first_timed_us:
            raise BadArgument(f"{args.log} records no step times (written before kvledger recorded them): "
                              "use --window")
        data["windows"] = windows.rows()
    if args.request is not None:
        data["requests"] = [a.as_dict() for a in admissions]
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print(data, admissions)
    if records.tear is not None:
        return _report_tear(records)
    if result.first_problem is not None:
        print(f"kvledger: the replay found a problem at seq {result.first_problem.seq} "
              f"({result.first_problem.detail}); what follows it is explained as the engine replayed it",
              file=sys.stderr)
        return EXIT_PROBLEM
    return EXIT_OK


class _Windows:
    """Each window's restored and computed tokens, and the computed by cause, tallied an
    admission at a time: by step (`--window`), or by the steps' wall time from the first
    timed admission's (`--window-seconds`; an admission before any timed step counts in
    the first window, as one admitted before the first step does by steps)."""

    def __init__(self, steps: int, seconds: int) -> None:
        self.unit = "steps" if steps else "seconds"
        self.width = steps or seconds
        self.last = steps - 1 if steps else seconds
        self.tallies: dict[int, Tally] = {}
        self.seen = False

    def add(self, admission: Admission, first_timed_us: int) -> None:
        self.seen = True
        if self.unit == "steps":
            index = max(admission.step, 0) // self.width
        else:
            index = max(admission.wall_time_us - first_timed_us, 0) // (self.width * 1_000_000)
        tally = self.tallies.get(index)
        if tally is None:
            tally = self.tallies[index] = Tally()
        tally.add(admission)

    def rows(self) -> list[dict]:
        rows = []
        for index in sorted(self.tallies):
            part = self.tallies[index].as_dict()
            rows.append({self.unit: [index * self.width, index * self.width + self.last],
                         "restored_tokens": part["restored_tokens"], "missed_tokens": part["missed_tokens"],
                         "missed_by_cause": {cause: entry["tokens"]
                                             for cause, entry in part["missed_by_cause"].items()}})
        return rows


def _tier_name(tier: int, tiers: list[str]) -> str:
    if tier == HOST:
        return "host memory"
    return f"tier {tier} ({tiers[tier]})" if tier < len(tiers) else f"tier {tier}"


# What a run of these causes adds to its cause's name: the job, the other request, the seq.
_WORDS = {
    "stored_too_late": ": store job {job} of request {request} started at seq {seq}",
    "request_ended": ": request {request} ended at seq {seq}",
    "not_computed_yet": ": request {request} had it first",
    "below_store_threshold": ": offered by request {request} at seq {seq}",
    "load_slower_than_compute": " (seq {seq})",
    "decode_not_offloaded": ": generated by request {request}",
}


def describe(run: Run, tiers: list[str]) -> str:
    """One run of blocks, in words."""
    if run.outcome == "device":
        return "in vLLM's own prefix cache"
    if run.outcome == "restored":
        return f"restored from {_tier_name(run.tier, tiers)} by load job {run.job_id} (seq {run.seq})"
    text = f"computed: {run.cause}"
    where = _tier_name(run.tier, tiers) if run.tier >= 0 else ""
    if run.cause == "evicted":
        text += f" from {where} at seq {run.seq}"
        if run.job_id >= 0:
            text += f", making room for job {run.job_id}" + (f" of request {run.other_request}" if run.other_request
                                                              else "")
    elif run.cause in ("reset", "transfer_failed", "store_failed", "not_admitted", "load_failed", "promotion_failed",
                       "spill_dropped"):
        text += f" at seq {run.seq}" + (f" (job {run.job_id})" if run.job_id >= 0 else "")
        if where and run.cause not in ("load_failed", "promotion_failed"):
            text += f", {where}"
    elif run.cause in _WORDS:
        text += _WORDS[run.cause].format(job=run.job_id, request=run.other_request, seq=run.seq)
    elif run.cause in ("tier_down", "lookup_timed_out", "lookup_dropped"):
        text += f": {where}'s lookup for this request, at seq {run.seq}"
    elif run.cause == "no_host_slot":
        text += f": held by {where}"
    elif run.cause == "bounded_by_group" and run.seq >= 0:
        text += f" (seq {run.seq})"
    if run.detail:
        text += f"; {run.detail}"
    return text


def _print(data: dict, admissions: list[Admission]) -> None:
    tiers = data["tiers"]
    print(f"log          {data['log']}: {data['events']} events, {data['admissions']} admissions "
          f"(policy {data['policy']}, {data['block_size']}-token blocks)")
    restored = ", ".join(f"{name} {tokens}" for name, tokens in data["restored_by_tier"].items())
    print(f"tokens       {data['prompt_tokens']} to compute or restore: {data['device_tokens']} in vLLM's prefix "
          f"cache, {data['restored_tokens']} restored" + (f" ({restored})" if restored else "")
          + f", {data['missed_tokens']} computed")
    superseded = data["superseded"]
    if superseded["admissions"]:
        print(f"superseded   {superseded['admissions']} admissions whose load failed and sent the request back to "
              f"waiting ({superseded['restored_tokens']} tokens restored, then recomputed: counted at the next)")
    if data["missed_by_cause"]:
        print()
        print(f"{'computed because':<20} {'tokens':>9} {'blocks':>8} {'admissions':>10}  what it means")
        for cause, entry in data["missed_by_cause"].items():
            print(f"{cause:<20} {entry['tokens']:>9} {entry['blocks']:>8} {entry['admissions']:>10}  {CAUSES[cause]}")
    if data.get("windows"):
        causes = list(data["missed_by_cause"])
        print()
        unit = "steps" if "steps" in data["windows"][0] else "seconds"
        print(f"{unit:<13} {'restored':>9} {'computed':>9}  " + " ".join(f"{c:>{max(len(c), 7)}}" for c in causes))
        for row in data["windows"]:
            span = f"{row[unit][0]}-{row[unit][1]}"
            print(f"{span:<13} {row['restored_tokens']:>9} {row['missed_tokens']:>9}  "
                  + " ".join(f"{row['missed_by_cause'].get(c, 0):>{max(len(c), 7)}}" for c in causes))
    for admission in admissions:
        print()
        note = f", superseded at seq {admission.superseded_at} (its load failed)" if admission.superseded_at >= 0 \
            else ""
        print(f"request {admission.request_id}, admission {admission.attempt} at seq {admission.seq} "
              f"(step {admission.step}): {admission.num_tokens} tokens, {admission.tokens('device')} in vLLM's "
              f"prefix cache, {admission.tokens('restored')} restored, {admission.tokens('missed')} computed{note}")
        for run in admission.runs:
            blocks = (f"block {run.first_block}" if run.first_block == run.last_block
                      else f"blocks {run.first_block}-{run.last_block}")
            print(f"  {blocks:<16} tokens {run.first_token}-{run.end_token - 1:<8} {describe(run, tiers)}")
    if "problem" in data:
        print()
        print(f"problem      at seq {data['problem']['seq']}: {data['problem']['detail']}")
