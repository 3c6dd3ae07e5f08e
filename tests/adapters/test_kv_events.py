"""KV cache events for the tier: advertised exactly while loadable."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvledger.adapters.vllm.kv_events import GroupEventSpec, TierEvents
from kvledger.engine import effects as fx
from kvledger.engine import queries
from kvledger.events import types as ev
from tests.engine.builders import Engine, chain, full_only_config, make_config, only

pytestmark = pytest.mark.vllm  # imports vLLM's types: not in the fast subset, which runs without vLLM

SPECS = (GroupEventSpec(block_size=32, kind="full_attention"),
         GroupEventSpec(block_size=32, kind="sliding_window", sliding_window=64))


class Watched(Engine):
    """An engine whose every transition's notifications go through a `TierEvents`;
    what it advertised is folded from the events taken, as a router would."""

    def __init__(self, config, specs=SPECS, num_lower_tiers: int = 0) -> None:
        super().__init__(config)
        self.tier_events = TierEvents(specs, num_lower_tiers)
        self.advertised: dict[str, set] = {"CPU": set(), "STORAGE": set()}  # medium -> {(group, hash)}
        self.problems: list[str] = []

    def apply(self, event):
        effects = super().apply(event)
        self.tier_events.observe(effects)
        return effects

    def take(self) -> list:
        events = self.tier_events.take()
        for x in events:
            pairs = {(x.group_idx, h) for h in x.block_hashes}
            seen = self.advertised[x.medium]
            if isinstance(x, BlockStored):
                if pairs & seen:
                    self.problems.append(f"stored twice: {pairs & seen}")
                seen |= pairs
            else:
                if pairs - seen:
                    self.problems.append(f"removed, never stored: {pairs - seen}")
                seen -= pairs
        return events

    def check_advertised(self) -> None:
        """Every advertised key can be loaded now, and every loadable key is advertised."""
        self.take()
        assert not self.problems
        assert self.advertised["CPU"] == _pairs(queries.loadable_keys(self.state))
        for tier in range(1, len(self.core.lower) + 1):
            assert self.advertised["STORAGE"] == _pairs(self.core.lower[tier - 1].held)


def _pairs(keys) -> set:
    return {(int.from_bytes(k[-4:], "big"), maybe_convert_block_hash(k[:-4])) for k in keys}


def hashes_of(events, kind) -> list[bytes]:
    return [h for e in events if isinstance(e, kind) for h in e.block_hashes]


def test_stored_blocks_are_advertised_once_their_store_completes(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    e = Watched(make_config())
    e.add("a", 96)
    e.alloc("a", (1, 2, 3), (4, 5, 6))
    e.step(("a", 0, 96))
    assert e.take() == []  # stores started, nothing loadable yet
    e.finish_all_jobs()
    events = e.take()
    assert all(isinstance(x, BlockStored) and x.medium == "CPU" for x in events)
    hashes = chain(3)
    # Every block of both groups can serve some hit (the window's first block serves one ending at 64).
    assert sorted((x.group_idx, x.block_hashes[0]) for x in events) == sorted(
        [(0, h) for h in hashes] + [(1, h) for h in hashes])
    assert {x.kv_cache_spec_kind for x in events if x.group_idx == 1} == {"sliding_window"}
    e.check_advertised()
    e.apply(ev.CacheReset(epoch=1))
    removed = e.take()
    assert all(isinstance(x, BlockRemoved) for x in removed)
    assert len(hashes_of(removed, BlockRemoved)) == 6
    e.check_advertised()


def test_a_store_is_advertised_only_after_every_worker_reports():
    e = Watched(make_config(world_size=2))
    e.add("a", 64)
    e.alloc("a", (1, 2), (3, 4))
    (store,) = e.step(("a", 0, 64))
    e.store_done(store.job_id, worker=0)
    assert e.take() == []
    e.store_done(store.job_id, worker=1)
    assert len(e.take()) == 4
    e.check_advertised()


def test_evicted_blocks_are_withdrawn_in_the_same_transition(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    e = Watched(full_only_config(num_tier_slots=3), specs=SPECS[:1])
    e.run_and_store("a", 96, (1, 2, 3), tag="a")
    assert len(e.take()) == 3
    e.run_and_store("b", 64, (4, 5), tag="b")  # two more blocks: two of a's are evicted
    events = e.take()
    removed, stored = hashes_of(events, BlockRemoved), hashes_of(events, BlockStored)
    assert len(removed) == 2 and len(stored) == 2
    assert set(removed) <= set(chain(3, "a")) and set(stored) == set(chain(2, "b"))
    e.check_advertised()


def test_a_failed_load_withdraws_the_keys_it_dropped(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    e = Watched(full_only_config(), specs=SPECS[:1])
    e.run_and_store("a", 96, (1, 2, 3))
    e.take()
    assert (0, chain(3)[1]) in e.advertised["CPU"]
    e.add("b", 97, chain(3))
    (load,) = only(e.alloc("b", (4, 5, 6, 7), ext=96), fx.StartLoad)
    e.apply(ev.LoadFailed(job_id=load.job_id, block_ids=(5,), keys=()))
    events = e.take()
    assert hashes_of(events, BlockRemoved) == [chain(3)[1]]
    assert (0, chain(3)[1]) not in e.advertised["CPU"]
    e.check_advertised()


def test_int_block_hashes_follow_vllms_setting(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    e = Watched(full_only_config(), specs=SPECS[:1])
    e.run_and_store("a", 32, (1,))
    (stored,) = e.take()
    assert stored.block_hashes == [int.from_bytes(chain(1)[0], "big") & ((1 << 64) - 1)]


def test_a_disk_tier_is_advertised_with_medium_storage_while_it_holds_a_block(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    from tests.engine.builders import FULL

    e = Watched(make_config(groups=(FULL,), lower_tiers=({"name": "1:fs", "num_blocks": 2},)), SPECS[:1],
                num_lower_tiers=1)
    e.add("a", 96)
    e.alloc("a", (1, 2, 3))
    e.step(("a", 0, 96))
    e.finish_all_jobs()  # stores, then the spills they start
    events = e.take()
    cpu = [x for x in events if x.medium == "CPU"]
    storage = [x for x in events if x.medium == "STORAGE"]
    assert all(isinstance(x, BlockStored) for x in events)
    assert len(cpu) == 3 and len(storage) == 2  # the disk holds two blocks
    e.check_advertised()
    e.apply(ev.CacheReset(epoch=1))
    removed = e.take()
    assert {x.medium for x in removed if isinstance(x, BlockRemoved)} == {"CPU", "STORAGE"}
    assert e.advertised == {"CPU": set(), "STORAGE": set()}
    e.check_advertised()


# Self-describing: vLLM's hashes, the parent, the tokens and the tier's locality.

class _Request:
    """What `describe_stores` reads of vLLM's `Request`: its block hashes and its tokens."""

    def __init__(self, hashes: list[bytes], tokens: list[int]) -> None:
        self.block_hashes = hashes
        self.all_token_ids = tokens


