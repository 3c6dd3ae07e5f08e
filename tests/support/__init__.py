"""Helpers shared by tests and benchmarks, kept out of the installed package.

Imported as `tests.support.<module>`, with the repository's root on sys.path
(pytest run from it; a benchmark puts it there itself).

fake_vllm        the parts of vLLM the step planner reads, as plain data
valkey_servers   real Valkey servers and clusters on loopback ports, with real faults
transitions_doc  docs/transitions.md, rendered from the engine's transition tables
causes_doc       docs/causes.md, one computed block of each cause, from seeded simulator runs
privileges       what a test may do as the user running the suite: root's skips, a second group
"""
