"""The Python API (issue 25, item 3): `fedhop.run` starts the real processes of `fedhop run` from a
user's own folder and returns plain Python objects, checked here against run.db read with SQL of
our own and against summary.json; `fedhop.load` gives the same object later; `fedhop report --csv`
writes the same rows; bad configs raise ConfigError, failed runs RunFailed."""
from __future__ import annotations

import csv
import json
import sqlite3
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import fedhop
from tests.helpers import quadratic_config

ROUNDS = 3


def quad_text(**kw) -> str:
    rng = np.random.default_rng(3)
    centers, curvatures = rng.normal(0, 2, size=(4, 3)), rng.uniform(0.5, 2.0, size=(4, 3))
    return quadratic_config(centers, curvatures, [5, 9, 13, 3], local_steps=2, per_round=3, processes=2, **kw)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One real run, started from a folder outside the repository with a relative `out`."""
    home = tmp_path_factory.mktemp("user")
    (home / "exp.toml").write_text(quad_text(rounds=5, name="api-quad"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(home)
        result = fedhop.run("exp.toml", set={"run.seed": 7, "run.rounds": ROUNDS}, out="runs/x")
    return home, result


def sql(db: Path, query: str, params=()) -> list[tuple]:
    con = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
    try:
        return con.execute(query, params).fetchall()
    finally:
        con.close()


def test_run_returns_the_run_db_and_summary_numbers(finished):
    home, res = finished
    db = home / "runs" / "x" / "run.db"
    assert res.run_dir == (home / "runs" / "x").resolve() and res.run_dir.is_absolute()
    assert res.status == res.summary["status"] == "completed"
    assert res.config["run"]["seed"] == 7 and res.config["run"]["rounds"] == ROUNDS   # `set` applied
    # every message recorded by both ends: the sender records alone count each message once
    (receiver_only,) = sql(db, "SELECT COUNT(*) FROM messages AS r WHERE role = 'receiver' AND NOT EXISTS "
                               "(SELECT 1 FROM messages AS s WHERE s.msg_id = r.msg_id AND s.role = 'sender')")[0]
    assert receiver_only == 0 and res.summary["ledger_agreement"]["ok"]

    db_rounds = sql(db, "SELECT round, participants, sampled, failures, metrics_json FROM rounds ORDER BY round")
    assert [r["round"] for r in res.rounds] == [r[0] for r in db_rounds] == list(range(1, ROUNDS + 1))
    for row, (rnd, participants, sampled, failures, metrics) in zip(res.rounds, db_rounds):
        assert (row["participants"], row["sampled"], row["failures"]) == (participants, sampled, failures) == (3, 3, 0)
        assert {k: row[k] for k in json.loads(metrics)} == json.loads(metrics)
        (framed, tensor, count), = sql(db, "SELECT SUM(framed_bytes), SUM(tensor_bytes), COUNT(*) FROM messages "
                                           "WHERE role = 'sender' AND round <= ?", (rnd,))
        assert (row["cumulative_framed_bytes"], row["cumulative_tensor_bytes"], row["cumulative_messages"]) == \
            (framed, tensor, count)
    framed = [r["cumulative_framed_bytes"] for r in res.rounds]
    assert framed == sorted(framed) and framed[0] > 0 and len(set(framed)) == ROUNDS   # traffic every round

    by_link = {link: {"messages": n, "tensor_bytes": t, "payload_bytes": p, "framed_bytes": f}
               for link, n, t, p, f in sql(db, "SELECT link, COUNT(*), SUM(tensor_bytes), SUM(payload_bytes), "
                                               "SUM(framed_bytes) FROM messages WHERE role = 'sender' GROUP BY link")}
    assert res.by_link == by_link and set(by_link) == {"client-server", "control"}
    assert res.totals == {k: sum(v[k] for v in by_link.values()) for k in res.totals}
    assert res.totals == res.summary["bytes"]["total"] and res.by_link == res.summary["bytes"]["by_link"]
    # the run's final model: client-server tensor bytes are 2 x 3 float32 parameters per client per round
    assert res.by_link["client-server"]["tensor_bytes"] == ROUNDS * 3 * 2 * 3 * 4
    assert res.final == res.summary["final"] and res.final["objective"] == res.rounds[-1]["objective"]


def test_load_gives_the_same_object_and_a_data_frame(finished, monkeypatch):
    home, res = finished
    monkeypatch.chdir(home)
    assert fedhop.load("runs/x") == res
    assert fedhop.load(res.run_dir) == res
    assert "api-quad" in repr(res) and "completed" in repr(res)
    pd = pytest.importorskip("pandas")
    frame = res.to_pandas()
    assert isinstance(frame, pd.DataFrame) and len(frame) == ROUNDS
    assert list(frame.columns[:4]) == ["round", "participants", "sampled", "failures"]
    assert frame["cumulative_framed_bytes"].tolist() == [r["cumulative_framed_bytes"] for r in res.rounds]
    assert frame["objective"].tolist() == [r["objective"] for r in res.rounds]
    assert res.rounds_frame().equals(frame)


def _copy_run(finished, into: Path) -> Path:
    """The finished run copied into `into`/run, without -shm/-wal files other tests' readers left."""
    import shutil
    _, res = finished
    copy = into / "run"
    shutil.copytree(res.run_dir, copy, ignore=shutil.ignore_patterns("run.db-*"))
    return copy


