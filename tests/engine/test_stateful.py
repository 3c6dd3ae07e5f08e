"""The whole protocol under generated action sequences.

A `Simulator` plays vLLM (scheduler, block pool, workers) and keeps a naive
model of what the engine should believe, plus a shadow of every block's
content. After every rule the engine's invariants and the model are checked.
The simulator raises on any content error: a request reading a block whose
bytes are not its key, which is what wrong output would be.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.adapters.cli.log_commands import Prefix
from kvledger.adapters.engine_host import EngineHost
from kvledger.adapters.log_files import open_log
from kvledger.adapters.log_seek import find_snapshots, read_snapshot
from kvledger.adapters.testing.simulator import Simulator
from kvledger.engine.digest import digest
from kvledger.engine.reducer import reduce, reduce_step
from kvledger.engine.replay import ReplayResult, replay
from kvledger.engine.snapshot import restore
from kvledger.engine.state import initial_state
from kvledger.events import types as ev
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

    @rule(sleep=st.booleans(), keep=st.booleans())
    def reset(self, sleep: bool, keep: bool) -> None:
        """`keep`: the tiers below host memory keep their blocks (`key_generations` "kept")."""
        self.sim.reset(sleep=sleep, keep=keep and bool(self.sim.disks))

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


class LoggedProtocol(Protocol):
    """The same machine with the event log written as it runs. `crash` cuts the
    log at any byte, as a killed process or a full disk leaves it, replays what
    was cut lazily and compares with the live engine's state after the last
    event the cut log holds; the snapshots the cut log still holds whole are
    found without an index, and each restores the live state at its seq, from
    which the replay of the rest reaches the same end. Then a fresh engine
    reopens on the same path, as a restarted server does (taking the next free
    name). Teardown closes the log, whose replay must end in the live state with
    the end mark checked, and whose index lists every snapshot written."""

    @initialize(config=st.sampled_from(CONFIGS), prefix_caching=st.booleans(),
                chunk=st.sampled_from([0, 0, 48]), seed=st.integers(0, 2**16),
                fmt=st.sampled_from(["binary", "jsonl"]), digest_interval=st.sampled_from([0, 1, 3]),
                snapshot_interval=st.sampled_from([0, 1, 12, 40]), snapshot_ratio=st.sampled_from([0.0, 1.0]))
    def setup(self, config: EngineConfig, prefix_caching: bool, chunk: int, seed: int,  # type: ignore[override]
              fmt: str, digest_interval: int, snapshot_interval: int, snapshot_ratio: float) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvledger-stateful-log-"))
        self.options = dict(config=config, prefix_caching=prefix_caching, chunk=chunk, fmt=fmt,
                            digest_interval=digest_interval, snapshot_interval=snapshot_interval,
                            snapshot_ratio=snapshot_ratio)
        self.rng = random.Random(seed)
        self.crashes = 0
        self._open_engine()

    def _open_engine(self) -> None:
        """A fresh engine and a log of its own: `log.bin` or the next free name."""
        o = self.options
        self.host = EngineHost(o["config"], log_path=self.dir / f"log.{o['fmt']}", fmt=o["fmt"],
                               digest_interval=o["digest_interval"], strict=True, next_free=True,
                               snapshot_interval_events=o["snapshot_interval"],
                               snapshot_bytes_ratio=o["snapshot_ratio"])
        self.sim = Simulator(o["config"], prefix_caching=o["prefix_caching"], chunk_tokens=o["chunk"],
                             check_every_event=True, host=self.host)
        self.after_event: list[str] = []  # the live state's digest after each event
        self.applied = 0
        self.writes: list[tuple[int, int]] = [(self.host.writer.path.stat().st_size, 0)]  # (bytes, events)
        apply, add_step = self.host.apply, self.host.writer.add_step

        def applied(event: ev.Event) -> tuple:
            self.applied += 1  # the step's write happens inside apply
            effects = apply(event)
            self.after_event.append(digest(self.host.state))
            return effects

        def added(step_index: int, events: list, digest_hex: str | None = None, snapshot: object = None) -> None:
            marks = len(self.host.writer.snapshots)
            add_step(step_index, events, digest_hex, snapshot)
            if len(self.host.writer.snapshots) > marks:  # the step's frame ends where its snapshot's begins
                self.writes.append((self.host.writer.snapshots[-1].offset, self.applied))
            self.writes.append((self.host.writer.path.stat().st_size, self.applied))

        self.host.apply = applied  # type: ignore[method-assign]
        self.host.writer.add_step = added  # type: ignore[method-assign]

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        path = self.host.writer.path
        written = path.read_bytes()
        header_bytes = self.writes[0][0]
        cut = data.draw(st.integers(header_bytes, len(written)), label="cut")
        cut_log = self.dir / f"crash{self.crashes}.{self.options['fmt']}"
        cut_log.write_bytes(written[:cut])
        self.crashes += 1
        header, records = open_log(cut_log)
        prefix = Prefix(records)
        result = replay(header.config, prefix, check_invariants=True)
        assert result.ok, result.first_problem
        whole = max(events for size, events in self.writes if size <= cut)  # events of the whole steps kept
        if self.options["fmt"] == "binary":
            assert result.events == whole, "a binary log keeps exactly its whole frames"
            at_boundary = any(size == cut for size, _ in self.writes)
        else:
            assert result.events >= whole, "a torn JSONL log lost a whole line"
            at_boundary = written[cut - 1:cut] == b"\n"
        assert (prefix.tear is None) == at_boundary, (cut, prefix.tear)
        expected = self.after_event[result.events - 1] if result.events else digest(initial_state(header.config))
        assert digest(result.state) == expected, "the replayed prefix differs from the live state it recorded"
        assert not result.ends_with_full_digest, "a cut log must not look closed"
        note_event(f"crash {'at a step boundary' if at_boundary else 'torn'}")
        self._check_snapshots(cut_log, result, whole_before=len(written[:cut]))
        self.host.writer.close()  # the crashed process's file handle; its file stays as it was
        self.host.writer = None
        self._open_engine()

    def _check_snapshots(self, path: Path, result: ReplayResult, whole_before: int) -> None:
        """Every snapshot of a (cut) log restores the live state at its seq, and the
        replay from it reaches the same end as the replay from the beginning."""
        snapshots = find_snapshots(path)
        written = [m for m in self.host.writer.snapshots if m.offset < whole_before]
        if self.options["fmt"] == "jsonl":
            assert snapshots.marks == ()
            return
        # A snapshot frame the cut runs through is not found; every whole one is.
        assert list(snapshots.marks) in (written, written[:-1]), (snapshots, written)
        for mark in snapshots.marks[-2:]:
            header, snapshot, records = read_snapshot(path, mark)
            state = restore(header.config, snapshot.data)
            assert digest(state) == self.after_event[mark.seq - 1], "a snapshot differs from the live state"
            resumed = replay(header.config, Prefix(records), check_invariants=True, state=state)
            assert resumed.ok, resumed.first_problem
            assert digest(resumed.state) == digest(result.state)
            note_event("resumed from a snapshot")

    def teardown(self) -> None:
        if hasattr(self, "host"):
            self.host.close()
            header, records = open_log(self.host.writer.path)
            result = replay(header.config, records, check_invariants=True)
            assert result.ok, result.first_problem
            assert result.ends_with_full_digest, "a closed log ends in its end mark"
            assert digest(result.state) == digest(self.host.state)
            snapshots = find_snapshots(self.host.writer.path)
            if self.options["fmt"] == "binary":
                assert snapshots.found_by == "index" and list(snapshots.marks) == self.host.writer.snapshots
                self._check_snapshots(self.host.writer.path, result, self.host.writer.path.stat().st_size)
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)


TestLoggedProtocol = LoggedProtocol.TestCase


def _trace(config: EngineConfig, seed: int) -> list:
    from kvledger.adapters.testing.simulator import run_random

    log: list = []
    sim = Simulator(config, record=log.append)
    run_random(sim, random.Random(seed), steps=120, arrivals=0.9, max_tokens=30, completion_rate=0.3,
               fail_rate=0.1, reset_rate=0.02)
    return log


@pytest.mark.parametrize("config", CONFIGS, ids=["full", "swa", "swa-pin-arc", "mamba", "swa-mixed", "swa-lazy",
                                                    "full-fs", "swa-fs-arc", "swa-threshold", "swa-fs-budget"])
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


@pytest.mark.pure
def test_mutant_without_flush_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engine import reducer

    monkeypatch.setattr(reducer, "_flush", lambda core, job_ids, out: None)
    caught = _run_until_caught(CONFIGS[0])
    assert caught is not None, "stores reading reused blocks went unnoticed"


@pytest.mark.pure
def test_mutant_with_short_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engine import hma

    real = hma.needed_range

    def short(group, start, end):  # loads one sliding block too few
        span = real(group, start, end)
        return span[1:] if group.kind.value == "sliding" else span

    monkeypatch.setattr(hma, "needed_range", short)
    caught = _run_until_caught(CONFIGS[1])
    assert caught is not None, "a sliding window missing a block went unnoticed"


@pytest.mark.pure
def test_mutant_offering_unfinished_stores_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engine import lookup as lookup_module
    from kvledger.engine.state import SlotState

    monkeypatch.setattr(lookup_module, "STORED_CODE", int(SlotState.STORING))
    caught = _run_until_caught(CONFIGS[0])
    assert caught is not None, "hits on keys still being stored went unnoticed"


@pytest.mark.pure
def test_mutant_trusting_failed_spills_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.engine import lower

    real = lower.spill_ended

    def trusting(core, job, out):  # a failed write counted as written
        job.failed_keys = frozenset()
        real(core, job, out)

    monkeypatch.setattr(lower, "spill_ended", trusting)
    caught = _run_until_caught(CONFIGS[6])
    assert caught is not None, "a tier offering keys no write put there went unnoticed"


def test_mutant_serving_damaged_promotions_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.adapters.testing import simulator

    real = simulator.Simulator._promote

    def careless(self, job, effect):  # a worker that skips the checksum: whatever the file holds is served
        injected = set(job.failed)  # failures injected before the read stay
        real(self, job, effect)
        for tiers, keys, slots, blocks in zip(effect.promote_tiers, effect.keys, effect.source_slot_ids,
                                              effect.target_block_ids):
            for tier, key, slot, block in zip(tiers, keys, slots, blocks):
                if tier and slot >= 0 and block not in injected and self.disks[tier - 1].get(key) is not None:
                    self.slot_content[slot] = self.disks[tier - 1][key]
                    job.failed.discard(block)

    monkeypatch.setattr(simulator.Simulator, "_promote", careless)
    caught = _run_until_caught(CONFIGS[6], damage_rate=0.2)
    assert caught is not None, "a damaged block served from a lower tier went unnoticed"
