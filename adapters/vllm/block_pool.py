"""The scheduler's GPU block pool, as kvledger uses it.

In pin mode a store holds a reference on each source block from the step
that plans it until it ends, so vLLM cannot hand the block out while a copy
reads it: a touch instead of a flush. Each reference is released exactly
once, on completion or on failure, because the engine emits one
`UnpinDeviceBlocks` per `PinDeviceBlocks` when the job ends. A block kvledger
holds after its request let go is freed by kvledger, which is what
`has_pending_block_frees` tells the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock


class BlockPoolView:
    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self.pinned = 0  # references kvledger holds now

    def touch(self, block_ids: Iterable[int]) -> None:
        blocks = [self._pool.blocks[b] for b in block_ids]
        self._pool.touch(blocks)
        self.pinned += len(blocks)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        blocks = [self._pool.blocks[b] for b in block_ids]
        if any(b.ref_cnt <= 0 for b in blocks):
            raise RuntimeError(f"kvledger would free blocks it does not hold: {[b.block_id for b in blocks]}")
        self._pool.free_blocks(blocks)
        self.pinned -= len(blocks)

    def iter_free_blocks(self) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order (least recently used first)."""
        yield from self._pool.free_block_queue.iter_blocks_after(None)
