"""run.db schema 2 and interrupted runs (issue 18, item 4): round counts are INTEGER columns, an
old (schema 1) run.db is migrated when opened for writing, and the children's ledgers of an
interrupted run are merged by `fedhop merge-ledgers` and by `fedhop run` on Ctrl-C."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.records.runstore import SCHEMA_VERSION, RunStore
from fedhop.common.wire.ledger import Ledger
from fedhop.deploy.launch.launcher import read_progress
from fedhop.deploy.tools.ledgers import main as merge_main
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]

# the rounds table as schema 1 (the code before issue 18) made it, with rows as its add_round wrote them
SCHEMA_1_ROUNDS = """CREATE TABLE rounds(
        run_id TEXT NOT NULL, round INTEGER NOT NULL, participants TEXT, sampled TEXT, failures TEXT,
        metrics_json TEXT, wall_seconds REAL, sim_seconds REAL, started REAL, finished REAL,
        PRIMARY KEY(run_id, round))"""


def test_counts_are_integers_and_compare_as_numbers(tmp_path):
    store = RunStore(tmp_path / "run.db")
    store.start_run("r")
    for rnd, n in ((1, 10), (2, 9), (3, 40)):
        store.add_round(rnd, participants=n, sampled=40, failures=40 - n, metrics={})
    types = {r[1]: r[2] for r in store._query("PRAGMA table_info(rounds)")}
    assert types["participants"] == types["sampled"] == types["failures"] == "INTEGER"
    # as TEXT, '9' < '5' is false and '10' < '5' true: the query must compare numbers
    assert store._query("SELECT round FROM rounds WHERE participants < 10 ORDER BY round") == [(2,)]
    assert store._query("SELECT typeof(failures) FROM rounds")[0] == ("integer",)


def test_schema_1_file_is_migrated_keeping_counts_and_lists(tmp_path):
    db = tmp_path / "run.db"
    con = sqlite3.connect(db)
    con.execute(SCHEMA_1_ROUNDS)
    con.execute("INSERT INTO rounds VALUES ('r', 1, '3', '4', '1', '{\"test_accuracy\": 0.5}', 1.5, NULL, NULL, NULL)")
    con.execute("INSERT INTO rounds VALUES ('r', 2, '[3, 1]', '[3, 1, 4]', '[4]', '{}', 1.0, NULL, NULL, NULL)")
    con.commit()
    con.close()
    store = RunStore(db)   # opened for writing: migrated
    assert store._query("PRAGMA user_version") == [(SCHEMA_VERSION,)]
    rows = store.rounds()
    assert [(r["participants"], r["sampled"], r["failures"]) for r in rows] == [(3, 4, 1), ([3, 1], [3, 1, 4], [4])]
    assert rows[0]["metrics"] == {"test_accuracy": 0.5} and rows[0]["wall_seconds"] == 1.5
    assert store._query("SELECT round, participants, failures FROM rounds ORDER BY round") == [(1, 3, 1), (2, 2, 1)]
    store.close()
    assert RunStore(db)._query("SELECT COUNT(*) FROM rounds") == [(2,)]   # a second open changes nothing


def _write_pair(server: Ledger, client: Ledger, i: int) -> None:
    fields = dict(run_id="r", round=1, step=0, src="client-0", dst="server", link="client-server", direction="up",
                  method="train.reply", tensor_bytes=40, payload_bytes=80, framed_bytes=85, seconds=0.0,
                  msg_id=f"m{i}", status="ok")
    client.record(recorder="client-proc0", role="sender", **fields)
    server.record(recorder="server", role="receiver", **fields)


def test_merge_ledgers_command(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "ledger").mkdir(parents=True)
    server, client = Ledger(), Ledger(run / "ledger" / "client-proc0.jsonl")
    for i in range(3):
        _write_pair(server, client, i)
    store = RunStore(run / "run.db")
    store.insert_records(server.records())
    assert not store.check_agreement().ok   # receiver-only: the children's side is missing
    assert merge_main([str(run)]) == 0
    assert "3 records added" in capsys.readouterr().out
    assert RunStore(run / "run.db").check_agreement().matched == 3
    assert merge_main([str(tmp_path / "nothing")]) == 2


def test_ctrl_c_merges_the_children_ledgers(tmp_path):
    rng = np.random.default_rng(1)
    text = quadratic_config(rng.normal(size=(6, 3)), rng.uniform(0.5, 2, size=(6, 3)), [1] * 6, rounds=100000,
                            processes=2)
    cfg = tmp_path / "q.toml"
    cfg.write_text(text)
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", str(cfg), "--out", str(out),
                                 "--quiet"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while len(read_progress(out / "run.db", 0)) < 3:
        assert launcher.poll() is None, launcher.stdout.read()
        assert time.monotonic() < deadline, "3 rounds did not finish in 120 s"
        time.sleep(0.1)
    launcher.send_signal(signal.SIGINT)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, output
    assert "merged the ledgers of every process" in output
    store = RunStore(out / "run.db", create=False)
    recorders = {r[0] for r in store._query("SELECT DISTINCT recorder FROM messages")}
    assert recorders == {"server", "client-proc0", "client-proc1"}
    agreement = store.check_agreement()
    assert agreement.matched > 6 * 3 * 2   # at least 3 rounds of 6 train calls and their replies, both sides
    # only messages in flight at the interrupt may be one-sided: at most one round's worth
    assert len(agreement.sender_only) + len(agreement.receiver_only) <= 2 * 6 + 4, agreement.summary()


def test_a_stop_raised_just_after_commit_is_not_hidden_by_a_failed_rollback(tmp_path):
    """A signal's exception can be raised just after COMMIT finished (the CI saw a Ctrl-C there):
    the write is kept and the stop propagates as itself, not as sqlite's "cannot rollback - no
    transaction is active" (which crashed the server instead of recording a stopped run)."""
    store = RunStore(tmp_path / "run.db")

    class CommitThenStop:   # the connection, with a KeyboardInterrupt right after COMMIT
        def __init__(self, conn):
            self.conn = conn

        def __getattr__(self, name):
            return getattr(self.conn, name)

        def execute(self, sql, *args):
            out = self.conn.execute(sql, *args)
            if sql == "COMMIT":
                raise KeyboardInterrupt
            return out

    real = store._conn
    store._conn = CommitThenStop(real)
    with pytest.raises(KeyboardInterrupt):
        store.set_live_bytes(["client-proc0"], [("client-proc0", "client-server", "up", 3, 12, 40, 55)])
    store._conn = real
    assert store._query("SELECT node, framed_bytes FROM live_bytes") == [("client-proc0", 55)]


