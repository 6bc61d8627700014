"""examples/femnist_fedavg.toml, shakespeare_fedavg.toml and cifar10_dirichlet.toml run end to end on
small generated files in the real formats, with few rounds and clients: FEMNIST as a user runs it
(`fedhop run`, real processes, relative paths), the other two in one process over the in-memory
transport (the same server and client classes; it keeps CI's time down)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedhop.common.config import load_config
from fedhop.common.data import fakedata
from fedhop.common.models import build_model, num_parameters
from fedhop.deploy.launch.inmemory import run_inmemory

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = ["run.rounds=2", "run.eval_every=2", "clients.count=4", "clients.per_round=2", "clients.processes=1"]
MODELS = {  # example: (model kind, input shape, classes)
    "femnist_fedavg": ("leaf_cnn", (1, 28, 28), 62),
    "shakespeare_fedavg": ("char_lstm", (80,), 80),
    "cifar10_dirichlet": ("cifar_cnn", (3, 32, 32), 10),
}


def _check(name: str, summary: dict) -> None:
    kind, shape, classes = MODELS[name]
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert summary["num_clients"] == 4
    assert summary["num_parameters"] == num_parameters(build_model(kind, shape, classes))
    assert 0.0 <= summary["final"]["test_accuracy"] <= 1.0


def test_femnist_example_runs_as_processes(tmp_path: Path) -> None:
    fakedata.femnist(tmp_path / "data" / "femnist", writers=8, mean=12, std=3, per_file=3)
    shutil.copy(EXAMPLES / "femnist_fedavg.toml", tmp_path / "femnist_fedavg.toml")
    sets = [a for kv in SMALL for a in ("--set", kv)]
    proc = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", "femnist_fedavg.toml", "--quiet",
                           "--out", "runs/femnist", *sets], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _check("femnist_fedavg", json.loads((tmp_path / "runs" / "femnist" / "summary.json").read_text()))


@pytest.mark.parametrize("name", ["shakespeare_fedavg", "cifar10_dirichlet"])
def test_example_runs_in_memory(name: str, tmp_path: Path, monkeypatch) -> None:
    if name.startswith("shakespeare"):
        fakedata.shakespeare(tmp_path / "data" / "shakespeare", roles=6, mean=20, per_file=4)
    else:
        fakedata.cifar10(tmp_path / "data", per_batch=12, n_test=20)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(EXAMPLES / f"{name}.toml", [*SMALL, 'transport.kind="inmemory"'])
    summary, _ = run_inmemory(cfg, tmp_path / "run")
    _check(name, summary)
