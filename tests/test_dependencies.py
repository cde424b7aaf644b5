"""pyproject.toml states what the code needs and what is tested: every third-party package that
pagedserve/ imports is declared, Ray is held to the series the code's use of its internals was
tested on, the web and template packages have floors past their known CVEs, and the pinned test
environment (constraints.txt) lies inside every range."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Import names whose distribution is named differently, for packages that may not be installed here.
DISTRIBUTION_OF = {"yaml": "pyyaml", "flash_attn": "flash-attn"}
# Optional kernels, imported only when their backend is chosen: an extra may declare them.
OPTIONAL = {"triton", "flash-attn"}


def requirements(extras: bool = False) -> dict[str, Requirement]:
    lines = list(PROJECT["dependencies"])
    if extras:
        lines += [line for group in PROJECT["optional-dependencies"].values() for line in group]
    return {canonicalize_name(Requirement(line).name): Requirement(line) for line in lines}


def imported_top_level_names(root: Path) -> set[str]:
    """Every absolute import in the package, top-level or inside a function."""
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"pagedserve", "__future__"}


@functools.cache
def installed_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution(import_name: str) -> str:
    installed = installed_distributions().get(import_name)
    return canonicalize_name(installed[0] if installed else DISTRIBUTION_OF.get(import_name, import_name))


def test_every_imported_package_is_declared():
    declared, with_extras = requirements(), requirements(extras=True)
    needed = {distribution(name) for name in imported_top_level_names(REPO / "pagedserve")}
    assert {"ray", "fastapi", "starlette", "psutil", "transformers"} <= needed  # the scan sees them
    missing = sorted(name for name in needed if name not in declared and not (name in OPTIONAL and name in with_extras))
    assert not missing, f"imported by pagedserve/ but not in pyproject's dependencies: {missing}"


def test_the_import_scan_finds_an_undeclared_package(tmp_path):
    (tmp_path / "mod.py").write_text("import os\nfrom requests_toolbelt import x\n\ndef f():\n    import psutil.tests\n")
    assert imported_top_level_names(tmp_path) == {"requests_toolbelt", "psutil"}


@pytest.mark.parametrize(
    "name, allowed, refused",
    [
        ("ray", ["2.60.0", "2.60.3"], ["2.59.0", "2.61.0", "3.0.0"]),  # the tested series only
        ("fastapi", ["0.109.1", "0.165.0"], ["0.109.0"]),  # CVE-2024-24762
        ("starlette", ["0.49.1", "1.10.0"], ["0.40.0", "0.47.1", "0.49.0"]),  # CVE-2024-47874, CVE-2025-54121, CVE-2025-62727
        ("jinja2", ["3.1.6"], ["3.1.4", "3.1.5"]),  # CVE-2024-56201, CVE-2024-56326, CVE-2025-27516
        ("transformers", ["5.0.0", "5.23.0"], ["4.53.0", "6.0.0"]),
    ],
)
def test_ranges_exclude_untested_and_vulnerable_versions(name, allowed, refused):
    specifier = requirements()[name].specifier
    assert all(specifier.contains(v) for v in allowed), (name, str(specifier))
    assert not any(specifier.contains(v) for v in refused), (name, str(specifier))


def test_the_pinned_environment_is_inside_every_range():
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    for name, requirement in requirements(extras=True).items():
        if name in pins:
            assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name], str(requirement.specifier))
    for name in ("ray", "fastapi", "starlette", "jinja2", "psutil", "transformers"):
        assert name in pins, f"{name} is not pinned in constraints.txt"
