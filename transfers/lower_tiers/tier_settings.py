"""What every tier type's settings share: the deployment secret (`secret_env` and its
keys, the same for every type) and the checks of a value.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Mapping
from typing import Any

import attrs

from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.block_seal import SECRET_BYTES_MIN, BlockSeal, key_material


@attrs.frozen(kw_only=True)
class TierSecret:
    """A tier's deployment secret (`secret_env`), read from the environment,
    never from the config, and kept out of every repr and log."""

    current: bytes | None = attrs.field(default=None, repr=False)
    previous: bytes | None = attrs.field(default=None, repr=False)  # accepted for reads during a rotation
    encrypt: bool = False
    require_encrypted: bool = False  # `encrypt: "required"`: a block sealed without encryption is refused
    previous_until: float | None = None  # when the rotation ends (seconds since the epoch): None, never
    stretched: tuple[str, ...] = ()  # the keys whose text was not 32 random bytes, stretched (`key_material`)

    def seal(self) -> BlockSeal | None:
        if self.current is None:
            return None
        return BlockSeal(self.current, previous=self.previous, encrypt=self.encrypt,
                         previous_until=self.previous_until, require_encrypted=self.require_encrypted)

    @property
    def naming(self) -> bytes | None:
        """The secret that names blocks: the previous one while a rotation lasts, so
        replicas not yet given the new secret still find what others write; the new one
        once `previous_until` has passed (read at start: names change at the next start)."""
        rotating = self.previous is not None and (self.previous_until is None or time.time() < self.previous_until)
        return self.previous if rotating else self.current

SECRET_KEYS = ("secret_env", "previous_secret_env", "previous_secret_until", "encrypt")
"""Every tier type takes these: the secret is named by an environment variable, never written in the config."""


def parse_secret(where: str, entry: Mapping[str, Any]) -> TierSecret:
    values: dict[str, bytes] = {}
    stretched: list[str] = []
    for name in ("secret_env", "previous_secret_env"):
        if name not in entry:
            continue
        variable = entry[name]
        if not isinstance(variable, str) or not variable:
            raise ConfigError(f"{where}.{name} must name an environment variable, got {variable!r}")
        value = os.environ.get(variable)
        if value is None:
            raise ConfigError(f"{where}.{name} names {variable!r}, which is not set in this process's environment")
        if len(value.encode()) < SECRET_BYTES_MIN:
            raise ConfigError(f"{where}.{name}: ${variable} holds {len(value.encode())} bytes; a tier secret needs "
                              f"at least {SECRET_BYTES_MIN} (for example `openssl rand -hex 32`)")
        values[name], was_stretched = key_material(value.encode())
        if was_stretched:
            stretched.append(name)
    if "previous_secret_env" in values and "secret_env" not in values:
        raise ConfigError(f"{where}.previous_secret_env is for a rotation: it needs secret_env, the new secret")
    until = None
    if "previous_secret_until" in entry:
        if "previous_secret_env" not in values:
            raise ConfigError(f"{where}.previous_secret_until ends a rotation: it needs previous_secret_env")
        until = _instant(f"{where}.previous_secret_until", entry["previous_secret_until"])
    encrypt = entry.get("encrypt", False)
    required = encrypt == "required"  # encrypt, and read no block stored in plaintext
    if required:
        encrypt = True
    if not isinstance(encrypt, bool):
        raise ConfigError(f"{where}.encrypt must be true, false or \"required\", got {encrypt!r}")
    if encrypt and "secret_env" not in values:
        raise ConfigError(f"{where}.encrypt needs secret_env: the key is derived from the tier's secret")
    return TierSecret(current=values.get("secret_env"), previous=values.get("previous_secret_env"), encrypt=encrypt,
                      require_encrypted=required, previous_until=until, stretched=tuple(stretched))


def _instant(where: str, value: Any) -> float:
    """An ISO 8601 date or time, as seconds since the epoch: a date is its midnight in UTC, a
    time without an offset is in UTC."""
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be an ISO 8601 date or time, e.g. '2026-12-31' or "
                          f"'2026-12-31T18:00:00+01:00', got {value!r}")
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not an ISO 8601 date or time, e.g. '2026-12-31' or "
                          f"'2026-12-31T18:00:00+01:00'") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} must be a positive int, got {value!r}")
    return value
