"""kvledger: an event-sourced KV-cache offloading engine for vLLM."""

__version__ = "0.1.0"
