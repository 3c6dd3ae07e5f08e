"""The Valkey tier's settings: parsed without asking the server (`parse_valkey_tier`), and
checked against it at start (`check_valkey_tier`: it answers, and is what the settings
say, a cluster's node or one server).
"""

from __future__ import annotations

import os
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import structlog

from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.tier_settings import TierSecret
from kvledger.transfers.lower_tiers.tier_settings import positive_int as _positive_int
from kvledger.transfers.lower_tiers.valkey.block_value import KEY_PREFIX
from kvledger.transfers.lower_tiers.valkey.cluster_store import open_store
from kvledger.transfers.lower_tiers.valkey.store import BadCertificate, StoreDown, ValkeyServer, ValkeyStore

_log = structlog.get_logger("kvledger.adapters.tier_settings")  # the name its lines have always carried


START_RETRIES_S = (0.5, 1.0, 2.0)
"""Waits between the start check's tries of an unanswered server: a slow answer or a failover
while a replica restarts is not a wrong setting. In the fleet soak a replica restarted during
host stalls failed to start when one ping outlasted its 0.5 s `timeout_s` (`bench/fleet_soak.py`);
a server that is truly down costs a start these 3.5 s and then the error, as before."""

VALKEY_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}  # scheme -> TLS


@attrs.frozen(kw_only=True)
class ValkeyTierSettings:
    """A tier on a Valkey (or Redis) server or cluster, shared by every vLLM instance that names it."""

    server: ValkeyServer
    capacity_bytes: int  # what this instance tracks in the store; the server's maxmemory bounds it all
    # I/O threads per worker, each with its own connection. In a process whose engine thread keeps
    # the GIL busy (in-process vLLM), each thread waits for it after every system call, so many
    # threads hide the waits: a 2k-token restore took 290-370 ms with 4, 180-285 with 8 (bench/tier_ttft.py).
    connections: int = 8
    on_unreachable: str = "error"  # or "warn": start with the tier down
    key_prefix: bytes = KEY_PREFIX  # every key starts with it: what an ACL binds to
    secret: TierSecret = TierSecret()
    shared: ClassVar[bool] = True  # always: other instances write the same keys
    kind: ClassVar[str] = "valkey"


