"""Load or recompute, by the clock (`restore_budget: "auto"`).

A hit is worth loading only where loading it is faster than computing it: a
short prefix on a busy disk or a far Valkey can take longer to read than to
prefill. The measured costs (`RestoreCostsMeasured`, in the state) price a
load of n blocks whose deepest source is tier t at `fixed_us[t] + n *
per_block_ns[t]`, and a computed token at `compute_ns`. Of the hit's aligned
ends, the one that saves the most time is kept (the local hit itself, when
none saves any): a prefix from host memory is kept while the tail a slow tier
would add is computed, and a hit whose fixed cost alone outweighs its
tokens is computed whole.
"""

from __future__ import annotations

from kvledger.events.config import GroupKind

from . import hma, lower
from .state import Core, RequestState


def budget_end(core: Core, request: RequestState, start: int, end: int) -> tuple[int, int, int]:
    """The hit's end that saves the most time, and the estimates (us) of what is cut
    beyond it: loading [kept, end) against computing it. `start`: the local hit."""
    costs = core.restore_costs
    assert costs is not None
    compute_ns, fixed_us, per_block_ns = costs
    alignment = core.alignment
    slot_of_key = core.slot_of_key

    def tier_of(key: bytes) -> int:
        """The tier a load reads the key from; -1 where none holds it."""
        return 0 if key in slot_of_key else lower.holder(core, key) or -1

    full = [g for g in core.groups if g.kind is GroupKind.FULL]
    windows = [g for g in core.groups if g.kind is not GroupKind.FULL]
    # Full-attention blocks grow with the end: counted once each, as the end moves on.
    counted = [start // g.block_size for g in full]
    full_blocks = 0
    full_deepest = 0
    best_end, best_saved = start, 0
    load_at: dict[int, int] = {start: 0}  # end -> the load's estimate (ns)
    for stop in range(start + alignment, end + 1, alignment):
        for index, group in enumerate(full):
            keys = request.keys[group.group_id]
            for position in range(counted[index], stop // group.block_size):
                full_blocks += 1
                full_deepest = max(full_deepest, tier_of(keys[position]))
            counted[index] = stop // group.block_size
        blocks, deepest, served = full_blocks, full_deepest, True
        for group in windows:
            keys = request.keys[group.group_id]
            for position in hma.needed_range(group, start, stop):
                tier = tier_of(keys[position]) if position < len(keys) else -1
                served = served and tier >= 0
                blocks += 1
                deepest = max(deepest, tier)
        if not served:  # a window group cannot end a hit here: not a choice
            continue
        load_ns = fixed_us[deepest] * 1000 + per_block_ns[deepest] * blocks
        load_at[stop] = load_ns
        saved = compute_ns * (stop - start) - load_ns  # the lookup's own end is always served
        if saved > best_saved:
            best_end, best_saved = stop, saved
    return best_end, (load_at[end] - load_at[best_end]) // 1000, compute_ns * (end - best_end) // 1000
