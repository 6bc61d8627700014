"""A Fed-CHS run continues from a checkpoint (topologies/sequential/driver.py, topologies/sequential/edge.py,
server/resilience.py). The model lives on the edges, so a checkpoint round's holder also sends
its model to the server; the checkpoint keeps it with the walk (holder, sequence, every edge's
visit count). On resume the fresh edges get their visit counts back, the next holder gets the
model, and the run goes on as if it had never stopped: the same edge sequence and, bit for bit,
the same final model, over gRPC and over torch.distributed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.records.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.launcher import resume_local, run_local
from tests.test_fedchs import ASSIGN, CENTERS, GRAPH, SIZES, D, closed_form, etas, fedchs_config

K, LR, ROUNDS = 3, 1.0, 6


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_resume_from_a_middle_checkpoint_equals_the_uninterrupted_run(tmp_path: Path, transport: str) -> None:
    text = fedchs_config(rounds=ROUNDS, K=K, lr=LR, eval_every=0, processes=4)
    text = text.replace('kind = "grpc"', f'kind = "{transport}"')
    cfg_file = tmp_path / "fedchs.toml"
    cfg_file.write_text(text)
    run_dir = tmp_path / "run"
    assert run_local(str(cfg_file), ["run.checkpoint_every=2"], str(run_dir), quiet=True, show_table=False) == 0
    uninterrupted = load_file(str(run_dir / "model.safetensors"))["w"]
    full = json.loads((run_dir / "summary.json").read_text())
    sequence = full["edge_sequence"]
    rho = float(np.prod([1 - e for e in etas(LR, K)]))

    # the checkpoint after round 4 holds the model after round 4 (closed form, T1) and the walk
    checkpoints = list_checkpoints(run_dir)
    assert [p.name for p in checkpoints][-2:] == ["round-000004.safetensors", "round-000006.safetensors"]
    second = load_checkpoint(run_dir / "checkpoints" / "round-000004.safetensors")
    np.testing.assert_allclose(second.params["w"].double().numpy(), closed_form(sequence[:4], CENTERS, SIZES, ASSIGN, rho),
                               rtol=0, atol=2e-5)
    walk = second.info["topology"]
    assert walk["sequence"] == sequence[:4] and walk["holder"] == sequence[4]
    # visit counts (count_start = false): every hand-off received so far, the next holder's included
    assert walk["visits"] == [sequence[1:5].count(e) for e in range(len(GRAPH))]

    # the model reached the server in checkpoint rounds 2 and 4 and the last round, nowhere else
    store = RunStore(run_dir / "run.db")
    to_server = sorted(r["round"] for r in store.messages() if r["role"] == "sender" and r["dst"] == "server"
                       and r["tensor_bytes"] == 4 * D)
    assert to_server == [2, 4, 6]

    # drop the newest checkpoint and continue from round 4 with fresh processes
    checkpoints[-1].unlink()
    assert resume_local(str(run_dir), quiet=True, show_table=False) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary.get("error")
    assert summary["faults"]["resumes"][0]["from_round"] == 4 and summary["faults"]["ledger"]["ok"]
    assert summary["edge_sequence"] == sequence
    assert torch.equal(load_file(str(run_dir / "model.safetensors"))["w"], uninterrupted)
    restored = [r for r in RunStore(run_dir / "run.db").messages()
                if r["method"] == "control.seq_restore" and r["role"] == "sender"]
    assert sorted(r["dst"] for r in restored) == [f"edge-{e}" for e in range(len(GRAPH))]


def test_a_checkpoint_without_the_walk_is_refused_by_name(tmp_path: Path, capsys) -> None:
    cfg_file = tmp_path / "fedchs.toml"
    cfg_file.write_text(fedchs_config(rounds=4, K=2, lr=LR, eval_every=0, processes=4))
    run_dir = tmp_path / "run"
    assert run_local(str(cfg_file), ["run.checkpoint_every=2"], str(run_dir), quiet=True, show_table=False) == 0
    checkpoints = list_checkpoints(run_dir)
    checkpoints[-1].unlink()
    ckpt = load_checkpoint(checkpoints[0])
    del ckpt.info["topology"]
    save_checkpoint(run_dir, ckpt)
    capsys.readouterr()
    # the server refuses the checkpoint as it starts: its one line, exit 2 (nothing ran)
    assert resume_local(str(run_dir), quiet=True, show_table=False) == 2
    assert "holds no state of the sequential topology's walk" in capsys.readouterr().err
    log = (run_dir / "logs" / "server.log").read_text()
    assert "holds no state of the sequential topology's walk" in log
