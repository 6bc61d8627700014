"""`fedhop examples`: the example configs, shipped inside the installed package, listed and copied
into the user's folder, so a wheel install needs no clone to start (issue 45, item 4).

    fedhop examples                      # list: name and first comment line of each
    fedhop examples copy fedavg_digits   # ./fedavg_digits.toml
    fedhop examples copy plugin hosts --to my-exp   # ./my-exp/plugin/ (the plug-in package) and ./my-exp/hosts.toml
    fedhop examples copy claims/fedli_tuning        # ./claims/fedli_tuning.toml and the ./fedavg_digits.toml it sweeps

An example is a TOML file of the examples folder (`claims/fedli_tuning`, named by its path without
.toml) or one of its folders that is a project of its own (`plugin`: a pip-installable plug-in
package and its config).  Each lands at its path under the examples folder, and a sweep spec brings
the base config it names (`claims/fedli_tuning` -> claims/fedli_tuning.toml and fedavg_digits.toml),
so relative references hold.  Copying never replaces a file: an existing target is refused, in one
line with exit status 2, unless --force, and then nothing is written.
"""
from __future__ import annotations

import posixpath
import shutil
import sys
import tomllib
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

from fedhop.common.util.cliparser import ArgumentParser, folder_problem
from fedhop.common.util.suggest import did_you_mean

PROJECTS = ("plugin",)           # example folders copied whole (their parts belong together)


class ExampleError(ValueError):
    """A name that is no example, or a copy that would replace a file."""


def examples_root() -> Traversable:
    """The examples folder of this installation (the package data of fedhop.examples)."""
    return resources.files("fedhop.examples")


def _tomls(folder: Traversable, prefix: str = "") -> dict[str, Traversable]:
    out: dict[str, Traversable] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.is_dir() and entry.name not in PROJECTS and not entry.name.startswith(("_", ".")):
            out.update(_tomls(entry, f"{prefix}{entry.name}/"))
        elif entry.is_file() and entry.name.endswith(".toml"):
            out[prefix + entry.name.removesuffix(".toml")] = entry
    return out


def catalogue() -> dict[str, Traversable]:
    """name -> the example (a TOML file, or a project folder)."""
    root = examples_root()
    found = _tomls(root)
    for name in PROJECTS:
        if root.joinpath(name).is_dir():
            found[name] = root.joinpath(name)
    return dict(sorted(found.items()))


def describe(entry: Traversable) -> str:
    """An example's first comment line (a project: its config's)."""
    if entry.is_dir():
        tomls = sorted((e for e in entry.iterdir() if e.name.endswith(".toml") and e.name != "pyproject.toml"),
                       key=lambda e: e.name)
        return describe(tomls[0]) if tomls else ""
    for line in entry.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def _files(entry: Traversable, rel: Path) -> list[tuple[Traversable, Path]]:
    if entry.is_file():
        return [(entry, rel)]
    return [pair for child in sorted(entry.iterdir(), key=lambda e: e.name)
            if child.name != "__pycache__" for pair in _files(child, rel / child.name)]


def _sweep_base(entry: Traversable, key: str) -> str | None:
    """The example a sweep spec's `[sweep] config` names (relative to the spec, as `fedhop sweep`
    reads it), by its example name; copied along so the spec runs where it lands."""
    if entry.is_dir():
        return None
    try:
        base = tomllib.loads(entry.read_text()).get("sweep", {}).get("config")
    except tomllib.TOMLDecodeError:
        return None
    if not isinstance(base, str):
        return None
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(key), base))
    return None if joined.startswith("..") else joined.removesuffix(".toml")


def copy(names: list[str], to: Path, force: bool = False) -> list[Path]:
    """Copy the named examples into `to` (created if missing); returns the files written.  Nothing
    is written unless every name is known and no target exists (or `force`)."""
    known = catalogue()
    plan: dict[Path, Traversable] = {}
    wanted = [name.removesuffix(".toml").removeprefix("examples/") for name in names]
    for name, key in zip(names, wanted):
        if key not in known:
            raise ExampleError(f"no example named '{name}'{did_you_mean(key, known)}; `fedhop examples` lists them")
    while wanted:
        key = wanted.pop(0)
        entry = known[key]
        for src, rel in _files(entry, Path(key if entry.is_dir() else key + ".toml")):
            plan[rel] = src
        base = _sweep_base(entry, key)
        if base is not None and base in known and Path(base + ".toml") not in plan:
            wanted.append(base)
    targets = [(src, to / rel) for rel, src in plan.items()]
    existing = [t for _, t in targets if t.exists() or t.is_symlink()]
    if existing and not force:
        raise ExampleError(f"{existing[0]} exists; copy into another folder with --to DIR, or replace it with --force")
    for _, target in targets:   # what --force cannot replace, refused before any file is written
        if target.is_symlink() and not target.exists():
            raise ExampleError(f"{target} is a link to nothing ({target.readlink()}); remove it or copy elsewhere")
        if target.exists() and not target.is_file():
            raise ExampleError(f"{target} is a folder, not a file; --force replaces files only")
        blocked = next((p for p in target.parents if (p.exists() or p.is_symlink()) and not p.is_dir()), None)
        if blocked is not None:
            raise ExampleError(f"{blocked} is {'a link to nothing' if not blocked.exists() else 'a file'}, so "
                               f"{target} cannot be made under it")
    for src, target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        with src.open("rb") as fin, open(target, "wb") as fout:
            shutil.copyfileobj(fin, fout)
    return [t for _, t in targets]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop examples", description="list the example configs, or copy some into "
                                                                     "this folder")
    sub = ap.add_subparsers(dest="action")
    sub.add_parser("list", help="every example with its first comment line (the default)")
    cp = sub.add_parser("copy", help="copy examples into this folder (or --to DIR); never replaces a file")
    cp.add_argument("names", nargs="+", metavar="NAME", help="an example's name as `fedhop examples` lists it")
    cp.add_argument("--to", default=".", help="the folder to copy into (created if missing; default: here)")
    cp.add_argument("--force", action="store_true", help="replace files that exist")
    args = ap.parse_args(argv)
    if args.action in (None, "list"):
        known = catalogue()
        width = max(map(len, known), default=0)
        for name, entry in known.items():   # a project folder is shown with a trailing /
            print(f"{name + ('/' if entry.is_dir() else ''):<{width + 1}}  {describe(entry)}")
        print("\ncopy one into this folder: fedhop examples copy NAME; then: fedhop run NAME.toml")
        return 0
    problem = folder_problem(args.to, "--to") if args.to.strip() else "--to '': name a folder (. for here)"
    if problem is not None:
        print(f"fedhop examples: {problem} (the folder to copy into)", file=sys.stderr)
        return 2
    try:
        written = copy(args.names, Path(args.to), args.force)
    except (ExampleError, OSError) as exc:
        print(f"fedhop examples: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    steps = [step for step in map(next_step, written) if step]
    if steps:
        print(f"\nnext: {steps[0]}", file=sys.stderr)
    return 0


def next_step(path: Path) -> str | None:
    """The command that uses a copied file: a sweep spec is swept, a hosts file launched, a config run."""
    if path.suffix != ".toml" or path.name == "pyproject.toml":
        return None
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if "sweep" in data:
        return f"fedhop sweep {path}"
    if "hosts" in data or "host" in data:
        return f"fedhop launch {path} CONFIG.toml"
    return f"fedhop run {path}"
