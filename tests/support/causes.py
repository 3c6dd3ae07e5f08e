"""`kvledger explain` on a log, each named cause checked against the event it names.

Used on every real vLLM log the suite replays (tests/on_vllm/conftest.py) and on
the stored ones (tests/test_golden.py): a cause that names a seq must find there
the event or the engine's answer it claims.
"""

from __future__ import annotations

from pathlib import Path

from kvledger.adapters.log_files import open_log
from kvledger.adapters.log_tools.misses import Admission, MissLedger, totals
from kvledger.engine import effects as fx
from kvledger.engine.replay import replay
from kvledger.events import types as ev


def explained(log: Path) -> tuple[list[Admission], dict]:
    """The admissions and the totals; fails on a computed block with no cause, and on a
    cause whose seq holds no event or answer of that kind."""
    header, records = open_log(log)
    ledger = MissLedger(header.config)
    at: dict[int, tuple[ev.Event, tuple[fx.Effect, ...]]] = {}

    def observe(seq, event, state, effects) -> None:
        ledger.observe(seq, event, state, effects)
        at[seq] = (event, effects)

    replay(header.config, records, observe=observe)
    for admission in ledger.admissions:
        for run in admission.runs:
            assert run.cause != "unexplained", (admission.request_id, admission.seq, run)
            if run.outcome == "missed" and run.seq >= 0:
                assert run.seq < admission.seq or run.cause == "load_failed", (admission, run)
                event, effects = at[run.seq]
                assert _names(run, event, effects), (admission.request_id, admission.seq, run, event)
    return ledger.admissions, totals(ledger.admissions)


def _names(run, event: ev.Event, effects: tuple[fx.Effect, ...]) -> bool:
    """The event at the run's seq, or the engine's answer to it, is what its cause says."""
    def dropped(reason: fx.Reason) -> bool:
        return any(isinstance(e, fx.KeysUnloadable) and e.tier == run.tier and e.reason is reason for e in effects)

    def failed(kind: str) -> bool:
        return any(isinstance(e, fx.TransferFailed) and e.kind == kind and e.job_id == run.job_id for e in effects)

    checks = {
        "evicted": lambda: dropped(fx.Reason.EVICTED),
        "reset": lambda: isinstance(event, ev.CacheReset) or dropped(fx.Reason.RESET),
        "transfer_failed": lambda: dropped(fx.Reason.FAILED),
        "store_failed": lambda: failed("store"),
        "load_failed": lambda: failed("load"),
        "promotion_failed": lambda: failed("load"),
        "not_admitted": lambda: any(isinstance(e, fx.KeysNotAdmitted) for e in effects),
        "stored_too_late": lambda: any(isinstance(e, fx.StartStore) and e.job_id == run.job_id for e in effects),
        "request_ended": lambda: isinstance(event, (ev.RequestFinished, ev.RequestAborted))
        and event.request_id == run.other_request,
    }
    for cause, reason in (("tier_down", "down"), ("lookup_timed_out", "timed_out"), ("lookup_dropped", "dropped")):
        checks[cause] = lambda reason=reason: (isinstance(event, ev.TierLookupFailed) and event.reason == reason
                                               and event.tier == run.tier)
    check = checks.get(run.cause)
    return True if check is None else check()
