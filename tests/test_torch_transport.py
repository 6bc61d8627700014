"""transport.kind = "torch": the same runs over gloo collectives, equal to gRPC, bytes counted."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from fedhop.common.config import load_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.launcher import LocalRun, run_local
from tests.faultkit import kill_after_round
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(5)
CENTERS = RNG.normal(0, 2, size=(8, 6))
CURV = RNG.uniform(0.5, 2.0, size=(8, 6))
SIZES = [5, 9, 13, 3, 7, 11, 2, 8]


def _run(tmp_path: Path, kind: str, processes: int = 3, rounds: int = 4, per_round: int = 5):
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, per_round=per_round, processes=processes)
    text = text.replace('kind = "grpc"', f'kind = "{kind}"')
    cfg = tmp_path / f"{kind}.toml"
    cfg.write_text(text)
    assert run_local(str(cfg), [], str(tmp_path / kind), quiet=True, show_table=False) == 0
    return load_file(str(tmp_path / kind / "model.safetensors"))["w"], tmp_path / kind


def test_torch_equals_grpc_within_rounding_and_counts_bytes(tmp_path):
    grpc_model, _ = _run(tmp_path, "grpc")
    torch_model, run_dir = _run(tmp_path, "torch")
    # summation order differs (per process, then across processes): equal within float32 rounding
    assert torch.allclose(torch_model, grpc_model, rtol=1e-6, atol=1e-6)
    assert not torch.equal(torch_model, torch.zeros_like(torch_model))
    store = RunStore(run_dir / "run.db")
    d, processes = CENTERS.shape[1], 3
    for r in range(1, 5):
        rows = [m for m in store.messages() if m["round"] == r and m["method"].startswith("torch.")
                and m["role"] == "sender"]
        down = sum(m["tensor_bytes"] for m in rows if m["method"] == "torch.broadcast")
        up = sum(m["tensor_bytes"] for m in rows if m["method"] == "torch.reduce")
        # one broadcast of the model to each client process, one reduced delta from each
        assert down == processes * 4 * d and up == processes * 4 * d
    assert store.check_agreement().ok
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["transport"] == "torch" and summary["status"] == "completed"


def test_killed_rank_fails_the_run_with_a_clear_message(tmp_path):
    cfg = load_config(ROOT / "examples" / "fedavg_digits.toml",
                      ["run.rounds=30", "clients.processes=2", "algorithm.local_epochs=3", "run.eval_every=0",
                       'transport.kind="torch"', "transport.timeout=15.0", "run.round_timeout=20.0"])
    status, seconds = kill_after_round(LocalRun(cfg, tmp_path), 2, lambda name: name == "client-proc1", timeout=120)
    assert status == 1
    assert seconds < 100  # the collective timeout, not a hang
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] < 30
    assert "client-proc1" in summary["error"] or "failed" in summary["error"]
