"""run.db's WAL: one left beside run.db, folded in once nothing runs, and read-only reads that add
none (common/records/runstore.py, module docstring).

SQLite removes a database's WAL (and its -shm) when the last connection closes, and only a
connection that may write can: a read-only one (the launcher's progress, a dashboard, `fedhop
report`) that is open when the run's writer closes leaves the WAL beside run.db.  What is in it
is still the database's (the next connection reads it), but a copy of run.db alone, or a read
with SQLite's `immutable` flag, would not see it.  And a read-only connection to a database with
no WAL makes an empty -wal and -shm beside it that it cannot remove: `connect_ro` is how every
read-only reader of run.db opens it, so that reading a finished run leaves its folder as it was.  This module
needs nothing but sqlite3, so the run-folder checks that run before torch loads
(deploy/launch/runfolder.py) can use it.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from time import monotonic, sleep
from typing import Any

#: seconds a writer's close (and `fold_wal`) waits for a reader of an older snapshot so that its
#: checkpoint takes the whole WAL
CLOSE_CHECKPOINT_WAIT = 2.0

#: seconds between `fold_wal`'s tries while another connection keeps the WAL
FOLD_RETRY_EVERY = 0.05


def fold_wal(db: Path, wait: float = CLOSE_CHECKPOINT_WAIT) -> bool:
    """Fold a WAL left beside the SQLite file `db` into it and remove it with its -shm, as the
    last connection to close does; for a database none of whose writers is still running.
    A reader open at that moment (a poll of the run's progress that overlaps its end) keeps the
    WAL: the fold is tried again every FOLD_RETRY_EVERY s for up to `wait` s, as such a read
    lasts milliseconds.  Returns whether a WAL is left (a connection is still open: the data are
    in the database file, the WAL empty; or SQLite could not open the file: the next connection
    that can reads the WAL)."""
    wal = db.with_name(db.name + "-wal")
    deadline = monotonic() + wait
    while wal.exists():
        with contextlib.suppress(sqlite3.Error):
            con = sqlite3.connect(str(db), timeout=CLOSE_CHECKPOINT_WAIT)
            try:
                con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            finally:
                con.close()
        if not wal.exists() or monotonic() >= deadline:
            break
        sleep(FOLD_RETRY_EVERY)
    return wal.exists()


def connect_ro(db: Path, timeout: float = 10.0, **options: Any) -> sqlite3.Connection:
    """`db` opened read-only; FileNotFoundError where it does not exist.  Without a -wal file beside it
    (no writer has it open, and none left rows outside it) it is opened `immutable`, so that the read
    adds no -shm or -wal file to the run folder and needs no write access to it (a run folder on a
    read-only disk, or another user's); with one, read-only through that WAL (a live run).
    `timeout`: seconds a read waits for a writer's lock; `options`: sqlite3.connect's others."""
    db = Path(db).resolve()
    if not db.is_file():
        raise FileNotFoundError(f"no run database at {db}")
    flags = "mode=ro" if os.path.lexists(f"{db}-wal") else "mode=ro&immutable=1"
    con = sqlite3.connect(f"{db.as_uri()}?{flags}", uri=True, timeout=timeout, **options)
    try:
        con.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
    except sqlite3.Error:
        con.close()
        raise
    return con
