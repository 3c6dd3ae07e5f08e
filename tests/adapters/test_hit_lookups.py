"""What `get_num_new_matched_tokens` remembers between vLLM's calls of one
step: the host slots of hits admitted before the engine has seen them."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # the adapter's package checks vLLM's version
from kvledger.adapters.vllm.hit_lookup import HitLookups  # noqa: E402
from tests.engine.test_lower import evict_host, stored_and_spilled, tiered  # noqa: E402

pytestmark = pytest.mark.vllm  # not in the fast subset, which runs without vLLM


def test_a_hit_read_in_place_waits_for_the_step_whose_promotions_would_evict_it() -> None:
    e = tiered(slots=4)
    stored_and_spilled(e)  # a document on disk only
    evict_host(e, blocks=(10, 11, 12, 13))  # another filling host memory, idle
    e.add("b", 100)  # the first: three promotions
    e.add("x", 140, tag="z")  # the second: four blocks read where they are
    lookups = HitLookups(lambda: e.state, lambda events: [e.apply(event) for event in events], None)
    assert lookups.hit("x", 0) == (128, True)  # alone, it would be admitted
    assert lookups.hit("b", 0) == (96, True)
    lookups.admitted("b", 96)  # vLLM admits b first: its promotions will evict three of x's blocks
    assert lookups.hit("x", 0) == (None, False)  # so x asks again next step
    lookups.take_admissions()  # the step ends
    e.alloc("b", (20, 21, 22, 23), ext=96)
    e.finish_all_jobs()  # b's load ends; x's blocks are on disk now, and slots are free again
    assert lookups.hit("x", 0) == (128, True)
