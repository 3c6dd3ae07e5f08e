"""The step planner, without vLLM: each case plays vLLM's scheduler by hand
(tests/support/fake_vllm.py), asks for the step's events, checks their exact
order, and has the engine apply them strictly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine import queries
from kvledger.engine.invariants import check
from kvledger.engine.planner import Admission, new_hashes
from kvledger.engine.state import RequestStatus
from kvledger.events import types as ev
from kvledger.events.config import StoreMode
from tests.engine import planner_workload
from tests.engine.builders import FULL, SLIDING, chain, full_only_config, key, make_config
from tests.support.fake_vllm import FakeVllm

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


def kinds(events: list[ev.Event]) -> list[str]:
    return [e.kind for e in events]


def short_window_config():
    """`make_config` with a 32-token window: vLLM frees a request's first window
    block once it has computed 63 tokens."""
    return make_config(groups=(FULL, attrs.evolve(SLIDING, window=32)))


def admitted(vllm: FakeVllm, rid: str, scheduled: int, *, local: int = 0, external: int = 0,
             **step: object) -> list[ev.Event]:
    vllm.requests[rid].num_computed_tokens = local + external
    scheduled_now = {rid: scheduled} if scheduled else {}
    return vllm.run({**step.pop("running", {}), **scheduled_now},  # type: ignore[dict-item]
                    admitted=(Admission(rid, local, external),), **step)


def test_chunked_prefill_allocates_each_chunk_as_vllm_grows_the_table():
    vllm = FakeVllm(make_config())
    vllm.add("a", 128, chain(4))
    vllm.give("a", (1, 2), (3, 4))
    events = admitted(vllm, "a", 64)
    assert events == [
        ev.BlocksAllocated(request_id="a", block_ids=((1, 2), (3, 4))),
        ev.StepScheduled(step_index=1, request_ids=("a",), num_computed_tokens=(0,), num_scheduled_tokens=(64,)),
    ]
    vllm.give("a", (5, 6), (7, 8))
    events = vllm.run({"a": 64})
    assert events == [
        ev.BlocksAllocated(request_id="a", block_ids=((5, 6), (7, 8))),
        ev.StepScheduled(step_index=2, request_ids=("a",), num_computed_tokens=(64,), num_scheduled_tokens=(64,)),
    ]
    assert vllm.table("a") == ((1, 2, 5, 6), (3, 4, 7, 8))
    assert queries.request_view(vllm.state, "a").num_computed_tokens == 64
    assert vllm.run({}) == []  # a step that schedules nothing says nothing


def test_a_window_free_comes_before_the_growth_that_reuses_the_block():
    vllm = FakeVllm(make_config())
    vllm.add("a", 96, chain(3, "a"))
    vllm.add("b", 64, chain(2, "b"))
    vllm.give("a", (1, 2, 3), (4, 5, 6))
    vllm.give("b", (7, 8), (9, 10))
    vllm.run({"a": 95, "b": 63}, admitted=(Admission("a", 0, 0), Admission("b", 0, 0)))
    # Next step: a's window leaves its first sliding block (4), and b grows into block 4.
    vllm.null_out("a", 1, 0)
    vllm.requests["b"].num_tokens = 65
    vllm.give("b", (11,), (4,))
    events = vllm.run({"b": 2, "a": 1})
    assert kinds(events) == ["blocks_freed", "blocks_allocated", "step_scheduled"]
    assert events[0] == ev.BlocksFreed(request_id="a", block_ids=((), (4,)))
    assert events[1] == ev.BlocksAllocated(request_id="b", block_ids=((11,), (4,)))
    assert events[2].request_ids == ("b", "a")  # vLLM's scheduling order
    assert vllm.table("a") == ((1, 2, 3), (0, 5, 6))


def hit_beside_growth(b_window: tuple[int, ...]) -> tuple[FakeVllm, list[ev.Event]]:
    """a computes 64 tokens. Then one step: a grows by blocks 5, 6 / 7, 8 and
    computes them; b, the same prompt, hits vLLM's prefix cache on 96 tokens,
    block 5 among them, with `b_window` as its window group's table."""
    vllm = FakeVllm(make_config())
    prompt = chain(4)
    vllm.add("a", 128, prompt)
    vllm.give("a", (1, 2), (3, 4))
    admitted(vllm, "a", 64)
    vllm.give("a", (5, 6), (7, 8))
    vllm.add("b", 128, prompt)
    vllm.give("b", (1, 2, 5, 9), b_window)
    return vllm, admitted(vllm, "b", 32, local=96, running={"a": 64})


