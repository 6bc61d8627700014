"""Helpers for tests/test_installed.py: build the fedhop wheel from the working tree, install it
into a fresh venv, and run that venv's `fedhop` the way a user does (from a folder of their own,
relative paths, no PYTHONPATH).

Why the fresh venv borrows the test venv's dependencies.  Installing torch, grpcio, scikit-learn
and the rest from the network in every CI run would take minutes and fail offline, and the point of
the test is fedhop's own packaging (is every module, data file and entry point in the wheel, does
anything still lean on the repository's folder layout or working directory), not pip's resolver.
So the wheel goes in with `--no-deps --no-index`, and a .pth file in the new venv's site-packages
lists the test venv's site-packages folders.  A .pth line is appended to sys.path *after* the
venv's own site-packages, so `fedhop.*` comes from the wheel; and a plain path line does not make
Python process the .pth files of the folder it names, so the test venv's editable-install finder
(`__editable__.fedhop-*.pth`, which maps fedhop.* to the checkout) stays inert.  The test then
checks both halves: every fedhop module resolves inside the fresh venv (never the checkout), and
every dependency the wheel declares is installed at a version its requirement admits and imports.

The wheel is built with `pip wheel --no-build-isolation` (the test venv's setuptools, no network)
from a copy of the working tree's files (tracked, plus untracked files git does not ignore), so the
change under test is what gets built, and setuptools' build/ and *.egg-info land in the copy, never
in the checkout.  FEDHOP_TEST_WHEEL=PATH tests a wheel built elsewhere instead (a release, or
today's main built from `git archive` to see which parts of the journey it fails).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import read_db, read_line  # noqa: F401  (read_line: tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
WHEEL_ENV = "FEDHOP_TEST_WHEEL"

# what a build (setuptools, pip) or a run from the wrong folder writes: none may appear in, or change in, the checkout
LEFT_BEHIND = ("build", "dist", "runs", "sweeps")
LEFT_BEHIND_SUFFIXES = (".egg-info", ".whl")


def working_tree_files(root: Path = ROOT) -> list[str]:
    """The files a build of the working tree sees: tracked ones that still exist, plus untracked
    files that git does not ignore (relative paths)."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True, timeout=60).stdout.decode()
    return sorted({p for p in out.split("\0") if p and os.path.lexists(root / p)})


def copy_working_tree(dest: Path, root: Path = ROOT) -> Path:
    """Copy the working tree's files (not .git, .venv or ignored build outputs) into `dest`."""
    if (root / ".git").exists() and shutil.which("git"):
        for rel in working_tree_files(root):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, target, follow_symlinks=False)
    else:   # an unpacked source tree without git: everything but the usual build and environment folders
        shutil.copytree(root, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "runs", "wheelhouse", "__pycache__", ".pytest_cache"))
    return dest


def left_behind(root: Path = ROOT) -> dict[str, int]:
    """Build outputs and run folders in the checkout (`git status --ignored`): path -> mtime_ns."""
    if not (root / ".git").exists() or not shutil.which("git"):
        return {}
    out = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--ignored", "--untracked-files=normal"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    found = {}
    for line in out.splitlines():
        path = line[3:].rstrip("/")
        name = Path(path).name
        if name in LEFT_BEHIND or name.endswith(LEFT_BEHIND_SUFFIXES):
            try:
                found[path] = (root / path).stat().st_mtime_ns
            except OSError:
                found[path] = -1
    return found


def build_wheel(workdir: Path) -> Path:
    """`pip wheel` of a copy of the working tree, in `workdir`; returns the wheel's path."""
    src = copy_working_tree(workdir / "src")
    wheels = workdir / "wheels"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(wheels), str(src)], capture_output=True, text=True, cwd=workdir, timeout=600)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    built = sorted(wheels.glob("fedhop-*.whl"))
    assert len(built) == 1, built
    return built[0]


def dependency_folders() -> list[str]:
    """The test environment's site-packages folders, in sys.path order."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


@dataclass
class Installed:
    venv: Path
    wheel: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def fedhop(self) -> Path:
        return self.venv / "bin" / "fedhop"

    def env(self) -> dict[str, str]:
        """A user's environment with this venv activated: no PYTHONPATH, no FEDHOP_* settings."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV") and not k.startswith("FEDHOP_")}
        env["VIRTUAL_ENV"] = str(self.venv)
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env


