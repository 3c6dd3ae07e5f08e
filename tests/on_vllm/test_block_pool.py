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


def test_the_cursor_resumes_after_its_block_or_starts_over_once_it_was_reused(view):
    from kvledger.adapters.vllm.block_pool import Cursor

    generations = {b: 0 for b in range(8)}
    first = list(view.iter_free_blocks(None, generations.get))[:3]
    cursor = Cursor(first[-1].block_id, generations[first[-1].block_id])
    assert _ids(view.iter_free_blocks(cursor, generations.get))[:2] == [4, 5]
    # vLLM allocates from the eviction end: blocks 1..3 go, the cursor's block among them.
    taken = view._pool.get_new_blocks(3)
    for block in taken:
        generations[block.block_id] += 1
    assert _ids(view.iter_free_blocks(cursor, generations.get)) == [4, 5, 6, 7]  # from the head again
    view._pool.free_blocks(taken)  # free again: the cursor's block is linked, but as a new free block
    from_head = _ids(view.iter_free_blocks(None, generations.get))
    assert _ids(view.iter_free_blocks(cursor, generations.get)) == from_head
    assert sorted(from_head) == list(range(1, 8))
