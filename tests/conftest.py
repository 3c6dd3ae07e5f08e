"""Shared test setup: markers and hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import kvledger

settings.register_profile("dev", max_examples=30, stateful_step_count=30, deadline=None)
settings.register_profile(
    "ci", max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly", max_examples=2000, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_NOT_FAST = {"slow", "cuda", "vllm"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything not marked slow, cuda or vllm is part of the fast subset. With the
    compiled engine, tests marked pure are deselected: a patched engine function is
    not what compiled callers call. tests/test_build.py runs them on the pure build."""
    for item in items:
        if not _NOT_FAST & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.fast)
    if kvledger.BUILD.compiled:
        pure = [item for item in items if item.get_closest_marker("pure")]
        if pure:
            items[:] = [item for item in items if not item.get_closest_marker("pure")]
            config.hook.pytest_deselected(items=pure)


@pytest.fixture
def mount(tmp_path):
    """Mounts a real file system for a test (`mount("tmpfs", "size=1m")`, `mount("ramfs")`)
    and unmounts it after. Tests run as root (CI too): a mount that fails fails the test."""
    import subprocess

    points = []

    def make(fstype: str, options: str = ""):
        point = tmp_path / f"{fstype}{len(points)}"
        point.mkdir()
        args = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(point)]
        done = subprocess.run(args, capture_output=True, text=True)
        assert done.returncode == 0, f"cannot mount {fstype} ({options}): {done.stderr.strip()}"
        points.append(point)
        return point

    yield make
    for point in reversed(points):
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture
def valkey_server():
    """A real valkey-server on a free loopback port, killed after the test."""
    from kvledger.adapters.testing.valkey_servers import ServerProcess

    made = []

    def make(**options):
        made.append(ServerProcess(**options))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture(scope="session")
def valkey_cluster():
    """Three masters with a replica each, shared by the session's cluster tests."""
    from kvledger.adapters.testing.valkey_servers import ClusterProcesses

    cluster = ClusterProcesses()
    yield cluster
    cluster.close()