def test_an_admission_may_touch_a_block_a_running_request_allocated_this_step():
    _, events = hit_beside_growth((0, 4, 7, 10))
    assert kinds(events) == ["blocks_allocated", "blocks_touched", "blocks_allocated", "step_scheduled"]
    assert events[0] == ev.BlocksAllocated(request_id="a", block_ids=((5, 6), (7, 8)))
    assert events[1] == ev.BlocksTouched(request_id="b", block_ids=((1, 2, 5), (0, 4, 7)))
    assert events[2] == ev.BlocksAllocated(request_id="b", block_ids=((9,), (10,)))
    assert events[3] == ev.StepScheduled(step_index=2, request_ids=("a", "b"), num_computed_tokens=(64, 96),
                                         num_scheduled_tokens=(64, 32))


def test_a_window_table_admitted_past_skipped_positions_scans_for_frees_from_its_first_block():
    """A prefix hit gives a window group null blocks before the window. The free
    floor starts past them (the planner's scan for window frees starts there, in
    every step: over a long context, thousands of positions), and the next free
    is still found."""
    vllm, _ = hit_beside_growth((0, 0, 7, 10))
    assert vllm.state.core.requests["b"].free_floor == [0, 2]
    # b has computed 128 tokens; vLLM frees position 2 once 159 are computed
    # (3 blocks of 32, plus the 63 tokens the 64-token window keeps).
    vllm.requests["b"].num_tokens = 160
    vllm.give("b", (11,), (12,))
    assert vllm.run({"b": 31})[0].kind == "blocks_allocated"
    vllm.null_out("b", 1, 2)
    events = vllm.run({"b": 1})
    assert kinds(events) == ["blocks_freed", "step_scheduled"]
    assert events[0] == ev.BlocksFreed(request_id="b", block_ids=((), (7,)))
    assert vllm.table("b") == ((1, 2, 5, 9, 11), (0, 0, 0, 10, 12))
    assert vllm.state.core.requests["b"].free_floor == [0, 3]
    check(vllm.state)


@pytest.mark.parametrize("window", [32, 48])
def test_a_decoding_requests_window_free_is_found_in_the_step_vllm_makes_it(window):
    """The planner looks for a window free only once the computed tokens reach
    the point where vLLM's `get_num_skipped_tokens` passes the block at the free
    floor; decoding token by token, each free is still found in its own step."""
    vllm = FakeVllm(make_config(groups=(FULL, attrs.evolve(SLIDING, window=window))))
    vllm.add("a", 64, chain(2))
    vllm.give("a", (1, 2, 3), (4, 5, 6))
    admitted(vllm, "a", 64)
    found = []
    for _ in range(31):  # decode to 95 tokens; vLLM frees as it would
        request = vllm.requests["a"]
        request.num_tokens += 1
        skipped = max(0, request.num_computed_tokens - window + 1) // 32
        for position in range(skipped):
            if vllm.tables[1]["a"][position].block_id:
                vllm.null_out("a", 1, position)
        events = vllm.run({"a": 1})
        found += [(request.num_computed_tokens - 1, e.block_ids) for e in events if e.kind == "blocks_freed"]
        assert vllm.engine_table("a") == vllm.table("a")
    # Position 0 leaves the window once 32 + window - 1 tokens are computed
    # (with a 32-token window, already before the first decode step).
    assert found == [(max(64, 32 + window - 1), ((), (4,)))]


@pytest.mark.parametrize("nulled", [19, 12])
def test_a_prefills_window_frees_are_found_in_one_pass_up_to_the_first_held_block(nulled):
    """After a long prefill chunk vLLM frees a run of window blocks at once (the
    planner reads those in C-level passes). It may free fewer than the window
    allows (blocks it retains): the run stops at the first block it holds."""
    vllm = FakeVllm(short_window_config())
    vllm.add("a", 640, chain(20))
    full, window = tuple(range(1, 21)), tuple(range(21, 41))
    vllm.give("a", full, window)
    admitted(vllm, "a", 639)
    # 639 computed tokens: the 32-token window keeps 31, so positions 0-18 may go.
    vllm.null_out("a", 1, *range(nulled))
    vllm.requests["a"].num_tokens = 641
    events = vllm.run({"a": 1})
    assert events[0] == ev.BlocksFreed(request_id="a", block_ids=((), window[:nulled]))
    assert vllm.engine_table("a") == vllm.table("a")
    assert vllm.state.core.requests["a"].free_floor == [0, nulled]
    check(vllm.state)


def test_preemption_then_readmission_in_a_later_step_and_in_the_same_one():
    vllm = FakeVllm(full_only_config())
    vllm.add("a", 64, chain(2))
    vllm.give("a", (1, 2))
    admitted(vllm, "a", 64)
    vllm.drop("a")
    events = vllm.run({}, preempted=("a",))
    assert events == [ev.RequestPreempted(request_id="a")]
    assert queries.request_status(vllm.state, "a") is RequestStatus.PREEMPTED
    vllm.give("a", (3, 4))
    events = admitted(vllm, "a", 64)
    assert kinds(events) == ["request_resumed", "blocks_allocated", "step_scheduled"]
    assert queries.request_status(vllm.state, "a") is RequestStatus.RUNNING
    # Preempted and admitted again within one step.
    vllm.drop("a")
    vllm.give("a", (5, 6))
    events = admitted(vllm, "a", 64, preempted=("a",))
    assert kinds(events) == ["request_preempted", "request_resumed", "blocks_allocated", "step_scheduled"]
    assert vllm.table("a") == ((5, 6),)


