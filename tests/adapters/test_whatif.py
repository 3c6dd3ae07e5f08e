"""`kvledger whatif`: the log's traffic driven again through the engine under
another configuration. Under the log's own, with no transfer failing, it
reproduces the log's hits exactly (the jobs keep the log's timing); under any,
the other engine never refuses an event; the one-pass LRU curve agrees with
the engine where every key fits."""

from __future__ import annotations

import json
import random
import re

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvledger.adapters.cli.main import main
from kvledger.adapters.log_tools import whatif
from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.engine.replay import replay
from kvledger.events import types as ev
from kvledger.events.config import EngineConfig, GroupSpec
from kvledger.events.log_records import EventRecord
from tests.engine.builders import SIMULATED_CONFIGS, chain, key

pytestmark = pytest.mark.slow


def _trace(config, seed: int, *, fail_rate: float, completion_rate: float = 0.3,
           reset_rate: float = 0.02, chunk: int = 0, keep_rate: float = 0.0) -> tuple[list, dict]:
    events: list = []
    sim = Simulator(config, prefix_caching=seed % 2 == 0, record=events.append, chunk_tokens=chunk)
    run_random(sim, random.Random(seed), steps=120, arrivals=0.8, max_tokens=12, fail_rate=fail_rate,
               completion_rate=completion_rate, reset_rate=reset_rate, keep_rate=keep_rate)
    return events, queries.stats(sim.state)


def _drive(recorded, config, events) -> whatif.Redrive:
    drive = whatif.Redrive(recorded, config)
    drive.run(events)
    return drive


@settings(deadline=None, max_examples=40)
@given(config=st.sampled_from(SIMULATED_CONFIGS), seed=st.integers(0, 2**16),
       completion_rate=st.sampled_from([0.3, 1.0]), chunk=st.sampled_from([0, 48]),
       keep_rate=st.sampled_from([0.0, 0.5]))
# A reset while a promotion read its key: the log's worker found the key gone and failed the
# load; the re-drive, whose tier lost the key to the same reset, completed it.
@example(config=SIMULATED_CONFIGS[7], seed=8636, completion_rate=0.3, chunk=0, keep_rate=0.0)
def test_the_logs_own_configuration_reproduces_its_hits(config, seed, completion_rate, chunk, keep_rate):
    """`keep_rate`: some resets keep the lower tiers (`key_generations` "kept")."""
    events, stats = _trace(config, seed, fail_rate=0.0, completion_rate=completion_rate, chunk=chunk,
                           keep_rate=keep_rate)
    drive = _drive(config, config, events)
    assert drive.not_applied == 0
    predicted = queries.stats(drive.state)
    # (A promotion that found its host slot taken fails without a worker: the engine decides
    # that from the order of one step's admissions, which the log keeps only as vLLM saw it.)
    same = ("hit_tokens", "loads", "keys_loaded", "stores", "keys_stored", "evictions")
    assert {name: predicted[name] for name in same} == {name: stats[name] for name in same}


@settings(deadline=None, max_examples=40)
@given(config=st.sampled_from(SIMULATED_CONFIGS), seed=st.integers(0, 2**16), scale=st.sampled_from([0.25, 0.5, 2, 4]),
       policy=st.sampled_from(["lru", "arc"]), chunk=st.sampled_from([0, 48]))
# A request moved a step later whose window frees were held: released before its load ended,
# they were refused ("blocks_freed for loading request").
@example(config=SIMULATED_CONFIGS[4], seed=2174, scale=0.5, policy="lru", chunk=0)
def test_another_configuration_takes_every_event(config, seed, scale, policy, chunk):
    """Failures in the log, another capacity and policy, prefills in chunks (a longer hit takes
    later allocations early): the other engine accepts the whole log, and its misses are all
    explained."""
    events, _ = _trace(config, seed, fail_rate=0.1, chunk=chunk)
    other = attrs.evolve(config, num_tier_slots=max(1, int(config.num_tier_slots * scale)), policy=policy)
    drive = _drive(config, other, events)
    assert drive.not_applied == 0
    outcome = drive.outcome()
    assert "unexplained" not in outcome.misses["missed_by_cause"]
    assert outcome.misses["hit_tokens"] == outcome.stats["hit_tokens"]


@settings(deadline=None, max_examples=25)
@given(config=st.sampled_from(SIMULATED_CONFIGS), seed=st.integers(0, 2**16), scale=st.sampled_from([0.25, 4]),
       chunk=st.sampled_from([0, 48]))
