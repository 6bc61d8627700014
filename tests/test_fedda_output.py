"""C-/MC-FedDA's output (seed-001 Algorithm 2): the weighted average sum_r alpha_r wbar_{r+1} / A_R
against numpy over the server iterates; `algorithm.output` picks the model, both are evaluated and
saved, and the choice leaves the iterates unchanged."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhop.common.algorithms.local import set_params
from fedhop.common.config import ConfigError, parse_config
from fedhop.common.tasks import build_task
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.test_composite import toml

A = 3.0
ROUNDS = 6


def run(tmp_path, algorithm: str, output: str, extra: dict | None = None):
    keys = {"mu": 0.5, "gamma": 20.0, "weights": "poly2", "a": A, "output": output, **(extra or {})}
    cfg = parse_config(toml(algorithm, keys, rounds=ROUNDS, clients=4, per_round=4, local_steps=3, eval_every=2))
    iterates = []

    def capture(net, procs, coord):
        step = coord.algorithm.server_update

        def wrapped(state, aggregate, round):
            step(state, aggregate, round)
            iterates.append(state.extra["w/w"].numpy().copy())
        coord.algorithm.server_update = wrapped

    summary, coord = run_inmemory(cfg, tmp_path / output, before_run=capture)
    return cfg, summary, coord, np.array(iterates)


def evaluate(cfg, w: np.ndarray) -> dict[str, float]:
    task = build_task(cfg)
    model = task.build_model()
    set_params(model, {"w": torch.from_numpy(w)})
    with torch.no_grad():
        return {k: float(v) for k, v in task.evaluate(model).items()}


def test_c_fedda_average_output_matches_numpy(tmp_path):
    cfg, summary, _, iters = run(tmp_path, "c_fedda", "average")
    alphas = np.array([(r + A) ** 2 for r in range(ROUNDS)])          # poly2: alpha_r = (r + a)^2
    expected = (alphas[:, None] * iters).sum(axis=0) / alphas.sum()   # sum_r alpha_r wbar_{r+1} / A_R
    run_dir = tmp_path / "average"
    model = load_file(str(run_dir / "model.safetensors"))["w"].numpy()
    np.testing.assert_allclose(model, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(load_file(str(run_dir / "model-average.safetensors"))["w"].numpy(), expected,
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(load_file(str(run_dir / "model-last.safetensors"))["w"].numpy(), iters[-1])
    final = summary["final"]
    assert final["objective"] == pytest.approx(evaluate(cfg, expected)["objective"], rel=1e-12)
    assert final["average_objective"] == final["objective"]
    assert final["last_objective"] == pytest.approx(evaluate(cfg, iters[-1])["objective"], rel=1e-12)
    assert final["last_objective"] != final["average_objective"]

    cfg_l, summary_l, _, iters_l = run(tmp_path, "c_fedda", "last")   # the choice leaves the iterates alone
    np.testing.assert_array_equal(iters_l, iters)
    assert summary_l["final"]["objective"] == summary_l["final"]["last_objective"]
    assert summary_l["final"]["average_objective"] == pytest.approx(final["average_objective"], rel=1e-12)


def test_mc_fedda_average_restarts_with_each_stage(tmp_path):
    cfg, summary, _, iters = run(tmp_path, "mc_fedda", "average", {"stage_rounds": [2, 4]})
    # the last stage (rounds 3..6) restarts the sums: its average runs over its own iterates, r = 0..3
    stage = iters[2:]
    alphas = np.array([(r + A) ** 2 for r in range(len(stage))])
    expected = (alphas[:, None] * stage).sum(axis=0) / alphas.sum()
    model = load_file(str(tmp_path / "average" / "model.safetensors"))["w"].numpy()
    np.testing.assert_allclose(model, expected, rtol=1e-12, atol=1e-12)


def test_output_key_is_validated():
    with pytest.raises(ConfigError, match="output"):
        parse_config(toml("c_fedda", {"output": "best"}))
