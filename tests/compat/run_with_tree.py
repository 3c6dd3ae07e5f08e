"""Run a script (or `-m module`) with kvledger imported from another checkout of it.

Usage: python tests/compat/run_with_tree.py TREE SCRIPT [ARGS...]
       python tests/compat/run_with_tree.py TREE -m MODULE [ARGS...]

The editable install maps the name `kvledger` to this checkout; this loads it
from TREE instead (an old commit's `git worktree`), before anything imports it,
with `KVLEDGER_PURE=1` (the engine from TREE's source, nothing to compile). The
processes it starts (vLLM's engine core, tensor-parallel workers) load TREE's
kvledger too: `tree_site/` goes first on PYTHONPATH, whose `sitecustomize`
does the same at their start. At the end, every kvledger module loaded must
have come from TREE, and no process may have opened a file of this checkout's
package (`KVLEDGER_COMPAT_STRAY` names the file where they are noted); if one
did, the exit status is 97 whatever the script's was.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
from pathlib import Path

SITE = Path(__file__).resolve().parent / "tree_site"
STRAY_EXIT = 97


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    tree = Path(sys.argv[1]).resolve()
    if not (tree / "__init__.py").exists() or not (tree / "engine").is_dir():
        raise SystemExit(f"{tree} is not a kvledger checkout")
    os.environ["KVLEDGER_COMPAT_TREE"] = str(tree)
    os.environ.setdefault("KVLEDGER_PURE", "1")
    made_stray_file = not os.environ.get("KVLEDGER_COMPAT_STRAY")
    if made_stray_file:
        handle, name = tempfile.mkstemp(prefix="kvledger-compat-stray-", suffix=".txt")
        os.close(handle)
        os.environ["KVLEDGER_COMPAT_STRAY"] = name
    stray_file = Path(os.environ["KVLEDGER_COMPAT_STRAY"])
    paths = [str(SITE), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    sys.path.insert(0, str(SITE))
    import sitecustomize  # noqa: F401  this folder's, when PYTHONPATH named it at start; else loaded now

    if getattr(sitecustomize, "__file__", None) != str(SITE / "sitecustomize.py"):
        import importlib.util

        spec = importlib.util.spec_from_file_location("_compat_site", SITE / "sitecustomize.py")
        assert spec is not None and spec.loader is not None
        sitecustomize = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sitecustomize)  # with the environment set above: loads the tree's kvledger
    import kvledger

    assert Path(kvledger.__file__).resolve() == tree / "__init__.py", kvledger.__file__
    print(f"run_with_tree: kvledger from {kvledger.__file__}, {kvledger.BUILD}", file=sys.stderr, flush=True)

    sys.path.remove(str(SITE))
    if sys.argv[2] == "-m":
        target, rest = sys.argv[3], sys.argv[4:]
        sys.argv = [target, *rest]
        sys.path[0] = os.getcwd()  # as `python -m MODULE` would
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        target, rest = str(Path(sys.argv[2]).resolve()), sys.argv[3:]
        sys.argv = [target, *rest]
        sys.path[0] = str(Path(target).parent)  # as `python SCRIPT` would
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    code: object = 0
    try:
        run()
    except SystemExit as exc:
        code = exc.code
    finally:
        stray = sitecustomize.stray_modules(tree)
        opened = stray_file.read_text().splitlines() if stray_file.exists() else []
        if stray or opened:
            print(f"run_with_tree: kvledger NOT only from {tree}: {stray + opened}", file=sys.stderr, flush=True)
            code = STRAY_EXIT
        elif made_stray_file:
            stray_file.unlink(missing_ok=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