def test_a_redrive_reading_ahead_a_window_predicts_as_one_holding_the_log(config, seed, scale, chunk):
    """A re-drive holds at most twice `ahead` events. Where every request's allocations lie
    within `ahead` events of each other, its prediction is the one from the whole log; with a
    window too short for that, it still takes every event and explains every miss."""
    events, _ = _trace(config, seed, fail_rate=0.1, chunk=chunk)
    other = attrs.evolve(config, num_tier_slots=max(1, int(config.num_tier_slots * scale)))
    whole = _drive(config, other, events).outcome().as_dict()
    firsts: dict[str, int] = {}
    span = 1
    for index, event in enumerate(events):
        if type(event).__name__ == "BlocksAllocated":
            span = max(span, index - firsts.setdefault(event.request_id, index) + 1)
    for ahead in (span, span + 7):
        drive = whatif.Redrive(config, other)
        drive.run(iter(events), ahead=ahead)
        assert len(drive.events) <= 2 * ahead
        assert drive.outcome().as_dict() == whole, ahead
    short = whatif.Redrive(config, other)
    short.run(iter(events), ahead=3)
    assert short.not_applied == 0
    assert "unexplained" not in short.outcome().misses["missed_by_cause"]


@settings(deadline=None, max_examples=25)
@given(config=st.sampled_from(SIMULATED_CONFIGS), seed=st.integers(0, 2**16), chunk=st.sampled_from([0, 48]),
       ahead=st.sampled_from([5, 40, whatif.READ_AHEAD]))
