"""The tiers below host memory: blocks between host slots and a file system or a Valkey store.
Each tier type is a package of its own (its settings, start-up checks, row, I/O and stored
format); what every type shares is a small module named for its job.

fs/            the file-system tier: block files in a directory
valkey/        the Valkey tier: values in a server or cluster replicas share
tier_types     the table of tier types: the one parser of `secondary_tiers`, the start-up checks, the sizing rule
contract       what a tier type is to kvledger: its row (`TierType`), lookups, a worker's site
tier_settings  what every type's settings share: the deployment secret, the checks of a value
health         whether a tier's server is up: a circuit breaker its I/O and lookups share
tier_jobs      the runner's jobs on the tiers (spills, promotions into host slots, removals) and `TierIO`
tier_io        what the tiers' I/O shares: jobs queued for I/O threads, blocks settled, outcomes polled
replica_tier   a tier as seen by a rank whose KV another rank writes: read-only
slowed_tier    a tier whose reads start late on purpose (`tier_read_delay_s`), for benchmarks and tests
block_header   the header every stored block carries (namespace, key, checksums, seal), file or value
block_errors   why a stored block cannot be served, for every tier and format
block_seal     a tier's secret over a block: a keyed MAC, or AES-256-GCM encryption
"""
