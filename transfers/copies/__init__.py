"""Copies between vLLM's KV caches and the host tier.

kv_spec           the KV cache config fields the layout reads, without vLLM
layout            canonical int8 view of vLLM's registered KV caches (vLLM PR #37853)
host_tier         the pool of host-memory slots, checked, touched and pinned at start
host_register     pinning host memory in place (`cudaHostRegister` in bounded chunks)
backend           the interface every copy backend offers the runner: submit, poll, wait, shutdown
cpu_backend       worker threads, for vLLM-CPU's host-resident caches
block_copy        batched row copies between canonical views, the CPU backend's work
cuda_backend      streams and events, for GPU caches and a pinned tier
copy_descriptors  one (source, target, bytes) per block and span, for a batch copy
batch_copies      kvledger's own batch copy, for a CUDA worker that vLLM hands none
triton_copy       that batch copy as one Triton kernel per job
driver_copy       that batch copy as the CUDA driver's `cuMemcpyBatchAsync`
faults            fault and corruption injection around any backend
"""