def test_redrives_run_together_predict_as_each_alone(config, seed, chunk, ahead):
    """One read of the log for every question (`predict_many`): the log's engine folded once
    and followed by re-drives of several capacities and policies, each of which takes later
    allocations early on its own. Each gives what it gives alone, and the log's own outcome is
    `recorded`'s. One that keeps no misses (a capacity sweep's point) gives the same hits and
    blocks moved as its counted twin."""
    events, _ = _trace(config, seed, fail_rate=0.1, chunk=chunk)
    configs = [config, attrs.evolve(config, num_tier_slots=max(1, config.num_tier_slots // 4)),
               attrs.evolve(config, num_tier_slots=config.num_tier_slots * 4, policy="arc")]
    records = [_Record(e, seq) for seq, e in enumerate(events)]
    recorded, outcomes = whatif.predict_many(config, [*configs, *configs[1:]], records, ahead=ahead,
                                             counted=[True, True, True, False, False])
    assert recorded.as_dict() == whatif.recorded(config, records).as_dict()
    for other, outcome in zip(configs, outcomes):
        alone = whatif.Redrive(config, other)
        alone.run(iter(events), ahead=ahead)
        assert outcome.as_dict() == alone.outcome().as_dict()
    for counted, uncounted in zip(outcomes[1:3], outcomes[3:]):
        assert uncounted.misses is None and counted.misses is not None
        assert attrs.evolve(uncounted, misses=counted.misses).as_dict() == counted.as_dict()


@pytest.mark.parametrize("index", [0, 1, 3])
def test_the_one_pass_curve_agrees_where_every_key_fits(index):
    config = SIMULATED_CONFIGS[index]
    events, _ = _trace(config, 11, fail_rate=0.0, reset_rate=0.0)  # (a reset's drops count as evictions)
    bound = whatif.distinct_keys_bound(config, [_Record(e) for e in events])
    admissions = whatif.lru_curve(config, [_Record(e) for e in events], bound)
    curve = whatif.hits_at(admissions, [1, 2, 4, 8, 16, 32, 64, bound])
    assert curve == sorted(curve) and curve[-1] > 0  # more room never loses a hit, in this model
    roomy = _drive(config, attrs.evolve(config, num_tier_slots=bound), events)
    assert queries.stats(roomy.state)["evictions"] == 0
    assert curve[-1] == queries.stats(roomy.state)["hit_tokens"]


class _Record:
    def __init__(self, event, seq: int = -1) -> None:
        self.event = event
        self.seq = seq


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    path = tmp_path_factory.mktemp("whatif") / "events.log"
    assert main(["simulate", "--scenario", "full", "--steps", "300", "--seed", "4", "--out", str(path)]) == 0
    return path


def test_the_command_beside_the_recorded_run(log, capsys):
    assert main(["whatif", str(log), "--capacity-blocks", "96", "--sweep", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recorded"]["num_tier_slots"] == 24 and data["predicted"]["num_tier_slots"] == 96
    assert data["predicted"]["not_applied"] == 0 and data["predicted_as_recorded"]["not_applied"] == 0
    assert data["self_check"]["recorded_hit_tokens"] == data["recorded"]["hit_tokens"]
    # The sweep's points keep no misses, but the one that is also the asked prediction keeps its own.
    assert "missed_by_cause" in data["predicted"]["misses"] and "missed_by_cause" in data["predicted_as_recorded"]["misses"]
    points = data["sweep"]["points"]
    assert [p["num_tier_slots"] for p in points][:3] == [12, 24, 48]
    assert points[-1]["num_tier_slots"] == data["sweep"]["every_key_fits_at"]
    assert points[-1]["hit_tokens"] == points[-1]["lru_one_pass"]
    assert main(["whatif", str(log), "--capacity-blocks", "96"]) == 0
    text = capsys.readouterr().out
    assert "predicted, other config" in text and "self-check" in text


def test_the_store_threshold_and_prompt_only_asked_and_swept(log, capsys):
    """vLLM's knobs on a log recorded without them: fewer blocks stored, the held-back
    blocks' misses named, and the sweep's point at 3 the same answer as asking for 3."""
    assert main(["whatif", str(log), "--store-threshold", "3", "--offload-prompt-only", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    predicted, same = data["predicted"], data["predicted_as_recorded"]
    assert (predicted["store_threshold"], predicted["offload_prompt_only"]) == (3, True)
    assert predicted["not_applied"] == 0
    assert predicted["blocks_moved"].get("stored", 0) < same["blocks_moved"]["stored"]
    assert predicted["misses"]["missed_by_cause"]["below_store_threshold"]["tokens"] > 0
    assert main(["whatif", str(log), "--store-threshold", "3", "--json"]) == 0
    asked = json.loads(capsys.readouterr().out)["predicted"]
    assert main(["whatif", str(log), "--sweep", "store-threshold", "--json"]) == 0
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    rows = {row["store_threshold"]: row for row in sweep["points"]}
    assert list(rows) == [1, 2, 3, 4, 6, 8]
    assert (rows[3]["hit_tokens"], rows[3]["blocks_stored"]) == (asked["hit_tokens"], asked["blocks_moved"]["stored"])
    assert rows[1]["blocks_stored"] == same["blocks_moved"]["stored"] and rows[1]["below_store_threshold_tokens"] == 0
    assert main(["whatif", str(log), "--sweep", "store-threshold"]) == 0
    assert "held back (tokens)" in capsys.readouterr().out


def test_passes_in_processes_answer_as_passes_in_turn(log, tmp_path, capsys):
    """`--jobs 2` runs the recorded run, each prediction and each sweep point in processes:
    the same answer, and a torn log is refused the same way."""
    argv = ["whatif", str(log), "--capacity-blocks", "96", "--sweep", "--json"]
    assert main(argv) == 0
    in_turn = json.loads(capsys.readouterr().out)
    assert main([*argv, "--jobs", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == in_turn
    assert main(["whatif", str(log), str(log), "--shared-tier", '{"type": "valkey", "capacity_bytes": 1}',
                 "--jobs", "2"]) == 2
    assert "--jobs does not go with --shared-tier" in capsys.readouterr().err
    cut = tmp_path / "cut.log"
    cut.write_bytes(log.read_bytes()[: log.stat().st_size * 2 // 3])
    errors = []
    for jobs in ("1", "2"):
        assert main(["whatif", str(cut), "--jobs", jobs]) == 2
        captured = capsys.readouterr()
        assert not captured.out
        errors.append(captured.err)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"kvledger: {cut}") and "truncated" in errors[0], errors


def test_the_sweep_as_a_page_of_curves(log, tmp_path, capsys):
    """`--sweep --report`: both policies at every point (the asked one's are the table's), the recorded
    point marked, the blocks moved; the page refuses to replace a file without --force."""
    page = tmp_path / "sweep.html"
    assert main(["whatif", str(log), "--sweep", "--json", "--report", str(page)]) == 0
    data = json.loads(capsys.readouterr().out)
    sweep = data["sweep"]
    assert sweep["recorded"] == {"num_tier_slots": 24, "policy": "lru", "slot_bytes": 0,
                                 "hit_tokens": data["recorded"]["hit_tokens"]}
    for point in sweep["points"]:
        assert set(point["by_policy"]) == {"lru", "arc"}
        assert point["hit_tokens"] == point["by_policy"]["lru"]["hit_tokens"]
        assert point["by_policy"]["lru"]["blocks_moved"].get("stored", 0) > 0
    at_recorded = next(p for p in sweep["points"] if p["num_tier_slots"] == 24)
    assert at_recorded["hit_tokens"] == data["predicted_as_recorded"]["hit_tokens"]
    text = page.read_text()
    figures = re.findall(r'<script type="application/json" class="kvledger-figure"[^>]*>(.*?)</script>', text, re.S)
    hits, moved = (json.loads(f) for f in figures)
    names = [trace["name"] for trace in hits["data"]]
    assert names == ["predicted, LRU", "predicted, ARC", "LRU, one-pass estimate", "recorded (LRU)"]
    assert hits["data"][-1]["x"] == [24] and hits["data"][-1]["y"] == [data["recorded"]["hit_tokens"]]
    assert hits["data"][1]["y"] == [p["by_policy"]["arc"]["hit_tokens"] for p in sweep["points"]]
    assert {trace["name"] for trace in moved["data"]} >= {"stored, LRU", "stored, ARC", "loaded, LRU"}
    assert main(["whatif", str(log), "--sweep", "--report", str(page)]) == 2  # exists: --force replaces it
    assert "exists" in capsys.readouterr().err
    assert main(["whatif", str(log), "--report", str(tmp_path / "other.html")]) == 2
    assert "give --sweep too" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--capacity-bytes", "1000000"], "does not record its slot size"),
    (["--secondary-tiers", "{}"], "takes a JSON list"),
    (["--secondary-tiers", '[{"type": "fs"}]'], "needs capacity_bytes or num_blocks"),
    (["--secondary-tiers", '[{"type": "fs", "num_blocks": 0}]'], "num_blocks must be a positive int"),
    (["--together"], "--together goes with --shared-tier"),
])
def test_bad_input_is_one_line_and_exit_2(log, capsys, argv, words):
    assert main(["whatif", str(log), *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


# A re-drive out of step with its log.

FULL_32 = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),), hash_block_size=32,
                       num_device_blocks=32, num_tier_slots=8)


def _stored_by_a(hashes: tuple[bytes, ...]) -> list:
    """Request a computes a two-block document (blocks 1-3) and its store completes: host memory holds it."""
    return [
        ev.RequestAdded(request_id="a", num_prompt_tokens=65, block_hashes=hashes),
        ev.BlocksAllocated(request_id="a", block_ids=((1, 2, 3),), num_external_tokens=0),
        ev.StepScheduled(step_index=0, request_ids=("a",), num_computed_tokens=(0,), num_scheduled_tokens=(65,)),
        ev.RequestFinished(request_id="a", block_ids=((1, 2, 3),)),
        ev.StepScheduled(step_index=1, request_ids=(), num_computed_tokens=(), num_scheduled_tokens=()),
        ev.StoreCompleted(job_id=1, worker_index=0),
    ]

def _failed_load_then_a_touch() -> tuple:
    """A replica's third life, cut to its first steps: request b's load fails ("missing"),
    vLLM admits b again to compute its blocks, and c, sharing b's first block, finds it in
    vLLM's prefix cache. The re-drive's load of that block succeeded (none fails there), so b
    is admitted again with a hit, a load of its own with no twin in the log."""
    config = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),), hash_block_size=32,
                          num_device_blocks=32, num_tier_slots=8, lower_tiers=({"name": "1:fs", "num_blocks": 16},))
    b = chain(3, "b")
    c = (b[0], *chain(2, "c"))
    d = chain(3, "d")
    events = [
        ev.TierKeysFound(tier=1, keys=(key(b[0], 0),)),
        ev.RequestAdded(request_id="b", num_prompt_tokens=100, block_hashes=b),
        ev.BlocksAllocated(request_id="b", block_ids=((10,),), num_external_tokens=32),
        ev.StepScheduled(step_index=0, request_ids=(), num_computed_tokens=(), num_scheduled_tokens=()),
        ev.LoadFailed(job_id=1, worker_index=0, block_ids=(10,), keys=(key(b[0], 0),), reason="missing"),
        ev.RequestAdded(request_id="c", num_prompt_tokens=100, block_hashes=c),
        ev.BlocksAllocated(request_id="b", block_ids=((10, 11, 12, 13),), num_external_tokens=0),
        ev.BlocksTouched(request_id="c", block_ids=((10,),)),
        ev.BlocksAllocated(request_id="c", block_ids=((14, 15, 16),), num_external_tokens=0),
        ev.RequestAdded(request_id="d", num_prompt_tokens=100, block_hashes=d),
        ev.BlocksAllocated(request_id="d", block_ids=((17, 18, 19, 20),), num_external_tokens=0),
        ev.StepScheduled(step_index=1, request_ids=("b", "c", "d"), num_computed_tokens=(0, 32, 0),
                         num_scheduled_tokens=(100, 68, 100)),
    ]
    return config, events


def test_a_block_the_logs_vllm_found_cached_ends_the_redrives_load_of_it():
    config, events = _failed_load_then_a_touch()
    steps = [sum(type(e) is ev.StepScheduled for e in events[:i]) for i in range(len(events))]
    records = [EventRecord(seq=i, step_index=steps[i], event=e) for i, e in enumerate(events)]
    assert not replay(config, records).violations
    drive = _drive(config, config, events)
    assert drive.not_applied == 0  # c's touch of block 10 waited for b's load here: refused, and every step of c after
    assert queries.request_view(drive.state, "c").next_store_positions == (3,)  # its step taken: its blocks stored


def test_a_request_out_of_step_is_left_out_of_the_step_not_the_others(monkeypatch):
    """Should a request fall out of step anyway, the others' steps go on without it."""
    config, events = _failed_load_then_a_touch()
    monkeypatch.setattr(whatif.Redrive, "_whole", lambda self, blocks: None)  # the divergence, as before the fix
    drive = _drive(config, config, events)
    assert drive.not_applied == 2 and drive.requests_dropped == 1  # c's touch, and the step refused for c
    assert queries.request_view(drive.state, "d").next_store_positions == (3,)  # d's part of the step applied
    assert queries.request_view(drive.state, "c").next_store_positions == (0,)


def test_a_load_the_log_never_had_ends_in_turn_with_the_steps_other_loads():
    """Three documents in host memory, asked again in one step: the log loaded a's and c's, but
    computed b's (its vLLM asked no hit), where the re-drive loads b's too. The log schedules b
    at once, so the re-drive ends b's load before that step; a worker ends a step's loads in
    the order they started, so a's ends first, and the eviction that follows takes a's oldest
    block, as in a real run at that configuration (the blocks go back to the LRU order a, b,
    c), where ending b's alone had left b's first to go."""
    config = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),), hash_block_size=32,
                          num_device_blocks=32, num_tier_slots=7)
    docs = {name: chain(2, name) for name in "abcd"}
    tables = {name: (3 * i + 1, 3 * i + 2, 3 * i + 3) for i, name in enumerate("abc")}
    events: list = []
    for name in "abc":
        events += [ev.RequestAdded(request_id=name, num_prompt_tokens=65, block_hashes=docs[name]),
                   ev.BlocksAllocated(request_id=name, block_ids=(tables[name],), num_external_tokens=0)]
    events += [ev.StepScheduled(step_index=0, request_ids=("a", "b", "c"), num_computed_tokens=(0, 0, 0),
                                num_scheduled_tokens=(65, 65, 65)),
               ev.StoreCompleted(job_id=1, worker_index=0),
               *(ev.RequestFinished(request_id=name, block_ids=(tables[name],)) for name in "abc"),
               *(ev.RequestAdded(request_id=f"{name}2", num_prompt_tokens=65, block_hashes=docs[name])
                 for name in "abc"),
               ev.BlocksAllocated(request_id="a2", block_ids=((10, 11),), num_external_tokens=64),
               ev.BlocksAllocated(request_id="b2", block_ids=((12, 13, 14),), num_external_tokens=0),
               ev.BlocksAllocated(request_id="c2", block_ids=((15, 16),), num_external_tokens=64),
               ev.StepScheduled(step_index=1, request_ids=("b2",), num_computed_tokens=(0,),
                                num_scheduled_tokens=(65,)),
               ev.LoadCompleted(job_id=2, worker_index=0), ev.LoadCompleted(job_id=3, worker_index=0),
               ev.RequestAdded(request_id="d", num_prompt_tokens=65, block_hashes=docs["d"]),
               ev.BlocksAllocated(request_id="d", block_ids=((17, 18, 19),), num_external_tokens=0),
               ev.StepScheduled(step_index=2, request_ids=("d",), num_computed_tokens=(0,),
                                num_scheduled_tokens=(65,))]
    evicted: list[bytes] = []
    drive = whatif.Redrive(config, config, on_effects=lambda effects: evicted.extend(
        k for e in effects if isinstance(e, fx.KeysUnloadable) for k in e.keys))
    drive.run(events)
    assert drive.not_applied == 0
    assert queries.stats(drive.state)["hit_tokens"] == 3 * 64  # b2's hit too
    assert evicted == [key(docs["a"][0], 0)]


