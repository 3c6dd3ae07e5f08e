"""Imports kvledger from another checkout in every Python process that names this folder in PYTHONPATH.

`run_with_tree.py` sets `KVLEDGER_COMPAT_TREE` to a checkout of kvledger (an old commit's worktree) and puts
this folder first on PYTHONPATH, so processes vLLM starts (an engine core, tensor-parallel workers, spawned
or forked) load the same old kvledger, not the editable install's (which maps the name to the main
checkout). It also drops the editable install's finder, so no kvledger module can come from elsewhere, and
notes every opened file of another kvledger checkout's package in `KVLEDGER_COMPAT_STRAY` (a stray import).

Python imports only the first `sitecustomize` on its path: Debian's (an apport hook) is not run here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

TREE_ENV = "KVLEDGER_COMPAT_TREE"
STRAY_ENV = "KVLEDGER_COMPAT_STRAY"
PROCS_ENV = "KVLEDGER_COMPAT_PROCS"
PACKAGE_PARTS = ("__init__.py", "_build.py", "_compiled.py", "engine", "events", "adapters", "transfers")


def stray_modules(tree: Path) -> list[str]:
    """kvledger modules loaded from somewhere other than `tree`, as 'name: file'."""
    return [f"{name}: {module.__file__}" for name, module in list(sys.modules.items())
            if (name == "kvledger" or name.startswith("kvledger.")) and getattr(module, "__file__", None)
            and not Path(module.__file__).resolve().is_relative_to(tree)]


def load(tree: Path) -> None:
    """kvledger from `tree`, before anything imports it; the editable install's finder removed."""
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                        and "__editable__" not in repr(f)]
    if "kvledger" in sys.modules:
        if stray_modules(tree):
            raise SystemExit(f"kvledger was imported before the compat loader: {stray_modules(tree)}")
        return
    spec = importlib.util.spec_from_file_location("kvledger", tree / "__init__.py",
                                                  submodule_search_locations=[str(tree)])
    assert spec is not None and spec.loader is not None, tree
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvledger"] = module
    spec.loader.exec_module(module)


def _watch_opens(tree: Path, report: str) -> None:
    """Note each kvledger package file opened from a checkout other than `tree` (the main one)."""
    main = Path(__file__).resolve().parents[3]  # tests/compat/tree_site/ -> the checkout this file is in
    if main == tree:
        return
    roots = tuple(str(main / part) for part in PACKAGE_PARTS)

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(roots):
            with open(report, "a") as out:  # another path: the hook passes it over
                out.write(f"{os.getpid()} {args[0]}\n")

    sys.addaudithook(hook)


def _at_exit(tree: Path, report: str) -> None:
    stray = stray_modules(tree)
    if stray:
        with open(report, "a") as out:
            out.writelines(f"{os.getpid()} {line}\n" for line in stray)


if os.environ.get(TREE_ENV):
    import atexit

    _tree = Path(os.environ[TREE_ENV]).resolve()
    load(_tree)
    if os.environ.get(STRAY_ENV):
        _watch_opens(_tree, os.environ[STRAY_ENV])
        atexit.register(_at_exit, _tree, os.environ[STRAY_ENV])
    if os.environ.get(PROCS_ENV):  # which processes started through here (a forked one does not: it inherits)
        with open(os.environ[PROCS_ENV], "a") as _out:
            _out.write(f"{os.getpid()} {' '.join(sys.argv)[:200]}\n")