def test_load_adds_no_file_to_the_run_folder(finished, tmp_path, monkeypatch):
    """load reads without writing: no run.db-shm or run.db-wal appears beside run.db."""
    _copy_run(finished, tmp_path)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in Path("run").iterdir())
    assert fedhop.load("run").status == "completed"
    assert sorted(p.name for p in Path("run").iterdir()) == before


@pytest.mark.parametrize("name, content, message", [
    ("config.toml", b"[run\n", "config.toml: not valid TOML (Expected ']'"),
    ("run.db", b"not sqlite at all" * 300, "run.db: not a readable run database (file is not a database)"),
])
def test_load_of_an_unreadable_file_is_a_value_error_naming_it(finished, tmp_path, monkeypatch, name, content,
                                                              message):
    copy = _copy_run(finished, tmp_path)
    (copy / name).write_bytes(content)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as caught:
        fedhop.load("run")
    assert str(caught.value).startswith(f"{copy.resolve() / name}: ") and message in str(caught.value)


def test_to_pandas_without_pandas_says_how_to_install_it(finished, monkeypatch):
    _, res = finished
    monkeypatch.setitem(sys.modules, "pandas", None)    # `import pandas` raises ImportError
    with pytest.raises(ImportError, match=r"pip install pandas"):
        res.to_pandas()


