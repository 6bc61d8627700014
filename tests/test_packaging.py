"""Packaging that installs (issue 18, item 6): consistent pins, a true requires-python, no
mlxtend/pandas in the default install, `fedhop --version`, every bench subcommand in its help."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCE_DIRS = ("api", "common", "client", "edge", "server", "deploy")
# pandas is the optional extra `pandas`: imported only by RunResult.to_pandas(), inside a function
OPTIONAL_PANDAS = ROOT / "deploy" / "api.py"


def _sources():
    for d in SOURCE_DIRS:
        yield from (ROOT / d).rglob("*.py")


def test_no_package_is_pinned_to_two_versions():
    """`pip install '.[extra]'` fails with ResolutionImpossible when an extra pins a package
    (torch) to another version than the dependencies do."""
    project = PYPROJECT["project"]
    pins: dict[str, set[str]] = {}
    groups = {"dependencies": project["dependencies"], **project.get("optional-dependencies", {})}
    for group, reqs in groups.items():
        for text in reqs:
            req = Requirement(text)
            for spec in req.specifier:
                if spec.operator == "==":
                    pins.setdefault(req.name.lower(), set()).add(spec.version)
    assert {name: v for name, v in pins.items() if len(v) > 1} == {}


def test_default_install_has_no_mlxtend_or_pandas():
    deps = {Requirement(t).name.lower() for t in PYPROJECT["project"]["dependencies"]}
    assert not deps & {"mlxtend", "pandas"}
    for path in _sources():
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+mlxtend\b", text, re.M), path
        if path == OPTIONAL_PANDAS:   # one import, inside `try: ... except ImportError`, never at module level
            assert re.findall(r"^(\s*)import pandas\n\s*except ImportError:", text, re.M) == [" " * 12], path
        else:
            assert not re.search(r"^\s*(import|from)\s+pandas\b", text, re.M), path


def test_requires_python_admits_no_version_without_tomllib():
    """The code imports tomllib (Python 3.11+) without a fallback, so requires-python must not admit 3.10."""
    users = [p for p in _sources() if re.search(r"^\s*import tomllib", p.read_text(), re.M)]
    assert users, "no module imports tomllib any more: this test can go"
    spec = SpecifierSet(PYPROJECT["project"]["requires-python"].split("#")[0].strip())
    assert "3.10.14" not in spec and "3.11.0" in spec


def test_version_flag_prints_the_installed_version():
    out = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"fedhop {PYPROJECT['project']['version']}"


def test_bench_help_lists_every_subcommand():
    from fedhop.deploy.bench.bench import BENCHMARKS
    out = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "bench", "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(BENCHMARKS) == {"transport", "compute", "scale", "growth", "gpu", "large", "flower", "peers"}
    for name in BENCHMARKS:
        assert re.search(rf"\b{name}\b", out.stdout.split("positional arguments")[1]), name


def test_every_source_package_is_in_the_wheel():
    """Every folder with an __init__.py under the mapped source folders is a package the wheel
    lists (pyproject.toml [tool.setuptools] packages, mapped by package-dir), or sits under one
    whose package-data carries its modules (the topology folders): a new sub-package left out
    would import in a checkout and fail in an installed wheel."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folder_of = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    data = setuptools.get("package-data", {})

    def carried(package: str) -> bool:   # its __init__.py is data of an enclosing listed package
        for owner, globs in data.items():
            if package.startswith(owner + "."):
                rel = package[len(owner) + 1:].replace(".", "/") + "/__init__.py"
                if any(PurePosixPath(rel).match(g) or g.startswith("**/") and PurePosixPath(rel).match(g[3:])
                       for g in globs):
                    return True
        return False

    missing = []
    for name, folder in folder_of.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            package = ".".join([name, *rel.parts]) if rel.parts else name
            if package not in listed and not carried(package):
                missing.append(package)
    assert missing == [], f"packages not in pyproject.toml's [tool.setuptools] packages: {missing}"
