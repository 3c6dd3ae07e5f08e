"""Which blocks each KV group needs, per hybrid-model (HMA) rules.

A hit that ends at token boundary `e` must give every group what its layers
read when computing from `e`:
- full attention reads every block before `e`;
- sliding window (W tokens) reads only the last W-1 tokens, so
  `cdiv(W - 1, block_size)` blocks (vLLM's `sliding_window_contiguous_blocks`);
- mamba reads only the state at `e`, held by the block that ends there.

Keys follow vLLM (reference §6): block `i` of group `g` is keyed by the chain
hash at the block's last hash boundary, followed by `g` as 4 big-endian bytes.
"""

from __future__ import annotations

from kvledger.events.config import EngineConfig, GroupKind, GroupSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_suffix(group_id: int) -> bytes:
    return group_id.to_bytes(4, "big")


def key_rules(config: EngineConfig) -> tuple[tuple[int, bytes], ...]:
    """Per group: (hashes per block, key suffix), how `append_keys` derives its keys."""
    return tuple((g.block_size // config.hash_block_size, group_suffix(g.group_id)) for g in config.groups)


def append_keys(keys: list[bytes], hashes: list[bytes], per_block: int, suffix: bytes) -> None:
    """Append the keys of every block whose last hash is now known: a block
    spans `per_block` hashes (block size over hash block size), and `suffix`
    is its group's (`group_suffix`)."""
    for position in range((len(keys) + 1) * per_block - 1, len(hashes), per_block):
        keys.append(hashes[position] + suffix)  # a typed loop: cheaper than map(add) when compiled


def window_blocks(group: GroupSpec) -> int:
    """Blocks a hit must supply before its end; 0 means all of them."""
    if group.kind is GroupKind.SLIDING:
        return max(1, cdiv(group.window - 1, group.block_size))
    if group.kind is GroupKind.MAMBA:
        return 1
    return 0


def needed_range(group: GroupSpec, start_tokens: int, end_tokens: int) -> range:
    """Block positions to load so that `group` can compute from `end_tokens`,
    given that blocks before `start_tokens` are already on the device."""
    first = start_tokens // group.block_size
    end = end_tokens // group.block_size
    span = window_blocks(group)
    if span:
        first = max(first, end - span)
    return range(first, end)


def is_reachable(group: GroupSpec, index: int, alignment_tokens: int) -> bool:
    """Whether block `index` can ever be part of a hit, so is worth storing.

    Hits end on `alignment_tokens` boundaries. A sliding block is useful only
    if it falls in the window before some boundary; a mamba block only if it
    ends on one.
    """
    if group.kind is GroupKind.FULL:
        return True
    block_end = (index + 1) * group.block_size
    if group.kind is GroupKind.MAMBA:
        return block_end % alignment_tokens == 0
    boundary_blocks = cdiv(block_end, alignment_tokens) * alignment_tokens // group.block_size
    return boundary_blocks - window_blocks(group) <= index


def reach_pattern(group: GroupSpec, alignment_tokens: int) -> tuple[bool, ...] | None:
    """`is_reachable` as a table: block `i` is reachable iff `pattern[i % len(pattern)]`,
    or always where None (full attention, and windows that span every boundary gap).

    The rule repeats every `alignment_tokens // block_size` blocks (the alignment
    is a multiple of every group's block size), so one period decides it.
    """
    period = alignment_tokens // group.block_size
    pattern = tuple(is_reachable(group, index, alignment_tokens) for index in range(period))
    return None if all(pattern) else pattern