def _parse_url(where: str, url: Any) -> tuple[str, int, bool, int, str | None, str | None]:
    """A URL's parts. Messages never quote the URL past its scheme: a password
    with `#`, `/` or `?` in it splits into the parts they would name."""
    if not isinstance(url, str) or not url:
        shown = "a non-str" if not isinstance(url, str) else "''"
        raise ConfigError(f"{where} must be a non-empty str such as 'redis://HOST:6379', got {shown}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in VALKEY_SCHEMES:
        raise ConfigError(f"{where} scheme {parts.scheme[:16]!r} is not supported; use one of "
                          f"{', '.join(s + '://' for s in VALKEY_SCHEMES)}")
    secret_hint = (" (a password with '#', '/' or '?' splits the URL there: give it in password_env)"
                   if "@" not in parts.netloc and "@" in url else "")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ConfigError(f"{where} has a bad port{secret_hint}") from None
    if not parts.hostname:
        raise ConfigError(f"{where} names no host{secret_hint}")
    db_text = parts.path.strip("/")
    if db_text and not db_text.isdigit():
        raise ConfigError(f"{where} path must be a database number{secret_hint}")
    if parts.query or parts.fragment:
        raise ConfigError(f"{where} takes no query or fragment; set timeouts with timeout_s{secret_hint}")
    if parts.password:
        _log.warning("tier_password_in_url", where=where,
                     advice="vLLM logs its arguments and other users can read a command line: "
                            "set password_env to the name of an environment variable holding the password")
    unquote = urllib.parse.unquote
    return (parts.hostname, port, VALKEY_SCHEMES[parts.scheme], int(db_text or 0),
            unquote(parts.username) if parts.username else None, unquote(parts.password) if parts.password else None)


def parse_valkey_tier(where: str, entry: Mapping[str, Any], *, located: bool = True) -> ValkeyTierSettings:
    """The settings alone, no server asked (`check_valkey_tier` does that, at start).
    `located` False: a tier described to be sized (`kvledger whatif`), which may name no server."""
    if not located and "url" not in entry and "urls" not in entry:
        entry = {**entry, "url": "redis://unnamed"}  # sized only: never connected to
    if ("url" in entry) == ("urls" in entry):
        raise ConfigError(f"{where} needs 'url' (a server, 'redis://HOST:PORT') or 'urls' (a cluster's seed "
                          f"nodes), one of them")
    if "urls" in entry:
        urls = entry["urls"]
        if not isinstance(urls, (list, tuple)) or not urls:
            raise ConfigError(f"{where}.urls must be a non-empty list of URLs, got {urls!r}")
        parsed = [_parse_url(f"{where}.urls[{i}]", u) for i, u in enumerate(urls)]
    else:
        parsed = [_parse_url(f"{where}.url", entry["url"])]
    if len({(p[2], p[3], p[4], p[5]) for p in parsed}) > 1:
        raise ConfigError(f"{where}.urls disagree on TLS, database or credentials")
    _, _, tls, db, username, password = parsed[0]
    cluster = entry.get("cluster", len(parsed) > 1)
    if not isinstance(cluster, bool):
        raise ConfigError(f"{where}.cluster must be a bool, got {cluster!r}")
    if len(parsed) > 1 and not cluster:
        raise ConfigError(f"{where}.urls names {len(parsed)} servers; several are a cluster's seed nodes "
                          f"(cluster: true)")
    if cluster and db:
        raise ConfigError(f"{where}: a cluster has only database 0, the URL names {db}")
    if "password_env" in entry:
        name = entry["password_env"]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.password_env must name an environment variable, got {name!r}")
        if password is not None:
            raise ConfigError(f"{where}: the password is in the URL and in password_env; give one")
        password = os.environ.get(name)
        if password is None:
            raise ConfigError(f"{where}.password_env names {name!r}, which is not set")
    if "capacity_bytes" not in entry:
        raise ConfigError(f"{where} needs 'capacity_bytes': bytes of blocks this instance may keep in the store")
    capacity = _positive_int(f"{where}.capacity_bytes", entry["capacity_bytes"])
    timeout = entry.get("timeout_s", 1.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 60:
        raise ConfigError(f"{where}.timeout_s must be a number of seconds in (0, 60], got {timeout!r}")
    connections = _positive_int(f"{where}.connections", entry.get("connections",
                                                                  attrs.fields(ValkeyTierSettings).connections.default))
    ca_file = entry.get("tls_ca_file")
    if ca_file is not None:
        if not tls:
            raise ConfigError(f"{where}.tls_ca_file is for TLS: use a rediss:// or valkeys:// URL")
        if not isinstance(ca_file, str) or not ca_file:
            raise ConfigError(f"{where}.tls_ca_file must be a file's path, got {ca_file!r}")
    on_unreachable = entry.get("on_unreachable", "error")
    if on_unreachable not in ("error", "warn"):
        raise ConfigError(f"{where}.on_unreachable must be 'error' or 'warn', got {on_unreachable!r}")
    server = ValkeyServer(nodes=tuple((p[0], p[1]) for p in parsed), cluster=cluster, tls=tls, db=db,
                          username=username, password=password, timeout_s=float(timeout), tls_ca_file=ca_file)
    prefix = entry.get("key_prefix", KEY_PREFIX.decode())
    if not isinstance(prefix, str) or not 0 < len(prefix) <= 64 or not all(c.isprintable() and not c.isspace()
                                                                          for c in prefix):
        raise ConfigError(f"{where}.key_prefix must be 1-64 printable characters without spaces, such as "
                          f"'kvledger:tenant-a:', got {prefix!r}")
    if any(c in prefix for c in "*?[]\\"):
        raise ConfigError(f"{where}.key_prefix {prefix!r} holds a glob character (* ? [ ] \\), which an ACL "
                          f"pattern or SCAN MATCH would read as a wildcard")
    return ValkeyTierSettings(server=server, capacity_bytes=capacity, connections=connections,
                              on_unreachable=on_unreachable, key_prefix=prefix.encode())


def check_valkey_tier(where: str, tier: ValkeyTierSettings) -> None:
    """At start: the CA file readable, and the server answering and being what the settings say it is. A certificate
    that does not verify, or a cluster node named as one server, stops start
    even with on_unreachable: 'warn': the settings are wrong (or someone is in
    the way), and waiting for the server would not mend them."""
    ca_file = tier.server.tls_ca_file
    if ca_file is not None and not os.path.isfile(ca_file):
        raise ConfigError(f"{where}.tls_ca_file {ca_file!r} is not a readable file")
    if tier.server.password is not None and not tier.server.tls:
        _log.warning("tier_password_in_clear", where=where, server=tier.server.where,
                     why="AUTH goes over plain redis://: anyone on the path reads the password; use rediss://")
    store = open_store(tier.server)
    try:
        _ping(store, where)
        if isinstance(store, ValkeyStore) and store.cluster_enabled():
            raise ConfigError(f"{where}: {tier.server.where} is a node of a cluster, which answers most keys "
                              f"with MOVED: set cluster: true (and name the cluster's nodes in 'urls')")
    except BadCertificate as exc:
        hosts = ", ".join(dict.fromkeys(host for host, _ in tier.server.nodes))
        raise ConfigError(f"{where}: the Valkey server at {tier.server.where} cannot be reached safely: its TLS "
                          f"certificate does not verify for host {hosts} (issued for another name, or by a CA "
                          f"that tls_ca_file does not name): {exc}") from None
    except StoreDown as exc:
        if tier.on_unreachable == "error":
            raise ConfigError(f"{where}: the Valkey server at {tier.server.where} cannot be reached: {exc} "
                              f"(on_unreachable: 'warn' starts with the tier down instead)") from None
        _log.warning("tier_unreachable_at_start", where=where, server=tier.server.where, error=str(exc))
    finally:
        store.close()


def _ping(store: Any, where: str) -> None:
    """`store.ping()`, tried again after each of `START_RETRIES_S` while the server does not
    answer; the last try's `StoreDown` is raised."""
    for wait in START_RETRIES_S:
        try:
            store.ping()
            return
        except StoreDown as exc:
            _log.warning("tier_start_check_retried", where=where, error=str(exc), retry_s=wait)
            time.sleep(wait)
    store.ping()
