"""benchmarks/round_threads.py (issue 49): it runs a real `fedhop run` from a folder of its own,
counts the CPU of every thread of the run's processes over some rounds, and stops the run; the
per-process sums add up to the total, and the server and each client process are there."""
from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = runpy.run_path(str(ROOT / "benchmarks" / "round_threads.py"), run_name="round_threads")

CONFIG = """[run]
name = "round-threads"
seed = 0
rounds = 100000
eval_every = 100000

[algorithm]
name = "fedavg"
lr = 0.1
batch_size = 0
local_steps = 1

[data]
dataset = "quadratic"
dim = 50

[model]
init = "zeros"

[clients]
count = 4
per_round = 4
processes = 2
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_a_run_is_counted_thread_by_thread_and_stopped(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)   # a user's folder, a relative path to the config
    Path("w.toml").write_text(CONFIG)
    assert BENCH["main"](["w.toml", "--seconds", "1.5", "--warmup", "3", "--json", "o.json"]) == 0
    out = json.loads(Path("o.json").read_text())
    assert out["rounds"] >= 1 and out["wall_ms_per_round"] > 0
    titles = list(out["processes"])
    assert any(t.startswith("fedhop server") for t in titles)
    assert sum(t.startswith("fedhop client client-proc") for t in titles) == 2
    assert out["processes"] == pytest.approx(
        {p: sum(t["ms_per_round"] for t in out["threads"] if t["process"] == p) for p in titles})
    assert out["total_ms_per_round"] == pytest.approx(sum(out["processes"].values()))
    assert all(t["ms_per_round"] >= 0 for t in out["threads"])
    server = [t for t in out["threads"] if t["process"].startswith("fedhop server")]
    assert [t["tid"] for t in server if t["thread"] == "main"] == [server[0]["pid"]]   # one main thread, tid = pid
    assert "all processes" in capsys.readouterr().out
    left = [t["pid"] for t in out["threads"] if BENCH["psutil"].pid_exists(t["pid"])]
    assert not left, f"the run's processes {sorted(set(left))} were left running"


def test_a_run_that_fails_to_start_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("bad.toml").write_text(CONFIG.replace('name = "fedavg"', 'name = "no-such-algorithm"'))
    assert BENCH["main"](["bad.toml", "--seconds", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("round_threads: the run ended (exit 2) before 5 rounds: ") and err.count("\n") == 1
    assert "no-such-algorithm" in err


def test_a_missing_config_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        BENCH["main"](["nothing.toml"])
    assert exc.value.code == 2 and not os.listdir(tmp_path)
