"""vLLM 0.33's `backpressure` on the tiers below host memory: a tier whose writes
run slow has its spills dropped rather than queued.

As vLLM's `EMABackpressureDetector` measures it, on the scheduler's clock: each
spill's time from its start (`StartSpill`) to its end (`JobEnded`) per MiB, in a
moving average seeded by the mean of the first `warmup_completions`; the tier
is under pressure above `high_water_s` a MiB and well again below
`low_water_s`, the average halving every `decay_half_life_s` of silence; and
`failure_threshold` failed writes in a row put it under pressure too. Then
`DropStorePolicy` drops every spill to it, `ThrottledDropPolicy` (vLLM's
default) a share growing with the overshoot, and for `cooldown_s` after the
pressure clears half of them. The engine decides which spill is dropped: the
share enters it as an event (`TierPressure`, in steps of a tenth) and it
drops spills by it, announcing each (`SpillDropped`), so a replay drops the
same ones and `explain` names a block a tier never got (`spill_dropped`).
"""

from __future__ import annotations

import attrs

from kvledger.engine import effects as fx
from kvledger.events import types as ev

MIB = 1 << 20
STEP_PPM = 100_000  # the share of spills dropped moves in tenths: an event each time it moves


@attrs.frozen
class BackpressureSettings:
    """One tier's, as vLLM 0.33 takes them (`backpressure`, top level and per tier)."""

    high_water_s: float
    low_water_s: float
    throttled: bool = True  # ThrottledDropPolicy (vLLM's default); False: DropStorePolicy
    alpha: float = 0.15
    warmup_completions: int = 10
    decay_half_life_s: float = 2.0
    cooldown_s: float = 1.0
    failure_threshold: int | None = 3  # vLLM sets it for its storage tiers
    ramp_factor: float = 2.0


class TierDetector:
    def __init__(self, settings: BackpressureSettings) -> None:
        self.settings = settings
        self.ema = 0.0  # seconds a MiB
        self.under_pressure = False
        self._warmup: list[float] = []
        self._completions = 0
        self._failures = 0
        self._last_update = 0.0
        self._cleared_at = -1.0

    def completed(self, elapsed_s: float, nbytes: int, now: float) -> None:
        s = self.settings
        if nbytes <= 0:
            return
        per_mib = elapsed_s / (nbytes / MIB)
        self._failures = 0
        self._completions += 1
        if self._completions <= s.warmup_completions:
            self._warmup.append(per_mib)
            if self._completions == s.warmup_completions:
                self.ema = sum(self._warmup) / len(self._warmup)
                self._last_update = now
            return
        self.ema = s.alpha * per_mib + (1 - s.alpha) * self.ema
        self._last_update = now
        if self.ema > s.high_water_s:
            self.under_pressure = True
        elif self.ema < s.low_water_s:
            self._clear(now)

    def failed(self, now: float) -> None:
        s = self.settings
        if s.failure_threshold is None:
            return
        self._failures += 1
        if self._failures >= s.failure_threshold:
            self.ema = max(self.ema, s.high_water_s * 4.0)
            self._last_update = now
            self.under_pressure = True

    def _clear(self, now: float) -> None:
        if self.under_pressure:
            self._cleared_at = now
        self.under_pressure = False

    def drop_ppm(self, now: float) -> int:
        """The share of spills to drop now, in tenths."""
        s = self.settings
        if self.under_pressure and s.decay_half_life_s > 0:  # silence lets it recover
            self.ema *= 0.5 ** ((now - self._last_update) / s.decay_half_life_s)
            self._last_update = now
            if self.ema < s.low_water_s:
                self._clear(now)
        if self.under_pressure:
            if not s.throttled or s.high_water_s <= 0:
                return 1_000_000
            share = min(1.0, max(0.0, self.ema - s.high_water_s) / s.high_water_s / s.ramp_factor)
            return round(share * 1_000_000 / STEP_PPM) * STEP_PPM
        if self._cleared_at >= 0 and now - self._cleared_at < s.cooldown_s:
            return 500_000
        return 0


class Backpressure:
    """The lower tiers' detectors (tier -> settings; a tier without is never dropped)."""

    def __init__(self, settings: dict[int, BackpressureSettings], slot_bytes: int) -> None:
        self.detectors = {tier: TierDetector(s) for tier, s in settings.items()}
        self._slot_bytes = slot_bytes
        self._started: dict[int, tuple[float, int, int]] = {}  # spill job -> start, tier, bytes
        self._sent: dict[int, int] = {}

    def spill_started(self, spill: fx.StartSpill, now: float) -> None:
        if spill.tier in self.detectors:
            self._started[spill.job_id] = (now, spill.tier, sum(map(len, spill.keys)) * self._slot_bytes)

    def spill_ended(self, ended: fx.JobEnded, now: float) -> None:
        started = self._started.pop(ended.job_id, None)
        if started is None or ended.stale:
            return
        start, tier, nbytes = started
        if ended.failed_keys:
            self.detectors[tier].failed(now)
        else:
            self.detectors[tier].completed(now - start, nbytes, now)

    def tick(self, now: float) -> list[ev.TierPressure]:
        """The tiers whose share of dropped spills moved since last said."""
        moved = []
        for tier, detector in self.detectors.items():
            drop = detector.drop_ppm(now)
            if drop != self._sent.get(tier, 0):
                self._sent[tier] = drop
                moved.append(ev.TierPressure(tier=tier, drop_ppm=drop,
                                             latency_ns_per_mib=round(detector.ema * 1e9)))
        return moved
