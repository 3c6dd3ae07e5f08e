"""kvledger: an event-sourced KV-cache offloading engine for vLLM."""

from kvledger import _build

__version__ = "0.2.0"

BUILD = _build.select()
"""The engine build in use: compiled with mypyc, or the pure source (and why)."""
