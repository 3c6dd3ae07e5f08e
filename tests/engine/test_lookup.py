"""The tier-hit query on hand-built hybrid (HMA) cases."""

from __future__ import annotations

import pytest

from kvledger.engine.digest import digest
from kvledger.engine.invariants import check
from kvledger.engine.lookup import LATER, MISS, LookupResult, lookup
from kvledger.engine.state import SlotState
from kvledger.events import types as ev
from kvledger.events.config import GroupSpec
from tests.engine.builders import Engine, chain, full_only_config, key, make_config, seed_tier

H = chain(8, "p")

MAMBA_CONFIG = make_config(groups=(
    GroupSpec(group_id=0, kind="full", block_size=32),
    GroupSpec(group_id=1, kind="mamba", block_size=64),
))


def full_keys(n: int) -> list[bytes]:
    return [key(h, 0) for h in H[:n]]


def sliding_keys(*positions: int) -> list[bytes]:
    return [key(H[p], 1) for p in positions]


def mamba_keys(*positions: int) -> list[bytes]:
    """A 64-token mamba block is keyed by the hash at its second 32-token boundary."""
    return [key(H[2 * p + 1], 1) for p in positions]


def waiting(config, num_tokens: int, *tiers: list[bytes], storing: list[bytes] = ()) -> Engine:
    e = Engine(config)
    e.add("r", num_tokens, H[:num_tokens // 32])
    for keys in tiers:
        seed_tier(e.state, keys)
    seed_tier(e.state, list(storing), SlotState.STORING)
    return e


def hit(e: Engine, local: int = 0) -> LookupResult:
    before = digest(e.state)
    result = lookup(e.state, "r", local)
    assert digest(e.state) == before, "lookup changed the state"
    return result


# (a) a 64-token sliding window next to full attention, both with 32-token blocks


def test_sliding_needs_only_the_last_two_blocks_of_the_hit():
    # 161 tokens: the hit may end at 160; the window before 160 is blocks 3 and 4.
    e = waiting(make_config(), 161, full_keys(5), sliding_keys(3, 4))
    assert hit(e) == LookupResult(160)


@pytest.mark.parametrize("missing", [0, 1, 2])
def test_a_missing_sliding_key_outside_the_window_does_not_shrink_the_hit(missing):
    present = [p for p in range(5) if p != missing]
    e = waiting(make_config(), 161, full_keys(5), sliding_keys(*present))
    assert hit(e) == LookupResult(160)


@pytest.mark.parametrize("missing, expected", [(4, 128), (3, 96)])
def test_a_missing_sliding_key_inside_the_window_walks_the_hit_down(missing, expected):
    present = [p for p in range(5) if p != missing]
    e = waiting(make_config(), 161, full_keys(5), sliding_keys(*present))
    assert hit(e) == LookupResult(expected)


def test_full_attention_needs_every_block_of_the_prefix():
    # Full key 1 is missing: the hit cannot pass 32 tokens, whatever the window has.
    keys = full_keys(5)
    del keys[1]
    e = waiting(make_config(), 161, keys, sliding_keys(0, 1, 2, 3, 4))
    assert hit(e) == LookupResult(32)


def test_a_local_hit_needs_only_the_window_keys_after_it():
    # Local 128 tokens: the hit to 160 needs full key 4 and sliding key 4 only.
    e = waiting(make_config(), 161, [full_keys(5)[4]], sliding_keys(4))
    assert hit(e, 128) == LookupResult(32)
    assert hit(e, 96) == MISS  # from 96, full key 3 is needed and absent


# (b) mamba (64-token blocks) next to full attention (32-token blocks)


@pytest.mark.parametrize("mamba, expected", [
    ((1,), 128), ((2,), 192), ((3,), 256), ((0, 1, 2), 192), ((), 0),
])
def test_mamba_hits_end_only_on_64_token_boundaries_with_a_stored_state(mamba, expected):
    e = waiting(MAMBA_CONFIG, 257, full_keys(8), mamba_keys(*mamba))
    assert hit(e) == (LookupResult(expected) if expected else MISS)


def test_mamba_hit_is_rounded_down_to_the_common_boundary():
    # Full attention covers 160 tokens; 160 is not a mamba boundary, so the hit is 128.
    e = waiting(MAMBA_CONFIG, 257, full_keys(5), mamba_keys(0, 1, 2, 3))
    assert hit(e) == LookupResult(128)
    assert hit(e, 64) == LookupResult(64)


# (c) at least one prompt token is left to compute


@pytest.mark.parametrize("num_tokens, expected", [(128, 96), (129, 128), (159, 128), (160, 128)])
def test_the_hit_leaves_at_least_one_token(num_tokens, expected):
    e = waiting(full_only_config(), num_tokens, full_keys(5))
    assert hit(e) == LookupResult(expected)


def test_a_prompt_of_whole_blocks_that_is_all_local_has_no_hit():
    e = waiting(full_only_config(), 128, full_keys(4))
    assert hit(e, 96) == MISS


# (d) ready=False: ask again later


def test_a_needed_key_still_storing_defers():
    keys = full_keys(4)
    e = waiting(make_config(), 129, keys[:3], sliding_keys(2, 3), storing=[keys[3]])
    assert hit(e) == LATER


def test_a_storing_key_outside_the_window_is_not_waited_for():
    e = waiting(make_config(), 129, full_keys(4), sliding_keys(2, 3), storing=sliding_keys(0))
    assert hit(e) == LookupResult(128)


def test_a_key_another_request_is_loading_defers_until_the_load_ends():
    e = Engine(make_config())
    e.run_and_store("d", 128, (1, 2, 3, 4), (5, 6, 7, 8), tag="p")
    e.finish("d")
    e.add("b", 129, H[:4])
    e.alloc("b", (9, 10, 11, 12, 13), (0, 0, 14, 15, 16), ext=128)
    e.add("r", 129, H[:4])
    assert hit(e) == LATER
    e.load_done(2)
    assert hit(e) == LookupResult(128)


def stored_on_one_of_two_workers() -> Engine:
    """Request "r" asks for a prefix whose store one of two workers has reported."""
    e = Engine(make_config(world_size=2))
    e.add("d", 128, H[:4])
    e.alloc("d", (1, 2, 3, 4), (5, 6, 7, 8))
    e.step(("d", 0, 128))
    e.store_done(1, worker=0)
    e.add("r", 129, H[:4])
    return e


def test_a_key_storing_on_one_of_two_workers_defers():
    e = stored_on_one_of_two_workers()
    assert hit(e) == LATER
    e.store_done(1, worker=1)
    assert hit(e) == LookupResult(128)


# (e) lookup is pure


def test_lookup_never_changes_the_state():
    e = waiting(make_config(), 161, full_keys(5), sliding_keys(1, 2, 4), storing=sliding_keys(3))
    snapshot = digest(e.state)
    policy = e.core.policy.canonical()
    for local in (0, 16, 32, 64, 96, 128, 160, 192):
        lookup(e.state, "r", local)
    lookup(e.state, "nobody", 0)
    assert digest(e.state) == snapshot
    assert e.core.policy.canonical() == policy  # a hit does not count as a use


# (f) only aligned local hits can be extended


@pytest.mark.parametrize("local", [16, 33, 100])
def test_an_unaligned_local_hit_is_a_miss(local):
    e = waiting(make_config(), 161, full_keys(5), sliding_keys(0, 1, 2, 3, 4))
    assert hit(e, local) == MISS


def test_a_local_hit_aligned_to_one_group_but_not_all_is_a_miss():
    e = waiting(MAMBA_CONFIG, 257, full_keys(8), mamba_keys(0, 1, 2, 3))
    assert hit(e, 32) == MISS
    assert hit(e, 64) == LookupResult(192)


# Who can hit


def test_only_a_request_waiting_for_admission_can_hit():
    e = Engine(make_config())
    e.run_and_store("d", 128, (1, 2, 3, 4), (5, 6, 7, 8), tag="p")
    e.add("r", 129, H[:4])
    assert hit(e) == LookupResult(128)
    assert lookup(e.state, "d", 0) == MISS  # running
    assert lookup(e.state, "nobody", 0) == MISS
    e.alloc("r", (9, 10, 11, 12, 13), (0, 0, 14, 15, 16), ext=128)
    assert lookup(e.state, "r", 0) == MISS  # loading


def test_the_seeded_tier_is_a_consistent_state():
    e = waiting(make_config(), 161, full_keys(5), sliding_keys(3, 4), storing=sliding_keys(0))
    with pytest.raises(AssertionError):
        check(e.state)  # a storing slot without a store job is caught...
    e = waiting(make_config(), 161, full_keys(5), sliding_keys(3, 4))
    check(e.state)  # ...a stored one is a legal tier


# (g) a kept answer: given back while nothing it rests on moved


def again(e: Engine, first: LookupResult, local: int = 0) -> LookupResult:
    """The lookup given its last answer back; it must equal a fresh lookup."""
    kept = lookup(e.state, "r", local, previous=first)
    assert kept == lookup(e.state, "r", local)
    return kept


def stored_doc(num_tier_slots: int = 32) -> Engine:
    e = Engine(make_config(num_tier_slots=num_tier_slots))
    e.run_and_store("d", 128, (1, 2, 3, 4), (5, 6, 7, 8), tag="p")
    e.finish("d")
    e.add("r", 129, H[:4])
    return e


def test_an_answer_is_given_back_while_the_tier_only_grows():
    e = stored_doc()
    first = hit(e)
    assert first == LookupResult(128)
    assert again(e, first) is first
    e.run_and_store("x", 64, (9, 10), (11, 12), tag="other")  # stores of other keys: the whole prompt still hits
    assert again(e, first) is first
    assert again(e, first, local=32) is not first  # another local hit is another question


def test_a_load_of_the_same_keys_drops_the_kept_answer():
    e = stored_doc()
    first = hit(e)
    e.add("b", 129, H[:4])
    e.alloc("b", (9, 10, 11, 12, 13), (0, 0, 14, 15, 16), ext=128)
    assert again(e, first) == LATER


def test_an_eviction_drops_the_kept_answer():
    e = stored_doc(num_tier_slots=8)
    first = hit(e)
    e.run_and_store("x", 128, (9, 10, 11, 12), (13, 14, 15, 16), tag="other")  # evicts the document
    assert e.core.stats.evictions == 8
    assert again(e, first) == MISS


def test_a_kept_answer_short_of_the_prompt_waits_for_the_key_it_stopped_at():
    e = Engine(make_config())
    e.run_and_store("d", 64, (1, 2), (3, 4), tag="p")
    e.finish("d")
    e.add("r", 129, H[:4])
    first = hit(e)
    assert first == LookupResult(64)
    assert again(e, first) is first
    e.run_and_store("x", 64, (5, 6), (7, 8), tag="other")  # not the key the walk stopped at
    assert again(e, first) is first
    e.run_and_store("y", 128, (9, 10, 11, 12), (13, 14, 15, 16), tag="p")  # the rest of the document
    assert again(e, first) == LookupResult(128)


def test_a_cache_reset_drops_the_kept_answer():
    e = stored_doc()
    first = hit(e)
    e.apply(ev.CacheReset(epoch=1))
    assert again(e, first) == MISS


def test_an_ask_again_later_answer_is_not_given_back_once_the_store_ends():
    # A store ending moves none of the counters a kept answer rests on.
    e = stored_on_one_of_two_workers()
    first = hit(e)
    assert first == LATER
    e.store_done(1, worker=1)
    assert again(e, first) == LookupResult(128)


def test_loads_this_step_started_do_not_make_a_lookup_of_the_same_step_wait():
    """vLLM asks about every request it admits in a step before the engine sees any of their
    allocations; a caller that applies each admission before the next lookup (`kvledger whatif`)
    names the loads the step's earlier admissions started, and the hit is what vLLM was told."""
    engine = Engine(full_only_config())
    keys = full_keys(4)
    seed_tier(engine.state, keys)
    engine.add("a", 4 * 32 + 1, hashes=H[:4])
    engine.add("b", 4 * 32 + 1, hashes=H[:4])
    engine.alloc("a", (1, 2, 3, 4), ext=4 * 32)  # a loads the four blocks
    assert lookup(engine.state, "b", 0) == LATER  # a load of another request's, from an earlier step
    slots = {engine.core.slot_of_key[k]: 1 for k in keys}
    assert lookup(engine.state, "b", 0, step_loads=slots).num_hit_tokens == 4 * 32
