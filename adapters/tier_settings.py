"""`secondary_tiers`: the tiers below host memory, in order, as vLLM 0.33's
tiering names them, each a dict with a `type`.

A tier is checked against the world while parsing, so a deployment learns of
a wrong path or an unreachable server at start, not at its first spill: a
file-system tier's directory exists or is made, takes a file and has room; a
Valkey tier's server answers (or, with `on_unreachable: "warn"`, the tier
starts down and comes up when the server does). Parsing again, as the worker
process does, finds the same answers.

Each type's settings class and parser are here; its row in
`tier_types.TIER_TYPES` names them, with everything else the type does.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile
import urllib.parse
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import structlog

from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.block_file import PROBE_PREFIX, make_dir
from kvledger.transfers.lower_tiers.block_file import SUFFIX as BLOCK_FILE_SUFFIX
from kvledger.transfers.lower_tiers.block_seal import SECRET_BYTES_MIN, BlockSeal
from kvledger.transfers.lower_tiers.block_value import KEY_PREFIX
from kvledger.transfers.lower_tiers.valkey_store import BadCertificate, StoreDown, ValkeyServer, ValkeyStore

_log = structlog.get_logger("kvledger.adapters.tier_settings")


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


@attrs.frozen(kw_only=True)
class FsTierSettings:
    """A tier of block files in a directory (local disk, NFS, a parallel file system).
    Its files are the user's alone (0o600, directories 0o700), or with `gid` (the
    `group` setting) a service group's too (0o660, directories 0o2770 of that group),
    never every local user's: KV is the prompts' content."""

    path: str  # absolute, normalised
    capacity_bytes: int
    threads: int = 16  # I/O threads per worker (bench/fs_tier_io.py: reads 10% faster than 8, 32 no faster)
    pack_bytes: int = 2 << 20  # a write job's small blocks go in files of up to this (`block_pack`); 0: a file each
    shared: bool = True  # other processes may write this directory: look up keys this process does not know
    gid: int | None = None  # the `group` setting's id: replicas running as other users of that group share the tier
    secret: TierSecret = TierSecret()
    kind: ClassVar[str] = "fs"


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


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} must be a positive int, got {value!r}")
    return value


def parse_fs_tier(where: str, entry: Mapping[str, Any], *, located: bool = True) -> FsTierSettings:
    """The settings alone, nothing on disk touched (`check_fs_tier` does that, at start).
    `located` False: a tier described to be sized (`kvledger whatif`), which may name no path."""
    paths = {}
    for name in ("path", "root_dir"):  # root_dir: vLLM 0.33's name
        if name in entry:
            value = entry[name]
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}.{name} must be a non-empty str, got {value!r}")
            paths[name] = os.path.abspath(os.path.expanduser(value))
    if not paths and located:
        raise ConfigError(f"{where} needs 'path': the tier's directory ('root_dir', vLLM's name, also works)")
    if len(set(paths.values())) > 1:
        raise ConfigError(f"{where}.path and {where}.root_dir are the same setting and disagree: "
                          f"{entry['path']!r} and {entry['root_dir']!r}")
    path = next(iter(paths.values()), "")
    if "capacity_bytes" not in entry:
        raise ConfigError(f"{where} needs 'capacity_bytes': bytes of block files the tier may hold")
    capacity = _positive_int(f"{where}.capacity_bytes", entry["capacity_bytes"])
    threads = _positive_int(f"{where}.threads", entry.get("threads", attrs.fields(FsTierSettings).threads.default))
    pack_bytes = entry.get("pack_bytes", attrs.fields(FsTierSettings).pack_bytes.default)
    if isinstance(pack_bytes, bool) or not isinstance(pack_bytes, int) or pack_bytes < 0:
        raise ConfigError(f"{where}.pack_bytes must be an int >= 0 (0: a file per block), got {pack_bytes!r}")
    shared = entry.get("shared", True)
    if not isinstance(shared, bool):
        raise ConfigError(f"{where}.shared must be a bool, got {shared!r}")
    gid = _group_id(f"{where}.group", entry["group"]) if "group" in entry else None
    return FsTierSettings(path=path, capacity_bytes=capacity, threads=threads, pack_bytes=pack_bytes, shared=shared,
                          gid=gid)


def check_fs_tier(where: str, tier: FsTierSettings) -> None:
    """At start: the directory made or found safe and writable, and the capacity fitting in its file system."""
    _make_writable_dir(f"{where}.path", tier.path, tier.gid)
    free = _free_bytes(tier.path)
    reusable = block_file_bytes(tier.path)
    if tier.capacity_bytes > free + reusable:
        raise ConfigError(
            f"{where}.capacity_bytes {tier.capacity_bytes} does not fit in {tier.path!r}: the file system has "
            f"{free} bytes free, and block files already there take {reusable}")


def _group_id(where: str, value: Any) -> int:
    """A group's id from its name or number; a name this host does not know is
    refused now, not at the first directory made."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a group's name or id, got {value!r}")
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ConfigError(f"{where} {value!r} is not a group on this host (`getent group {value}` finds none)") from None


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


