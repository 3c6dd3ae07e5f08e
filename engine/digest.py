"""A stable fingerprint of the state, for replay to name the first divergence.

It hashes a canonical encoding: tables in id order, maps sorted by key, the
policy in its eviction order. Nothing depends on `PYTHONHASHSEED`, on dict
iteration order or on object identity, so two processes that applied the
same events agree.
"""

from __future__ import annotations

import hashlib
from array import array

from .state import State


def digest(state: State) -> str:
    core = state.core
    h = hashlib.blake2b(digest_size=16)

    def put(value: object) -> None:
        h.update(repr(value).encode())
        h.update(b"\x1f")

    put(sorted(core.config.to_dict().items()))
    put((core.step_index, core.epoch, core.next_job_id, core.next_fresh_slot))
    for column in (core.block_refs, core.block_pins, core.block_generation, core.block_group):
        h.update(array("q", column).tobytes())
    h.update(b"".join(k or b"\x00" for k in core.block_key))
    put(sorted(core.block_writer.items()))
    put(sorted((b, sorted(j)) for b, j in core.block_readers.items()))
    if core.lazy_keys:  # empty in eager mode: eager logs keep their digests
        put(sorted(core.lazy_keys.items()))
    used = core.next_fresh_slot
    h.update(bytes(core.slot_state[:used]))
    h.update(b"".join(k or b"\x00" for k in core.slot_key[:used]))
    put(sorted(core.slot_of_key.values()))  # the keys are in slot_key; which slots are indexed
    put(sorted(core.slot_loads.items()))
    put(tuple(core.free_slots))  # a stack: its order decides the next slot
    put(core.policy.canonical())
    for rid in sorted(core.requests):
        put(core.requests[rid].canonical())
    for jid in sorted(core.jobs):
        put(core.jobs[jid].canonical())
    put(sorted(core.stats.as_dict().items()))
    return h.hexdigest()
