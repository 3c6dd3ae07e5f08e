"""Which engine runs: the modules mypyc compiled, or the Python source they came from.

setup.py compiles the modules `sources()` names and writes each one's source hash
into `_compiled.py` beside them. kvledger uses the compiled modules only while
those hashes match the source on disk. Otherwise (an edited engine not yet
rebuilt, an install without a compiler's build, or KVLEDGER_PURE=1, which the
suite uses to test the source itself) a finder placed first on `sys.meta_path`
loads those modules from source, so an extension module never shadows newer code.
Standard library only: setup.py loads this file by path, before kvledger exists.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

ROOT = os.path.dirname(os.path.abspath(__file__))
PURE_ENV = "KVLEDGER_PURE"


# Left as Python: mypyc rejects attrs fields whose default is a factory of a
# builtin type (ReplayResult's Counter and list), and the fold's cost is in the
# reducer and the invariants it calls, which are compiled.
NOT_COMPILED = ("engine/__init__.py", "engine/replay.py")

# Compiled beside the engine: the miss ledger, which `explain`, `whatif` and the live miss
# counter fold an event at a time (`explain` of a 2M-event log 0.88-0.92x of the time with it
# from source; bench/history/2026-12-07.md, "Log tools, fourth pass"). Its admissions' attrs
# classes stay Python (`adapters/log_tools/admissions.py`).
ALSO_COMPILED = ("adapters/log_tools/misses.py",)


def sources(root: str = ROOT) -> list[str]:
    """The compiled modules' sources, relative to the package root: engine/, less NOT_COMPILED,
    and ALSO_COMPILED."""
    found = (os.path.relpath(path, root).replace(os.sep, "/") for path in glob.glob(os.path.join(root, "engine", "*.py")))
    return sorted([source for source in found if source not in NOT_COMPILED] + list(ALSO_COMPILED))


def module_name(source: str) -> str:
    return "kvledger." + source[:-len(".py")].replace("/", ".")


def fingerprint(root: str = ROOT) -> dict[str, str]:
    """sha256 of each source, as setup.py records it and the import checks it."""
    hashes = {}
    for source in sources(root):
        with open(os.path.join(root, source), "rb") as file:
            hashes[source] = hashlib.sha256(file.read()).hexdigest()
    return hashes


class Build:
    """The build in use, and why."""

    def __init__(self, compiled: bool, reason: str, modules: Sequence[str]) -> None:
        self.compiled = compiled
        self.reason = reason
        self.modules = tuple(modules)  # the modules this choice covers

    def __repr__(self) -> str:
        return f"Build({'compiled' if self.compiled else 'pure'}: {self.reason})"


def decide(pure_env: str | None, recorded: dict[str, str] | None, current: dict[str, str]) -> Build:
    modules = [module_name(source) for source in current]
    if pure_env == "1":
        return Build(False, f"{PURE_ENV}=1", modules)
    if recorded is None:
        return Build(False, "not compiled (no _compiled.py: installed without mypyc's build)", modules)
    if recorded != current:
        changed = sorted(set(recorded.items()) ^ set(current.items()))
        names = sorted({source for source, _ in changed})
        return Build(False, f"stale: the compiled modules were built from other source ({', '.join(names)}); "
                            f"rebuild with `pip install -e .` (or `make venv`)", modules)
    return Build(True, "compiled with mypyc, built from the source on disk", modules)


class SourceFinder(importlib.abc.MetaPathFinder):
    """Finds `names` in their `.py` files only, passing over extension modules."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in self.names or not path:
            return None
        loaders = [(importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)]
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, *loaders).find_spec(fullname, target)
            if spec is not None:
                return spec
        return None


def select() -> Build:
    """Choose at kvledger's import; with the pure build, route imports to source."""
    try:
        recorded = importlib.import_module("kvledger._compiled").HASHES  # written by setup.py
    except ImportError:
        recorded = None
    build = decide(os.environ.get(PURE_ENV), recorded, fingerprint())
    if not build.compiled:
        sys.meta_path.insert(0, SourceFinder(build.modules))
        if build.reason.startswith("stale"):
            warnings.warn(f"kvledger runs its engine from source: {build.reason}", RuntimeWarning, stacklevel=3)
    return build
