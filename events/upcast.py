"""Bring records of older event versions forward to the current class.

Each upcaster takes the fields of a record at (kind, version N) in JSON form
(bytes as hex, tuples as lists) and returns the fields at version N + 1,
without mutating its argument. `codec.from_record` applies them in a chain,
so a record several versions old passes through each step in turn.
"""

from __future__ import annotations

from collections.abc import Callable


def upcast_store_failed_v1_v2(fields: dict) -> dict:
    """v1 had no `keys`: a failed store always meant the whole job, which v2 spells `keys=[]`."""
    return {**fields, "keys": []}


def upcast_cache_reset_v1_v2(fields: dict) -> dict:
    """v1 left device contents and request keys as they were."""
    return {**fields, "forget_device": False, "rekeyed": False}


def upcast_cache_reset_v2_v3(fields: dict) -> dict:
    """v2's reset always emptied the tiers below host memory."""
    return {**fields, "keep_lower": False}


def upcast_step_scheduled_v1_v2(fields: dict) -> dict:
    """v1 recorded no time: 0 says so."""
    return {**fields, "wall_time_us": 0}


def upcast_failure_reason(fields: dict) -> dict:
    """store_failed v2 and load_failed v1 carried no reason: "" says none was given."""
    return {**fields, "reason": ""}


UPCASTERS: dict[tuple[str, int], Callable[[dict], dict]] = {
    ("store_failed", 1): upcast_store_failed_v1_v2,
    ("store_failed", 2): upcast_failure_reason,
    ("load_failed", 1): upcast_failure_reason,
    ("cache_reset", 1): upcast_cache_reset_v1_v2,
    ("cache_reset", 2): upcast_cache_reset_v2_v3,
    ("step_scheduled", 1): upcast_step_scheduled_v1_v2,
}
