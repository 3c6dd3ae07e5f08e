"""A stable fingerprint of the state, for replay to name the first divergence.

It hashes a canonical encoding: tables in id order, maps sorted by key, the
policy in its eviction order. Nothing depends on `PYTHONHASHSEED`, on dict
iteration order or on object identity, so two processes that applied the
same events agree.

A live engine host cannot afford `digest` on a large state: 100k device blocks
and 1M tier slots take about 100 ms, a stall of the scheduler's step. So it
records part digests (`"part/parts:hex"`): the small tables (counters, jobs,
transfers in flight, stats) whole, and one `parts`-th of each large one
(the block and slot columns, the free-slot stack, the policy's orders, the
requests), each part taken in turn. Every table is covered once per
`parts` digests, and each digest costs about 1/`parts` of a full one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from itertools import islice
from operator import eq
from typing import Any, cast

from kvledger.events.config import EngineConfig
from kvledger.events.log_records import join_digest, split_digest

from .state import Core, State, reader_ids

PART_ROWS = 8192
"""Rows of the largest table (device blocks or tier slots) per part: about
1.7 ms per part digest at 100k blocks and 1M slots (123 parts; a full digest
takes 100-150 ms there)."""


def _hasher() -> tuple[Any, Callable[[object], None], Callable[[str], None]]:
    """A blake2b, `put`, which hashes a value's repr with a separator, and `put_text`, which
    hashes a repr already made (a request's `canonical_repr()`) the same way."""
    h = hashlib.blake2b(digest_size=16)

    def put_text(text: str) -> None:
        h.update(text.encode())
        h.update(b"\x1f")

    def put(value: object) -> None:
        put_text(repr(value))

    return h, put, put_text


def digest(state: State) -> str:
    core = state.core
    h, put, put_text = _hasher()
    # Not the rules: a log names them in its header, and logs written before
    # they were named (kvledger 0.1.0) were digested without them.
    put(sorted(item for item in core.config.to_dict().items() if item[0] != "rules"))
    put((core.step_index, core.epoch, core.next_job_id, core.next_fresh_slot))
    for column in (core.block_refs, core.block_pins, core.block_generation, core.block_group):
        h.update(array("q", column).tobytes())
    h.update(_joined(core.block_key))
    put(sorted(core.block_writer.items()))
    put(_readers(core))
    if core.lazy_keys:  # empty in eager mode: eager logs keep their digests
        put(sorted(core.lazy_keys.items()))
    used = core.next_fresh_slot
    h.update(bytes(core.slot_state[:used]))
    h.update(_joined(core.slot_key[:used]))
    put(sorted(core.slot_of_key.values()))  # the keys are in slot_key; which slots are indexed
    put(sorted(core.slot_loads.items()))
    put(tuple(core.free_slots))  # a stack: its order decides the next slot
    put_text(_policy_text(core, core.policy.canonical()))
    for rid in sorted(core.requests):
        put_text(core.requests[rid].canonical_repr())
    for jid in sorted(core.jobs):
        put(core.jobs[jid].canonical())
    put(sorted(core.stats.as_dict().items()))
    if core.lower:  # only with lower tiers: logs without them keep their digests
        put([tier.canonical() for tier in core.lower])
        put(sorted(core.spill_reads.items()))
    if core.offers is not None:  # only under a store threshold, likewise
        put(core.offers.canonical())
    if core.restore_costs is not None:  # only once measured (restore_budget "auto"), likewise
        put(core.restore_costs)
    if core.pressure is not None:  # only once a tier was under pressure, likewise
        put(core.pressure)
    return h.hexdigest()


def parts_for(config: EngineConfig) -> int:
    """How many parts a live engine splits its digests into."""
    rows = max(config.num_device_blocks, config.num_tier_slots)
    return max(1, -(-rows // PART_ROWS))


def part_digest(state: State, part: int, parts: int) -> str:
    """The digest of part `part` of `parts`, as a record holds it: `"part/parts:hex"`."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts}")
    core = state.core
    h, put, put_text = _hasher()
    # Whole: the scalars, what is in flight, and the sizes of what is cut.
    put((core.step_index, core.epoch, core.next_job_id, core.next_fresh_slot, part, parts))
    put((len(core.slot_of_key), len(core.free_slots), len(core.requests), len(core.lazy_keys)))
    put(sorted(core.block_writer.items()))
    put(_readers(core))
    put(sorted(core.slot_loads.items()))
    for jid in sorted(core.jobs):
        put(core.jobs[jid].canonical())
    put(sorted(core.stats.as_dict().items()))
    if core.lower:
        put(sorted(core.spill_reads.items()))
        for tier in core.lower:
            put((tier.name, tier.capacity, len(tier.held), sorted(tier.writing.items()),
                 sorted(tier.reading.items()), sorted(tier.counts.items())))
            lo, hi = _bounds(len(tier.held), part, parts)
            put(tuple(islice(tier.held, lo, hi)))
    # Cut: the part-th slice of each large table.
    lo, hi = _bounds(core.config.num_device_blocks, part, parts)
    for column in (core.block_refs, core.block_pins, core.block_generation, core.block_group):
        h.update(array("q", column[lo:hi]).tobytes())
    h.update(_joined(core.block_key[lo:hi]))
    if core.lazy_keys:
        put(list(map(core.lazy_keys.get, range(lo, hi))))
    lo, hi = _bounds(core.next_fresh_slot, part, parts)  # slots past it were never used: free, no key
    keys = core.slot_key[lo:hi]
    h.update(bytes(core.slot_state[lo:hi]))
    h.update(_joined(keys))
    # Which of these slots the index points at (with the index's size above).
    # An unused slot's key is None, which the index simply lacks.
    index_of = cast("Callable[[bytes | None], int | None]", core.slot_of_key.get)
    h.update(bytes(map(eq, map(index_of, keys), range(lo, hi))))
    lo, hi = _bounds(len(core.free_slots), part, parts)
    h.update(array("q", core.free_slots[lo:hi]).tobytes())
    put_text(_policy_text(core, core.policy.canonical_part(part, parts)))
    rids = sorted(core.requests)
    lo, hi = _bounds(len(rids), part, parts)
    for rid in islice(rids, lo, hi):
        put_text(core.requests[rid].canonical_repr())
    if core.restore_costs is not None:  # only once measured: other logs keep their digests
        put(core.restore_costs)
    if core.pressure is not None:  # likewise, once a tier was under pressure
        put(core.pressure)
    offers = core.offers
    if offers is not None:  # only under a store threshold: other logs keep their digests
        lo, hi = _bounds(len(offers.counts), part, parts)
        put((len(offers.counts), [(key, count, offers.last[key]) for key, count in islice(offers.counts.items(), lo, hi)]))
    return join_digest(part, parts, h.digest())


def _joined(keys: list[bytes | None]) -> bytes:
    """The keys end to end, an unused entry (None) as one zero byte: in one C-level
    join where none is unused, as in a full tier."""
    if None in keys or b"" in keys:
        return b"".join(k or b"\x00" for k in keys)
    return b"".join(cast("list[bytes]", keys))


KEY_TEXTS_MAX = 1 << 16
"""Keys whose repr `text_of` keeps (about 15 MB at most). The policy's order is most of a
digest's cost on a small tier, and from one digest to the next most of its keys are the
same; a tier whose order could outgrow this uses `repr` (`_policy_text`)."""

KEY_TEXTS_MIN = 1 << 10
"""The fewest keys a digest's memo holds before it forgets them: past four times what the
tier's order can hold (and this), the keys kept are mostly ones that left the order: kept
up to `KEY_TEXTS_MAX`, they grew a 64-slot tier's scheduler by about 0.2 MB a minute for
hours (3 MB over 18 minutes of a fleet replica's log: `bench/fleet_soak.py`)."""

_key_texts: dict[bytes, str] = {}


def _policy_text(core: Core, value: object) -> str:
    """The policy's canonical text: through `text_of` where every key its order can hold
    (ARC's ghosts too: twice the slots) fits among the kept texts. Past that the kept texts
    would be cleared before a key came round again: each would cost a miss (1.8x `repr`'s
    time at 8,192 keys, measured), so a large tier's digests, on the scheduler's thread,
    take `repr` as before."""
    most = 2 * core.config.num_tier_slots
    if most <= KEY_TEXTS_MAX:
        if len(_key_texts) > max(4 * most, KEY_TEXTS_MIN):
            _key_texts.clear()  # mostly keys that left the order: each still in it costs one repr again
        return text_of(value)
    return repr(value)


def text_of(value: object) -> str:
    """`repr(value)` for the policy's canonical tuples (tuples, strs, ints, bytes),
    with each key's repr made once: a memo, so the text is repr's whatever it holds
    (tests/engine/test_digest.py checks the two agree)."""
    if type(value) is bytes:
        return _key_text(value)
    if type(value) is tuple:
        if len(value) == 1:
            return "(" + text_of(value[0]) + ",)"
        try:  # an order whose every key's text is kept: one C-level pass (no str or int equals a key)
            return "(" + ", ".join(map(_key_texts.__getitem__, value)) + ")"
        except KeyError:
            return "(" + ", ".join([text_of(item) for item in value]) + ")"
    return repr(value)


def _key_text(key: bytes) -> str:
    text = _key_texts.get(key)
    if text is None:
        if len(_key_texts) >= KEY_TEXTS_MAX:
            _key_texts.clear()
        text = _key_texts[key] = repr(key)
    return text


def _readers(core: Core) -> list[tuple[int, list[int]]]:
    """Each read block and its readers, sorted: the same rows whether an entry
    holds one job id or a list."""
    return sorted((b, sorted(reader_ids(j))) for b, j in core.block_readers.items())


def _bounds(n: int, part: int, parts: int) -> tuple[int, int]:
    return n * part // parts, n * (part + 1) // parts


def matches(state: State, recorded: str) -> bool:
    """Whether `state` has the digest a record holds: a part digest (`"part/parts:hex"`),
    or a full one (logs of schema version 1). Raises ValueError for neither."""
    split = split_digest(recorded)
    if split is None:
        raise ValueError(f"malformed digest {recorded!r}: expected 'hex' or 'part/parts:hex' with part < parts")
    part, parts, _ = split
    if not parts:
        return digest(state) == recorded
    return part_digest(state, part, parts) == recorded
