"""The log tools: a recorded log folded through the engine to answer questions about
its run. They import only `engine/` and `events/` (import-linter keeps it so): no vLLM,
no I/O, no tiers; the command line reads the log and prints their answers.

misses         why each prompt block was restored or computed (`explain`, the live miss counter)
admissions     what the miss ledger says of each admission: runs of blocks and their causes
whatif         the log's traffic driven again under another configuration (`whatif`)
fleet          the logs of several replicas driven again over one shared tier (`whatif --shared-tier`)
report_series  a replayed log folded into per-step series, for the replay report
"""
