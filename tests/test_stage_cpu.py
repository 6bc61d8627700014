"""benchmarks/stage_cpu.py (issue 49): a real run's CPU by stage, from a folder outside the
checkout; its checks refuse sums that do not add up."""
from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "stage_cpu.py"
BENCH = runpy.run_path(str(SCRIPT), run_name="stage_cpu")

CONFIG = """
[run]
name = "stage-cpu"
seed = 3
rounds = 6
eval_every = 6

[algorithm]
name = "fedavg"
lr = 0.05
batch_size = 8
local_steps = 2

[data]
dataset = "crossdevice"
base = "synthetic"

[model]
kind = "logreg"

[clients]
count = 12
per_round = 5
processes = 2
"""


def test_a_run_is_timed_stage_by_stage_and_the_stages_fit_their_processes(tmp_path):
    (tmp_path / "exp.toml").write_text(CONFIG)
    done = subprocess.run([sys.executable, str(SCRIPT), "exp.toml", "--skip", "2", "--json", "figures.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["replies"] == (6 - 2) * 5 and figures["client_processes"] == 2
    client = figures["client_ms_per_train_call"]
    chain = ["    client_update (the training)", "  local_update", "handler (_handle)", "process CPU"]
    assert all(0 < client[inner] <= client[outer] for inner, outer in zip(chain, chain[1:])), client
    assert client["request decoded (_take)"] + client["handler (_handle)"] + \
        client["reply encoded and recorded (_reply)"] <= client["process CPU"]
    server = figures["server_ms_per_reply"]
    inside = sum(server[k] for k in ("  replies decoded", "  replies checked (reply chain)", "  replies folded"))
    assert 0 < inside <= server["call threads (call_many, inclusive)"] <= server["process CPU"]
    assert "server, per reply:" in done.stdout and "client processes, per train call:" in done.stdout


def body(role: str, cpu: float, acc: dict[str, float], count: dict[str, int]) -> dict:
    return {"role": role, "pid": 1, "cpu": cpu, "acc": acc, "count": count}


def test_sums_that_do_not_add_up_are_refused():
    server = body("server", 1.0, {"checks": 0.1}, {"checks": 4})
    clients = [body("client", 1.0, {"client_update": 0.2}, {"train": 2, "client_update": 2}) for _ in range(2)]
    assert BENCH["summarise"]([server, *clients])["replies"] == 4
    with pytest.raises(ValueError, match="checked 4 replies but the clients trained 3"):
        BENCH["summarise"]([server, clients[0], body("client", 1.0, {"client_update": 0.1}, {"train": 1})])
    with pytest.raises(ValueError, match="not forked"):
        BENCH["summarise"](clients)
    with pytest.raises(ValueError, match="served no train call"):
        BENCH["summarise"]([server, *clients, body("client", 1.0, {}, {})])
    with pytest.raises(ValueError, match="over the process's"):
        BENCH["summarise"]([body("server", 0.05, {"checks": 0.1}, {"checks": 4}), *clients])


def test_a_config_fedhop_refuses_is_its_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text(CONFIG.replace('kind = "logreg"', 'kind = "lgoreg"'))
    done = subprocess.run([sys.executable, str(SCRIPT), "bad.toml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "model.kind" in done.stderr and "stage_cpu: fedhop run exited 2" in done.stderr
    assert "replies after" not in done.stdout
