"""BlockPoolView over vLLM's own BlockPool: references and the free-queue cursor."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture
def view():
    from vllm.v1.core.block_pool import BlockPool

    from kvledger.adapters.vllm.block_pool import BlockPoolView

    return BlockPoolView(BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16))


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_a_touched_free_block_leaves_the_queue_and_comes_back_once(view):
    pool = view._pool
    assert _ids(view.iter_free_blocks()) == list(range(1, 8))  # block 0 is the null block
    view.touch([3])
    assert 3 not in _ids(view.iter_free_blocks())
    assert view.pinned == 1
    view.free_blocks([3])
    assert view.pinned == 0 and pool.blocks[3].ref_cnt == 0
    with pytest.raises(RuntimeError, match="does not hold"):
        view.free_blocks([3])  # a second release would corrupt vLLM's counts: refused
