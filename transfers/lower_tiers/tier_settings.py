"""What every tier type's settings share: the deployment secret (`secret_env` and its
keys, the same for every type) and the checks of a value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.block_seal import SECRET_BYTES_MIN, BlockSeal


@attrs.frozen(kw_only=True)
class TierSecret:
    """A tier's deployment secret (`secret_env`), read from the environment,
    never from the config, and kept out of every repr and log."""

    current: bytes | None = attrs.field(default=None, repr=False)
    previous: bytes | None = attrs.field(default=None, repr=False)  # accepted for reads during a rotation
    encrypt: bool = False

    def seal(self) -> BlockSeal | None:
        if self.current is None:
            return None
        return BlockSeal(self.current, previous=self.previous, encrypt=self.encrypt)

    @property
    def naming(self) -> bytes | None:
        """The secret that names blocks: the previous one while a rotation lasts,
        so replicas not yet given the new secret still find what others write."""
        return self.previous if self.previous is not None else self.current

SECRET_KEYS = ("secret_env", "previous_secret_env", "encrypt")
"""Every tier type takes these: the secret is named by an environment variable, never written in the config."""


def parse_secret(where: str, entry: Mapping[str, Any]) -> TierSecret:
    values = {}
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
        values[name] = value.encode()
    if "previous_secret_env" in values and "secret_env" not in values:
        raise ConfigError(f"{where}.previous_secret_env is for a rotation: it needs secret_env, the new secret")
    encrypt = entry.get("encrypt", False)
    if not isinstance(encrypt, bool):
        raise ConfigError(f"{where}.encrypt must be a bool, got {encrypt!r}")
    if encrypt and "secret_env" not in values:
        raise ConfigError(f"{where}.encrypt needs secret_env: the key is derived from the tier's secret")
    return TierSecret(current=values.get("secret_env"), previous=values.get("previous_secret_env"), encrypt=encrypt)


def positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} must be a positive int, got {value!r}")
    return value
