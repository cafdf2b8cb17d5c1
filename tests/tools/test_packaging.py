"""pyproject.toml installs every package of the tree: each folder with an `__init__.py` under
the installed folders is listed in `[tool.setuptools] packages`, and each listed package is
such a folder (through `[tool.setuptools.package-dir]`). A package left out is missing from
the wheel, so its commands fail only where users install it (tests run on the checkout)."""
from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
# the folders installed as prefixgate.<folder> (DESIGN.md §1), and the configs
INSTALLED = ("common", "proxy", "plugins", "backend", "kernels", "conf")


def setuptools_table(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"]


def tree_packages(root: Path = ROOT) -> set[str]:
    """prefixgate.<dotted folder> for every folder with an __init__.py under INSTALLED."""
    return {".".join(("prefixgate", *init.parent.relative_to(root).parts))
            for folder in INSTALLED if (root / folder).is_dir()
            for init in (root / folder).rglob("__init__.py")}


def package_folder(package: str, package_dir: dict[str, str], root: Path = ROOT) -> Path:
    """Where setuptools looks for `package`: its nearest mapped parent's folder, then the rest
    of its name as subfolders."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        mapped = package_dir.get(".".join(parts[:i]))
        if mapped is not None:
            return root.joinpath(mapped, *parts[i:])
    return root.joinpath(*parts)


def packaging_problems(root: Path = ROOT) -> list[str]:
    table = setuptools_table(root)
    listed, package_dir = set(table["packages"]), table.get("package-dir", {})
    problems = [f"{p} is not in [tool.setuptools] packages"
                for p in sorted(tree_packages(root) - listed)]
    problems += [f"{p}: no {package_folder(p, package_dir, root).relative_to(root)}/__init__.py"
                 for p in sorted(listed)
                 if not (package_folder(p, package_dir, root) / "__init__.py").is_file()]
    return problems


def test_every_package_of_the_tree_is_installed():
    assert packaging_problems() == []


def test_the_check_catches_a_missing_and_a_stray_package(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["prefixgate.proxy", "prefixgate.proxy.gone"]\n'
        '[tool.setuptools.package-dir]\n"prefixgate.proxy" = "proxy"\n')
    for folder in ("proxy", "proxy/tune", "proxy/tune/deep", "proxy/data"):
        (tmp_path / folder).mkdir()
    for folder in ("proxy", "proxy/tune", "proxy/tune/deep"):
        (tmp_path / folder / "__init__.py").write_text("")
    assert packaging_problems(tmp_path) == [
        "prefixgate.proxy.tune is not in [tool.setuptools] packages",
        "prefixgate.proxy.tune.deep is not in [tool.setuptools] packages",
        "prefixgate.proxy.gone: no proxy/gone/__init__.py",
    ]
