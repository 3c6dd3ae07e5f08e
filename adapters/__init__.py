"""Where the engine meets the outside world; only this folder imports vLLM (in `vllm/`).

vllm/            the vLLM KV connector: scheduler and worker halves, metrics, KV events, the tiers' wiring
cli/             the `kvledger` command
testing/         stand-ins for vLLM shipped for `simulate` and `demo` (never imported by the connector)
settings         `kv_connector_extra_config`, checked once at start (the tiers' own: transfers/lower_tiers/)
key_lookups      which keys a shared tier holds, asked off the scheduler's thread
engine_host      runs the engine and records its inputs: a live system's one way to state and log
log_files        event logs on disk: reading either form, writing step by step
log_seek         reading a binary log from a snapshot
log_rules        the decision rules of a kvledger 0.1.0 log, shown by its records
log_tools/       the log tools: explain's misses, whatif, the fleet, the report's series (engine and events only)
backpressure     vLLM 0.33's backpressure: a lower tier's writes measured, the share of spills to drop
miss_counter     missed prompt tokens by cause, counted while serving
restore_costs    what a load and a prefill cost here, measured, for `restore_budget: "auto"`
structlog_setup  structlog, configured once for every kvledger process
vllm_version     the vLLM releases kvledger follows, and what to say about the installed one
"""
