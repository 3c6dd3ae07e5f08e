"""What the miss ledger (`misses.py`) says of each admission: its runs of blocks, each
restored, found on the device or computed, and why. A module of its own: attrs builds
these classes, and the ledger around them is compiled (mypyc would not build them).
"""

from __future__ import annotations

import attrs


@attrs.define
class Run:
    """Consecutive blocks of one admission with one outcome."""

    first_block: int
    last_block: int  # inclusive
    first_token: int
    end_token: int  # exclusive
    outcome: str  # "device", "restored" or "missed"
    cause: str = ""  # missed: a CAUSES name; restored: "" (see tier)
    tier: int = -1  # restored: the tier it came from (0: host memory); evicted: the tier it left
    seq: int = -1  # the event behind it: the load, the eviction, the reset, the failure...
    job_id: int = -1
    other_request: str = ""  # the request behind it: whose store evicted it, who had it first...
    detail: str = ""

    @property
    def tokens(self) -> int:
        return self.end_token - self.first_token

    def as_dict(self) -> dict:
        data = {"blocks": [self.first_block, self.last_block], "tokens": [self.first_token, self.end_token],
                "outcome": self.outcome}
        for name in ("cause", "tier", "seq", "job_id", "other_request", "detail"):
            value = getattr(self, name)
            if value not in ("", -1) or (name == "tier" and self.outcome == "restored"):
                data[name] = value
        return data


@attrs.define
class Admission:
    """One allocation of a request while it waited: what its tokens became."""

    request_id: str
    seq: int
    step: int
    num_tokens: int
    attempt: int  # 1 for the first admission; more after preemptions and recomputed loads
    wall_time_us: int = 0  # the last step's, before the admission (0: the log records no times)
    runs: list[Run] = attrs.field(factory=list)
    load_job: int = -1
    superseded_at: int = -1  # a failed load sent it back to waiting: the next admission counts instead

    def tokens(self, outcome: str, cause: str | None = None) -> int:
        return sum(r.tokens for r in self.runs if r.outcome == outcome and (cause is None or r.cause == cause))

    def as_dict(self) -> dict:
        data = {"request_id": self.request_id, "seq": self.seq, "step": self.step, "wall_time_us": self.wall_time_us,
                "attempt": self.attempt,
                "num_tokens": self.num_tokens, "device_tokens": self.tokens("device"),
                "restored_tokens": self.tokens("restored"), "missed_tokens": self.tokens("missed"),
                "runs": [r.as_dict() for r in self.runs]}
        if self.superseded_at >= 0:
            data["superseded_at"] = self.superseded_at
        return data