def test_report_csv_rows_equal_the_run_db_rounds(finished, monkeypatch):
    from fedhop.deploy.tools.report import main
    home, res = finished
    monkeypatch.chdir(home)
    assert main(["runs/x", "--out", "rep", "--csv", "rep/rows.csv", "--format", "svg"]) == 0
    with open(home / "rep" / "rows.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    db = home / "runs" / "x" / "run.db"
    db_rounds = sql(db, "SELECT round, participants, failures, metrics_json FROM rounds ORDER BY round")
    assert len(rows) == len(db_rounds) == ROUNDS
    for row, (rnd, participants, failures, metrics) in zip(rows, db_rounds):
        assert row["run"] == "api-quad" and Path(row["run_dir"]) == res.run_dir
        assert (int(row["round"]), int(row["participants"]), int(row["failures"])) == (rnd, participants, failures)
        for name, value in json.loads(metrics).items():
            assert float(row[name]) == value, name      # full precision
        (framed,), = sql(db, "SELECT SUM(framed_bytes) FROM messages WHERE role = 'sender' AND round <= ?", (rnd,))
        assert int(row["cumulative_framed_bytes"]) == framed
    svgs = sorted(p.name for p in (home / "rep").glob("*.svg"))
    assert "metric_vs_round.svg" in svgs and not list((home / "rep").glob("*.png"))
    assert (home / "rep" / "metric_vs_round.svg").read_text().lstrip().startswith("<?xml")


def test_bad_config_raises_config_error_and_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp.toml").write_text(quad_text(rounds=2))
    with pytest.raises(fedhop.ConfigError, match=r"algorithm\.lr"):
        fedhop.run("exp.toml", set={"algorithm.lr": "fast"})
    with pytest.raises(fedhop.ConfigError, match=r"unknown config section '\[nope\]'"):
        fedhop.run({"nope": {"x": 1}})
    with pytest.raises(fedhop.ConfigError, match=r"cannot read config file"):
        fedhop.run("missing.toml")
    assert not (tmp_path / "runs").exists()
    assert not isinstance(fedhop.ConfigError("x"), SystemExit)


def test_out_onto_an_earlier_run_is_a_config_error(finished, monkeypatch):
    home, res = finished
    monkeypatch.chdir(home)
    before = (home / "runs" / "x" / "summary.json").read_bytes()
    with pytest.raises(fedhop.ConfigError, match=r"holds an earlier run.*force=True"):
        fedhop.run("exp.toml", out="runs/x")
    assert (home / "runs" / "x" / "summary.json").read_bytes() == before
    assert fedhop.load("runs/x") == res


def test_failed_run_raises_run_failed_with_its_records(tmp_path, monkeypatch):
    """A dict config (no file) that diverges at once: every client fails round 1, the run fails."""
    monkeypatch.chdir(tmp_path)
    config = tomllib.loads(quad_text(rounds=2, name="diverges"))
    config["algorithm"]["lr"] = 1e200
    with pytest.raises(fedhop.RunFailed) as caught:
        fedhop.run(config)
    err = caught.value
    assert err.exit_code == 1 and "failed" in str(err)
    result = err.result
    assert result is not None and result.status == "failed" == result.summary["status"]
    assert result.run_dir.parent == (tmp_path / "runs").resolve() and result.run_dir.name.startswith("diverges-")
    assert result.rounds == [] and result.summary["rounds_completed"] == 0
    assert result.totals == result.summary["bytes"]["total"] and result.totals["messages"] > 0
    assert result.config["algorithm"]["lr"] == 1e200
    assert fedhop.load(result.run_dir) == result


def test_import_fedhop_is_cheap(tmp_path):
    """No torch, grpc or numpy until the API is used; the package is api/ installed as fedhop."""
    code = ("import sys, fedhop; heavy = [m for m in ('torch', 'grpc', 'numpy') if m in sys.modules]; "
            "assert not heavy, heavy; assert callable(fedhop.run); "
            "import fedhop.common.config; print(fedhop.__version__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"]["version"]


def test_a_script_without_a_main_guard_runs_the_in_process_engine_with_workers(tmp_path):
    """A user's script that calls `fedhop.run` at its top level (no `if __name__ == "__main__":`)
    with run.workers = 2: its workers are fresh interpreters started as `python -m
    fedhop.deploy.launch.workers` (the script's process may not fork them), never the script
    again.  (Under multiprocessing's "spawn" each worker ran the script again, which started a
    second run there, and the run failed: "fedhop worker 0 ended (exit code 1)".)  The model is
    the one `fedhop run` gives with its workers forked."""
    (tmp_path / "exp.toml").write_text(quad_text(rounds=3, name="guardless"))
    (tmp_path / "exp.py").write_text(
        "import fedhop\n"
        "r = fedhop.run('exp.toml', set={'run.engine': 'inprocess', 'run.workers': 2}, out='api', quiet=True)\n"
        "print('status', r.status)\n")
    out = subprocess.run([sys.executable, "exp.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "status completed" in out.stdout, out.stderr[-2000:]
    log = (tmp_path / "api" / "logs" / "inprocess.log").read_text()
    assert "client-proc0 trains in fedhop worker 0 (spawned)" in log and "client-proc1 trains in fedhop worker 1" in log
    cli = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "exp.toml", "--out", "cli", "--quiet",
                          "--engine", "inprocess", "--set", "run.workers=2"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "(forked" in (tmp_path / "cli" / "logs" / "inprocess.log").read_text()
    assert (tmp_path / "api" / "model.safetensors").read_bytes() == (tmp_path / "cli" / "model.safetensors").read_bytes()
