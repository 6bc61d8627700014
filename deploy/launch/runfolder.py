"""Run folders: which folder a new run may take, and what marks one as in use.

A run takes its folder by creating `config.toml` exclusively (`claim`: of two runs started at once
with the same `--out`, one gets it) and holds it while it lives: `hold` takes an exclusive flock on
the folder itself, which every process the launcher forks shares, so a folder stays "in use" while
any process of its run is alive (the launcher, or children it left behind).

A run that takes a folder also marks it (`RUN_MARK`, written right after the claim).  Only a
marked folder is ever emptied: a false start (its run never got as far as a round: it failed or
was stopped while its processes started, and nothing holds it) is reused by `--out`, an earlier
run is replaced with --force.  A folder that holds a run's file names but no mark (a `config.toml`
or `run.db` of the user's, a run of another tool) and a folder that holds no run are never
touched, --force or not: fedhop does not delete a user's files.  A report or `--resume` reads any
folder that holds a run's files.

This module imports nothing heavy, so `fedhop run --out` refuses a taken folder before torch loads.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from typing import Callable

from fedhop.common.records.walfold import fold_wal
from fedhop.common.util.cliparser import folder_problem


def run_stamp(name: str, seed: int, when: float | None = None, utc: bool = False) -> str:
    """A run folder's name, `NAME-seedS-YYYYmmdd-HHMMSS`: runs of one config with other seeds are
    told apart by their folders (`fedhop run`'s runs/ and the compose server role's runs-compose/)."""
    moment = time.gmtime(when) if utc else time.localtime(when)
    return f"{name}-seed{seed}-{time.strftime('%Y%m%d-%H%M%S', moment)}"


class RunDirError(ValueError):
    """`--out` names a folder a new run cannot use; the message says why and what to do."""


# what marks a folder as a run directory (a run writes these first; docs/run-folder.md)
RUN_MARKERS = ("config.toml", "run.db", "summary.json", "ledger", "checkpoints")
# the file a run writes when it takes its folder: the one proof that fedhop made the run there,
# and so may empty the folder for a new run (`check_out`)
RUN_MARK = ".fedhop-run"
_HELD: list[int] = []        # descriptors of the folders this process holds (released when it exits)


def new_folder(parent: Path, stamp: str, take: Callable[[Path], bool] = lambda folder: True) -> Path:
    """A new folder PARENT/STAMP made for this caller (`-2`, `-3`, ... when one of that name exists:
    mkdir is atomic, so two callers never get the same one), and taken by `take` (a run holds and
    claims it; a folder `take` refuses is passed over)."""
    parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        folder = parent / (stamp if n == 1 else f"{stamp}-{n}")
        n += 1
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        if take(folder):
            return folder


def holds_run(folder: Path) -> bool:
    return any((folder / name).exists() for name in RUN_MARKERS)


def marked(folder: Path) -> bool:
    """Whether a fedhop run took `folder` (`claim` wrote its RUN_MARK)."""
    return (folder / RUN_MARK).is_file()


def claim(folder: Path) -> bool:
    """Take `folder` for a new run: create its config.toml exclusively, so that of two runs
    started at once with the same folder exactly one gets it, then mark it as a run's (RUN_MARK)."""
    try:
        os.close(os.open(folder / "config.toml", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    (folder / RUN_MARK).write_text("a fedhop run's folder: `fedhop run --out` may empty it for a new run "
                                   "(docs/run-folder.md)\n")
    return True


def hold(folder: Path) -> bool:
    """Hold `folder` for this process's run (and every process it forks) until they exit; False
    if another run holds it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _HELD.append(fd)
    return True


def release_since(count: int) -> None:
    """Let go of the folders this process took after it held `count` of them (`held_count`): a
    process that runs several runs one after another (the Python API) holds each only while it runs."""
    while len(_HELD) > count:
        os.close(_HELD.pop())


def held_count() -> int:
    return len(_HELD)


def in_use(folder: Path) -> bool:
    """Whether a live process holds `folder` (`hold`)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)       # closing releases a lock taken here
    return False


def rounds_done(folder: Path) -> int:
    """Rounds the folder's run recorded: summary.json's rounds_completed, or where that says none,
    run.db's rounds rows (0 when neither says anything).  For a folder no process holds."""
    done = 0
    try:
        summary = json.loads((folder / "summary.json").read_text())
        done = int(summary.get("rounds_completed") or 0) if isinstance(summary, dict) else 0
    except (OSError, ValueError, TypeError):
        pass
    db = folder / "run.db"
    if done == 0 and db.is_file():
        fold_wal(db)   # a run killed before closing run.db left rows in its WAL, which `immutable` does not read
        try:   # immutable: no process holds the folder, and a reader of a WAL database would add its -shm file
            con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True, timeout=1.0)
            try:
                row = con.execute("SELECT COUNT(*) FROM rounds WHERE round > 0").fetchone()
                done = max(done, int(row[0] or 0))
            finally:
                con.close()
        except sqlite3.Error:
            pass
    return done


