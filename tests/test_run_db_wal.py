"""run.db's WAL when a reader is open as the run's writer closes (common/records/walfold.py).

SQLite leaves a WAL beside its database when the last connection to close may not write (a
read-only reader: the launcher's progress, a dashboard, `fedhop report`), and what is in it is
not in run.db: a copy of run.db alone, or a read with `immutable` (what a run folder's next user
reads, deploy/launch/runfolder.py), would miss it.  The writer's close checkpoints first, the
launcher folds what is left once its run is over, and a folder's next user folds the WAL of a
run that was killed before it closed run.db.
"""
from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from fedhop.common.records.runstore import RunStore
from fedhop.common.records.walfold import connect_ro, fold_wal
from fedhop.deploy.launch.runfolder import false_start, rounds_done
from tests.helpers import max_round, quadratic_config, read_db, wait_until

PY = sys.executable


def immutable_rounds(db: Path) -> int:
    """Rounds run.db's file itself holds (`immutable`: SQLite reads neither its WAL nor its locks)."""
    con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    try:
        return int(con.execute("SELECT COUNT(*) FROM rounds").fetchone()[0])
    except sqlite3.OperationalError:   # the table itself only in the WAL
        return 0
    finally:
        con.close()


def wal(db: Path) -> Path:
    return db.with_name("run.db-wal")


def test_a_writer_closing_beside_an_open_reader_leaves_every_row_in_run_db(tmp_path):
    db = tmp_path / "run.db"
    store = RunStore(db)
    store.start_run("r")
    for r in (1, 2, 3):
        store.add_round(r, participants=[0, 1], metrics={"loss": 1.0 / r})
    reader = sqlite3.connect(f"file:{db}?mode=ro", uri=True)   # as the launcher's progress reads it
    assert reader.execute("SELECT COUNT(*) FROM rounds").fetchone()[0] == 3
    store.close()
    assert wal(db).exists()   # the reader's connection keeps it: the writer was not the last to close
    assert immutable_rounds(db) == 3 and wal(db).stat().st_size == 0
    assert fold_wal(db, wait=0.2) is True   # the reader is still open: its WAL stays, empty
    reader.close()
    assert fold_wal(db) is False
    assert not wal(db).exists() and not db.with_name("run.db-shm").exists()
    assert RunStore(db, create=False).rounds()[-1]["round"] == 3


def files_beside(db: Path) -> list[str]:
    return sorted(p.name for p in db.parent.iterdir() if p.name.startswith("run.db-"))


def test_reading_a_finished_run_adds_no_wal_to_its_folder(tmp_path):
    """A read-only SQLite connection to a database without a WAL makes an empty -wal and -shm that
    it cannot remove: a test's poll, a dashboard or the launcher's progress that read run.db after
    its run closed it would leave them (and the run folder would look left open).  Every reader
    opens it with `connect_ro`, `immutable` where no WAL is there; with a writer open, through its
    WAL, so that a live run's rows are read."""
    from fedhop.deploy.launch.launcher import read_progress, registration_complete
    from fedhop.deploy.tools.dashboard import _snapshot
    from fedhop.deploy.tools.runread import read_run_db
    db = tmp_path / "run.db"
    store = RunStore(db)
    store.start_run("r")
    store.add_round(1, participants=[0, 1], metrics={"loss": 1.0})
    live = connect_ro(db)   # a writer is open: its WAL is read, not the file alone
    try:
        assert live.execute("SELECT COUNT(*) FROM rounds").fetchone()[0] == 1 and immutable_rounds(db) == 0
        store.add_round(2, participants=[0, 1], metrics={"loss": 0.5})
        assert live.execute("SELECT COUNT(*) FROM rounds").fetchone()[0] == 2
    finally:
        live.close()
    store.close()
    assert files_beside(db) == []
    assert read_db(db, "SELECT MAX(round) FROM rounds") == 2
    assert [r["round"] for r in read_progress(db, 0, final=True)] == [1, 2]
    assert registration_complete(db) is False
    assert [r["round"] for r in _snapshot(tmp_path, {})["rounds"]] == [1, 2]
    assert [r["round"] for r in read_run_db(tmp_path)[0]] == [1, 2]
    with RunStore(db, create=False, read_only=True) as reader:   # the report's, the sweep's
        assert [r["round"] for r in reader.rounds()] == [1, 2]
    assert files_beside(db) == []
    plain = sqlite3.connect(f"file:{db}?mode=ro", uri=True)   # what each of them did before
    plain.execute("SELECT COUNT(*) FROM rounds").fetchone()
    plain.close()
    assert files_beside(db) == ["run.db-shm", "run.db-wal"]


