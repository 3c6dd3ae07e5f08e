"""The whole protocol under generated action sequences.

A `Simulator` plays vLLM (scheduler, block pool, workers) and keeps a naive
model of what the engine should believe, plus a shadow of every block's
content. After every rule the engine's invariants and the model are checked.
The simulator raises on any content error: a request reading a block whose
bytes are not its key, which is what wrong output would be.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.adapters.testing.simulator import Simulator
from kvledger.engine.reducer import reduce, reduce_step
from kvledger.events.config import EngineConfig
from tests.engine.builders import SIMULATED_CONFIGS

pytestmark = pytest.mark.slow

CONFIGS = SIMULATED_CONFIGS


class Protocol(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(CONFIGS), prefix_caching=st.booleans(),
                chunk=st.sampled_from([0, 0, 48]), seed=st.integers(0, 2**16))
    def setup(self, config: EngineConfig, prefix_caching: bool, chunk: int, seed: int) -> None:
        self.sim = Simulator(config, prefix_caching=prefix_caching, chunk_tokens=chunk,
                             check_every_event=True)
        self.rng = random.Random(seed)

    @rule(doc=st.integers(0, 2), blocks=st.integers(1, 5), extra=st.integers(0, 31),
          max_tokens=st.integers(1, 24))
    def add(self, doc: int, blocks: int, extra: int, max_tokens: int) -> None:
        size = self.sim.config.hash_block_size
        self.sim.add_request(doc, blocks * size + extra % size, max_tokens)

    @precondition(lambda self: self.sim.waiting())
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        self.sim.admit(data.draw(st.sampled_from(self.sim.waiting())))

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        running = self.sim.running()
        chosen = data.draw(st.lists(st.sampled_from(running), unique=True)) if running else []
        self.sim.step(chosen)

    @precondition(lambda self: self.sim.jobs)
    @rule(data=st.data(), fail=st.booleans())
    def complete(self, data: st.DataObject, fail: bool) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.sim.jobs)))
        worker = data.draw(st.sampled_from(sorted(self.sim.jobs[job_id].pending)))
        self.sim.complete(job_id, worker, fail and data.draw(st.booleans()), self.rng)

    @precondition(lambda self: self.sim.running())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.sim.preempt(data.draw(st.sampled_from(self.sim.running())))

    @precondition(lambda self: self.sim.abortable())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.sim.abort(data.draw(st.sampled_from(self.sim.abortable())))

    @rule(data=st.data(), doc=st.integers(0, 2), blocks=st.integers(1, 5), max_tokens=st.integers(1, 6))
    def round(self, data: st.DataObject, doc: int, blocks: int, max_tokens: int) -> None:
        """A whole scheduler round, so deep states (hits after finishes, reuse
        of freed blocks under pressure) are a few rules away."""
        size = self.sim.config.hash_block_size
        self.sim.add_request(doc, blocks * size + size // 2, max_tokens)
        for rid in self.sim.waiting():
            if not self.sim.admit(rid):
                break
        self.sim.step(self.sim.running())
        for job_id in sorted(self.sim.jobs):
            if data.draw(st.booleans()):
                job = self.sim.jobs[job_id]
                fail = data.draw(st.integers(0, 9)) == 0
                self.sim.complete(job_id, min(job.pending), fail, self.rng)

    @rule()
    def reset(self) -> None:
        self.sim.reset()

    @precondition(lambda self: any(self.sim.disks))
    @rule(remove=st.booleans())
    def damage_tier(self, remove: bool) -> None:
        """A block file removed or corrupted under the engine: its load must fail, never serve."""
        self.sim.damage_tier(self.rng, remove=remove)

    @precondition(lambda self: self.sim.disks)
    @rule()
    def foreign_write(self) -> None:
        """Another process wrote blocks to the shared tier; a lookup found them."""
        self.sim.foreign_write(self.rng, docs=3)

    @invariant()
    def engine_matches_model(self) -> None:
        if hasattr(self, "sim"):
            self.sim.check()
            stats = self.sim.state.core.stats
            for name in ("loads", "jobs_flushed", "preemptions", "load_failures", "evictions"):
                if getattr(stats, name):
                    note_event(f"reached {name}")
            for tier in self.sim.state.core.lower:
                for name in ("keys_written", "keys_read", "read_failures", "write_failures", "evictions"):
                    if tier.counts[name]:
                        note_event(f"reached tier {name}")


TestProtocol = Protocol.TestCase


def _trace(config: EngineConfig, seed: int) -> list:
    from kvledger.adapters.testing.simulator import run_random

    log: list = []
    sim = Simulator(config, record=log.append)
    run_random(sim, random.Random(seed), steps=120, arrivals=0.9, max_tokens=30, completion_rate=0.3,
               fail_rate=0.1, reset_rate=0.02)
    return log


@pytest.mark.parametrize("config", CONFIGS, ids=["full", "swa", "swa-pin-arc", "mamba", "swa-mixed", "swa-lazy",
                                                    "full-fs", "swa-fs-arc"])
def test_reduce_step_equals_fold_of_reduce(config: EngineConfig) -> None:
    from kvledger.engine.digest import digest
    from kvledger.engine.state import initial_state

    events = _trace(config, seed=7)
    folded, folded_effects = initial_state(config), []
    for event in events:
        folded, produced = reduce(folded, event)
        folded_effects.extend(produced)
    stepped, stepped_effects = reduce_step(initial_state(config), events)
    assert list(stepped_effects) == folded_effects
    assert digest(stepped) == digest(folded)
    assert len(events) > 200


# The checks above must be able to fail. Each mutant breaks one rule of the
# contract; the simulator or the invariants must notice within a few traces.

def _run_until_caught(config: EngineConfig, seeds: int = 12, **rates: float) -> Exception | None:
    from kvledger.adapters.testing.simulator import run_random

    for seed in range(seeds):
        sim = Simulator(config, check_every_event=True)
        try:
            run_random(sim, random.Random(seed), steps=200, arrivals=0.9, max_tokens=30,
                       completion_rate=0.3, fail_rate=0.1, check_every=1, **rates)
        except AssertionError as caught:  # SimulationError and InvariantViolation
            return caught
    return None


def test_mutant_without_flush_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engine import reducer

    monkeypatch.setattr(reducer, "_flush", lambda core, job_ids, out: None)
    caught = _run_until_caught(CONFIGS[0])
    assert caught is not None, "stores reading reused blocks went unnoticed"


def test_mutant_with_short_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engine import hma

    real = hma.needed_range

    def short(group, start, end):  # loads one sliding block too few
        span = real(group, start, end)
        return span[1:] if group.kind.value == "sliding" else span

    monkeypatch.setattr(hma, "needed_range", short)
    caught = _run_until_caught(CONFIGS[1])
    assert caught is not None, "a sliding window missing a block went unnoticed"


def test_mutant_offering_unfinished_stores_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engine import lookup as lookup_module
    from kvledger.engine.state import SlotState

    monkeypatch.setattr(lookup_module, "SlotState", type("S", (), {"STORED": SlotState.STORING}))
    caught = _run_until_caught(CONFIGS[0])
    assert caught is not None, "hits on keys still being stored went unnoticed"


def test_mutant_trusting_failed_spills_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engine import lower

    real = lower.spill_ended

    def trusting(core, job, out):  # a failed write counted as written
        job.failed_keys.clear()
        real(core, job, out)

    monkeypatch.setattr(lower, "spill_ended", trusting)
    caught = _run_until_caught(CONFIGS[6])
    assert caught is not None, "a tier offering keys no write put there went unnoticed"


def test_mutant_serving_damaged_promotions_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.adapters.testing import simulator

    real = simulator.Simulator._promote

    def careless(self, job, effect):  # a worker that skips the checksum
        for tiers, keys, slots in zip(effect.promote_tiers, effect.keys, effect.source_slot_ids):
            for tier, key, slot in zip(tiers, keys, slots):
                if tier and slot >= 0 and key in self.disks[tier - 1]:
                    self.disks[tier - 1][key] = self.disks[tier - 1][key]
        real(self, job, effect)
        job.failed.clear()

    monkeypatch.setattr(simulator.Simulator, "_promote", careless)
    caught = _run_until_caught(CONFIGS[6], damage_rate=0.2)
    assert caught is not None, "a damaged block served from a lower tier went unnoticed"