class _Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


def _described_store(events: TierEvents, keys: tuple[bytes, ...], blocks: tuple[int, ...]) -> list[bytes]:
    """A request of len(keys) blocks in group 0 (full) and one block in group 1 (sliding), stored; vLLM's hashes."""
    vllm_hashes = [bytes([i]) * 32 for i in range(1, len(keys) + 1)]
    request = _Request(vllm_hashes, list(range(32 * len(keys) + 5)))
    tables = ({"r": [_Block(b) for b in blocks]}, {"r": [_Block(90)]})
    store = fx.StartStore(job_id=1, request_id="", keys=(keys, (b"w" * 32 + (1).to_bytes(4, "big"),)),
                          source_block_ids=(blocks, (90,)), target_slot_ids=(tuple(range(len(keys))), (9,)))
    events.describe_stores([store], {"r": request}, tables, ["r"])
    return vllm_hashes


def test_self_described_blocks_carry_vllms_hashes_tokens_and_locality_per_tier() -> None:
    events = TierEvents(SPECS, 1, self_describing=True, localities=["REMOTE"], hash_block_size=32)
    keys = tuple(b"k%d" % i + b"\0" * 29 + (0).to_bytes(4, "big") for i in range(3))  # kvledger's chained keys
    vllm_hashes = _described_store(events, keys, (11, 12, 13))
    window = b"w" * 32 + (1).to_bytes(4, "big")
    events.observe([fx.KeysLoadable(keys=(*keys, window), tier=0), fx.KeysLoadable(keys=keys[:2], tier=1)])
    stored = events.take()
    host = [e for e in stored if e.medium == "CPU" and e.group_idx == 0]
    assert [e.block_hashes for e in host] == [[maybe_convert_block_hash(h)] for h in vllm_hashes]
    assert [e.parent_block_hash for e in host] == [None, *map(maybe_convert_block_hash, vllm_hashes[:2])]
    assert [e.token_ids for e in host] == [list(range(0, 32)), list(range(32, 64)), list(range(64, 96))]
    assert {e.locality for e in host} == {"LOCAL"}
    (plain,) = [e for e in stored if e.group_idx == 1]  # a sliding-window block keeps the plain form
    assert plain.token_ids == [] and plain.block_hashes == [maybe_convert_block_hash(b"w" * 32)]
    below = [e for e in stored if e.medium == "STORAGE"]
    assert [e.block_hashes for e in below] == [[maybe_convert_block_hash(h)] for h in vllm_hashes[:2]]
    assert {e.locality for e in below} == {"REMOTE"}
    # Removed under the same hashes, tier by tier; the payload kept while a tier announces it.
    events.observe([fx.KeysUnloadable(keys=keys, tier=0, reason=fx.Reason.EVICTED)])
    removed = events.take()
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(map(maybe_convert_block_hash, vllm_hashes))
    assert set(events._described) == set(keys[:2])
    events.observe([fx.KeysUnloadable(keys=keys[:2], tier=1, reason=fx.Reason.EVICTED)])
    assert [e.medium for e in events.take()] == ["STORAGE", "STORAGE"] and not events._described


def test_a_failed_store_leaves_no_payload_behind() -> None:
    events = TierEvents(SPECS, 0, self_describing=True, hash_block_size=32)
    keys = tuple(b"k%d" % i + b"\0" * 29 + (0).to_bytes(4, "big") for i in range(2))
    _described_store(events, keys, (11, 12))
    assert set(events._described) == set(keys)
    events.forget_unstored(keys)
    assert not events._described and events.take() == []


def test_without_self_describing_events_carry_kvledgers_keys() -> None:
    events = TierEvents(SPECS, 0, hash_block_size=32)
    keys = (b"k" * 32 + (0).to_bytes(4, "big"),)
    _described_store(events, keys, (11,))
    events.observe([fx.KeysLoadable(keys=keys, tier=0)])
    (event,) = events.take()
    assert event.block_hashes == [maybe_convert_block_hash(b"k" * 32)] and event.token_ids == []
    assert event.locality is None
