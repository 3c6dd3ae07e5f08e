"""Each package's docstring is its index: a line per module and subpackage, its
name first, then its one job. A reader finds where a thing lives from it, so a
module it does not name, or a name it keeps after the module went, fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_MODULES = {"setup.py", "_compiled.py", "__init__.py"}  # the build script; written by the build
PACKAGES = sorted(path.parent for path in ROOT.glob("**/__init__.py")
                  if not {"tests", "bench", "build", "dist"} & set(path.relative_to(ROOT).parts)
                  and not any(part.startswith(".") for part in path.relative_to(ROOT).parts))
_ENTRY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*/?) {2,}\S")


def _members(package: Path) -> set[str]:
    modules = {path.stem for path in package.glob("*.py") if path.name not in NOT_MODULES}
    subpackages = {path.parent.name + "/" for path in package.glob("*/__init__.py")}
    return modules | subpackages


def _index(package: Path) -> set[str]:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return {match.group(1) for line in docstring.splitlines() if (match := _ENTRY.match(line))}


@pytest.mark.fast
@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)) or "kvledger")
def test_a_packages_index_names_every_module_it_holds(package: Path) -> None:
    members, index = _members(package), _index(package)
    assert not members - index, f"{package.relative_to(ROOT)}/__init__.py does not name {sorted(members - index)}"
    assert not index - members, f"{package.relative_to(ROOT)}/__init__.py names what is not there: " \
                                f"{sorted(index - members)}"


@pytest.mark.fast
def test_the_indexes_cover_every_package() -> None:
    assert {str(p.relative_to(ROOT)) for p in PACKAGES} >= {".", "engine", "events", "transfers", "adapters",
                                                            "adapters/vllm", "transfers/lower_tiers"}
