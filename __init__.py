"""kvledger: an event-sourced KV-cache offloading engine for vLLM.

events/     the facts the engine learns, and the log they are written in
engine/     the pure core: the reducer, the state, the invariants, replay
transfers/  the effect runner: the only code that moves KV bytes
adapters/   the vLLM connector, the command line, the log tools
_build      which engine runs: the mypyc-compiled modules or their source
_identity   which build this is: the version and commit a log's header records
"""

from kvledger import _build

__version__ = "0.3.0"

BUILD = _build.select()
"""The engine build in use: compiled with mypyc, or the pure source (and why)."""
