"""FedNova (common/algorithms/fednova.py): an independent numpy implementation of Wang et al.'s
normalised averaging, and the objective-inconsistency fix on clients with different step counts
(FedAvg's fixed point is the step-weighted one; FedNova's is the sample-weighted optimum)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import Payload
from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config

RNG = np.random.default_rng(2)
CENTERS = RNG.normal(0, 2, size=(4, 3))
SIZES = [1, 2, 3, 4]
TAUS = [1, 4, 16, 40]


def numpy_fednova(history, curv, taus, lr, server_lr, weights):
    """x <- x + eta_g (sum_i p_i tau_i) sum_i p_i (x_i - x) / tau_i, full-batch local GD."""
    x = np.zeros(CENTERS.shape[1])
    for participants in history:
        p = np.array([weights[i] for i in participants], dtype=float)
        p = p / p.sum()
        d, tau_eff = np.zeros_like(x), 0.0
        for pi, i in zip(p, participants):
            y = x.copy()
            for _ in range(taus[i]):
                y = y - lr * curv[i] * (y - CENTERS[i])
            d += pi * (y - x) / taus[i]
            tau_eff += pi * taus[i]
        x = x + server_lr * tau_eff * d
    return x


def _run(tmp_path, algorithm="fednova", *, curv=None, taus=TAUS, rounds=5, per_round=3, lr=0.05, server_lr=1.0,
         weighting="samples", topology="", eval_every=1):
    curv = np.ones_like(CENTERS) if curv is None else curv
    text = quadratic_config(CENTERS, curv, SIZES, rounds=rounds, local_steps=list(taus), lr=lr, per_round=per_round,
                            algorithm=algorithm, server_lr=server_lr, topology=topology,
                            extra_algorithm=f'weighting = "{weighting}"')
    text = text.replace("eval_every = 1", f"eval_every = {eval_every}")
    summary, coord = run_inmemory(parse_config(text), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    return summary, coord


@pytest.mark.parametrize("weighting,server_lr", [("samples", 1.0), ("uniform", 1.5)])
def test_fednova_matches_numpy(tmp_path, weighting, server_lr):
    curv = RNG.uniform(0.5, 1.5, size=CENTERS.shape)
    _, coord = _run(tmp_path, curv=curv, weighting=weighting, server_lr=server_lr)
    history = [r.participants for r in coord.history]
    assert any(set(h) != set(history[0]) for h in history)
    weights = SIZES if weighting == "samples" else [1] * len(SIZES)
    want = numpy_fednova(history, curv, TAUS, 0.05, server_lr, weights)
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), want, rtol=1e-4, atol=1e-5)
    # tau_eff of the last round: sum_i p_i tau_i over its participants
    p = np.array([weights[i] for i in history[-1]], dtype=float)
    assert coord.state.scalars["fednova_tau_eff"] == pytest.approx(float(p @ np.array(TAUS)[history[-1]]) / p.sum())


def test_fednova_reaches_the_sample_weighted_optimum_where_fedavg_is_step_weighted(tmp_path):
    """f_i = 1/2 |w - A_i|^2, p_i = n_i / n, tau_i in {1, 4, 16, 40} local GD steps of size lr.
    A client's delta is a_i (A_i - x) with a_i = 1 - (1 - lr)^tau_i, so the fixed points are, in
    closed form, FedAvg: sum p_i a_i A_i / sum p_i a_i (~ the tau-weighted mean of the A_i) and
    FedNova: sum p_i (a_i/tau_i) A_i / sum p_i (a_i/tau_i) (-> w* = sum p_i A_i as lr -> 0)."""
    lr, rounds = 0.002, 200
    p = np.array(SIZES, dtype=float) / sum(SIZES)
    taus = np.array(TAUS, dtype=float)
    a = 1 - (1 - lr) ** taus
    w_star = p @ CENTERS
    step_weighted = (p * taus) @ CENTERS / (p @ taus)
    gap = np.linalg.norm(w_star - step_weighted)
    assert gap > 0.5
    fixed = {"fedavg": (p * a) @ CENTERS / (p @ a), "fednova": (p * a / taus) @ CENTERS / (p @ (a / taus))}
    final = {}
    for algorithm in ("fedavg", "fednova"):
        summary, coord = _run(tmp_path / algorithm, algorithm, rounds=rounds, per_round=4, lr=lr, eval_every=0)
        np.testing.assert_allclose(coord.task.optimum().numpy(), w_star, rtol=1e-12)
        final[algorithm] = coord.state.params["w"].double().numpy()
        assert np.linalg.norm(final[algorithm] - fixed[algorithm]) < 2e-3        # converged to its fixed point
    d = {k: (np.linalg.norm(x - w_star), np.linalg.norm(x - step_weighted)) for k, x in final.items()}
    assert d["fednova"][0] < 0.03 * gap and d["fednova"][1] > 0.9 * gap
    assert d["fedavg"][1] < 0.03 * gap and d["fedavg"][0] > 0.9 * gap


def test_equal_steps_make_fednova_fedavg(tmp_path):
    _, nova = _run(tmp_path / "nova", taus=[5, 5, 5, 5])
    _, avg = _run(tmp_path / "avg", "fedavg", taus=[5, 5, 5, 5])
    np.testing.assert_allclose(nova.state.params["w"].numpy(), avg.state.params["w"].numpy(), rtol=1e-6, atol=1e-7)


def test_hierarchical_one_edge_equals_star_and_two_edges_match(tmp_path):
    _, star = _run(tmp_path / "star", per_round=4)
    _, one = _run(tmp_path / "one", per_round=4, topology='kind = "hierarchical"\nedges = 1')
    _, two = _run(tmp_path / "two", per_round=4, topology='kind = "hierarchical"\nedges = 2')
    assert torch.equal(star.state.params["w"], one.state.params["w"])
    np.testing.assert_allclose(two.state.params["w"].numpy(), star.state.params["w"].numpy(), rtol=1e-5, atol=1e-6)


def test_reply_carries_tau_as_four_tensor_bytes(tmp_path):
    rounds, per_round = 3, 3
    up = {}
    for algorithm in ("fedavg", "fednova"):
        _run(tmp_path / algorithm, algorithm, rounds=rounds, per_round=per_round)
        up[algorithm] = RunStore(tmp_path / algorithm / "run.db").bytes_by_link_direction()["client-server"]["up"]
    assert up["fednova"]["tensor_bytes"] - up["fedavg"]["tensor_bytes"] == rounds * per_round * 4


def test_kappa2_above_one_is_refused():
    algo = build_algorithm(parse_config('[algorithm]\nname = "fednova"'))
    with pytest.raises(ValueError, match="kappa2"):
        algo.edge_step(Payload({"w": torch.zeros(2)}), Payload({"w": torch.zeros(2)}, {"weight": 1.0}))
