"""The ledger agreement verdict counts explained losses as explained (issue 44, item 8; red team
partial: summary.json and `fedhop report` said DISAGREE for a run whose only one-sided records
were an explained loss).

Real processes: a server and two client processes (tests/faultkit.py, rounds of about a second).
Client process 1 is stopped (SIGSTOP) while it trains in round 2, until the server has marked it
dead; then it is let go (SIGCONT).  The server recorded its calls to it as lost; the client,
resumed, finishes the training it was stopped in and records the reply it sends, which nobody
receives: a one-sided sender record whose loss the caller recorded (server/resilience.py
`ledger_consistency` explains it).  summary.json's `ledger_agreement`, `fedhop report`'s table
and report.md must say the records agree, and count the explained record; a record that nothing
explains still makes them say DISAGREE (tests/test_agreement_units.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from fedhop.common.config import load_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.launcher import LocalRun
from fedhop.server.resilience import ledger_consistency
from tests.faultkit import FAST_LIVENESS, slow_quadratic, wait_dead
from tests.helpers import read_db, wait_until


def _wait_for_own_work(ledger: Path, round: int, server, timeout: float = 300.0) -> None:
    """Block until `ledger` (a client process's file, flushed per record) holds its receiver
    record of a `train` request of `round`: that process is training.  A server that exits
    first fails the test with its log's tail."""
    def training() -> bool:
        if server.proc.poll() is not None:
            log = ledger.parent.parent / "logs" / "server.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
            raise AssertionError(f"the server exited ({server.proc.returncode}) before round {round}:\n{tail}")
        if not ledger.exists():
            return False
        for line in ledger.read_bytes().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("round") == round and rec.get("role") == "receiver" and rec.get("method") == "train":
                return True
        return False
    wait_until(f"receiver record of round {round}'s train in {ledger}", training, timeout=timeout, every=0.02)


def _wait_for_event(db: Path, kind: str, node: str, timeout: float = 120.0) -> None:
    """Until run.db holds a `kind` event naming `node` (read-only: the server keeps writing)."""
    wait_until(f"{kind} event for {node} in {db}",
               lambda: read_db(db, "SELECT 1 FROM events WHERE kind = ? AND node = ?", (kind, node)), timeout=timeout)


def test_a_run_whose_one_sided_records_are_explained_losses_agrees_everywhere(tmp_path):
    cfg_file = tmp_path / "exp.toml"
    cfg_file.write_text(slow_quadratic(5, processes=2))
    run = LocalRun(load_config(cfg_file, FAST_LIVENESS), tmp_path / "run")
    run.run_dir.mkdir(parents=True, exist_ok=True)
    server = run.start([])
    victim = next(c for c in run.children if c.name == "client-proc1")
    try:
        _wait_for_own_work(run.run_dir / "ledger" / "client-proc1.jsonl", 2, server)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            _wait_for_event(run.run_dir / "run.db", "node_dead", "client-proc1")
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        assert server.proc.wait(timeout=300) == 0
        wait_dead([c.proc.pid for c in run.children], timeout=60)
    finally:
        run.stop_all()
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary.get("error")
    store = RunStore(run.run_dir / "run.db", create=False)
    try:
        raw = store.check_agreement()
        consistency = ledger_consistency(store)
    finally:
        store.close()
    # the scenario: one-sided records beyond the sender's own 'lost' ones, each explained
    assert raw.sender_only or raw.receiver_only, raw.summary()
    assert consistency["ok"] and consistency["unexplained"] == 0, consistency
    verdict = summary["ledger_agreement"]
    assert verdict["ok"] is True, verdict
    assert verdict["unexplained"] == 0 and verdict["explained"] >= len(raw.sender_only) + len(raw.receiver_only)
    # fedhop report: the table's ledger column and report.md's agreement line
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "report", "run", "--out", "rep"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "DISAGREE" not in res.stdout and "agree" in res.stdout, res.stdout
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "DISAGREE" not in md and "records agree" in md and "explained by a recorded loss" in md, md
    # merge-ledgers (idempotent here: nothing to add) prints the same verdict
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "merge-ledgers", "run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "0 records added" in res.stdout, (res.stdout, res.stderr)
    assert "records agree" in res.stdout and "DISAGREE" not in res.stdout, res.stdout