def test_a_request_the_log_loaded_for_computes_in_the_step_it_is_admitted_here():
    """x's blocks were in the log's host memory, not in a smaller one's: the log's vLLM waited a
    step for x2's load, where with nothing to load it computes x2 in the step it admits it, first
    (it was admitted before y). So x2's blocks are stored in that step, before y's, and the two
    slots go to them, not to y's."""
    config = FULL_32
    x, z, w = chain(2, "x"), chain(2, "z"), chain(2, "w")
    events = [
        ev.RequestAdded(request_id="a", num_prompt_tokens=65, block_hashes=x),
        ev.RequestAdded(request_id="b", num_prompt_tokens=65, block_hashes=z),
        ev.BlocksAllocated(request_id="a", block_ids=((1, 2, 3),), num_external_tokens=0),
        ev.BlocksAllocated(request_id="b", block_ids=((4, 5, 6),), num_external_tokens=0),
        ev.StepScheduled(step_index=0, request_ids=("b", "a"), num_computed_tokens=(0, 0),
                         num_scheduled_tokens=(65, 65)),
        ev.RequestFinished(request_id="a", block_ids=((1, 2, 3),)),
        ev.RequestFinished(request_id="b", block_ids=((4, 5, 6),)),
        ev.StepScheduled(step_index=1, request_ids=(), num_computed_tokens=(), num_scheduled_tokens=()),
        ev.StoreCompleted(job_id=1, worker_index=0),
        ev.RequestAdded(request_id="x2", num_prompt_tokens=65, block_hashes=x),
        ev.RequestAdded(request_id="y", num_prompt_tokens=65, block_hashes=w),
        ev.BlocksAllocated(request_id="x2", block_ids=((7, 8),), num_external_tokens=64),  # loaded in the log
        ev.BlocksAllocated(request_id="y", block_ids=((9, 10, 11),), num_external_tokens=0),
        ev.StepScheduled(step_index=2, request_ids=("y",), num_computed_tokens=(0,), num_scheduled_tokens=(65,)),
        ev.LoadCompleted(job_id=2, worker_index=0),
        ev.BlocksAllocated(request_id="x2", block_ids=((12,),), num_external_tokens=0),
        ev.StepScheduled(step_index=3, request_ids=("x2", "y"), num_computed_tokens=(64, 65),
                         num_scheduled_tokens=(1, 1)),
    ]
    stores: list[list[bytes]] = []
    drive = whatif.Redrive(config, attrs.evolve(config, num_tier_slots=2), on_effects=lambda effects: stores.extend(
        [k for group in e.keys for k in group] for e in effects if isinstance(e, fx.StartStore)))
    drive.run(events)
    assert drive.not_applied == 0
    assert queries.stats(drive.state)["hit_tokens"] == 0  # x did not fit beside z here
    assert stores == [[key(h, 0) for h in z], [key(h, 0) for h in x]]


