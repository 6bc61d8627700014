"""The relay topology (topologies/relay/driver.py): a weighted random walk of one model over the clients,
one gradient step per visit, checked against the seeded draws and a numpy replay."""
from __future__ import annotations

import numpy as np

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.util.rng import numpy_stream
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config

RNG = np.random.default_rng(21)
CENTERS = RNG.normal(0, 2, size=(6, 5))
CURV = RNG.uniform(0.5, 1.5, size=(6, 5))
SIZES = [1, 8, 3, 12, 5, 2]


def relay_config(rounds=5, hops=7, lr=0.3, seed=4) -> str:
    return quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=1, lr=lr, processes=2, seed=seed,
                            topology=f'kind = "relay"\nhops_per_round = {hops}')


def test_walk_follows_seeded_data_weighted_draws_and_gd_replay(tmp_path):
    rounds, hops, lr, seed = 5, 7, 0.3, 4
    summary, coord = run_inmemory(parse_config(relay_config(rounds, hops, lr, seed)), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    p = np.asarray(SIZES, dtype=float) / sum(SIZES)
    expected_walk = [int(c) for r in range(1, rounds + 1)
                     for c in numpy_stream(seed, "chain", r).choice(len(SIZES), size=hops, p=p)]
    assert summary["client_walk"] == expected_walk
    w = np.zeros(CENTERS.shape[1])
    for j in expected_walk:                       # one full-batch gradient step per visit
        w = w - lr * CURV[j] * (w - CENTERS[j])
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), w, rtol=0, atol=1e-5)


def test_each_hop_moves_the_model_twice_through_the_server(tmp_path):
    rounds, hops = 3, 4
    summary, _ = run_inmemory(parse_config(relay_config(rounds, hops)), tmp_path)
    store = RunStore(tmp_path / "run.db")
    d = CENTERS.shape[1]
    for r in range(1, rounds + 1):
        assert store.bytes_per_round()[r]["tensor_bytes"] == hops * 2 * 4 * d
    assert set(summary["bytes"]["by_link"]) <= {"client-server", "control"}
    assert store.check_agreement().ok

