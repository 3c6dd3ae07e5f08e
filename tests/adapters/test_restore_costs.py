"""What a restore and a prefill cost, measured while serving (`restore_budget: "auto"`):
the fits, when the numbers are news, and a tier slowed on purpose."""

from __future__ import annotations

import threading
import time

import pytest

from kvledger.adapters.restore_costs import EVERY_STEPS, CostMeter, LinearFit
from kvledger.engine import effects as fx

pytestmark = pytest.mark.fast


def test_a_fit_finds_the_fixed_part_and_the_slope() -> None:
    fit = LinearFit()
    assert fit.estimate() is None
    for blocks in (1, 4, 16, 64, 2, 32):
        fit.add(blocks, 0.002 + blocks * 0.0005)
    a, b = fit.estimate()
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0005)
    one = LinearFit()
    for _ in range(5):
        one.add(8, 0.004)  # one size only: a fixed wait and a cost a block cannot be told apart
    assert one.estimate() is None
    one.add(16, 0.005)
    assert one.estimate() == pytest.approx((0.003, 0.000125))
    slow_first = LinearFit(decay=1.0, all_fixed=True)  # a first load slower than a larger second one
    slow_first.add(12, 0.5)
    slow_first.add(24, 0.26)
    assert slow_first.estimate() == pytest.approx((0.38, 0.0))  # a fixed wait, not 32 ms a block


def _load(job_id: int, blocks: int, tier: int) -> fx.StartLoad:
    ids = tuple(range(blocks))
    return fx.StartLoad(job_id=job_id, request_id="r", keys=(tuple(b"k%d" % i for i in ids),), source_slot_ids=(ids,),
                        target_block_ids=(ids,), promote_tiers=((tier,) * blocks,))


def test_the_costs_are_sent_when_first_known_and_when_they_move() -> None:
    meter = CostMeter(num_lower_tiers=1)
    now = 100.0
    sent = []
    tokens = 0
    for step in range(3 * EVERY_STEPS):
        now += 0.010 + tokens * 0.0001  # the last step's time: 10 ms a step and 100 us a token
        tokens = 512 if step % 4 == 0 else 8  # a prefill now and then among decodes
        measured = meter.step(now, tokens)
        if measured is not None:
            sent.append(measured)
        if step == 3:
            meter.load_started(_load(1, 10, tier=1), now)  # 10 blocks from the disk: 5 ms + 1 ms each
            meter.load_ended(1, True, now + 0.015)
            meter.load_started(_load(2, 40, tier=1), now)
            meter.load_ended(2, True, now + 0.045)
            meter.load_started(_load(3, 10, tier=0), now)
            meter.load_ended(3, False, now + 5.0)  # a failed load is no sample
    assert len(sent) == 1  # nothing moved after the first
    costs = sent[0]
    assert costs.compute_ns_per_token == pytest.approx(100_000, rel=0.01)
    assert costs.load_fixed_us == (0, pytest.approx(5_000, rel=0.01))  # host memory not measured: free
    assert costs.load_ns_per_block == (0, pytest.approx(1_000_000, rel=0.01))
    later = []
    for step in range(2 * EVERY_STEPS):
        now += 0.010 + tokens * 0.0005  # tokens five times as slow: news
        tokens = 512 if step % 4 == 0 else 8
        later.append(meter.step(now, tokens))
    assert any(m is not None and m.compute_ns_per_token > 2 * costs.compute_ns_per_token for m in later)


def test_a_slowed_tier_starts_each_read_late() -> None:
    from kvledger.transfers.lower_tiers.slowed_tier import SlowedTierIO

    class Tier:
        def __init__(self) -> None:
            self.reads: list[tuple[int, float]] = []
            self.done = threading.Event()

        def read(self, job_id, keys, slot_ids) -> None:
            self.reads.append((job_id, time.monotonic()))
            self.done.set()

        def wait(self, job_ids, timeout_s) -> None:
            return

        def poll(self) -> list:
            return []

        def shutdown(self, *, drain=True, timeout_s=30.0) -> None:
            return

    inner = Tier()
    slowed = SlowedTierIO(inner, 0.2)
    asked = time.monotonic()
    slowed.read(7, ((b"k",),), ((0,),))
    assert inner.reads == []  # the worker goes on
    slowed.wait((7,), 5.0)
    (job_id, at), = inner.reads
    assert job_id == 7 and at - asked >= 0.19
    slowed.read(8, ((b"k",),), ((0,),))
    slowed.shutdown()  # a read not yet handed over is dropped
    time.sleep(0.25)
    assert [j for j, _ in inner.reads] == [7]