def test_a_request_the_redrive_loads_for_computes_a_step_later_than_the_log():
    """The reverse: the log's vLLM computed r at once (it asked no hit), where this engine finds
    x's blocks and loads them. vLLM waits a step for a load, so r computes from the next step,
    and its block after x is stored a step later than the log stored it."""
    config = FULL_32
    x, y = chain(2, "x"), chain(1, "y")
    events = [
        *_stored_by_a(x),
        ev.RequestAdded(request_id="r", num_prompt_tokens=97, block_hashes=(*x, *y)),
        ev.BlocksAllocated(request_id="r", block_ids=((4, 5, 6, 7),), num_external_tokens=0),
        ev.StepScheduled(step_index=2, request_ids=("r",), num_computed_tokens=(0,), num_scheduled_tokens=(97,)),
        ev.StepScheduled(step_index=3, request_ids=("r",), num_computed_tokens=(97,), num_scheduled_tokens=(1,)),
    ]
    stored: list[tuple[int, bytes]] = []
    drive = whatif.Redrive(config, config, on_effects=lambda effects: stored.extend(
        (drive.steps, k) for e in effects if isinstance(e, fx.StartStore) for group in e.keys for k in group))
    drive.run(events)
    assert drive.not_applied == 0 and queries.stats(drive.state)["hit_tokens"] == 64
    # (x stored at step 0; `steps` counts the steps taken before the one applied)
    assert stored == [(0, key(x[0], 0)), (0, key(x[1], 0)), (3, key(y[0], 0))]


