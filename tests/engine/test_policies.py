"""Eviction policies: LRU and ARC, on their own and inside the engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.invariants import check
from kvledger.engine.policies import ARC, LRU, make_policy
from kvledger.events.config import PolicyName
from tests.engine.builders import Engine, chain, full_only_config, key

K = [bytes([i]) * 4 for i in range(12)]


def lru_of(*keys: bytes) -> LRU:
    policy = LRU()
    for k in keys:
        policy.insert(k, False)
    return policy


# LRU


def test_lru_evicts_in_insertion_order():
    policy = lru_of(*K[:5])
    assert policy.evict(2) == [K[0], K[1]]
    assert policy.evict(1) == [K[2]]
    assert policy.canonical() == ("lru", (K[3], K[4]))
    assert len(policy) == 2 and K[3] in policy and K[0] not in policy


def test_lru_reinsertion_moves_a_key_to_the_back():
    policy = lru_of(*K[:4])
    policy.remove(K[0])  # a load pins it
    policy.insert(K[0], True)  # the load ended: it was just used
    assert policy.evict(4) == [K[1], K[2], K[3], K[0]]


@pytest.mark.parametrize("count", [4, 10])
def test_lru_evict_is_atomic(count):
    policy = lru_of(*K[:3])
    before = policy.canonical()
    assert policy.evict(count) is None
    assert policy.canonical() == before


def test_lru_evict_nothing_and_admit_change_nothing():
    policy = lru_of(*K[:3])
    assert policy.evict(0) == []
    policy.admit(K[7])
    assert policy.canonical() == ("lru", tuple(K[:3]))


def test_lru_clone_is_independent_and_clear_empties():
    policy = lru_of(*K[:3])
    other = policy.clone()
    other.evict(1)
    assert len(policy) == 3 and len(other) == 2
    policy.clear()
    assert len(policy) == 0 and policy.evict(1) is None


def test_lru_remove_of_an_absent_key_raises():
    with pytest.raises(KeyError):
        lru_of(K[0]).remove(K[1])


# ARC


def test_arc_new_keys_go_to_t1_and_reused_keys_to_t2():
    arc = ARC(8)
    arc.insert(K[0], False)
    arc.insert(K[1], True)
    assert list(arc.t1) == [K[0]] and list(arc.t2) == [K[1]]
    assert len(arc) == 2 and K[0] in arc and K[1] in arc
    arc.remove(K[1])
    arc.remove(K[0])
    assert len(arc) == 0


def test_arc_evicts_t1_while_it_is_above_target_and_remembers_ghosts():
    arc = ARC(8)
    for k in K[:3]:
        arc.insert(k, False)
    arc.insert(K[3], True)
    assert arc.evict(2) == [K[0], K[1]]  # p = 0: T1 goes first
    assert list(arc.b1) == [K[0], K[1]] and not arc.b2
    assert arc.evict(2) == [K[2], K[3]]  # T1 then T2 once T1 is empty
    assert list(arc.b2) == [K[3]]


def test_arc_evicts_t2_when_t1_is_within_target():
    arc = ARC(8)
    arc.p = 2
    for k in K[:2]:
        arc.insert(k, False)
    for k in K[2:4]:
        arc.insert(k, True)
    assert arc.evict(1) == [K[2]]


def test_arc_ghost_hit_in_b1_raises_the_target_and_in_b2_lowers_it():
    arc = ARC(8)
    arc.insert(K[0], False)
    for k in K[1:4]:
        arc.insert(k, True)
    arc.evict(4)
    assert list(arc.b1) == [K[0]] and list(arc.b2) == K[1:4]
    arc.admit(K[0])  # B1 hit: p grows by max(|B2| // |B1|, 1) = 3
    assert arc.p == 3 and K[0] not in arc.b1
    arc.admit(K[1])  # B2 hit: p shrinks by max(|B1| // |B2|, 1) = 1
    assert arc.p == 2 and K[1] not in arc.b2
    arc.admit(K[9])  # not a ghost: nothing to learn
    assert arc.p == 2


def test_arc_target_stays_within_zero_and_capacity():
    arc = ARC(2)
    arc.insert(K[0], False)
    arc.insert(K[1], True)
    arc.evict(2)
    arc.p = 2
    arc.admit(K[0])
    assert arc.p == 2
    arc.p = 0
    arc.admit(K[1])
    assert arc.p == 0


def test_arc_ghost_lists_stay_bounded():
    arc = ARC(3)
    for round_ in range(4):
        for k in K[3 * round_:3 * round_ + 3]:
            arc.insert(k, round_ % 2 == 1)
        assert arc.evict(3) is not None
        assert len(arc.b1) <= 3 and len(arc.b1) + len(arc.b2) <= 3
    assert list(arc.b1) == K[6:9]  # the most recent ghosts are kept


@pytest.mark.parametrize("count", [3, 9])
def test_arc_evict_is_atomic(count):
    arc = ARC(4)
    arc.insert(K[0], False)
    arc.insert(K[1], True)
    before = arc.canonical()
    assert arc.evict(count) is None
    assert arc.canonical() == before


def test_arc_clone_and_clear():
    arc = ARC(4)
    arc.insert(K[0], False)
    arc.evict(1)
    arc.admit(K[0])
    other = arc.clone()
    other.insert(K[1], True)
    assert arc.canonical() != other.canonical() and arc.p == other.p == 1
    arc.clear()
    assert arc.canonical() == ("arc", 0, (), (), (), ())


@pytest.mark.parametrize("make", [lambda: LRU(), lambda: ARC(8)])
def test_remove_many_is_remove_of_each_key(make):
    one, many = make(), make()
    for policy in (one, many):
        for i, k in enumerate(K[:6]):
            policy.insert(k, i % 2 == 1)  # ARC: into T1 and T2 alike
    for k in (K[4], K[1], K[2]):
        one.remove(k)
    many.remove_many([K[4], K[1], K[2]])
    assert many.canonical() == one.canonical() and len(many) == 3
    with pytest.raises(KeyError):
        many.remove_many([K[0], K[1]])


def test_make_policy():
    assert isinstance(make_policy(PolicyName.LRU, 4), LRU)
    arc = make_policy(PolicyName.ARC, 4)
    assert isinstance(arc, ARC) and arc.capacity == 4


# ARC inside the engine


def test_arc_in_the_engine_tracks_reuse_and_learns_from_ghosts():
    e = Engine(full_only_config(num_tier_slots=4, policy="arc"))
    a = [key(h, 0) for h in chain(4, "a")]
    b = [key(h, 0) for h in chain(2, "b")]
    e.run_and_store("a", 128, (1, 2, 3, 4))
    e.finish("a")
    arc = e.core.policy
    assert list(arc.t1) == a and not arc.t2
    e.add("l", 33, chain(1, "a"))
    e.alloc("l", (5, 6), ext=32)
    e.load_done(2)
    assert list(arc.t1) == a[1:] and list(arc.t2) == a[:1]  # loaded, so reused
    e.run_and_store("b", 64, (7, 8), tag="b")
    assert list(arc.b1) == a[1:3]  # p = 0: seen-once keys went first
    assert list(arc.t1) == [a[3], *b] and arc.p == 0
    check(e.state)
    # Prefix "a" again: keys 1 and 2 are ghosts in B1, so T1 deserved more room.
    e.add("a2", 128, chain(4, "a"))
    e.alloc("a2", (9, 10, 11, 12))
    (evict, store) = e.step(("a2", 0, 128))
    assert evict.keys == (a[3], b[0])
    assert store.keys == (tuple(a[1:3]),)
    assert arc.p == 2 and list(arc.b1) == [a[3], b[0]]  # the hits left B1; the new victims joined it
    e.finish_all_jobs()
    assert len(arc.t1) + len(arc.t2) <= arc.capacity
    check(e.state)


# ARC against its textbook form


def _paper_evict(arc: ARC, count: int) -> list[bytes] | None:
    """ARC's eviction as the paper writes it, on an ARC's own lists: each victim taken as
    the first key of its list, each surplus ghost likewise. The engine's `evict` takes them
    in one pass a list (a dict's first key costs a scan past every entry deleted before it)."""
    if count > len(arc.t1) + len(arc.t2):
        return None
    victims = []
    for _ in range(count):
        if arc.t1 and (len(arc.t1) > arc.p or not arc.t2):
            k = next(iter(arc.t1))
            del arc.t1[k]
            arc.b1[k] = None
        else:
            k = next(iter(arc.t2))
            del arc.t2[k]
            arc.b2[k] = None
        victims.append(k)
    while arc.b1 and len(arc.b1) > arc.capacity:
        del arc.b1[next(iter(arc.b1))]
    while arc.b2 and len(arc.b1) + len(arc.b2) > arc.capacity:
        del arc.b2[next(iter(arc.b2))]
    return victims


_ARC_OPS = st.lists(st.tuples(st.sampled_from(["store", "reuse", "pin", "evict", "ghost", "target"]), st.integers(0, 40)),
                    max_size=120)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 12), ops=_ARC_OPS)