def test_preemptions_come_sorted_and_only_for_running_requests():
    vllm = FakeVllm(full_only_config())
    for rid, block in (("c", 1), ("a", 2), ("b", 3)):
        vllm.add(rid, 32, chain(1, rid))
        vllm.give(rid, (block,))
    vllm.run({"c": 31, "a": 31}, admitted=(Admission("c", 0, 0), Admission("a", 0, 0)))
    for rid in ("c", "a"):
        vllm.drop(rid)
    events = vllm.run({}, preempted=("c", "b", "a", "unknown"))  # b never ran: nothing to preempt
    assert events == [ev.RequestPreempted(request_id="a"), ev.RequestPreempted(request_id="c")]


def test_new_hashes_come_before_the_frees_of_a_decoding_request():
    vllm = FakeVllm(short_window_config())  # at 64 computed tokens, vLLM has freed position 0
    vllm.add("a", 64, chain(2))
    vllm.give("a", (1, 2, 3), (4, 5, 6))
    admitted(vllm, "a", 64)
    longer = chain(3)
    vllm.requests["a"].block_hashes = list(longer)
    vllm.requests["a"].num_tokens = 96
    vllm.null_out("a", 1, 0)
    events = vllm.run({"a": 32})
    assert events[0] == ev.BlockHashesAppended(request_id="a", num_tokens=96, block_hashes=longer[2:])
    assert events[1] == ev.BlocksFreed(request_id="a", block_ids=((), (4,)))
    assert kinds(events)[2:] == ["step_scheduled"]


def test_a_sessions_replaced_hash_is_rewound_in_the_engine_and_its_block_stored_under_the_new_one():
    """vLLM's `_update_request_as_session`: the last sampled token (here the one that filled
    block 2) is replaced by the next input, and block 2's hash is computed again."""
    vllm = FakeVllm(full_only_config())
    vllm.sessions.add("s")
    vllm.add("s", 64, chain(2))
    vllm.give("s", (1, 2, 3, 4))
    admitted(vllm, "s", 64)
    old, new = chain(3), chain(2) + chain(1, "next input")
    session = vllm.requests["s"]
    session.block_hashes, session.num_tokens = list(old), 96
    assert vllm.run({"s": 31})[0] == ev.BlockHashesAppended(request_id="s", num_tokens=96, block_hashes=old[2:])
    session.block_hashes, session.num_tokens = list(new), 98  # 95 kept, 3 new
    events = vllm.run({"s": 3})
    assert events[:2] == [ev.BlockHashesRewound(request_id="s", num_hashes=2),
                          ev.BlockHashesAppended(request_id="s", num_tokens=98, block_hashes=new[2:])]
    stored = {k for store in vllm.effects if hasattr(store, "keys") for group in store.keys for k in group}
    assert key(new[2], 0) in stored and key(old[2], 0) not in stored
    assert vllm.run({"s": 1})[:1] == [ev.StepScheduled(step_index=4, request_ids=("s",), num_computed_tokens=(98,),
                                                       num_scheduled_tokens=(1,))]  # nothing more to compare


def test_fewer_keys_than_the_engine_knows_rewind_a_session_only():
    """A `keys_of` that yields fewer keys than the engine holds (vLLM's hashes grew,
    its derived keys have not): nothing new for a request, a rewind for a session."""
    vllm = FakeVllm(full_only_config())
    vllm.add("a", 129, chain(4))
    request = vllm.requests["a"]
    request.block_hashes = list(chain(5))
    behind = lambda _request: list(chain(2))  # noqa: E731
    assert new_hashes(vllm.state, "a", request, behind) == ()
    assert new_hashes(vllm.state, "a", request, behind, rewinds=True) == (
        ev.BlockHashesRewound(request_id="a", num_hashes=2),)


def test_the_engine_table_stays_vllms_so_the_final_table_is_accepted():
    vllm = FakeVllm(short_window_config())  # at 64 computed tokens, vLLM has freed position 0
    vllm.add("a", 96, chain(3))
    vllm.give("a", (1, 2), (3, 4))
    admitted(vllm, "a", 64)
    vllm.give("a", (5,), (6,))
    vllm.null_out("a", 1, 0)
    vllm.run({"a": 31})
    assert vllm.table("a") == ((1, 2, 5), (0, 4, 6))
    view = queries.request_view(vllm.state, "a")
    assert view.table_positions == (3, 3) and view.blocks_per_group == (3, 2)
    vllm.apply([ev.RequestFinished(request_id="a", block_ids=vllm.table("a"))])  # strict: a mismatch raises
    assert queries.request_status(vllm.state, "a") is None
    assert queries.device_usage(vllm.state).held_blocks == 0


