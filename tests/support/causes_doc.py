"""Render `docs/causes.md`: one computed block of each cause, as `kvledger explain --request` prints it.

Seeded simulator runs (the workloads `tests/adapters/test_misses.py` reaches every cause with)
are explained; for each cause the first admission with a run of it is shown whole, with the
event its seq names. `render()` returns the page; `tests/adapters/test_misses.py` checks the
committed file equals it (`KVLEDGER_UPDATE_GOLDEN=1` rewrites it).
"""

from __future__ import annotations

import json
import random

from kvledger.adapters.cli.explain import describe
from kvledger.adapters.log_tools.misses import CAUSES, Admission, MissLedger
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.events import codec
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupSpec
from tests.engine.builders import SIMULATED_CONFIGS

SMALL = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=16),), hash_block_size=16,
                     num_device_blocks=24, num_tier_slots=6, protection="pin")
RATES = {"fail_rate": 0.1, "reset_rate": 0.03, "damage_rate": 0.05, "foreign_rate": 0.05, "lookup_fail_rate": 0.1}
SHOWN = [cause for cause in CAUSES if cause not in ("unexplained", "log_table")]  # log_table: whatif's
REKEYED = "reset, under an earlier key generation"  # shown beside `reset`'s first example


def _runs():
    """Each seeded run: its config, its admissions, and its events by seq; then the same with
    conversations' next turns, for the causes only those reach."""
    for turns in ({}, {"turn_rate": 0.2, "pressure_rate": 0.05}):
        yield from _seeded(turns)


def _seeded(turns: dict[str, float]):
    for number, config in enumerate((*SIMULATED_CONFIGS, SMALL)):
        for seed in range(6):
            ledger = MissLedger(config)
            events: list[ev.Event] = []

            def observe(seq, event, state, effects, ledger=ledger, events=events):
                ledger.observe(seq, event, state, effects)
                events.append(event)

            sim = Simulator(config, prefix_caching=seed % 2 == 0, observe=observe)
            run_random(sim, random.Random(seed), steps=120, arrivals=0.8, max_tokens=12, **RATES, **turns)
            yield number, seed, config, ledger.admissions, events


def _example(cause: str, config: EngineConfig, admission: Admission, events: list[ev.Event], named) -> list[str]:
    tiers = ["host"] + [t.name for t in config.lower_tiers]
    lines = [f"request {admission.request_id}, admission {admission.attempt} at seq {admission.seq}: "
             f"{admission.num_tokens} tokens, {admission.tokens('device')} in vLLM's prefix cache, "
             f"{admission.tokens('restored')} restored, {admission.tokens('missed')} computed"]
    for run in admission.runs:
        blocks = f"block {run.first_block}" if run.first_block == run.last_block else \
            f"blocks {run.first_block}-{run.last_block}"
        mark = "->" if run == named else "  "
        lines.append(f"{mark} {blocks:<14} {describe(run, tiers)}")
    if 0 <= named.seq < len(events):
        lines.append(f"   seq {named.seq}: {json.dumps(codec.to_record(events[named.seq]))}")
    return lines


def render() -> str:
    found: dict[str, tuple[int, int, list[str]]] = {}
    for number, seed, config, admissions, events in _runs():
        for admission in admissions:
            for run in admission.runs:
                if run.outcome != "missed" or run.cause not in SHOWN:
                    continue
                shown = REKEYED if run.cause == "reset" and "key generation" in run.detail else run.cause
                if shown not in found:
                    found[shown] = (number, seed, _example(run.cause, config, admission, events, run))
        if len(found) == len(SHOWN) + 1:
            break
    out = [
        "<!-- Rendered by tests/support/causes_doc.py from seeded simulator runs; do not edit by hand.",
        "     KVLEDGER_UPDATE_GOLDEN=1 python -m pytest tests/adapters/test_misses.py rewrites it. -->",
        "",
        "# Why a block was computed: one of each cause",
        "",
        "Each example is one admission as `kvledger explain LOG --request ID` prints it, from a seeded",
        "simulator run (the simulator plays vLLM, its workers and another process sharing a tier: it",
        "fails transfers, damages tier files, resets, and leaves shared-tier lookups unanswered). The",
        "arrow marks the run of the cause shown; the last line is the event at the seq that run names,",
        "as the log's JSON form has it. The causes are described in the README's table.",
        "",
    ]
    for cause in [*SHOWN[:SHOWN.index("reset") + 1], REKEYED, *SHOWN[SHOWN.index("reset") + 1:]]:
        if cause == REKEYED:
            out.append("A block stored before a reset that began a new key generation (tiers below host memory),")
            out.append("asked for again under its new key:")
        else:
            out.append(f"## `{cause}`")
            out.append("")
            out.append(CAUSES[cause][0].upper() + CAUSES[cause][1:] + ".")
        out.append("")
        if cause not in found:
            out.append("(no seeded run reaches it)")
            out.append("")
            continue
        number, seed, lines = found[cause]
        where = "`SMALL` in `tests/support/causes_doc.py`" if number == len(SIMULATED_CONFIGS) else \
            f"`SIMULATED_CONFIGS[{number}]` in `tests/engine/builders.py`"
        out.append(f"{where}, seed {seed}:")
        out.append("")
        out.append("```")
        out.extend(lines)
        out.append("```")
        out.append("")
    return "\n".join(out)
