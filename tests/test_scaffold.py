"""SCAFFOLD (common/algorithms/scaffold.py): an independent numpy implementation of Karimireddy
et al.'s Algorithm 1 (option II), the client-drift fix on a heterogeneous quadratic, the ledger's
doubled traffic, hierarchical edges, and client state kept across rounds in real processes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import Payload
from fedhop.common.config import parse_config
from fedhop.common.records.checkpoint import list_checkpoints, load_checkpoint
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from fedhop.deploy.launch.launcher import resume_local, run_local
from tests.helpers import quadratic_config

RNG = np.random.default_rng(4)
CENTERS = RNG.normal(0, 2, size=(6, 4))
CURV = RNG.uniform(0.2, 3.0, size=(6, 4))     # heterogeneous curvatures: FedAvg's fixed point is biased
SIZES = [3, 8, 5, 1, 6, 4]


def numpy_scaffold(history, steps, lr, server_lr, weights, keep_state=True):
    """Algorithm 1 of SCAFFOLD, option II, full-batch gradients C_i (y - A_i).

    `keep_state=False` forgets every c_i between rounds (what a client process that lost its
    state would do)."""
    n, d = CENTERS.shape
    x, c = np.zeros(d), np.zeros(d)
    ci = np.zeros((n, d))
    total = float(sum(weights))
    for participants in history:
        if not keep_state:
            ci = np.zeros((n, d))
        dys, dcs = [], []
        for i in participants:
            y = x.copy()
            for _ in range(steps):
                y = y - lr * (CURV[i] * (y - CENTERS[i]) - ci[i] + c)           # line 10
            new = ci[i] - c + (x - y) / (steps * lr)                          # line 12, option II
            dys.append(y - x)
            dcs.append(new - ci[i])
            ci[i] = new
        w = np.array([weights[i] for i in participants], dtype=float)
        x = x + server_lr * sum(wi * dy for wi, dy in zip(w / w.sum(), dys))   # line 16
        c = c + sum(wi * dc for wi, dc in zip(w, dcs)) / total                 # line 17: (|S|/N) mean under uniform
    return x, c


def _text(algorithm="scaffold", rounds=5, per_round=3, steps=10, lr=0.1, server_lr=1.0, weighting="uniform",
          topology="", processes=2):
    return quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=steps, lr=lr, per_round=per_round,
                            algorithm=algorithm, server_lr=server_lr, topology=topology, processes=processes,
                            extra_algorithm=f'weighting = "{weighting}"')


def _run(tmp_path, **kw):
    summary, coord = run_inmemory(parse_config(_text(**kw)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    return summary, coord


@pytest.mark.parametrize("weighting,server_lr", [("uniform", 1.0), ("samples", 0.7)])
def test_scaffold_matches_numpy_with_partial_participation(tmp_path, weighting, server_lr):
    _, coord = _run(tmp_path, weighting=weighting, server_lr=server_lr, rounds=6)
    history = [r.participants for r in coord.history]
    assert any(set(h) != set(history[0]) for h in history)
    weights = SIZES if weighting == "samples" else [1] * len(SIZES)
    x, c = numpy_scaffold(history, 10, 0.1, server_lr, weights)
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(coord.state.extra["scaffold_c.w"].double().numpy(), c, rtol=1e-4, atol=1e-5)
    stateless, _ = numpy_scaffold(history, 10, 0.1, server_lr, weights, keep_state=False)
    assert np.abs(stateless - x).max() > 1e-3          # the clients' c_i carried over between rounds mattered


def test_scaffold_reaches_the_optimum_where_fedavg_is_biased(tmp_path):
    """Many local steps (20) on clients with different curvatures: FedAvg's fixed point is not w*
    (client drift); SCAFFOLD's correction removes the drift."""
    kw = dict(rounds=30, per_round=6, steps=20, lr=0.1, weighting="samples")
    avg, _ = _run(tmp_path / "fedavg", algorithm="fedavg", **kw)
    sca, coord = _run(tmp_path / "scaffold", algorithm="scaffold", **kw)
    w_star = coord.task.optimum().numpy()
    d_sca = float(np.linalg.norm(coord.state.params["w"].double().numpy() - w_star))
    d_avg = avg["final"]["distance_to_opt"]
    assert sca["final"]["distance_to_opt"] == pytest.approx(d_sca, rel=1e-6, abs=1e-9)
    assert d_sca < 1e-4
    assert d_avg > 0.1
    # FedAvg has stalled at its biased point: more rounds do not help
    avg_more, _ = _run(tmp_path / "fedavg60", algorithm="fedavg", **{**kw, "rounds": 45})
    assert avg_more["final"]["distance_to_opt"] == pytest.approx(d_avg, rel=1e-3)


def test_scaffold_tensor_bytes_are_twice_fedavgs_both_ways(tmp_path):
    rounds, per_round, d = 3, 4, CENTERS.shape[1]
    got = {}
    for algorithm in ("fedavg", "scaffold"):
        summary, _ = _run(tmp_path / algorithm, algorithm=algorithm, rounds=rounds, per_round=per_round)
        store = RunStore(tmp_path / algorithm / "run.db")
        assert store.check_agreement().ok
        got[algorithm] = {k: v["tensor_bytes"] for k, v in store.bytes_by_link_direction()["client-server"].items()
                          if k in ("up", "down")}
        assert summary["bytes"]["by_link"]["client-server"]["tensor_bytes"] == sum(got[algorithm].values())
    per_client = rounds * per_round * 4 * d
    assert got["fedavg"] == {"down": per_client, "up": per_client}
    assert got["scaffold"] == {"down": 2 * per_client, "up": 2 * per_client}