@pytest.mark.parametrize("mode", [StoreMode.LAZY, StoreMode.EAGER])
def test_blocks_near_eviction_are_reported_in_lazy_mode_only(mode):
    vllm = FakeVllm(full_only_config(store_mode=mode))
    vllm.add("a", 64, chain(2))
    vllm.give("a", (1, 2))
    events = admitted(vllm, "a", 63, near_eviction=(7, 5, 6))
    expected = ["blocks_allocated", "blocks_near_eviction", "step_scheduled"]
    if mode is StoreMode.EAGER:
        expected.remove("blocks_near_eviction")
    assert kinds(events) == expected
    if mode is StoreMode.LAZY:
        assert events[1] == ev.BlocksNearEviction(block_ids=(7, 5, 6))  # vLLM's eviction order, as given


def test_admissions_come_in_vllms_order_with_their_hashes_first():
    vllm = FakeVllm(full_only_config())
    for rid in ("z", "m", "a"):
        vllm.add(rid, 64, chain(1, rid))
    for block, rid in enumerate(("z", "m", "a"), start=1):
        vllm.give(rid, (block * 2, block * 2 + 1))
        vllm.requests[rid].block_hashes = list(chain(2, rid))
    events = vllm.run({"z": 63, "m": 63, "a": 63},
                      admitted=(Admission("z", 0, 0), Admission("m", 0, 0), Admission("a", 0, 0)))
    assert [(e.kind, e.request_id) for e in events[:-1]] == [
        ("block_hashes_appended", "z"), ("block_hashes_appended", "m"), ("block_hashes_appended", "a"),
        ("blocks_allocated", "z"), ("blocks_allocated", "m"), ("blocks_allocated", "a")]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(20, 80), preempt_rate=st.sampled_from([0.0, 0.1, 0.4]))
def test_the_planner_keeps_the_engine_on_vllms_tables_through_any_workload(seed, steps, preempt_rate):
    """Strictly applied (any rejected event raises), with the engine's tables
    checked against vLLM's after every step, and the invariants at the end."""
    vllm = planner_workload.run(None, steps, seed, preempt_rate=preempt_rate, check=True)
    check(vllm.state)
    kinds_seen = {e.kind for e in vllm.log}
    assert {"request_added", "blocks_allocated", "step_scheduled", "store_completed"} <= kinds_seen


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), preempt_rate=st.sampled_from([0.0, 0.1, 0.4]))
def test_told_what_vllms_output_says_the_planner_emits_what_reading_every_table_and_request_does(
        seed, preempt_rate):
    """Which tables grew, and each request's token counts: with them the planner
    skips most reads, and must miss nothing."""
    told = planner_workload.run(None, 60, seed, preempt_rate=preempt_rate, check=True)
    compared = planner_workload.run(None, 60, seed, preempt_rate=preempt_rate, check=True, say_grown=False,
                                    say_counts=False)
    assert told.log == compared.log
    assert {"blocks_allocated", "blocks_freed", "block_hashes_appended"} <= {e.kind for e in told.log}
    # Out of vLLM's order the cached requests match no scheduled one, and each is read instead.
    unordered = planner_workload.run(None, 60, seed, preempt_rate=preempt_rate, check=True, cached_reversed=True)
    assert told.log == unordered.log


def test_a_running_request_not_named_as_grown_is_not_compared():
    """The hint is what makes the common step cheap: the planner trusts it."""
    vllm = FakeVllm(make_config())
    vllm.add("a", 128, chain(4))
    vllm.give("a", (1, 2), (3, 4))
    admitted(vllm, "a", 64)
    vllm.give("a", (5, 6), (7, 8))
    vllm.given.clear()  # vLLM's scheduler output would name "a": this one does not
    assert kinds(vllm.plan({"a": 64})) == ["step_scheduled"]
    vllm.given.add("a")
    assert kinds(vllm.plan({"a": 64})) == ["blocks_allocated", "step_scheduled"]


def _workload_log(tmp_path: Path, seed: str) -> bytes:
    out = tmp_path / f"log-{seed}.jsonl"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.planner_workload", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_bytes()


def test_the_same_workload_writes_the_same_log_bytes_under_any_hash_seed(tmp_path):
    logs = {seed: _workload_log(tmp_path, seed) for seed in ("0", "1", "4242")}
    assert len(logs["0"]) > 10_000
    assert logs["0"] == logs["1"] == logs["4242"]