def test_a_longer_hit_than_the_log_had_takes_spare_blocks_where_the_logs_were_in_use():
    """r's hit here is two blocks, where the log loaded one and allocated the next a step later,
    in blocks q used in between: vLLM would have allocated r two blocks at once, so a spare block
    stands for the second (the hit is not cut to the log's table), and the log's block there is
    renamed to it in every later event naming it (r's final table among them)."""
    config = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32),), hash_block_size=32,
                          num_device_blocks=16, num_tier_slots=8)
    x, z, w = chain(2, "x"), chain(1, "z"), chain(1, "w")
    events = [
        ev.RequestAdded(request_id="a", num_prompt_tokens=65, block_hashes=x),
        ev.BlocksAllocated(request_id="a", block_ids=((1, 2, 3),), num_external_tokens=0),
        ev.StepScheduled(step_index=0, request_ids=("a",), num_computed_tokens=(0,), num_scheduled_tokens=(65,)),
        ev.RequestFinished(request_id="a", block_ids=((1, 2, 3),)),
        ev.StoreCompleted(job_id=1, worker_index=0),
        ev.RequestAdded(request_id="r", num_prompt_tokens=97, block_hashes=(*x, *z)),
        ev.BlocksAllocated(request_id="r", block_ids=((4,),), num_external_tokens=32),  # the log's vLLM took one
        ev.RequestAdded(request_id="q", num_prompt_tokens=33, block_hashes=w),
        ev.BlocksAllocated(request_id="q", block_ids=((5, 6),), num_external_tokens=0),
        ev.StepScheduled(step_index=1, request_ids=("q",), num_computed_tokens=(0,), num_scheduled_tokens=(33,)),
        ev.LoadCompleted(job_id=2, worker_index=0),
        ev.RequestFinished(request_id="q", block_ids=((5, 6),)),
        ev.BlocksAllocated(request_id="r", block_ids=((5, 6, 7),), num_external_tokens=0),
        ev.StepScheduled(step_index=2, request_ids=("r",), num_computed_tokens=(32,), num_scheduled_tokens=(65,)),
        ev.RequestFinished(request_id="r", block_ids=((4, 5, 6, 7),)),
    ]
    steps = [sum(type(e) is ev.StepScheduled for e in events[:i]) for i in range(len(events))]
    assert not replay(config, [EventRecord(seq=i, step_index=steps[i], event=e)
                               for i, e in enumerate(events)]).violations
    drive = _drive(config, config, events)
    assert drive.not_applied == 0
    assert queries.stats(drive.state)["hit_tokens"] == 64  # two blocks: not cut to the log's one
    assert drive._renamed == {5: 16}  # the first spare (past the log's 16 blocks) holds what r's 5 held
    assert queries.num_requests(drive.state) == 0 and not drive._spared


