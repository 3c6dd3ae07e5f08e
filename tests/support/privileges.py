"""What a test may do as the user running the suite, and a skip that names what it lacks.

CI runs the suite as root; a contributor may not. A test that needs what only
root may do (mount a file system, make a device node, chown to another user,
register a userfaultfd where unprivileged ones are off) skips elsewhere, saying
why. A test that needs a second group uses one this user belongs to, and skips
where there is none.
"""

from __future__ import annotations

import grp
import os

import pytest

IS_ROOT = os.geteuid() == 0


def need_root(what: str) -> None:
    """Skip unless root, naming what needs it."""
    if not IS_ROOT:
        pytest.skip(f"needs root ({what}); this suite runs as uid {os.geteuid()}")


def second_group() -> tuple[str, int]:
    """A group other than this user's own that it may give files to: root's `users`, or a
    supplementary group of this user. Skips where this user has none."""
    if IS_ROOT:
        users = grp.getgrnam("users")
        return users.gr_name, users.gr_gid
    own = os.getegid()
    for gid in sorted(set(os.getgroups()) - {own}):
        try:
            return grp.getgrgid(gid).gr_name, gid
        except KeyError:  # a group id with no name
            continue
    pytest.skip(f"needs a second group of this user (uid {os.geteuid()} is in its own group alone); "
                "root's is `users`")
