"""The effect runner: the only code that moves KV bytes.

layout      canonical int8 view of vLLM's registered KV caches (seed #37853)
specs       the KV cache config fields the layout reads, without vLLM
host_tier   the pool of host-memory slots
block_copy  batched gather/scatter of block rows with torch ops
backend     the interface backends offer: submit, poll, wait, shutdown
cpu_backend worker threads, for vLLM-CPU's host-resident caches
cuda_backend streams and events, for GPU caches and a pinned tier
faults      fault and corruption injection around any backend
preconditions what an effect must satisfy before any byte moves
runner      effects in, completion events out
assemble    all of the above from what vLLM registers
"""
