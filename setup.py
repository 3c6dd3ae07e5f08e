"""Compiles the engine (and the miss ledger, `_build.ALSO_COMPILED`) with mypyc at install time
(pyproject.toml holds everything else).

The repository root is the `kvledger` package, and mypyc names a module after
its path, so the sources are handed to mypyc through a `kvledger` link in a
scratch folder. All modules form one group, one shared library
(`kvledger/_engine__mypyc.*.so`), so calls between them are native. `_compiled.py`,
written beside the extension modules, records the hashes of the sources they
were built from (`_build.py` reads it at import).

A failed compile fails the install: a silently pure engine runs about 1.4x
slower and the suite would not say why. KVLEDGER_PURE_BUILD=1 installs without
compiling, on purpose.
"""

from __future__ import annotations

import os
import runpy
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
GROUP = "kvledger._engine"
build_info = runpy.run_path(os.path.join(ROOT, "_build.py"))
identity = runpy.run_path(os.path.join(ROOT, "_identity.py"))


def compiled_extensions() -> list:
    if os.environ.get("KVLEDGER_PURE_BUILD") == "1":
        print("kvledger: KVLEDGER_PURE_BUILD=1, the engine is not compiled")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        raise SystemExit(f"kvledger: mypyc (from mypy) is needed to build the engine: {exc}. "
                         "Install with build isolation (the default), or set KVLEDGER_PURE_BUILD=1.") from None
    scratch = tempfile.mkdtemp(prefix="kvledger-mypyc-")
    os.symlink(ROOT, os.path.join(scratch, "kvledger"), target_is_directory=True)
    target = os.path.join(ROOT, "build", "mypyc")
    here = os.getcwd()
    try:
        os.chdir(scratch)
        paths = ["kvledger/" + source for source in build_info["sources"](ROOT)]
        extensions = mypycify(paths, opt_level="3", group_name=GROUP, target_dir=target)
    finally:
        os.chdir(here)
        shutil.rmtree(scratch)
    for extension in extensions:  # setuptools wants paths relative to setup.py
        extension.sources = [os.path.relpath(source, ROOT) for source in extension.sources]
    return extensions


class BuildExt(build_ext):
    """build_ext, then `_compiled.py` beside the extension modules."""

    def run(self) -> None:
        super().run()
        if not self.extensions:
            return
        package_dir = os.path.dirname(self.get_ext_fullpath(GROUP + "__mypyc"))
        hashes = build_info["fingerprint"](ROOT)
        with open(os.path.join(package_dir, "_compiled.py"), "w") as file:
            file.write('"""Written by setup.py: the source each compiled engine module was built from."""\n\n')
            file.write(f"HASHES = {hashes!r}\n")


class BuildPy(build_py):
    """build_py, less this script, which sits in the package's folder but is no part of it;
    and `_commit.txt`, the commit the wheel is built from, which its logs record."""

    def run(self) -> None:
        super().run()
        commit = identity["from_git"](ROOT)
        if commit is not None and not self.editable_mode:
            with open(os.path.join(self.build_lib, "kvledger", identity["COMMIT_FILE"]), "w") as file:
                file.write(commit + "\n")

    def find_package_modules(self, package: str, package_dir: str) -> list:
        return [entry for entry in super().find_package_modules(package, package_dir)
                if (entry[0], entry[1]) != ("kvledger", "setup")]


setup(ext_modules=compiled_extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})