def install(wheel: Path, venv: Path) -> Installed:
    """A fresh venv holding `wheel` (no dependencies installed: see the module docstring)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz-test-dependencies.pth").write_text("\n".join(dependency_folders()) + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip install of {wheel.name} failed:\n{done.stderr[-3000:]}"
    return Installed(venv, wheel)


# Run by the fresh venv's interpreter: where fedhop comes from, and each declared dependency's
# installed version and whether one of its top-level modules imports.
PROBE = r"""
import importlib, json, re, sys
import importlib.metadata as md
import fedhop, fedhop.common, fedhop.deploy.cli.cli, fedhop.deploy.launch.launcher, fedhop.server, fedhop.client, fedhop.edge
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
dist = md.distribution("fedhop")
tops = md.packages_distributions()
deps = {}
for text in dist.requires or []:
    if "extra ==" in text:
        continue
    name = re.split(r"[\s;<>=!~\[(]", text, maxsplit=1)[0]
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        deps[text] = {"version": None, "module": None, "error": "not installed"}
        continue
    mods = sorted(m for m, ds in tops.items() if m.isidentifier() and not m.startswith("_")
                  and any(norm(d) == norm(name) for d in ds))
    mod = norm(name) if norm(name) in mods else (mods[0] if mods else None)
    error = None
    try:
        importlib.import_module(mod)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    deps[text] = {"version": version, "module": mod, "error": error}
print(json.dumps({
    "fedhop_path": list(fedhop.__path__),
    "modules": {m.__name__: m.__file__ for m in (fedhop.common, fedhop.deploy.cli.cli, fedhop.deploy.launch.launcher,
                                                 fedhop.server, fedhop.client, fedhop.edge)},
    "dist": str(dist.locate_file("")), "version": dist.version, "deps": deps, "sys_path": sys.path}))
"""


def probe(inst: Installed, cwd: Path) -> dict:
    done = subprocess.run([str(inst.python), "-c", PROBE], capture_output=True, text=True, cwd=cwd, env=inst.env(),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def fedhop(inst: Installed, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed `fedhop` in `cwd` and wait for it."""
    return subprocess.run([str(inst.fedhop), *args], capture_output=True, text=True, cwd=cwd, env=inst.env(),
                          timeout=timeout)


def start(inst: Installed, *args: str, cwd: Path, **kw) -> subprocess.Popen:
    """Start the installed `fedhop` in `cwd` in its own process group (as a terminal's job)."""
    return subprocess.Popen([str(inst.fedhop), *args], cwd=cwd, env=inst.env(), text=True,
                            start_new_session=True, **kw)


def explain(done: subprocess.CompletedProcess | subprocess.Popen, run_dir: Path | None = None,
            out: str = "", err: str = "") -> str:
    """A failure message: the command's output and the last lines of the run's logs."""
    out = out or (done.stdout if isinstance(done.stdout, str) else "")
    err = err or (done.stderr if isinstance(done.stderr, str) else "")
    text = f"exit {done.returncode}\n--- stdout\n{out[-2000:]}\n--- stderr\n{err[-2000:]}"
    if run_dir is not None and (run_dir / "logs").is_dir():
        for log in sorted((run_dir / "logs").glob("*.log")):
            text += f"\n--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-8:])
    return text


def rounds_recorded(db: Path) -> int:
    """Rows in run.db's rounds table, read-only (0 while the table or the file is not there)."""
    return int(read_db(db, "SELECT COUNT(*) FROM rounds", default=0))
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            return con.execute("SELECT COUNT(*) FROM rounds").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 300) -> None:
    """Block until `ready()` (a check of files the run writes, polled); fail if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"fedhop exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.05)


def interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the job's whole process group (if still there)."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass


def wheel_under_test(workdir: Path) -> Path:
    """The wheel FEDHOP_TEST_WHEEL names, else one built from the working tree."""
    given = os.environ.get(WHEEL_ENV)
    return Path(given).resolve() if given else build_wheel(workdir)
