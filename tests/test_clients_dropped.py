"""A dropped participant is visible: `clients_dropped` per round in run.db (an INTEGER column) and
in summary.json and the final table; `run.min_results` decides whether such a round counts."""
from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import final_table
from fedhop.server.coordinator import SHORT_ROUND_RETRIES
from tests.helpers import quadratic_config

CENTERS = np.random.default_rng(1).normal(size=(6, 4))


def run(tmp_path, min_results: int, on_short_round: str = "fail"):
    text = quadratic_config(CENTERS, np.ones_like(CENTERS), [1] * 6, rounds=3, local_steps=2, processes=2)
    text = text.replace("round_timeout = 60.0", f"round_timeout = 60.0\nmin_results = {min_results}\n"
                                                f"on_short_round = \"{on_short_round}\"")

    def cut(net, procs, coord):   # client-proc1 (clients 3, 4, 5) becomes unreachable
        procs[1].endpoint.stop()

    return run_inmemory(parse_config(text), tmp_path / f"{min_results}{on_short_round}", before_run=cut)[0]


def test_dropped_clients_are_counted_and_the_round_counts_at_min_results(tmp_path):
    summary = run(tmp_path, 3)
    assert summary["status"] == "completed", summary["error"]
    run_dir = tmp_path / "3fail"
    rows = RunStore(run_dir / "run.db").rounds()
    assert [r["clients_dropped"] for r in rows] == [3, 3, 3]
    assert [r["participants"] for r in rows] == [3, 3, 3]
    assert summary["clients_dropped"] == 9
    con = sqlite3.connect(run_dir / "run.db")
    assert {t for (t,) in con.execute("SELECT typeof(clients_dropped) FROM rounds")} == {"integer"}
    con.close()
    assert "clients dropped 9" in final_table(run_dir)


def test_a_round_below_min_results_fails_the_run(tmp_path):
    summary = run(tmp_path, 4)
    assert summary["status"] == "failed" and "run.min_results requires 4" in summary["error"]
    assert summary["rounds_completed"] == 0 and summary["clients_dropped"] == 0


@pytest.mark.parametrize("policy", ["skip", "retry"])
def test_a_round_below_min_results_is_skipped_or_retried_then_skipped(tmp_path, policy):
    """run.on_short_round: every round is short (3 of 6 clients unreachable, min_results 4), so
    each is skipped, after SHORT_ROUND_RETRIES new samples under "retry"; the model stays."""
    summary = run(tmp_path, 4, policy)
    assert summary["status"] == "completed", summary["error"]
    assert summary["rounds_completed"] == 3 and summary["rounds_skipped"] == 3
    retries = SHORT_ROUND_RETRIES if policy == "retry" else 0
    assert summary["round_retries"] == 3 * retries
    store = RunStore(tmp_path / f"4{policy}" / "run.db")
    assert store.rounds() == []
    assert [e["round"] for e in store.events("round_skipped")] == [1, 2, 3]
    assert len(store.events("client_failed")) == 3 * 3 * (retries + 1) == summary["failures"]


def test_an_older_run_db_gains_the_column(tmp_path):
    db = tmp_path / "run.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE rounds(run_id TEXT NOT NULL, round INTEGER NOT NULL, participants TEXT, sampled TEXT, "
                "failures TEXT, metrics_json TEXT, wall_seconds REAL, sim_seconds REAL, started REAL, finished REAL, "
                "PRIMARY KEY(run_id, round))")
    con.execute("INSERT INTO rounds(run_id, round) VALUES ('r', 1)")
    con.commit()
    con.close()
    store = RunStore(db, run_id="r")
    store.add_round(2, clients_dropped=2)
    assert [r["clients_dropped"] for r in store.rounds()] == [None, 2] and store.clients_dropped() == 2
