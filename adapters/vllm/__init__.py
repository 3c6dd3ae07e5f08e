"""kvledger as a vLLM KV connector.

vLLM loads it from
`{"kv_connector": "KVLedgerConnector", "kv_connector_module_path": "kvledger.adapters.vllm", ...}`.
Importing this package checks the installed vLLM first: the connector API
moves between minor releases, and a mismatch must fail at start, by name.
"""

from kvledger.adapters.vllm_version import check_vllm_version

check_vllm_version()

from kvledger.adapters.vllm.connector import KVLedgerConnector  # noqa: E402

__all__ = ["KVLedgerConnector"]