def false_start(folder: Path, held: bool = False) -> bool:
    """A run folder whose run ended before its first round: no round recorded, no checkpoint, and
    no live process holding it (`held`: this process holds it, so none other does)."""
    if not holds_run(folder) or (not held and in_use(folder)):
        return False
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return False
    return rounds_done(folder) == 0


def _empty(folder: Path) -> None:
    """Delete what `folder` holds, keeping the folder (and so the hold this process has on it)."""
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def give_back(folder: Path, made: bool) -> None:
    """Undo a run's taking of `folder` when its config was refused before anything ran (a data set
    the partition cannot split, a data file that is not one): what the run wrote there is deleted,
    and the folder too when the run `made` it, so a refusal leaves no false start behind.  Only for
    a folder this process holds and claimed (`out_run_dir`, `new_folder`)."""
    if not marked(folder):
        return
    if made:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        _empty(folder)


def check_out(out: str, force: bool = False, held: bool = False) -> Path:
    """Whether `--out` may be a new run's folder, without taking it (what `fedhop run` checks before
    it loads anything heavy): RunDirError saying why not.  `held`: this process holds the folder."""
    problem = folder_problem(out, "--out")   # a file there, or on the way to it
    if problem is not None:
        raise RunDirError(problem)
    folder = Path(out).expanduser().resolve()
    if folder.is_dir() and any(folder.iterdir()):
        if not holds_run(folder):
            raise RunDirError(f"--out {out}: {folder} is not empty and holds no fedhop run; name a new or empty folder")
        if not marked(folder):
            raise RunDirError(f"--out {out}: {folder} holds files of a run that no fedhop run made there (no "
                              f"{RUN_MARK}), so fedhop will not empty it, --force or not; name a new or empty folder")
        if not held and in_use(folder):
            raise RunDirError(f"--out {out}: a run is still using {folder}; name another folder")
        if not force and not false_start(folder, held):
            raise RunDirError(f"--out {out}: {folder} holds an earlier run; name another folder, continue it with "
                              f"`fedhop run --resume {out}`, or replace it with --force")
    return folder


def out_run_dir(out: str, force: bool = False) -> Path:
    """The absolute run folder named by `--out` (relative to the working directory), held and
    claimed for a new run.  An earlier run there is replaced only with `force`, or when it was a
    false start (it recorded no round); a non-empty folder that holds no run is always refused."""
    folder = check_out(out, force)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:   # no permission, a read-only file system, ...
        raise RunDirError(f"--out {out}: cannot make {folder}: {exc.strerror or exc}") from None
    if not hold(folder):
        raise RunDirError(f"--out {out}: another run started in {folder} at the same time")
    if any(folder.iterdir()):
        check_out(out, force, held=True)   # held now: what it holds can no longer change under us
        _empty(folder)
    if not claim(folder):
        raise RunDirError(f"--out {out}: another run started in {folder} at the same time")
    return folder


def record_server_lost(run_dir: Path, status: str, why: str) -> None:
    """After the server process has ended without recording the run's end (killed, crashed, or
    killed by a second Ctrl-C): run.db's run, still "running", becomes `status` with a
    `server_lost` event saying `why`, so that a reader of run.db (a report, a dashboard, a script)
    is not told a dead run is running.  A run whose server recorded its end is left as it is;
    `fedhop run --resume` continues either from the last checkpoint.  Used by the launchers that
    outlive the server: `fedhop run`, `fedhop launch` (the run.db it gathered),
    `fedhop slurm --wait`."""
    from fedhop.common.records.runstore import RunStore
    if not (run_dir / "run.db").is_file():
        return
    try:
        store = RunStore(run_dir / "run.db")
        try:
            run = store.run()
            if run is not None and run.get("status") == "running":
                store.add_event("server_lost", node="server", detail=why)
                store.finish_run(status)
        finally:
            store.close()
    except Exception as exc:   # noqa: BLE001 - the run is over either way; its rounds are kept
        print(f"fedhop: could not record the run's end in {run_dir / 'run.db'} ({exc})", file=sys.stderr)
