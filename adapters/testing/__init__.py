"""The testing wing: stand-ins for vLLM that ship with kvledger, for the CLI's
`simulate` and `demo` commands, tests and benchmarks; never imported by the
connector (pyproject.toml's import-linter contract). Helpers only tests and
benchmarks use live in tests/support/.

simulator    a seeded stand-in for vLLM that drives the engine with legal event sequences
tiny_models  tiny random-weight models, built locally in seconds
"""
