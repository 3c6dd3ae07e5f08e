"""The pure core: `reduce(state, event) -> (state, effects)`. No torch, vLLM, clock,
randomness, logging or I/O (tests/test_layering.py). Compiled with mypyc at install,
all but `replay`, with the log tools' miss ledger (`_build.py`).

state        the block-state model: device blocks per group, tier slots and keys, requests, jobs
reducer      every transition: one handler per event kind
transitions  every legal state move, as data: request, slot, lower-tier key and job moves
checks       the protocol checks, each one's fast path beside the path that names the problem
admission    what a step stores and what a hit loads, and the host slots each takes
offers       vLLM's store threshold: which blocks enough requests have offered to store
slots        a tier slot's life, as `SLOT_MOVES` says
lower        the tiers below host memory: what each holds, spills, promotions
lookup       the tier-hit query behind `get_num_new_matched_tokens`
budget       load or recompute, by the clock: the hit's end that saves the most time
planner      a scheduler step's events, decided from what vLLM exposes
hma          which blocks each KV group needs (full attention, sliding window, mamba)
policies     eviction orders: LRU and ARC
key_order    a dict's key order that churn never rebuilds whole (a lower tier's)
effects      what the engine asks the outside world to do, and where each is done (`ROUTES`)
construct    the per-step events and effects, built without attrs' `__init__`
queries      what the world outside engine/ may ask of the state
invariants   the correctness contract as checks over the state
digest       a stable fingerprint of the state, whole or in parts
snapshot     the whole state as plain data, and back
replay       a fold of `reduce` over a log, with the checks that make it a debugger
fold         replay's loop over the events between two digest records, compiled
"""