def test_a_load_with_no_twin_ends_before_the_next_steps_store_reports():
    """vLLM's worker reports a step's finished loads before its finished stores: r's load (the
    re-drive's alone, r moved a step later) ends before w's store, so its blocks go back to the
    eviction policy first, as in a real run at this configuration."""
    config = FULL_32
    x, y, w = chain(2, "x"), chain(1, "y"), chain(2, "w")
    events = [
        *_stored_by_a(x),
        ev.RequestAdded(request_id="r", num_prompt_tokens=97, block_hashes=(*x, *y)),
        ev.RequestAdded(request_id="w", num_prompt_tokens=65, block_hashes=w),
        ev.BlocksAllocated(request_id="r", block_ids=((4, 5, 6, 7),), num_external_tokens=0),  # computed in the log
        ev.BlocksAllocated(request_id="w", block_ids=((8, 9, 10),), num_external_tokens=0),
        ev.StepScheduled(step_index=2, request_ids=("r", "w"), num_computed_tokens=(0, 0),
                         num_scheduled_tokens=(97, 65)),
        ev.StoreCompleted(job_id=2, worker_index=0),
        ev.StepScheduled(step_index=3, request_ids=("r", "w"), num_computed_tokens=(97, 65),
                         num_scheduled_tokens=(1, 1)),
    ]
    ended: list[str] = []
    drive = whatif.Redrive(config, config, on_effects=lambda effects: ended.extend(
        e.kind for e in effects if isinstance(e, fx.JobEnded)))
    drive.run(events)
    assert drive.not_applied == 0 and queries.stats(drive.state)["hit_tokens"] == 64
    assert ended == ["store", "load", "store"]  # a's store; r's load before w's store


def test_window_blocks_the_log_freed_early_are_computed_and_stored_here_first():
    """r computed its whole prompt at once in the log, so in the next step vLLM freed the window
    group's blocks behind the window. Here r loaded its first three blocks and computes the rest
    a step later: the log's frees wait for that step, so the window blocks it computes (positions
    3 and 4) are stored, as in a real run at this configuration."""
    sliding = GroupSpec(group_id=1, kind="sliding", block_size=32, window=64)
    config = EngineConfig(groups=(GroupSpec(group_id=0, kind="full", block_size=32), sliding), hash_block_size=32,
                          num_device_blocks=64, num_tier_slots=32)
    x, y = chain(3, "x"), chain(4, "y")
    table = ((1, 2, 3, 4), (5, 6, 7, 8))
    events = [
        ev.RequestAdded(request_id="a", num_prompt_tokens=97, block_hashes=x),
        ev.BlocksAllocated(request_id="a", block_ids=table, num_external_tokens=0),
        ev.StepScheduled(step_index=0, request_ids=("a",), num_computed_tokens=(0,), num_scheduled_tokens=(97,)),
        ev.RequestFinished(request_id="a", block_ids=table),
        ev.StepScheduled(step_index=1, request_ids=(), num_computed_tokens=(), num_scheduled_tokens=()),
        ev.StoreCompleted(job_id=1, worker_index=0),
        ev.RequestAdded(request_id="r", num_prompt_tokens=225, block_hashes=(*x, *y)),
        ev.BlocksAllocated(request_id="r", block_ids=(tuple(range(10, 18)), tuple(range(20, 28))),
                           num_external_tokens=0),  # the log computed it all at once
        ev.StepScheduled(step_index=2, request_ids=("r",), num_computed_tokens=(0,), num_scheduled_tokens=(225,)),
        ev.BlocksFreed(request_id="r", block_ids=((), (20, 21, 22, 23, 24))),  # behind the window now
        ev.StepScheduled(step_index=3, request_ids=("r",), num_computed_tokens=(225,), num_scheduled_tokens=(1,)),
    ]
    stored: list[bytes] = []
    drive = whatif.Redrive(config, config, on_effects=lambda effects: stored.extend(
        k for e in effects if isinstance(e, fx.StartStore) for group in e.keys for k in group))
    drive.run(events)
    assert drive.not_applied == 0 and queries.stats(drive.state)["hit_tokens"] == 96
    assert {key(y[0], 1), key(y[1], 1)} <= set(stored)