def test_arc_evicts_as_its_one_at_a_time_form(capacity: int, ops: list[tuple[str, int]]) -> None:
    """Every victim, ghost and target the same, whatever the order of stores, loads and
    evictions (the tier's calls: admit and insert a new key, pin and put back a stored one)."""
    engine, paper = ARC(capacity), ARC(capacity)  # driven alike, but for how each evicts
    fresh = 0
    for op, n in ops:
        for policy in (engine, paper):
            held = list(policy.t1) + list(policy.t2)
            if op == "store":
                new = bytes([fresh % 256, fresh // 256]) * 2
                policy.admit_many([new])
                policy.insert(new, False)
            elif op in ("reuse", "pin") and held:
                chosen = held[n % len(held)]
                policy.remove_many([chosen])
                if op == "reuse":
                    policy.insert(chosen, True)
        if op == "store":
            fresh += 1
        elif op == "evict":
            assert engine.evict(n % 6) == _paper_evict(paper, n % 6)
        elif op == "ghost" and (engine.b1 or engine.b2):  # stored again: the target moves
            ghost = (list(engine.b1) + list(engine.b2))[n % (len(engine.b1) + len(engine.b2))]
            for policy in (engine, paper):
                policy.admit(ghost)
                policy.insert(ghost, False)
        elif op == "target":  # where ghost hits would have moved it (every value reached)
            engine.p = paper.p = n % (capacity + 1)
        assert engine.canonical() == paper.canonical()
