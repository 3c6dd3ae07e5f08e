"""The effect runner: the only code that moves KV bytes.

Two machines under one runner: `copies/` moves blocks between vLLM's KV
caches and the host tier, `lower_tiers/` between host slots and the tiers
below host memory.

runner         effects in, completion events out (the worker's phases of `engine.effects.ROUTES`)
preconditions  what an effect must satisfy before any byte moves
assemble       the runner and all it drives, from what vLLM registers: one call for the adapter
copies/        vLLM's KV caches to the host tier and back: layouts, copy backends, fault injection
lower_tiers/   host slots to a file system or a Valkey store and back: block formats, tier I/O
"""