# Several replicas, one shared tier.

@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas of one model on the same documents, recorded apart (each with host memory only)."""
    folder = tmp_path_factory.mktemp("fleet")
    paths = []
    for seed in (1, 2):
        path = folder / f"replica-{seed}.log"
        assert main(["simulate", "--scenario", "full", "--steps", "200", "--seed", str(seed), "--fail-rate", "0",
                     "--out", str(path)]) == 0
        paths.append(str(path))
    return paths


def test_replicas_sharing_a_tier_find_what_the_others_wrote(replicas, capsys):
    assert main(["whatif", *replicas, "--shared-tier", '{"type": "valkey", "num_blocks": 4096}', "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["replicas"]
    assert [row["not_applied"] for row in rows] == [0, 0]
    assert data["shared_tier"]["blocks_written"] > 0 and data["shared_tier"]["blocks_evicted"] == 0
    # Each replica restores more with the other's blocks below it than alone, and what it
    # restored from the shared tier is what it gained (its own writes come back through host memory).
    for row in rows:
        assert row["predicted_shared_hit_tokens"] > row["predicted_alone_hit_tokens"]
        assert 0 < row["predicted_shared_restored_tokens"] <= row["predicted_shared_hit_tokens"]
        assert row["blocks_read_from_shared_tier"] > 0
    # Sharing is worth more than the same tier below each replica alone, for the two together.
    assert data["all"]["predicted_shared_hit_tokens"] > data["all"]["predicted_own_tier_hit_tokens"]
    assert data["all"]["predicted_shared_hit_tokens"] == sum(r["predicted_shared_hit_tokens"] for r in rows)
    # A shared tier of 8 blocks keeps little: less is found, blocks are evicted, promotions of an
    # evicted block fail and are recomputed, and nothing is refused.
    assert main(["whatif", *replicas, "--shared-tier", '{"type": "valkey", "num_blocks": 8}', "--json"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["shared_tier"]["blocks_evicted"] > 0
    assert [row["not_applied"] for row in small["replicas"]] == [0, 0]
    assert small["all"]["predicted_shared_hit_tokens"] < data["all"]["predicted_shared_hit_tokens"]


def test_logs_recorded_apart_are_put_side_by_side(replicas):
    """`--together`: each log's steps at their time since its own first step, so a log recorded
    an hour after the other is interleaved with it, not played after it."""
    from kvledger.adapters.cli.whatif import _read_whole
    from kvledger.adapters.log_tools import fleet
    from kvledger.events.config import LowerTierSpec

    first, second = (fleet.Replica(path, *_read_whole(path)) for path in replicas)
    hour = 3_600_000_000
    later = [attrs.evolve(r, event=attrs.evolve(r.event, wall_time_us=r.event.wall_time_us + hour))
             if type(getattr(r, "event", None)) is ev.StepScheduled else r for r in second.records]
    moved = attrs.evolve(second, records=later)
    clocks = [clock for clock, _ in fleet._steps(whatif.events_of(moved.records), together=True)]
    assert clocks[0] == 0 and clocks == sorted(clocks)
    tier = LowerTierSpec(name="1:valkey", num_blocks=64)
    apart, _ = fleet.predict_fleet([first, moved], tier)
    together, _ = fleet.predict_fleet([first, moved], tier, together=True)
    same, _ = fleet.predict_fleet([first, second], tier, together=True)
    assert [o.stats for o in together] == [o.stats for o in same]  # the hour taken out
    assert [o.stats for o in apart] != [o.stats for o in together]  # played one after the other, it differs


def test_logs_without_step_times_cannot_be_interleaved(capsys):
    from pathlib import Path

    old = str(Path(__file__).resolve().parents[1] / "golden" / "full_flush.jsonl")  # written before step times
    assert main(["whatif", old, old, "--shared-tier", '{"type": "valkey", "num_blocks": 64}']) == 2
    assert "record(s) no step times" in capsys.readouterr().err
    assert main(["whatif", old, old]) == 2
    assert "give the tier they would share" in capsys.readouterr().err
