"""The scheduler half's own bookkeeping, on plain stand-ins for vLLM's objects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
from kvledger.adapters.settings import parse_settings
from kvledger.adapters.vllm.scheduler_side import LedgerScheduler
from tests.engine.builders import FULL, chain, make_config

pytestmark = pytest.mark.vllm  # imports vLLM's types: not in the fast subset, which runs without vLLM


def test_a_streaming_session_gets_no_output_count_so_its_hashes_are_read_every_step():
    """A resumable request's prompt grows between turns: the engine's prompt length
    plus vLLM's output count would not bound its tokens, so the planner is not given
    the count for it (and reads the request's hashes instead) until it finishes."""
    scheduler = LedgerScheduler(make_config(groups=(FULL,)), parse_settings({"capacity_bytes": 1 << 20}))
    try:
        for rid, resumable in (("chat", False), ("session", True)):
            scheduler.on_new_request(SimpleNamespace(request_id=rid, num_prompt_tokens=64,
                                                     block_hashes=list(chain(2, rid)), resumable=resumable))
        cached = SimpleNamespace(req_ids=["chat", "session"], num_output_tokens=[3, 5])
        assert scheduler._num_output(cached) == {"chat": 3}
        scheduler.request_finished(SimpleNamespace(request_id="session"), ([],))
        assert scheduler._num_output(cached) == {"chat": 3, "session": 5}  # a later request of that id is new
    finally:
        scheduler.shutdown()
