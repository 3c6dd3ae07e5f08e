"""The file-system tier's directory, held by descriptor: opened once, and
everything below it reached one component at a time from descriptors, never
through a link, so whoever can write a directory on the way cannot point the
tier elsewhere after its start check (a swapped path leaves this process in
the directory it checked).

`root/<namespace hex>/<key hex[:2]>/<key hex>.kvb` (`block_file.block_path`):
the root, each namespace's directory and each fan-out directory are opened
once (O_DIRECTORY | O_NOFOLLOW; a worker's 256 fan-out directories when it
opens the tier, so its descriptors do not grow while it serves) and stay
open, and a block's file is named in its fan-out directory alone: no more
system calls a block than a path would take (three more a block, opening
its fan-out directory each time, cost 17-38% of 64 KiB blocks' speed, each
call's return waiting for the GIL among the tier's threads). A directory
below the root that another user made (and not the tier's group's), or that
others could write, is refused.

At start, `check_ancestors` refuses a tier whose directories above it others
could replace, as OpenSSH's `secure_filename` does for keys.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading

from kvledger.transfers.lower_tiers.fs.block_file import make_dir

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotTheTiers(PermissionError):
    """A directory in the tier that this user did not make (nor the tier's group), or that others can write."""


def refusal(info: os.stat_result, gid: int | None) -> str | None:
    """Why a directory of the tier is not to be used: owned by another user
    (and not the tier's group's), or writable by more than its owner and the
    tier's group; None where it may be."""
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid() and (gid is None or info.st_gid != gid):
        return f"owned by uid {info.st_uid} (gid {info.st_gid}), not by this user (uid {os.geteuid()}) or the tier's group"
    if mode & stat.S_IWOTH:
        return f"writable by every user (mode {mode:#o})"
    if mode & stat.S_IWGRP and (gid is None or info.st_gid != gid):
        return f"writable by its group, gid {info.st_gid} (mode {mode:#o}), which is not the tier's 'group'"
    return None


def open_dir(name: str, dir_fd: int | None, gid: int | None, *, create: bool = False) -> int:
    """The directory `name` in `dir_fd`, open, not through a link; made first
    (`block_file.make_dir`: the tier's mode and group) where missing and
    `create`. `NotTheTiers` where `refusal` says so; FileNotFoundError where
    missing; another OSError (ELOOP, ENOTDIR) where something else is there."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        make_dir(name, gid, dir_fd=dir_fd)
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        why = refusal(os.fstat(fd), gid)
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        raise NotTheTiers(f"{name}: {why}")
    return fd


class TierDir:
    """The tier's directory, its namespaces' and their fan-out directories, each
    opened once and kept open for the process's life (`close` ends it): a
    worker holds at most 2 + 256 descriptors a namespace. Safe to share between
    threads. A directory removed while held (someone cleared the tier, or
    another process made it anew) is let go by `refresh`, and opened again by
    the next use; a descriptor let go is closed only by `close`, as another
    thread may be using it."""

    def __init__(self, root: str | os.PathLike, gid: int | None = None, *, create: bool = False) -> None:
        self.root = os.fspath(root)
        self.gid = gid
        self.fd = open_dir(self.root, None, gid, create=create)
        self._spaces: dict[bytes, int] = {}
        self._fans: dict[tuple[bytes, str], int] = {}
        self._let_go: list[int] = []
        self._lock = threading.Lock()

    def space(self, namespace: bytes, *, create: bool = False) -> int:
        """The namespace's directory, open (made first where `create`)."""
        fd = self._spaces.get(namespace)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._spaces.get(namespace)
            if fd is None:
                fd = self._spaces[namespace] = open_dir(namespace.hex(), self.fd, self.gid, create=create)
            return fd

    def fan_out(self, namespace: bytes, key: bytes, *, create: bool = False) -> int:
        """The key's fan-out directory, open (made first where `create`); where the
        held root or namespace directory was removed meanwhile, through new ones."""
        fd = self._fans.get((namespace, key.hex()[:2]))
        if fd is not None:
            return fd
        try:
            return self._open_fan_out(namespace, key.hex()[:2], create)
        except FileNotFoundError:
            if not self.refresh(namespace):
                raise
            return self._open_fan_out(namespace, key.hex()[:2], create)

    def _open_fan_out(self, namespace: bytes, name: str, create: bool) -> int:
        parent = self.space(namespace, create=create)
        with self._lock:
            fd = self._fans.get((namespace, name))
            if fd is None:
                fd = self._fans[(namespace, name)] = open_dir(name, parent, self.gid, create=create)
            return fd

    def hold(self, namespace: bytes, *, create: bool = True) -> None:
        """Every fan-out directory of `namespace` open now (made where `create`), so
        a worker's descriptors are counted at its start, not grown into while it
        serves. One refused (not the tier's) or missing is tried again when used."""
        for first in range(256):
            with contextlib.suppress(OSError):  # NotTheTiers among them
                self.fan_out(namespace, bytes([first]), create=create)

    def refresh(self, namespace: bytes, key: bytes | None = None, used: int | None = None) -> bool:
        """After an operation found something missing: whether a held directory on
        its way had been removed, and is now let go, or had been since the caller
        took it (`used`: the fan-out directory it took): the caller tries once more."""
        with self._lock:
            root_gone = gone(self.fd)
            if root_gone:
                try:
                    fresh = open_dir(self.root, None, self.gid, create=True)  # made again, checked again
                except OSError:  # cannot be made again (its parent is gone too): nothing to try
                    return False
                self._let_go.append(self.fd)
                self.fd = fresh
            space = self._spaces.get(namespace)
            spaces = list(self._spaces) if root_gone else [namespace] if space is not None and gone(space) else []
            for dropped in spaces:
                self._let_go.append(self._spaces.pop(dropped))
            fan = None if key is None else key.hex()[:2]
            fans = [w for w, fd in self._fans.items()
                    if w[0] in spaces or (w == (namespace, fan) and gone(fd))]
            for dropped_fan in fans:
                self._let_go.append(self._fans.pop(dropped_fan))
            # Let go already (by another thread, since the caller took it): worth a try too.
            let_go = fan is not None and self._fans.get((namespace, fan)) != used
            return root_gone or bool(spaces) or bool(fans) or let_go

    def close(self) -> None:
        with self._lock:
            for fd in (self.fd, *self._spaces.values(), *self._fans.values(), *self._let_go):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._spaces.clear()
            self._fans.clear()
            self._let_go.clear()
            self.fd = -1


def usable_dir(name: str, parent: int, gid: int | None) -> bool:
    """Whether `name` in `parent` is a directory (not a link) `refusal` lets the
    tier use, by one `fstatat` without opening it (lookups: a hint)."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and refusal(info, gid) is None


def gone(fd: int) -> bool:
    """Whether the directory open at `fd` has been removed (no name links to it any more)."""
    return os.fstat(fd).st_nlink == 0


def check_ancestors(path: str, gid: int | None) -> str | None:
    """Why the directories above `path` (after links are resolved) let another
    user replace the tier's directory, or None. Each must be owned by root or
    this user, and writable by no one else, unless sticky (as /tmp: others'
    entries cannot be renamed there) or writable only by the tier's group."""
    here = os.path.dirname(os.path.realpath(path))
    while True:
        info = os.stat(here)
        mode = stat.S_IMODE(info.st_mode)
        sticky = bool(mode & stat.S_ISVTX)
        if info.st_uid not in (0, os.geteuid()):
            return f"{here} is owned by uid {info.st_uid}, who could replace the tier's directory"
        if mode & stat.S_IWOTH and not sticky:
            return f"{here} is writable by every user (mode {mode:#o}) and not sticky"
        if mode & stat.S_IWGRP and not sticky and (gid is None or info.st_gid != gid):
            return f"{here} is writable by group gid {info.st_gid} (mode {mode:#o}), which is not the tier's 'group'"
        if here == os.path.dirname(here):
            return None
        here = os.path.dirname(here)
