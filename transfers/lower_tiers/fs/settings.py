"""The file-system tier's settings: parsed without touching the disk (`parse_fs_tier`),
and checked against it at start (`check_fs_tier`: the directory made or found safe,
a file made in it, the capacity fitting in its file system).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from kvledger.events.config import ConfigError
from kvledger.transfers.lower_tiers.fs.block_file import PROBE_PREFIX, make_dir
from kvledger.transfers.lower_tiers.fs.block_file import SUFFIX as BLOCK_FILE_SUFFIX
from kvledger.transfers.lower_tiers.fs.tier_dir import check_ancestors
from kvledger.transfers.lower_tiers.tier_settings import TierSecret
from kvledger.transfers.lower_tiers.tier_settings import positive_int as _positive_int


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
    if gid is None and mode & stat.S_IWGRP:
        raise ConfigError(f"{where} {path!r} is writable by its group {_group(info.st_gid)} (mode {mode:#o}), and the "
                          f"tier has no 'group': its members could plant or remove blocks. `chmod g-w` it, or give "
                          f"the tier 'group' to share it with them")
    unsafe = check_ancestors(path, gid)
    if unsafe is not None:
        raise ConfigError(f"{where} {path!r} sits where another user could replace it: {unsafe}. Put the tier in "
                          f"a directory whose parents only root and this user can write (or sticky ones, as /tmp)")


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


def check_distinct_dirs(tiers: Sequence[Any]) -> None:
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
