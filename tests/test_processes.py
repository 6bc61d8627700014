"""Real OS processes on loopback: `fedhop run` equals the in-memory run, survives a killed
client, and leaves no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.config import load_config, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import LocalRun, read_progress, run_local
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(3)
CENTERS = RNG.normal(0, 2, size=(8, 6))
CURV = RNG.uniform(0.5, 2.0, size=(8, 6))
SIZES = [5, 9, 13, 3, 7, 11, 2, 8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        # the state follows the command name in parentheses, which may hold spaces ("fedhop client c")
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_processes_equal_inmemory_bit_for_bit_and_twice(tmp_path):
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=4, per_round=3, processes=3, local_steps=3)
    cfg_file = tmp_path / "quad.toml"
    cfg_file.write_text(text)
    _, coord = run_inmemory(parse_config(text), tmp_path / "mem")
    models = []
    for name in ("p1", "p2"):
        assert run_local(str(cfg_file), [], str(tmp_path / name), quiet=True) == 0
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["transport"] == "grpc"
        models.append(load_file(str(tmp_path / name / "model.safetensors"))["w"])
        store = RunStore(tmp_path / name / "run.db")
        assert store.check_agreement().ok
        for r, row in store.bytes_per_round().items():
            if r >= 1:
                assert row["tensor_bytes"] == 2 * 3 * 4 * CENTERS.shape[1]
    assert torch.equal(models[0], coord.state.params["w"])
    assert torch.equal(models[0], models[1])


@pytest.mark.skipif(sys.platform != "linux", reason="the launcher forks on Linux only")
def test_cli_forked_children_equal_execed_children_bit_for_bit(tmp_path):
    """`fedhop run` forks its children (deploy/launch/forkstart.py) unless FEDHOP_START=exec; both give
    the same model, and every child says how it was started."""
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=3, per_round=4, processes=2, local_steps=2)
    cfg_file = tmp_path / "quad.toml"
    cfg_file.write_text(text)
    models = {}
    for start in ("fork", "exec"):
        out = tmp_path / start
        env = dict(os.environ, FEDHOP_START=start)
        done = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", str(cfg_file), "--out", str(out), "--quiet"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        logs = {p.stem: p.read_text() for p in (out / "logs").glob("*.log")}
        assert set(logs) == {"server", "client-proc0", "client-proc1"}
        for name, log in logs.items():
            assert ("forked from the launcher" in log) == (start == "fork"), name
        assert RunStore(out / "run.db").check_agreement().ok
        models[start] = load_file(str(out / "model.safetensors"))["w"]
    assert torch.equal(models["fork"], models["exec"])


def test_killed_client_process_run_completes(tmp_path):
    cfg = load_config(ROOT / "examples" / "fedavg_digits.toml",
                      ["run.rounds=8", "clients.processes=3", "algorithm.local_epochs=4", "run.eval_every=0"])
    run = LocalRun(cfg, tmp_path)
    server = run.start([])
    victim = run.children[2]  # client-proc1
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not read_progress(tmp_path / "run.db", 1):
            time.sleep(0.05)
        assert read_progress(tmp_path / "run.db", 1), "round 2 never finished"
        os.kill(victim.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=240)
    finally:
        run.stop_all()
    assert server.proc.returncode == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 8
    assert summary["failures"] > 0
    store = RunStore(tmp_path / "run.db")
    failed = store.events("client_failed")
    victim_clients = set(range(17, 34))  # client-proc1 hosts clients 17..33 of 50 over 3 processes
    assert failed and all(int(e["node"].split("-")[1]) in victim_clients for e in failed)
    for child in run.children:
        assert not _alive(child.proc.pid), f"{child.name} left behind"


def test_digits_example_reaches_090(tmp_path):
    code = run_local(str(ROOT / "examples" / "fedavg_digits.toml"), [], str(tmp_path), quiet=True)
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final"]["test_accuracy"] >= 0.90, summary["final"]
    assert summary["rounds_completed"] == 30


def test_bad_config_key_exits_2_with_message(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nroundz = 3\n')
    assert run_local(str(bad), [], str(tmp_path / "r"), quiet=True) == 2
    assert "run.roundz" in capsys.readouterr().err


def test_child_that_fails_to_start_fails_the_run_at_once(tmp_path, monkeypatch, capsys):
    """A client process that exits before registering dooms the run; `fedhop run` says which one
    and why (its log tail) instead of waiting out the server's registration timeout."""
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=3, per_round=4, processes=2, local_steps=2)
    cfg_file = tmp_path / "quad.toml"
    cfg_file.write_text(text)
    spawn = LocalRun.spawn

    def broken_spawn(self, name, argv):
        if name == "client-proc1":   # an id spec the client's argument parser refuses: exit status 2
            argv = [a if a != "4-7" else "4-seven" for a in argv]
        return spawn(self, name, argv)

    monkeypatch.setattr(LocalRun, "spawn", broken_spawn)
    started = time.monotonic()
    assert run_local(str(cfg_file), [], str(tmp_path / "run"), quiet=True, show_table=False) == 1
    err = capsys.readouterr().err
    assert "client-proc1 exited with status 2 before every process had registered" in err
    assert "4-seven" in err          # the child's own error, from its log
    assert time.monotonic() - started < 60   # well inside the server's 120 s registration timeout
    events = RunStore(tmp_path / "run" / "run.db").events("registration_complete")
    assert events == []
