"""benchmarks/async_compare.py in its tiny mode: the table parses and agrees with the runs' own records.

The script reads run.db (rounds' metrics and sim_seconds, the server's ledger rows in the messages
table); this test checks its figures against records it does not read: the ledger file
ledger/server.jsonl (bytes to the target), the async_updates table (an asynchronous run's simulated
time to the target is the simulated arrival of the last update applied by then) and the deadline
events (a round that cut a client lasts exactly the deadline).
"""
from __future__ import annotations

import json
import math
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "async_compare.py"
TARGET = 0.5
MODEL_BYTES = 10 * 4      # the quadratic task's model: dim 10, float32


def _ledger_train_bytes(run_dir: Path, upto: int) -> tuple[int, int]:
    """(tensor bytes, records) of the server's train requests sent and replies received, rounds <= upto."""
    total = n = 0
    for line in (run_dir / "ledger" / "server.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["round"] > upto or rec["method"] not in ("train", "train.reply"):
            continue
        mine = (rec["role"] == "sender" and rec["src"] == "server") or (rec["role"] == "receiver" and rec["dst"] == "server")
        if mine:
            total += rec["tensor_bytes"]
            n += 1
    return total, n


def test_tiny_table_parses_and_matches_the_records(tmp_path: Path) -> None:
    keep = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--target", str(TARGET), "--keep", str(keep)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"target suboptimality {TARGET}" in out
    runs = {}
    for m in re.finditer(r"^# run (\S+) seed (\d+) dir (\S+) round (\S+) sim (\S+) bytes (\S+)$", out, re.M):
        runs[m.group(1)] = (m.group(3), int(m.group(4)), float(m.group(5)), int(m.group(6)))
    assert set(runs) == {"fedavg", "fedavg-deadline", "fedbuff", "fedasync"}, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        name, reached, s_med, s_rng, b_med, b_rng, dirs = cells[0], cells[2], cells[3], cells[4], cells[5], cells[6], cells[8]
        run_name, rnd, sim, nbytes = runs[name]
        assert reached == "1/1" and dirs == run_name
        # one seed: the median and both ends of the range are that run's figures
        assert math.isclose(float(s_med), sim, abs_tol=5e-4)
        assert s_rng == f"{sim:.3f}-{sim:.3f}" and b_med == str(nbytes) and b_rng == f"{nbytes}-{nbytes}"
        run_dir = keep / run_name
        ledger_bytes, records = _ledger_train_bytes(run_dir, rnd)
        assert nbytes == ledger_bytes == records * MODEL_BYTES > 0
        con = sqlite3.connect(run_dir / "run.db")
        subs = [json.loads(m)["suboptimality"] for (m,) in
                con.execute("SELECT metrics_json FROM rounds WHERE round <= ? ORDER BY round", (rnd,))]
        assert subs[-1] <= TARGET and all(s > TARGET for s in subs[:-1])   # the first round at the target
        if name in ("fedbuff", "fedasync"):
            (last,) = con.execute("SELECT MAX(sim_arrival) FROM async_updates WHERE status = 'applied' "
                                  "AND applied_version <= ?", (rnd,)).fetchone()
            assert math.isclose(sim, last, rel_tol=1e-9)
        if name == "fedavg-deadline":
            cut = {r for (r,) in con.execute("SELECT DISTINCT round FROM events WHERE kind = 'deadline_missed'")}
            per_round = dict(con.execute("SELECT round, sim_seconds FROM rounds"))
            assert cut, "the tiny deadline run cut no client"
            assert all(math.isclose(per_round[r], 0.1) for r in cut)
            assert math.isclose(sim, sum(per_round[r] for r in range(1, rnd + 1)), rel_tol=1e-9)
        con.close()
