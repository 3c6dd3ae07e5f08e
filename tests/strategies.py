"""Events for any test to reuse: one realistic example per kind, and Hypothesis
strategies for arbitrary valid events of every kind.

"Valid" means well-typed and encodable (ints fit in 64 bits), not meaningful
to the engine: ids need not refer to anything. `from tests.strategies import
events_strategy` works when pytest runs as `python -m pytest` from the root.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvledger.events import types as ev

_H = [bytes.fromhex(f"{i:02x}" * 32) for i in range(1, 5)]  # 32-byte block hashes, as sha256 gives

EXAMPLE_EVENTS: dict[str, ev.Event] = {
    e.kind: e  # type: ignore[union-attr]
    for e in (
        ev.RequestAdded(request_id="cmpl-7f3a-0", num_prompt_tokens=50, block_hashes=tuple(_H[:3])),
        ev.BlockHashesAppended(request_id="cmpl-7f3a-0", num_tokens=64, block_hashes=(_H[3],)),
        ev.BlocksTouched(request_id="cmpl-7f3a-0", block_ids=((11, 12), (0, 12))),
        ev.BlocksAllocated(request_id="cmpl-7f3a-0", block_ids=((13, 14), (13, 14)), num_external_tokens=16),
        ev.BlocksFreed(request_id="cmpl-7f3a-0", block_ids=((), (12,))),
        ev.BlocksNearEviction(block_ids=(7, 3, 12)),
        ev.RequestPreempted(request_id="cmpl-7f3a-0"),
        ev.RequestResumed(request_id="cmpl-7f3a-0"),
        ev.RequestFinished(request_id="cmpl-7f3a-0", block_ids=((11, 12, 13, 14), (0, 0, 13, 14))),
        ev.RequestAborted(request_id="cmpl-91c2-0"),
        ev.StepScheduled(
            step_index=7,
            request_ids=("cmpl-7f3a-0", "cmpl-91c2-0", "cmpl-b004-0"),
            num_computed_tokens=(48, 0, 1031),
            num_scheduled_tokens=(1, 512, 1),
        ),
        ev.StoreCompleted(job_id=41, worker_index=1),
        ev.StoreFailed(job_id=42, worker_index=0, keys=(_H[1],)),
        ev.LoadCompleted(job_id=43),
        ev.LoadFailed(job_id=44, worker_index=3, block_ids=(13, 14), keys=(_H[0], _H[1])),
        ev.CacheReset(epoch=2),
        ev.TierKeysFound(tier=1, keys=(_H[2], _H[3])),
        ev.BlockHashesRewound(request_id="cmpl-7f3a-0", num_hashes=2),
        ev.TierLookupFailed(tier=1, request_id="cmpl-91c2-0", reason="timed_out"),
        ev.RestoreCostsMeasured(compute_ns_per_token=41_000, load_fixed_us=(30, 2_000), load_ns_per_block=(9_000, 350_000)),
        ev.RestoreBudgeted(request_id="cmpl-7f3a-0", offered_tokens=64, kept_tokens=32, load_us=180_000,
                           compute_us=40_000),
        ev.TierPressure(tier=1, drop_ppm=1_000_000, latency_ns_per_mib=12_000_000),
        ev.FirstGenerationHashes(request_id="cmpl-7f3a-0", first=0, block_hashes=(_H[0], _H[1])),
    )
}
assert set(EXAMPLE_EVENTS) == set(ev.KIND_TO_TYPE), "every event kind needs an example"

ints = st.integers(min_value=0, max_value=2**63 - 1)
small_ints = st.integers(min_value=0, max_value=1 << 20)
block_ids = st.integers(min_value=0, max_value=2**31 - 1)
request_ids = st.text(min_size=0, max_size=40)
hashes = st.binary(min_size=0, max_size=40)
hash_tuples = st.one_of(  # equal widths too, as real hashes have, so the packed binary form is exercised
    st.lists(hashes, max_size=6).map(tuple),
    st.integers(min_value=1, max_value=40).flatmap(
        lambda width: st.lists(st.binary(min_size=width, max_size=width), max_size=8).map(tuple)
    ),
)
block_tables = st.lists(st.lists(block_ids, max_size=8).map(tuple), max_size=3).map(tuple)


@st.composite
def _step_scheduled(draw: st.DrawFn) -> ev.StepScheduled:
    ids = draw(st.lists(request_ids, max_size=8))
    column = st.lists(small_ints, min_size=len(ids), max_size=len(ids)).map(tuple)
    return ev.StepScheduled(
        step_index=draw(small_ints),
        request_ids=tuple(ids),
        num_computed_tokens=draw(column),
        num_scheduled_tokens=draw(column),
    )


_BY_KIND: dict[str, st.SearchStrategy] = {
    "request_added": st.builds(
        ev.RequestAdded, request_id=request_ids, num_prompt_tokens=small_ints, block_hashes=hash_tuples
    ),
    "block_hashes_appended": st.builds(
        ev.BlockHashesAppended, request_id=request_ids, num_tokens=small_ints, block_hashes=hash_tuples
    ),
    "blocks_touched": st.builds(ev.BlocksTouched, request_id=request_ids, block_ids=block_tables),
    "blocks_allocated": st.builds(
        ev.BlocksAllocated, request_id=request_ids, block_ids=block_tables, num_external_tokens=small_ints
    ),
    "blocks_freed": st.builds(ev.BlocksFreed, request_id=request_ids, block_ids=block_tables),
    "blocks_near_eviction": st.builds(ev.BlocksNearEviction, block_ids=st.lists(small_ints, max_size=5)),
    "request_preempted": st.builds(ev.RequestPreempted, request_id=request_ids),
    "request_resumed": st.builds(ev.RequestResumed, request_id=request_ids),
    "request_finished": st.builds(ev.RequestFinished, request_id=request_ids, block_ids=block_tables),
    "request_aborted": st.builds(ev.RequestAborted, request_id=request_ids),
    "step_scheduled": _step_scheduled(),
    "store_completed": st.builds(ev.StoreCompleted, job_id=ints, worker_index=small_ints),
    "store_failed": st.builds(ev.StoreFailed, job_id=ints, worker_index=small_ints, keys=hash_tuples),
    "load_completed": st.builds(ev.LoadCompleted, job_id=ints, worker_index=small_ints),
    "load_failed": st.builds(
        ev.LoadFailed,
        job_id=ints,
        worker_index=small_ints,
        block_ids=st.lists(block_ids, max_size=6).map(tuple),
        keys=hash_tuples,
    ),
    "cache_reset": st.builds(ev.CacheReset, epoch=ints, forget_device=st.booleans(), rekeyed=st.booleans(),
                            keep_lower=st.booleans()),
    "tier_keys_found": st.builds(ev.TierKeysFound, tier=small_ints, keys=hash_tuples),
    "block_hashes_rewound": st.builds(ev.BlockHashesRewound, request_id=request_ids, num_hashes=small_ints),
    "tier_lookup_failed": st.builds(ev.TierLookupFailed, tier=small_ints, request_id=request_ids,
                                    reason=st.sampled_from(ev.LOOKUP_FAILURES)),
    "restore_costs_measured": st.builds(ev.RestoreCostsMeasured, compute_ns_per_token=ints,
                                        load_fixed_us=st.lists(ints, min_size=1, max_size=3).map(tuple),
                                        load_ns_per_block=st.lists(ints, min_size=1, max_size=3).map(tuple)),
    "restore_budgeted": st.builds(ev.RestoreBudgeted, request_id=request_ids, offered_tokens=ints, kept_tokens=ints,
                                  load_us=ints, compute_us=ints),
    "tier_pressure": st.builds(ev.TierPressure, tier=small_ints, drop_ppm=ints, latency_ns_per_mib=ints),
    "first_generation_hashes": st.builds(ev.FirstGenerationHashes, request_id=request_ids, first=small_ints,
                                         block_hashes=hash_tuples),
}
assert set(_BY_KIND) == set(ev.KIND_TO_TYPE), "every event kind needs a strategy"


def event_strategy(kind: str) -> st.SearchStrategy:
    """Arbitrary valid events of one kind."""
    return _BY_KIND[kind]


def events_strategy(kinds: tuple[str, ...] | None = None) -> st.SearchStrategy:
    """Arbitrary valid events of every kind (or of `kinds`)."""
    return st.one_of([_BY_KIND[k] for k in (kinds or tuple(_BY_KIND))])
