"""What ships is what is tested (issue 36): the wheel's package list and data cannot drift from the tree.

A wheel built from pyproject's explicit list lacked ``pdserve.engine.core`` (``pdserve node`` crashed with
ModuleNotFoundError) and every ``.c``/``.h`` file (the C kernels could not be built). Here every folder with an
``__init__.py`` under a mapped folder must be listed, and every file a package reads at run time that is not
Python must be package data. ``scripts/wheel_check.sh`` (run by the README's test command) then builds the wheel,
installs it into a fresh venv and serves a completion through ``pdserve serve`` with the C kernels loaded.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parent.parent
SKIP = {"__pycache__"}
NOT_SHIPPED = ("*.md", "*.sh")          # documents and shell scripts beside the code: read by people, not by pdserve


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _tree_packages(mapping: dict[str, str]) -> set[str]:
    found = set()
    for package, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            parts = init.parent.relative_to(base).parts
            if not SKIP & set(parts):
                found.add(".".join((package, *parts)))
    return found


def test_every_package_in_the_tree_is_in_the_wheel():
    cfg = _setuptools()
    nested = {p for p in _tree_packages(cfg["package-dir"]) if p != "pdserve"}
    assert nested | {"pdserve"} == set(cfg["packages"]), "pyproject's [tool.setuptools] packages != the tree"


def test_every_non_python_file_a_package_reads_is_package_data():
    cfg = _setuptools()
    data = cfg.get("package-data", {})
    for package, folder in cfg["package-dir"].items():
        for path in (ROOT / folder).iterdir():
            if path.is_file() and path.suffix not in (".py", ".pyc") and not path.name.startswith(".") and \
                    not any(fnmatch.fnmatch(path.name, p) for p in NOT_SHIPPED):
                patterns = data.get(package, [])
                assert any(fnmatch.fnmatch(path.name, p) for p in patterns), f"{path} is not package data"
