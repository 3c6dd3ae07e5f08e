"""The tiers below host memory: blocks between host slots and a file system or a Valkey store.

tier_jobs     the runner's jobs on them (spills, promotions into host slots, removals) and `TierIO`
tier_io       what the tiers' I/O shares: jobs queued for I/O threads, blocks settled, outcomes polled
fs_tier       the file-system tier's I/O: block files on threads, and the scan of what a directory holds
valkey_tier   the Valkey tier's I/O: values in a shared store, in pipelined batches on threads
valkey_store  pipelined commands on a Valkey server or cluster, its replies not trusted
replica_tier  a tier as seen by a rank whose KV another rank writes: read-only
block_header  the header every stored block carries (namespace, key, checksums, seal), file or value
block_errors  why a stored block cannot be served, for every tier and format
block_file    one block as a file: the header padded to 4096 bytes, written aside and renamed
block_pack    a write job's small blocks as one file, each key's name a link to it
block_value   one block as a store's value: the header unpadded, under a namespaced key
block_seal    a tier's secret over a block: a keyed MAC, or AES-256-GCM encryption
"""
