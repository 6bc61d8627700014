"""benchmarks/round_timeline.py (issue 49): a real run's rounds on one clock, from a folder outside
the checkout; its checks refuse events out of causal order."""
from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "round_timeline.py"
BENCH = runpy.run_path(str(SCRIPT), run_name="round_timeline")

CONFIG = """
[run]
name = "round-timeline"
seed = 5
rounds = 8
eval_every = 8
checkpoint_every = 3

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
count = 14
per_round = 6
processes = 2
"""


def test_a_runs_rounds_are_timed_on_one_clock_in_causal_order(tmp_path):
    """Eight rounds of six clients in two processes, checkpoints every third round (whose state
    pulls are calls the clients serve inside a round, and are not train calls): every round after
    the second passes the script's checks, and the figures hold what they say."""
    (tmp_path / "exp.toml").write_text(CONFIG)
    done = subprocess.run([sys.executable, str(SCRIPT), "exp.toml", "--skip", "2", "--json", "figures.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["rounds"] == 8 - 2 and figures["client_processes"] == 2
    events, phases = figures["events_ms"], figures["phases_ms"]
    order = ["requests<", "sent first", "folded first", "folded last", "complete>", "records>", "records<", "round<"]
    assert all(0 <= events[a] <= events[b] for a, b in zip(order, order[1:])), events
    assert events["sent first"] <= events["a client process's first decode"] <= events["the last reply made"]
    assert figures["round_ms"] == events["round<"]
    assert all(v >= 0 for v in phases.values()), phases
    assert 0 < phases["training, a client process (first handler to last reply)"] < figures["round_ms"]
    assert phases["server alone at the start (to the first decode)"] == events["a client process's first decode"]
    assert "phases, ms:" in done.stdout and not (tmp_path / "runs").exists()   # the run went to a temporary folder


def test_an_in_process_runs_rounds_are_timed_with_its_workers_as_the_client_processes(tmp_path):
    """The same rounds in the in-process engine with two forked workers (`--engine inprocess`):
    the server's calls are its batches written to the workers' pipes, each worker notes the
    requests it decodes, handles and answers, and every round after the second passes the same
    causal checks on one clock."""
    (tmp_path / "exp.toml").write_text(CONFIG.replace('name = "round-timeline"', 'name = "round-timeline"\nworkers = 2'))
    done = subprocess.run([sys.executable, str(SCRIPT), "exp.toml", "--engine", "inprocess", "--skip", "2",
                           "--json", "figures.json"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["engine"] == "inprocess" and figures["rounds"] == 8 - 2 and figures["client_processes"] == 2
    events, phases = figures["events_ms"], figures["phases_ms"]
    order = ["requests<", "sent first", "folded first", "folded last", "complete>", "records>", "records<", "round<"]
    assert all(0 <= events[a] <= events[b] for a, b in zip(order, order[1:])), events
    assert events["sent first"] <= events["a client process's first decode"] <= events["the last reply made"]
    assert events["the last reply made"] <= events["folded last"]
    assert all(v >= 0 for v in phases.values()), phases
    assert "(inprocess)" in done.stdout and "2 workers" in done.stdout


def test_an_in_process_run_without_a_forked_worker_is_refused_with_the_reason(tmp_path):
    """`run.workers = 1` keeps the clients in the run's process: no worker notes anything, and
    the script says why in one line and exits 1."""
    (tmp_path / "exp.toml").write_text(CONFIG.replace('name = "round-timeline"', 'name = "round-timeline"\nworkers = 1'))
    done = subprocess.run([sys.executable, str(SCRIPT), "exp.toml", "--engine", "inprocess"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "round_timeline: expected one server and client processes with notes, found 1 and 0" in done.stderr
    assert "forked no worker (run.workers" in done.stderr and "phases, ms:" not in done.stdout


def _round(**changes):
    r = {"round>": 0.0, "requests<": 0.5, "sent first": 1.0, "sent last": 1.2, "folded first": 4.0,
         "folded last": 9.0, "complete>": 9.5, "records>": 10.0, "records<": 11.0, "round<": 11.5,
         "clients": [{"take first": 1.5, "handle first": 2.0, "reply last": 8.0},
                     {"take first": 1.6, "handle first": 2.5, "reply last": 8.5}]}
    r.update(changes)
    return r


@pytest.mark.parametrize("changes,message", [
    ({}, None),
    ({"complete>": None}, "server events missing: complete>"),
    ({"records<": 9.8}, "server: records> at 10.000 ms after records< at 9.800 ms"),
    ({"clients": []}, "no client process handled a request"),
    ({"clients": [{"take first": 0.8, "handle first": 2.0, "reply last": 8.0}]},
     "decoded a request at 0.800 ms, before the server's first call at 1.000 ms"),
    ({"clients": [{"take first": 2.0, "handle first": 1.8, "reply last": 8.0}]}, "out of order"),
    ({"folded first": 1.9}, "before any client process handled a request"),
    ({"folded last": 8.2}, "the last reply was made at 8.500 ms, after the server's last fold at 8.200 ms"),
])
def test_events_out_of_causal_order_are_refused(changes, message):
    problem = BENCH["check_round"](_round(**changes))
    if message is None:
        assert problem is None
    else:
        assert problem is not None and message in problem


def test_a_config_fedhop_refuses_is_its_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text(CONFIG.replace('kind = "logreg"', 'kind = "lgoreg"'))
    done = subprocess.run([sys.executable, str(SCRIPT), "bad.toml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "model.kind" in done.stderr and "round_timeline: fedhop run exited 2" in done.stderr
    assert "phases, ms:" not in done.stdout
