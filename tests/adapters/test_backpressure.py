"""vLLM 0.33's backpressure, measured as vLLM measures it: the moving average of a
tier's write time a MiB, its water marks, silence and failures; the share of spills
dropped by each policy; and the settings, top level and per tier."""

from __future__ import annotations

import pytest

from kvledger.adapters.backpressure import MIB, Backpressure, BackpressureSettings, TierDetector
from kvledger.engine import effects as fx
from kvledger.events.config import ConfigError

pytestmark = pytest.mark.fast

LOCAL = BackpressureSettings(high_water_s=0.010, low_water_s=0.002, throttled=False, warmup_completions=3)


def _writes(detector: TierDetector, per_mib: float, count: int, now: float) -> float:
    for _ in range(count):
        now += 0.1
        detector.completed(per_mib * 4, 4 * MIB, now)
    return now


def test_slow_writes_put_a_tier_under_pressure_and_silence_lets_it_recover() -> None:
    detector = TierDetector(LOCAL)
    now = _writes(detector, 0.050, 3, 0.0)  # the warm-up: never pressure, however slow
    assert not detector.under_pressure and detector.ema == pytest.approx(0.050)
    now = _writes(detector, 0.050, 1, now)
    assert detector.under_pressure and detector.drop_ppm(now) == 1_000_000  # DropStorePolicy: every spill
    # No writes (all dropped): the average halves every 2 s until under the low mark, then half for a second.
    assert detector.drop_ppm(now + 3.0) == 1_000_000
    assert detector.drop_ppm(now + 10.0) == 500_000 and not detector.under_pressure
    assert detector.drop_ppm(now + 12.0) == 0


def test_the_throttled_policy_drops_a_share_growing_with_the_overshoot() -> None:
    detector = TierDetector(BackpressureSettings(high_water_s=0.010, low_water_s=0.002, warmup_completions=1))
    now = _writes(detector, 0.020, 2, 0.0)  # average at twice the high mark: overshoot 1, ramp 2: half
    assert detector.drop_ppm(now) == 500_000
    now = _writes(detector, 0.5, 20, now)
    assert detector.drop_ppm(now) == 1_000_000


def test_failed_writes_in_a_row_are_pressure_too() -> None:
    detector = TierDetector(LOCAL)
    for n in range(3):
        assert not detector.under_pressure
        detector.failed(float(n))
    assert detector.under_pressure and detector.drop_ppm(3.0) == 1_000_000


def test_the_engine_hears_of_a_change_once() -> None:
    pressure = Backpressure({1: LOCAL}, slot_bytes=MIB)
    now = 0.0
    for job in range(5):
        spill = fx.StartSpill(job_id=job, tier=1, keys=((b"k",) * 4,), source_slot_ids=((0, 1, 2, 3),))
        pressure.spill_started(spill, now)
        now += 0.2  # 4 MiB in 0.2 s: 50 ms a MiB
        pressure.spill_ended(fx.JobEnded(job_id=job, kind="spill", request_id="", tier=1, keys=spill.keys,
                                         failed_keys=(), stale=False), now)
    (said,) = pressure.tick(now)
    assert (said.tier, said.drop_ppm) == (1, 1_000_000) and said.latency_ns_per_mib == pytest.approx(50_000_000, rel=0.01)
    assert pressure.tick(now) == []


def test_the_settings_top_level_and_per_tier(tmp_path) -> None:
    from kvledger.adapters.settings import parse_settings

    base = {"capacity_bytes": 1 << 20, "backpressure": {"backpressure_cls": "EMABackpressureDetector"},
            "secondary_tiers": [{"type": "fs", "path": str(tmp_path / "a"), "capacity_bytes": 1 << 30},
                                {"type": "fs", "path": str(tmp_path / "b"), "capacity_bytes": 1 << 30,
                                 "backpressure": {"policy_cls": "DropStorePolicy", "high_water_s": 0.05}}]}
    first, second = parse_settings(base).backpressure
    assert (first.throttled, first.high_water_s, first.low_water_s) == (True, 0.010, 0.002)
    assert (second.throttled, second.high_water_s) == (False, 0.05)
    alone = {k: v for k, v in base.items() if k != "backpressure"}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\].backpressure needs backpressure_cls"):
        parse_settings(alone)  # as vLLM: a tier's own, with no top level, names its detector
    alone["secondary_tiers"][1]["backpressure"]["backpressure_cls"] = "EMABackpressureDetector"
    assert parse_settings(alone).backpressure[0] is None  # only the second tier's own
    assert parse_settings(alone).backpressure[1].high_water_s == 0.05
    with pytest.raises(ConfigError, match="needs backpressure_cls 'EMABackpressureDetector'"):
        parse_settings({**base, "backpressure": {"policy_cls": "DropStorePolicy"}})
    with pytest.raises(ConfigError, match="policy_cls must be"):
        parse_settings({**base, "backpressure": {"backpressure_cls": "EMABackpressureDetector",
                                                 "policy_cls": "Mine"}})
    with pytest.raises(ConfigError, match="low_water_s must be from 0 to high_water_s"):
        parse_settings({**base, "backpressure": {"backpressure_cls": "EMABackpressureDetector", "low_water_s": 1}})
