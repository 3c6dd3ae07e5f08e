"""What a restore and a prefill cost here, measured while serving, for
`restore_budget: "auto"` (the engine's `budget.py` decides by them).

A load is timed on the scheduler's clock from its start (`StartLoad`) to its
end (`JobEnded`) and charged to the deepest tier it reads from (0: host
memory); each tier's loads are fitted as a fixed cost plus a cost a block. A
prefill token's cost is the slope of a step's time against the tokens it
scheduled. Both fits are least squares over recent samples, each weighing
less as newer ones come. The numbers enter the engine as an event
(`RestoreCostsMeasured`) when they first exist and when one moves by a fifth
or more, at most every `EVERY_STEPS` steps: a replay decides as the run did.

A tier not measured yet (fewer than two sizes of load) costs nothing: its hits
are loaded, as under "load", until its loads say otherwise. A tier judged too slow is read no more, so
its estimate stays where its last loads left it.
"""

from __future__ import annotations

from kvledger.engine import effects as fx
from kvledger.events import types as ev

EVERY_STEPS = 16
STEPS_FIRST = 8  # steps timed before the first estimate: one or two would be noise
MOVE = 0.2  # a relative change that is news
LONGEST_STEP_S = 10.0  # an interval longer than this is idle time, not a step's work


class LinearFit:
    """y = a + b x by weighted least squares; each sample's weight decays by `decay` per newer one."""

    def __init__(self, decay: float = 0.95, *, all_fixed: bool = False) -> None:
        self.decay = decay
        self.all_fixed = all_fixed  # a slope the noise made negative: the mean y as fixed (else y/x as slope)
        self.n = self.x = self.y = self.xx = self.xy = 0.0
        self.samples = 0

    def add(self, x: float, y: float) -> None:
        self.samples += 1
        d = self.decay
        self.n = self.n * d + 1
        self.x = self.x * d + x
        self.y = self.y * d + y
        self.xx = self.xx * d + x * x
        self.xy = self.xy * d + x * y

    def estimate(self) -> tuple[float, float] | None:
        """(a, b), neither below zero; None until samples of more than one x tell the fixed
        part from the slope (one size alone cannot: read as all slope, a tier with a long
        fixed wait looked cheap for short loads, measured on 2026-12-07). A slope the noise
        made negative gives the mean y as a fixed part (`all_fixed`: a load's first, slow
        sample did that) or the mean ratio y/x and no fixed part."""
        if not self.n or not self.x:
            return None
        spread = self.n * self.xx - self.x * self.x
        if spread <= 1e-6 * self.n * self.xx:
            return None
        slope = (self.n * self.xy - self.x * self.y) / spread
        if slope > 0:
            return max(0.0, (self.y - slope * self.x) / self.n), slope
        return (self.y / self.n, 0.0) if self.all_fixed else (0.0, self.y / self.x)


class CostMeter:
    def __init__(self, num_lower_tiers: int) -> None:
        # per tier: seconds against blocks; noise read as a fixed wait, never as a cheap short load
        self._loads = [LinearFit(all_fixed=True) for _ in range(1 + num_lower_tiers)]
        self._compute = LinearFit()  # seconds a step against its tokens
        self._started: dict[int, tuple[float, int, int]] = {}  # load job -> start, blocks, tier
        self._last_step: tuple[float, int] | None = None  # the last step's start and tokens
        self._sent: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
        self._steps_since = EVERY_STEPS

    def load_started(self, load: fx.StartLoad, now: float) -> None:
        tier = max((t for tiers in load.promote_tiers for t in tiers), default=0)
        self._started[load.job_id] = (now, sum(map(len, load.keys)), tier)

    def load_ended(self, job_id: int, ok: bool, now: float) -> None:
        started = self._started.pop(job_id, None)
        if started is not None and ok:
            start, blocks, tier = started
            self._loads[tier].add(blocks, now - start)

    def forget(self, job_id: int) -> None:
        self._started.pop(job_id, None)

    def step(self, now: float, tokens: int) -> ev.RestoreCostsMeasured | None:
        """A step starts, scheduling `tokens`: the last one's time is a sample. The costs,
        when they are news."""
        last = self._last_step
        if last is not None and last[1] > 0 and now - last[0] < LONGEST_STEP_S:
            self._compute.add(last[1], now - last[0])
        self._last_step = (now, tokens)
        self._steps_since += 1
        return self._due()

    def _due(self) -> ev.RestoreCostsMeasured | None:
        compute = self._compute.estimate()
        if compute is None or self._compute.samples < STEPS_FIRST or self._steps_since < EVERY_STEPS:
            return None
        fits = [fit.estimate() or (0.0, 0.0) for fit in self._loads]
        costs = (round(compute[1] * 1e9), tuple(round(a * 1e6) for a, _ in fits), tuple(round(b * 1e9) for _, b in fits))
        if self._sent is not None and not _moved(self._sent, costs):
            return None
        self._sent, self._steps_since = costs, 0
        return ev.RestoreCostsMeasured(compute_ns_per_token=costs[0], load_fixed_us=costs[1],
                                       load_ns_per_block=costs[2])


def _moved(old: tuple, new: tuple) -> bool:
    before = (old[0], *old[1], *old[2])
    after = (new[0], *new[1], *new[2])
    return any(abs(a - b) > MOVE * max(a, b) for a, b in zip(before, after))
