"""Per-group block needs and offload keys (engine/hma.py)."""

from __future__ import annotations

import pytest

from kvledger.engine import hma
from kvledger.events.config import GroupSpec
from tests.engine.builders import chain, make_config

H = chain(6, "h")


def group(kind: str, block_size: int, window: int = 0, group_id: int = 0) -> GroupSpec:
    return GroupSpec(group_id=group_id, kind=kind, block_size=block_size, window=window)


# Keys


def test_group_suffix_is_four_big_endian_bytes():
    assert hma.group_suffix(0) == b"\x00\x00\x00\x00"
    assert hma.group_suffix(1) == b"\x00\x00\x00\x01"
    assert hma.group_suffix(258) == b"\x00\x00\x01\x02"


def test_keys_at_hash_granularity_are_the_hash_plus_the_group():
    keys: list[bytes] = []
    hma.append_keys(keys, list(H[:3]), 1, hma.group_suffix(2))  # 16-token blocks, 16-token hashes
    assert keys == [h + b"\x00\x00\x00\x02" for h in H[:3]]
    assert all(len(k) == 36 for k in keys)


def test_a_block_of_two_hash_blocks_is_keyed_by_its_last_hash():
    # vLLM: key[i] = hashes[(i + 1) * (T // H) - 1] + group id.
    keys: list[bytes] = []
    hma.append_keys(keys, list(H[:5]), 2, hma.group_suffix(1))  # 32-token blocks, 16-token hashes
    assert keys == [H[1] + b"\x00\x00\x00\x01", H[3] + b"\x00\x00\x00\x01"]  # H[4] half-fills block 2


def test_append_keys_appends_only_newly_completed_blocks():
    keys: list[bytes] = []
    hma.append_keys(keys, list(H[:3]), 2, hma.group_suffix(3))
    first = list(keys)
    hma.append_keys(keys, list(H[:6]), 2, hma.group_suffix(3))
    assert keys[:1] == first
    assert keys == [H[i] + b"\x00\x00\x00\x03" for i in (1, 3, 5)]


# Which blocks a hit must supply


@pytest.mark.parametrize("kind, block_size, window, expected", [
    ("full", 32, 0, 0),
    ("sliding", 32, 64, 2),  # cdiv(63, 32)
    ("sliding", 32, 65, 2),  # cdiv(64, 32)
    ("sliding", 32, 66, 3),
    ("sliding", 32, 1, 1),  # at least the block the hit ends in
    ("sliding", 16, 4096, 256),
    ("mamba", 64, 0, 1),
])
def test_window_blocks(kind, block_size, window, expected):
    assert hma.window_blocks(group(kind, block_size, window)) == expected


@pytest.mark.parametrize("kind, window, start, end, expected", [
    ("full", 0, 0, 160, range(0, 5)),
    ("full", 0, 64, 160, range(2, 5)),
    ("sliding", 64, 0, 160, range(3, 5)),
    ("sliding", 64, 128, 160, range(4, 5)),
    ("sliding", 64, 0, 32, range(0, 1)),
    ("mamba", 0, 0, 160, range(4, 5)),
    ("mamba", 0, 160, 160, range(5, 5)),
])
def test_needed_range(kind, window, start, end, expected):
    assert hma.needed_range(group(kind, 32, window), start, end) == expected


# Which blocks are worth storing


def reachable(g: GroupSpec, alignment: int, count: int = 8) -> list[int]:
    return [i for i in range(count) if hma.is_reachable(g, i, alignment)]


def test_every_full_attention_block_is_reachable():
    assert reachable(group("full", 32), 128) == list(range(8))


def test_a_sliding_block_is_reachable_when_its_boundary_window_holds_it():
    # Window 64 = two blocks: with boundaries every block, every block is in a window.
    assert reachable(group("sliding", 32, 64), 32) == list(range(8))
    # Window 33 needs one block; with 64-token boundaries only each second block ends on one.
    assert reachable(group("sliding", 32, 33), 64) == [1, 3, 5, 7]
    # Window 64 with 128-token boundaries: the last two blocks of each 4.
    assert reachable(group("sliding", 32, 64), 128) == [2, 3, 6, 7]
    # A window wider than the boundary spacing reaches everything.
    assert reachable(group("sliding", 32, 200), 64) == list(range(8))


def test_a_mamba_block_is_reachable_only_when_it_ends_on_a_boundary():
    assert reachable(group("mamba", 64), 64) == list(range(8))
    assert reachable(group("mamba", 32), 64) == [1, 3, 5, 7]
    assert reachable(group("mamba", 32), 96) == [2, 5]


@pytest.mark.parametrize("kind, window", [("sliding", 64), ("sliding", 33), ("mamba", 0)])
@pytest.mark.parametrize("alignment", [32, 64, 96, 128])
def test_reachable_blocks_are_exactly_those_some_boundary_needs(kind, window, alignment):
    g = group(kind, 32, window)
    needed = set()
    for boundary in range(alignment, 32 * 12 + 1, alignment):
        needed.update(hma.needed_range(g, 0, boundary))
    assert set(reachable(g, alignment, 12)) == needed


def test_alignment_is_the_lcm_of_group_blocks():
    config = make_config(groups=(group("full", 32), group("mamba", 64, group_id=1)))
    assert config.alignment_tokens == 64


@pytest.mark.parametrize("kind, window", [("full", 0), ("sliding", 64), ("sliding", 33), ("sliding", 200),
                                          ("mamba", 0)])
@pytest.mark.parametrize("alignment", [32, 64, 96, 128])
def test_the_reach_pattern_is_is_reachable_as_a_table(kind, window, alignment):
    g = group(kind, 32, window)
    pattern = hma.reach_pattern(g, alignment)
    for index in range(40):
        expected = hma.is_reachable(g, index, alignment)
        assert (True if pattern is None else pattern[index % len(pattern)]) == expected, index
    assert (pattern is None) == all(hma.is_reachable(g, i, alignment) for i in range(40))
