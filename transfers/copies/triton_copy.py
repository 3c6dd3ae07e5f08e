"""A batch copy run by a few compute units: one Triton kernel per job.

The pinned host tier is mapped into the device's address space (CUDA's
unified addressing), so a kernel reads and writes its slots directly over
the bus. A bounded grid (`programs`) leaves the rest of the GPU to the
forward pass, and lets a store and a load run at once on their own streams,
where the copy engines' batch call spends its time per descriptor on the
host (bench/history/2026-11-26.md). Each program copies whole descriptors, 8 bytes a
word: it is offered only layouts whose every address and size is a multiple
of 8 (`batch_copies.moves_in_words`).
"""

from __future__ import annotations

import torch

from kvledger.transfers.copies.copy_descriptors import BatchCopy

PROGRAMS = 16
"""Programs per kernel (each on one multiprocessor)."""
CHUNK_WORDS = 1024
"""8-byte words a program moves per loop turn."""


def triton_batch_copy(programs: int = PROGRAMS, chunk_words: int = CHUNK_WORDS) -> BatchCopy | None:
    """A `BatchCopy` on the current CUDA stream, or None without Triton."""
    try:
        # Optional: Triton is installed with CUDA builds of vLLM only; None without it.
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_words(sources, targets, sizes, count, CHUNK: tl.constexpr):  # noqa: N803 (Triton's constexpr style)
        offsets = tl.arange(0, CHUNK)
        job = tl.program_id(0)
        while job < count:
            source = tl.load(sources + job).to(tl.pointer_type(tl.int64))
            target = tl.load(targets + job).to(tl.pointer_type(tl.int64))
            words = tl.load(sizes + job) // 8
            for start in range(0, words, CHUNK):
                index = start + offsets
                inside = index < words
                tl.store(target + index, tl.load(source + index, mask=inside), mask=inside)
            job += tl.num_programs(0)

    def triton_copy(sources: torch.Tensor, targets: torch.Tensor, sizes: torch.Tensor) -> None:
        count = sizes.numel()
        if not count:
            return
        # Pinned, so the upload waits for nothing; torch's host allocator keeps each buffer until its
        # upload ran, and the device copies are freed in this stream's order.
        on_device = [a.pin_memory().to("cuda", non_blocking=True) for a in (sources, targets, sizes)]
        copy_words[(min(programs, count),)](*on_device, count, CHUNK=chunk_words)

    return triton_copy
