"""MC-FedDA at a stage's last round (issue 28 item 4): the evaluated model and its `last_*` /
`average_*` metrics are that round's iterate wbar and the stage's weighted average ŵ_m (numpy over
the stage's server iterates), not the restart point; the next stage starts from ŵ_m."""
from __future__ import annotations

import numpy as np
import pytest

from fedhop.common.algorithms.dual_averaging import STAGE_KEY
from fedhop.common.config import parse_config
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.test_composite import toml
from tests.test_fedda_output import evaluate

A = 3.0
STAGES = [3, 3]


def test_restart_round_evaluates_the_rounds_own_iterates(tmp_path):
    keys = {"mu": 0.5, "gamma": 20.0, "weights": "poly2", "a": A, "output": "last", "warm_start": "average",
            "stage_rounds": STAGES}
    cfg = parse_config(toml("mc_fedda", keys, rounds=sum(STAGES), clients=4, per_round=4, local_steps=3,
                            eval_every=1))
    iterates: dict[int, np.ndarray] = {}
    w0_sent: dict[int, np.ndarray] = {}

    def capture(net, procs, coord):
        algo = coord.algorithm
        step, restart, broadcast = algo.server_update, algo.restart, algo.broadcast
        before_restart: list[np.ndarray] = []

        def wrapped_restart(state):   # wherever it runs, the iterate it replaces is wbar of the stage's last round
            before_restart.append(state.extra["w/w"].numpy().copy())
            restart(state)

        def wrapped_step(state, aggregate, round):
            before_restart.clear()
            step(state, aggregate, round)
            iterates[round] = before_restart[0] if before_restart else state.extra["w/w"].numpy().copy()

        def wrapped_broadcast(state, round):
            message = broadcast(state, round)
            if "w0/w" in message.tensors:
                w0_sent[round] = message.tensors["w0/w"].numpy().copy()
            return message

        algo.restart, algo.server_update, algo.broadcast = wrapped_restart, wrapped_step, wrapped_broadcast

    summary, coord = run_inmemory(cfg, tmp_path / "run", before_run=capture)
    assert summary["status"] == "completed", summary.get("error")
    metrics = {h.round: h.metrics for h in coord.history}
    boundary = STAGES[0]
    stage = np.array([iterates[r] for r in range(1, boundary + 1)])
    alphas = np.array([(r + A) ** 2 for r in range(boundary)])           # poly2: alpha_r = (r + a)^2
    average = (alphas[:, None] * stage).sum(axis=0) / alphas.sum()       # ŵ_0 = sum_r alpha_r wbar_{r+1} / A_R
    last = stage[-1]
    assert np.abs(average - last).max() > 1e-3                          # the two outputs differ here
    want_last, want_avg = evaluate(cfg, last), evaluate(cfg, average)
    got = metrics[boundary]
    for key in ("distance_to_opt", "objective"):
        assert got[f"last_{key}"] == pytest.approx(want_last[key], rel=1e-12)
        assert got[key] == got[f"last_{key}"]                            # output = "last": the model
        assert got[f"average_{key}"] == pytest.approx(want_avg[key], rel=1e-12)
    # the next stage restarts from ŵ_0 (warm_start = "average"), sent with its broadcasts
    np.testing.assert_allclose(w0_sent[boundary + 1], average, rtol=1e-12, atol=1e-14)
    assert coord.state.scalars[STAGE_KEY] == 1
    # a round inside a stage: the model is its own iterate as before
    assert metrics[2]["last_distance_to_opt"] == pytest.approx(evaluate(cfg, iterates[2])["distance_to_opt"],
                                                               rel=1e-12)
