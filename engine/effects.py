"""What the engine asks the outside world to do.

Effects only describe work; the effect runner (transfers/) and the adapter
perform it, and outcomes come back as events. They hold no callables, so they
compare equal and serialize.

Per-group fields are aligned: `keys[g][i]` moves between
`source_*[g][i]` and `target_*[g][i]`. A slot holds one block of one group.
"""

from __future__ import annotations

from typing import Union

import attrs

KeysByGroup = tuple[tuple[bytes, ...], ...]
IdsByGroup = tuple[tuple[int, ...], ...]


@attrs.frozen(kw_only=True)
class StartStore:
    """Copy device blocks into tier slots, after this step's forward wrote them."""

    job_id: int
    request_id: str
    keys: KeysByGroup
    source_block_ids: IdsByGroup
    target_slot_ids: IdsByGroup


@attrs.frozen(kw_only=True)
class StartLoad:
    """Copy tier slots into device blocks, before any forward reads them."""

    job_id: int
    request_id: str
    keys: KeysByGroup
    source_slot_ids: IdsByGroup
    target_block_ids: IdsByGroup


@attrs.frozen(kw_only=True)
class FlushStores:
    """Wait for these stores before this step's forward: their source blocks
    were just handed to someone else."""

    job_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class PinDeviceBlocks:
    """Take a block-pool reference so vLLM cannot reallocate these blocks."""

    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class UnpinDeviceBlocks:
    """Release references taken by `PinDeviceBlocks`, exactly once each."""

    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class KeysEvicted:
    """These keys left the tier and can no longer be loaded."""

    keys: tuple[bytes, ...]


@attrs.frozen(kw_only=True)
class ReportViolation:
    """The caller broke the protocol; the event was not applied."""

    code: str
    message: str
    event_kind: str
    request_id: str = ""
    job_id: int = -1


Effect = Union[StartStore, StartLoad, FlushStores, PinDeviceBlocks, UnpinDeviceBlocks, KeysEvicted, ReportViolation]
