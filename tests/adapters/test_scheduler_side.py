"""The scheduler half's own bookkeeping, on plain stand-ins for vLLM's objects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
from kvledger.adapters.settings import parse_settings
from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
from tests.engine.builders import FULL, chain, make_config

pytestmark = pytest.mark.vllm  # imports vLLM's types: not in the fast subset, which runs without vLLM


def test_a_streaming_session_is_one_to_the_planner_until_it_finishes():
    """A resumable request's next turn can rewind its hashes, so the planner is told
    which requests are sessions (and compares their hashes in every step)."""
    scheduler = LedgerScheduler(make_config(groups=(FULL,)), parse_settings({"capacity_bytes": 1 << 20}))
    try:
        for rid, resumable in (("chat", False), ("session", True)):
            scheduler.on_new_request(SimpleNamespace(request_id=rid, num_prompt_tokens=64,
                                                     block_hashes=list(chain(2, rid)), resumable=resumable))
        assert scheduler._sessions == {"session"}
        scheduler.request_finished(SimpleNamespace(request_id="session"), ([],))
        assert scheduler._sessions == set()  # a later request of that id is new
    finally:
        scheduler.shutdown()