def _ledger_record(i: int):
    from fedhop.common.wire.ledger import LedgerRecord
    return LedgerRecord(run_id="r", round=1, step=0, src="server", dst=f"client-{i}", link="client-server",
                        direction="down", method="train", tensor_bytes=4000, payload_bytes=4100, framed_bytes=4200,
                        seconds=0.001, recorder="server", role="sender", msg_id=f"m{i}", status="ok",
                        wall_time=1.0, error="")


def test_a_transaction_commits_its_writes_together_and_a_failure_keeps_none(tmp_path):
    """RunStore.transaction: a round's ledger rows, its row and the live totals land in one
    COMMIT (another connection sees none of them before it, all after); an exception inside
    rolls every one back and reaches the caller; a nested block joins the outer one."""
    store = RunStore(tmp_path / "run.db")
    store.start_run("r")
    reader = sqlite3.connect(tmp_path / "run.db")

    def seen() -> tuple[int, int, int]:
        return tuple(reader.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                     for t in ("messages", "rounds", "live_bytes"))

    live = [("server", "client-server", "down", 3, 12000, 12300, 12600)]
    with store.transaction():
        assert store.insert_records([_ledger_record(i) for i in range(3)]) == 3
        store.add_round(1, participants=3, sampled=3, failures=0, metrics={})
        with store.transaction():   # joins: nothing is committed at its end
            store.set_live_bytes(["server"], live, 1)
        assert seen() == (0, 0, 0)
    assert seen() == (3, 1, 1)
    assert reader.execute("SELECT live_framed_bytes FROM rounds WHERE round = 1").fetchone() == (12600,)

    with pytest.raises(RuntimeError, match="a writer failed"):
        with store.transaction():
            store.insert_records([_ledger_record(i) for i in range(3, 6)])
            store.add_round(2, participants=3, sampled=3, failures=0, metrics={})
            store.set_live_bytes(["server"], [(*live[0][:3], 6, 24000, 24600, 25200)], 2)
            raise RuntimeError("a writer failed")
    assert seen() == (3, 1, 1)
    assert not store._conn.in_transaction
    assert reader.execute("SELECT framed_bytes FROM live_bytes").fetchone() == (12600,)
    # the store goes on: the next writes commit on their own
    assert store.insert_records([_ledger_record(9)]) == 1
    assert seen() == (4, 1, 1)
