"""A streaming session's rewound hashes (`block_hashes_rewound`).

vLLM drops a session's last sampled token when its next input arrives, and
computes the hashes of the block that token was in again. A block keyed by the
dropped hash must never be stored under it once it holds the new tokens.
"""

from __future__ import annotations

from kvledger.engine.effects import StartStore
from kvledger.events import types as ev

from .builders import Engine, chain, full_only_config, key, only

OLD = chain(4, "old")
NEW = chain(4, "new")  # the rewound session's hashes from index 2 on


def stored_keys(effects: tuple) -> list[bytes]:
    return [k for store in only(effects, StartStore) for group in store.keys for k in group]


def test_the_block_after_a_rewind_is_stored_under_its_new_key_not_the_dropped_one() -> None:
    e = Engine(full_only_config())
    e.add("s", 128, OLD)  # 4 blocks of 32 tokens, hashes known for all four
    e.alloc("s", (1, 2, 3, 4))
    assert stored_keys(e.step(("s", 0, 64))) == [key(OLD[0], 0), key(OLD[1], 0)]
    e.apply(ev.BlockHashesRewound(request_id="s", num_hashes=2))
    assert e.core.requests["s"].hashes == list(OLD[:2])
    assert e.core.requests["s"].keys == [[key(OLD[0], 0), key(OLD[1], 0)]]
    e.apply(ev.BlockHashesAppended(request_id="s", num_tokens=128, block_hashes=NEW[2:]))
    stored = stored_keys(e.step(("s", 64, 64)))
    assert stored == [key(NEW[2], 0), key(NEW[3], 0)]
    assert not {key(OLD[2], 0), key(OLD[3], 0)} & set(e.core.slot_of_key)


def test_a_rewind_keeps_what_was_stored_and_no_block_is_stored_twice() -> None:
    e = Engine(full_only_config())
    e.add("s", 128, OLD)
    e.alloc("s", (1, 2, 3, 4))
    e.step(("s", 0, 128))
    e.finish_all_jobs()
    e.apply(ev.BlockHashesRewound(request_id="s", num_hashes=3))
    e.apply(ev.BlockHashesAppended(request_id="s", num_tokens=128, block_hashes=NEW[3:]))
    e.alloc("s", (5,))
    assert stored_keys(e.step(("s", 127, 2))) == []  # position 3 was considered once already
    assert e.core.block_key[4] is None  # its content is no longer known by that key
    assert key(OLD[3], 0) in e.core.slot_of_key  # what was stored from the old tokens stays


def test_a_lazy_key_at_a_dropped_position_is_forgotten() -> None:
    e = Engine(full_only_config(store_mode="lazy"))
    e.add("s", 128, OLD)
    e.alloc("s", (1, 2, 3, 4))
    e.step(("s", 0, 128))
    assert set(e.core.lazy_keys) == {1, 2, 3, 4}
    e.apply(ev.BlockHashesRewound(request_id="s", num_hashes=2))
    assert e.core.lazy_keys == {1: key(OLD[0], 0), 2: key(OLD[1], 0)}


def test_a_rewind_cannot_add_hashes_or_name_an_unknown_request() -> None:
    e = Engine(full_only_config())
    e.add("s", 128, OLD[:2])
    assert e.reject(ev.BlockHashesRewound(request_id="s", num_hashes=3)) == "rewind_past_end"
    assert e.reject(ev.BlockHashesRewound(request_id="nobody", num_hashes=0)) == "illegal_request_event"


def test_a_digest_after_a_rewind_to_the_same_length_or_a_rekeying_reset_sees_the_new_hashes() -> None:
    """The digest keeps a request's hashes' text between digests: a rewind then an append back
    to the same length, and a reset that drops every request's hashes, must each be seen."""
    from kvledger.engine.digest import digest

    e = Engine(full_only_config())
    e.add("s", 128, OLD)
    request = e.core.requests["s"]
    before = digest(e.state)  # the text of OLD's hashes is kept now
    e.apply(ev.BlockHashesRewound(request_id="s", num_hashes=2))
    request = e.core.requests["s"]
    assert request.canonical_repr() == repr(request.canonical())  # two hashes now, not four
    e.apply(ev.BlockHashesAppended(request_id="s", num_tokens=128, block_hashes=NEW[2:]))
    request = e.core.requests["s"]
    assert len(request.hashes) == len(OLD) and request.canonical_repr() == repr(request.canonical())
    assert digest(e.state) != before
    e.apply(ev.CacheReset(epoch=1, rekeyed=True))
    request = e.core.requests["s"]
    assert request.hashes == [] and request.canonical_repr() == repr(request.canonical())
