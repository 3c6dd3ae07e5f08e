"""kvledger as a vLLM KV connector.

vLLM loads it from
`{"kv_connector": "KVLedgerConnector", "kv_connector_module_path": "kvledger.adapters.vllm", ...}`.
Importing this package checks the installed vLLM first: the connector API
moves between minor releases, and a mismatch must fail at start, by name.

connector         `KVLedgerConnector`, the class vLLM instantiates: forwards each call to its half
scheduler_side    the scheduler half: vLLM's calls in, engine events out
hit_lookup        `get_num_new_matched_tokens`, and what it remembers between vLLM's calls
restore_timing    where a restore's time goes, on the scheduler's clock
worker_side       the worker half: runs the step's transfers
metadata          what crosses between the scheduler and the workers, per step
kv_cache_config   vLLM's KV cache config, translated once into kvledger's own types
block_pool        the scheduler's GPU block pool, as pin mode holds references on it
chain_keys        block keys that mean the same in every process
lower_tiers       the tiers below host memory as both roles see them, built from the settings
tier_namespace    the identity of the model and KV layout a persistent tier's blocks belong to
kv_events         KV cache events for the host tier and the tiers below it
metrics           connector metrics through vLLM's hooks
metric_deltas     what the scheduler reports each step: changes since the last report
store_timing      when the worker submits a step's stores, and what orders them
batch_copy        vLLM's batch copy, looked up here because only the adapter imports vLLM
"""

from kvledger.adapters.vllm_version import check_vllm_version

check_vllm_version()

from kvledger.adapters.vllm.connector import KVLedgerConnector  # noqa: E402

__all__ = ["KVLedgerConnector"]