def test_checking_someone_elses_database_leaves_nothing_beside_it(tmp_path):
    """`foreign_schema_problem` refuses a SQLite file that is not a run's before any writer opens
    it; the file is someone else's, so the check adds no -wal or -shm file beside it either, even
    where that file is a WAL database."""
    from fedhop.common.records.runstore import foreign_schema_problem
    db = tmp_path / "run.db"
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("CREATE TABLE notes (x)")
    con.commit()
    con.close()
    assert foreign_schema_problem(db) == "holds no table of a run (tables: notes)"
    assert files_beside(db) == []
    assert foreign_schema_problem(tmp_path / "missing.db").startswith("not a SQLite database (no run database at ")


def test_a_fold_outlasts_a_read_that_overlaps_the_runs_end(tmp_path, monkeypatch):
    """A reader open at the fold's first try (a poll of the run's progress as the run ends) keeps
    the WAL; the fold tries again while its wait lasts, so the WAL is gone once the read ends."""
    import fedhop.common.records.walfold as walfold

    db = tmp_path / "run.db"
    store = RunStore(db)
    store.start_run("r")
    store.add_round(1, participants=[0], metrics={"loss": 1.0})
    reader = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    reader.execute("SELECT COUNT(*) FROM rounds").fetchone()
    store.close()
    pauses: list[float] = []

    def pause(seconds: float) -> None:   # the reader's read ends after the fold's first try
        pauses.append(seconds)
        reader.close()
    monkeypatch.setattr(walfold, "sleep", pause)   # this module's pause only, no other thread's
    assert fold_wal(db, wait=60.0) is False
    assert pauses == [walfold.FOLD_RETRY_EVERY]
    assert not wal(db).exists() and immutable_rounds(db) == 1


def test_a_killed_runs_rounds_in_its_wal_keep_its_folder(tmp_path):
    """A server killed before closing run.db (no summary.json, no checkpoint) left its rounds in
    the WAL: they are counted, so the folder is not taken for a false start and emptied."""
    folder = tmp_path / "run"
    script = ("import os, sys\nfrom fedhop.common.records.runstore import RunStore\n"
              "s = RunStore(sys.argv[1]); s.start_run('r')\n"
              "for r in (1, 2): s.add_round(r, participants=[0])\n"
              "os._exit(0)\n")   # no close: what was committed is in the WAL only
    subprocess.run([PY, "-c", script, str(folder / "run.db")], check=True, timeout=120)
    assert wal(folder / "run.db").stat().st_size > 0 and immutable_rounds(folder / "run.db") == 0
    assert rounds_done(folder) == 2
    assert not false_start(folder)
    assert not wal(folder / "run.db").exists() and immutable_rounds(folder / "run.db") == 2


def test_fedhop_run_beside_a_reader_leaves_the_whole_run_in_run_db(tmp_path):
    """A reader (a user's dashboard or sqlite3 shell) holds run.db open from round 1 to after
    `fedhop run` has exited: the server's close checkpointed every row into run.db."""
    rounds = 4
    (tmp_path / "exp.toml").write_text(quadratic_config([[1.0, -2.0], [3.0, 0.5]], [[1.0, 2.0], [0.5, 1.0]],
                                                        [10, 20], rounds=rounds, processes=2))
    with open(tmp_path / "run.out", "wb") as out:
        launcher = subprocess.Popen([PY, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "run", "--quiet"],
                                    cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    db = tmp_path / "run" / "run.db"
    try:
        wait_until("round 1", lambda: max_round(db) >= 1, [launcher])
        reader = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            assert reader.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1
            assert launcher.wait(120) == 0, (tmp_path / "run.out").read_text()
            assert immutable_rounds(db) == rounds
            con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
            assert con.execute("SELECT status FROM runs").fetchone()[0] == "completed"
            con.close()
            assert not wal(db).exists() or wal(db).stat().st_size == 0
        finally:
            reader.close()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