def test_hierarchical_edges_match_star(tmp_path):
    _, star = _run(tmp_path / "star", per_round=4)
    _, one = _run(tmp_path / "one", per_round=4, topology='kind = "hierarchical"\nedges = 1')
    _, two = _run(tmp_path / "two", per_round=4, topology='kind = "hierarchical"\nedges = 2', processes=2)
    assert torch.equal(star.state.params["w"], one.state.params["w"])
    assert torch.equal(star.state.extra["scaffold_c.w"], one.state.extra["scaffold_c.w"])
    for key, t in (("w", two.state.params["w"]), ("scaffold_c.w", two.state.extra["scaffold_c.w"])):
        ref = star.state.params["w"] if key == "w" else star.state.extra[key]
        np.testing.assert_allclose(t.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


def test_kappa2_above_one_is_refused_with_a_clear_error():
    algo = build_algorithm(parse_config('[algorithm]\nname = "scaffold"'))
    with pytest.raises(ValueError, match="kappa2"):
        algo.edge_step(Payload({"w": torch.zeros(2)}), Payload({"w": torch.zeros(2)}, {"weight": 1.0}))


def test_server_state_and_reply_spec():
    algo = build_algorithm(parse_config('[algorithm]\nname = "scaffold"'))
    state = algo.init_state({"w": torch.zeros(3), "b": torch.zeros(2, 2)})
    assert set(state.extra) == {"scaffold_c.w", "scaffold_c.b"}
    assert set(algo.broadcast(state, 1).tensors) == {"w", "b", "scaffold_c.w", "scaffold_c.b"}
    assert algo.reply_spec(state) == {"w": (torch.float32, (3,)), "b": (torch.float32, (2, 2)),
                                      "scaffold_dc.w": (torch.float32, (3,)), "scaffold_dc.b": (torch.float32, (2, 2))}


def test_grpc_processes_keep_client_state_across_rounds(tmp_path):
    """Real OS processes over gRPC: the final model equals the in-memory run bit for bit and the
    numpy reference whose clients keep c_i, not the one whose clients forget it."""
    text = _text(rounds=4, per_round=3, processes=2)
    cfg_file = tmp_path / "scaffold.toml"
    cfg_file.write_text(text)
    _, coord = run_inmemory(parse_config(text), tmp_path / "mem")
    assert run_local(str(cfg_file), [], str(tmp_path / "grpc"), quiet=True) == 0
    summary = json.loads((tmp_path / "grpc" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["transport"] == "grpc" and summary["rounds_completed"] == 4
    model = load_file(str(tmp_path / "grpc" / "model.safetensors"))["w"]
    assert torch.equal(model, coord.state.params["w"])
    history = [r.participants for r in coord.history]
    assert len({c for h in history for c in h}) < sum(len(h) for h in history)   # some client trained twice
    x, _ = numpy_scaffold(history, 10, 0.1, 1.0, [1] * len(SIZES))
    stateless, _ = numpy_scaffold(history, 10, 0.1, 1.0, [1] * len(SIZES), keep_state=False)
    np.testing.assert_allclose(model.double().numpy(), x, rtol=1e-4, atol=1e-5)
    assert np.abs(model.double().numpy() - stateless).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,server_lr", [("scaffold", 1.0), ("fedadam", 0.1)])
def test_resume_from_checkpoint_restores_server_and_client_state_exactly(tmp_path, algorithm, server_lr):
    """A finished gRPC run with checkpoints at rounds 2 and 4; drop round 4's and `--resume` from
    round 2 with fresh processes: the model equals the uninterrupted one bit for bit only if the
    server state (c; m, v) and the clients' c_i came back exactly."""
    text = _text(algorithm=algorithm, rounds=4, per_round=3, server_lr=server_lr)
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text(text)
    run_dir = tmp_path / "run"
    assert run_local(str(cfg_file), ["run.checkpoint_every=2"], str(run_dir), quiet=True, show_table=False) == 0
    uninterrupted = load_file(str(run_dir / "model.safetensors"))["w"]
    checkpoints = list_checkpoints(run_dir)
    assert [p.name for p in checkpoints] == ["round-000002.safetensors", "round-000004.safetensors"]
    saved = load_checkpoint(checkpoints[0])
    assert all(float(t.abs().sum()) > 0 for t in saved.extra.values()) and saved.extra     # c, or m and v
    if algorithm == "scaffold":
        assert any(float(s["scaffold_ci.w"].abs().sum()) > 0 for s in saved.client_states.values())
    checkpoints[-1].unlink()
    assert resume_local(str(run_dir), quiet=True, show_table=False) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["faults"]["resumes"][0]["from_round"] == 2
    assert torch.equal(load_file(str(run_dir / "model.safetensors"))["w"], uninterrupted)
