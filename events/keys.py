"""How block keys are shown to people: in full hex, so a key from a log
line can be passed to `kvledger replay --key` as it is."""

from __future__ import annotations

from collections.abc import Iterable

KEYS_SHOWN = 8


def hex_keys(keys: Iterable[bytes], limit: int = KEYS_SHOWN) -> list[str]:
    """The first `limit` keys in hex, then one entry counting the rest."""
    shown: list[str] = []
    rest = 0
    for key in keys:
        if len(shown) < limit:
            shown.append(key.hex())
        else:
            rest += 1
    if rest:
        shown.append(f"+{rest} more")
    return shown
