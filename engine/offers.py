"""vLLM's store threshold: a block is stored once enough requests have offered it.

A one-off prompt's blocks evict what many requests share. With
`store_threshold` N (vLLM's `kv_connector_extra_config` name), a block host
memory lacks is stored only when the Nth distinct request offers it (computes
it, or holds it in vLLM's prefix cache), as vLLM's `CPUOffloadingManager`
does. The offers are counted for the `max_tracker_size` most recently offered
keys; a new key forgets the least recently offered one, never one offered in
the same batch (`_record_accesses` in vLLM 0.33). The keys not stored for it
are announced (`KeysBelowThreshold`), so metrics and `explain` name them.

Distinct requests, where vLLM counts offers: a request whose store waited for
host slots offers the same blocks again in a later step, and that is not a
second request wanting them.
"""

from __future__ import annotations

from . import effects as fx
from .state import Core


def offered(core: Core, request_id: str, cand_groups: list[int], cand_blocks: list[int], cand_keys: list[bytes],
            start: int, out: list[fx.Effect]) -> None:
    """Count `request_id`'s offer of the candidates from `start` on, and drop
    from the columns those not yet offered by `store_threshold` requests."""
    tracker = core.offers
    if tracker is None or len(cand_keys) <= start:
        return
    threshold = core.config.store_threshold
    most = core.config.max_tracker_size
    counts = tracker.counts
    last = tracker.last
    offer = cand_keys[start:]
    # Known keys first, moved to the recent end: the forgetting below never reaches them.
    known: set[bytes] = set()
    for key in offer:
        count = counts.get(key)
        if count is not None and key not in known:
            known.add(key)
            if last.pop(key) != request_id:
                counts[key] = count + 1
            last[key] = request_id  # both in the same order, the recent end last
            counts.move_to_end(key)
    forgettable = len(counts) - len(known)
    for key in offer:
        if key in counts:
            continue
        if len(counts) >= most:
            if forgettable == 0:
                continue  # every tracked key is in this offer: this one goes uncounted
            old, _count = counts.popitem(last=False)
            del last[old]
            forgettable -= 1
        counts[key] = 1
        last[key] = request_id
    kept: list[int] = []
    below: list[bytes] = []
    for index in range(start, len(cand_keys)):
        key = cand_keys[index]
        if counts.get(key, 0) >= threshold:
            kept.append(index)
        else:
            below.append(key)
    if not below:
        return
    cand_groups[start:] = [cand_groups[i] for i in kept]
    cand_blocks[start:] = [cand_blocks[i] for i in kept]
    cand_keys[start:] = [cand_keys[i] for i in kept]
    out.append(fx.KeysBelowThreshold(request_id=request_id, keys=tuple(below)))