TierSettings = FsTierSettings | ValkeyTierSettings  # each has its row in `tier_types.TIER_TYPES`


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
    store = ValkeyStore(tier.server)
    try:
        store.ping()
        if not tier.server.cluster and store.cluster_enabled():
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


def _make_writable_dir(where: str, path: str, gid: int | None = None) -> None:
    """Make `path` if missing (its parents as the umask has them, itself with the
    tier's mode and group); refuse one that others could read through, plant
    blocks in or point elsewhere; prove a file can be made in it."""
    if not os.path.lexists(path):
        try:
            try:
                make_dir(path, gid)  # leaves one another process made first: checked below
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                make_dir(path, gid)
        except OSError as error:
            raise ConfigError(f"{where} {path!r} cannot be created: {error}") from error
    _check_tier_dir(where, path, gid)
    try:
        handle, probe = tempfile.mkstemp(dir=path, prefix=PROBE_PREFIX)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ConfigError(f"{where} {path!r} is not writable: {error}") from error


def _check_tier_dir(where: str, path: str, gid: int | None) -> None:
    """Whoever owns or can write the tier's directory can read every block and
    plant blocks every replica serves: only this user, or the tier's group."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise ConfigError(f"{where} {path!r} cannot be examined: {error}") from error
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(f"{where} {path!r} is a symbolic link (to {os.readlink(path)!r}): whoever can replace it "
                          f"can point the tier elsewhere; name the directory itself")
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{where} {path!r} is not a directory")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid() and (gid is None or info.st_gid != gid):
        raise ConfigError(
            f"{where} {path!r} is owned by {_user(info.st_uid)}, not by this process's user {_user(os.geteuid())}: "
            f"that user could read and replace its blocks. Use a directory of this user's (or `chown` this one), "
            f"or, to share it with replicas that run as other users, give the tier 'group': the directory's group "
            f"({_group(info.st_gid)}), set on it with mode 2770")
    if mode & stat.S_IWOTH:
        raise ConfigError(f"{where} {path!r} is writable by every user (mode {mode:#o}): anyone could plant or remove "
                          f"blocks; `chmod o-w` it (kvledger makes its directories 0o700, or 0o2770 with 'group')")
    if gid is not None and info.st_gid != gid:
        raise ConfigError(f"{where} {path!r} belongs to group {_group(info.st_gid)}, not the tier's 'group' "
                          f"{_group(gid)}: `chgrp {gid} {path} && chmod 2770 {path}`, or leave 'group' out")


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"gid {gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return f"gid {gid}"


def _free_bytes(path: str) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def block_file_bytes(root: str) -> int:
    """Disk space kvledger block files (`*.kvb`, regular files) take anywhere
    under `root`: allocated bytes, not sizes, so a sparse file of any size
    frees no room, and a pack (`block_pack`) once, whatever keys name it. Files
    that vanish while it looks (another process evicting) are not counted."""
    total = 0
    seen: set[tuple[int, int]] = set()
    pending = [root]
    while pending:
        try:
            entries = os.scandir(pending.pop())
        except (FileNotFoundError, NotADirectoryError):
            continue
        with entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif entry.name.endswith(BLOCK_FILE_SUFFIX) and entry.is_file(follow_symlinks=False):
                        info = entry.stat(follow_symlinks=False)
                        if info.st_nlink > 1:
                            if (info.st_dev, info.st_ino) in seen:
                                continue
                            seen.add((info.st_dev, info.st_ino))
                        total += info.st_blocks * 512
                except FileNotFoundError:
                    continue
    return total


def check_distinct_dirs(tiers: list[TierSettings]) -> None:
    """No two tiers share a directory, or hold one inside the other (a tier
    would count, and find at start, the other's blocks as its own)."""
    seen: dict[str, int] = {}
    for index, tier in enumerate(tiers):
        if not isinstance(tier, FsTierSettings):
            continue
        real = os.path.realpath(tier.path)
        for other_real, other in seen.items():
            if real == other_real or os.path.samefile(tier.path, tiers[other].path):  # a bind mount, say
                raise ConfigError(f"secondary_tiers[{index}].path {tier.path!r} is also "
                                  f"secondary_tiers[{other}].path")
            if os.path.commonpath([real, other_real]) in (real, other_real):
                raise ConfigError(f"secondary_tiers[{index}].path {tier.path!r} and secondary_tiers[{other}].path "
                                  f"{tiers[other].path!r} nest: each tier needs a directory of its own")
        seen[real] = index
