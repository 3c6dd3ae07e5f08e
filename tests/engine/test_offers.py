"""vLLM's store threshold and prompt-only offloading, decided by the engine: a
block is stored once `store_threshold` distinct requests offered it, the
offers counted for the `max_tracker_size` most recently offered keys; under
`offload_prompt_only` no block of generated tokens is stored."""

from __future__ import annotations

import random

import pytest

from kvledger.adapters.testing.simulator import Simulator, run_random
from kvledger.engine import effects as fx
from kvledger.engine.admission import PAST_EVERY_HORIZON
from kvledger.events import types as ev
from kvledger.events.config import ConfigError, EngineConfig
from tests.engine.builders import Engine, chain, full_only_config, key, only

BLOCK = 32


def _engine(**config: object) -> Engine:
    return Engine(full_only_config(**config))


def _compute(engine: Engine, rid: str, blocks: tuple[int, ...], tag: str = "doc") -> tuple:
    """Request `rid` computes a prompt of len(blocks) whole blocks of text `tag`; the step's effects."""
    engine.add(rid, len(blocks) * BLOCK, tag=tag)
    engine.alloc(rid, blocks)
    return engine.step((rid, 0, len(blocks) * BLOCK))


def _stored(effects: tuple) -> list[bytes]:
    return [k for store in only(effects, fx.StartStore) for group in store.keys for k in group]


def test_a_block_is_stored_once_a_second_request_offers_it() -> None:
    engine = _engine(store_threshold=2)
    first = _compute(engine, "a", (1, 2, 3))
    keys = [key(h, 0) for h in chain(3, "doc")]
    assert _stored(first) == [] and only(first, fx.KeysBelowThreshold) == [
        fx.KeysBelowThreshold(request_id="a", keys=tuple(keys))]
    engine.finish("a")
    second = _compute(engine, "b", (4, 5, 6))
    assert _stored(second) == keys and not only(second, fx.KeysBelowThreshold)
    # A one-off prompt beside them is held back, and counted once.
    other = _compute(engine, "c", (7, 8), tag="once")
    assert _stored(other) == [] and len(only(other, fx.KeysBelowThreshold)[0].keys) == 2
    assert dict(engine.core.offers.counts) == {**dict.fromkeys(keys, 2),
                                               **dict.fromkeys([key(h, 0) for h in chain(2, "once")], 1)}


def test_the_same_request_offering_again_is_not_a_second_request() -> None:
    engine = _engine(store_threshold=2)
    _compute(engine, "a", (1, 2))
    engine.preempt("a")  # its blocks freed; resumed, it computes and offers them again
    engine.resume("a")
    engine.alloc("a", (3, 4))
    again = engine.step(("a", 0, 2 * BLOCK))
    assert _stored(again) == [] and list(engine.core.offers.counts.values()) == [1, 1]


def test_the_tracker_forgets_the_least_recently_offered_never_one_of_this_offer() -> None:
    engine = _engine(store_threshold=2, max_tracker_size=3)
    _compute(engine, "a", (1, 2), tag="old")
    _compute(engine, "b", (3,), tag="mid")
    mid = key(chain(1, "mid")[0], 0)
    _compute(engine, "c", (4,), tag="old")  # offers old's first block again: old's first, then mid, most recent
    old = [key(h, 0) for h in chain(2, "old")]
    assert list(engine.core.offers.counts) == [old[1], mid, old[0]]
    _compute(engine, "d", (5, 6, 7, 8), tag="new")  # four new keys: the tracker holds three of the offer
    counts = engine.core.offers.counts
    assert len(counts) == 3 and set(counts) <= {key(h, 0) for h in chain(4, "new")}
    assert old[0] not in counts and mid not in counts


def test_prompt_only_stores_no_block_of_generated_tokens() -> None:
    engine = _engine(offload_prompt_only=True)
    engine.add("a", 2 * BLOCK + 4, hashes=chain(2, "p"))
    engine.alloc("a", (1, 2, 3))
    prompt = engine.step(("a", 0, 2 * BLOCK + 4))
    assert _stored(prompt) == [key(h, 0) for h in chain(2, "p")]
    assert engine.core.requests["a"].next_store_tokens == PAST_EVERY_HORIZON
    decode = (chain(3, "p")[2],)  # its reply fills block 2
    engine.apply(ev.BlockHashesAppended(request_id="a", num_tokens=3 * BLOCK, block_hashes=decode))
    later = engine.step(("a", 2 * BLOCK + 4, BLOCK - 4))
    assert _stored(later) == []


def test_without_them_every_block_is_stored_as_before() -> None:
    engine = _engine()
    assert engine.core.offers is None
    engine.add("a", 2 * BLOCK + 4, hashes=chain(2, "p"))
    engine.alloc("a", (1, 2, 3))
    engine.step(("a", 0, 2 * BLOCK + 4))
    engine.apply(ev.BlockHashesAppended(request_id="a", num_tokens=3 * BLOCK, block_hashes=(chain(3, "p")[2],)))
    assert _stored(engine.step(("a", 2 * BLOCK + 4, BLOCK - 4))) == [key(chain(3, "p")[2], 0)]


@pytest.mark.parametrize("seed", range(3))
def test_a_workload_under_a_threshold_stores_less_and_restores_right(seed: int) -> None:
    """The simulator checks every block a forward reads, restored ones included."""
    stores = []
    for threshold in (1, 3):
        config = full_only_config(store_threshold=threshold, max_tracker_size=8, num_tier_slots=12)
        sim = Simulator(config, check_every_event=True)
        run_random(sim, random.Random(seed), steps=100, arrivals=0.7, fail_rate=0.0, check_every=1)
        stores.append(sim.state.core.stats.keys_stored)
    assert stores[1] < stores[0]


def test_the_config_names_a_bad_threshold_or_tracker() -> None:
    with pytest.raises(ConfigError, match="store_threshold must be a positive int"):
        full_only_config(store_threshold=0)
    with pytest.raises(ConfigError, match="max_tracker_size must be a positive int"):
        full_only_config(max_tracker_size=0)
    with pytest.raises(ConfigError, match="offload_prompt_only must be true or false"):
        full_only_config(offload_prompt_only=1)
    assert "store_threshold" not in full_only_config().to_dict()  # a log without them keeps its digests
    config = full_only_config(store_threshold=2, offload_prompt_only=True)
    assert EngineConfig.from_dict(config.to_dict()) == config


def test_a_log_under_a_threshold_replays_checked_and_from_its_snapshots(tmp_path) -> None:
    """The tracker is state: its digests check, and a replay that starts at a snapshot
    decides every later store as the run did."""
    from kvledger.adapters.cli.main import main
    from kvledger.adapters.engine_host import EngineHost
    from tests.engine.builders import SIMULATED_CONFIGS

    config = next(c for c in SIMULATED_CONFIGS if c.store_threshold > 1)
    assert config.store_threshold == 2 and config.offload_prompt_only
    path = tmp_path / "events.log"
    host = EngineHost(config, log_path=path, digest_interval=4, snapshot_interval_events=200)
    sim = Simulator(config, host=host)
    run_random(sim, random.Random(3), steps=200, arrivals=0.8, max_tokens=20, turn_rate=0.2)
    host.close()
    assert sim.state.core.stats.keys_stored > 0 and len(sim.state.core.offers.counts) == config.max_tracker_size
    assert main(["replay", str(path), "--check"]) == 0
    assert main(["inspect", str(path), "--at", str(sim.events - 5)]) == 0  # from the last snapshot before it
    assert main(["bisect", str(path)]) == 0
