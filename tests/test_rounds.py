"""The round engine (common/engine/rounds.py): the round rules without a transport.

- its in-process rounds give the same model, bit for bit, as the coordinator and client hosts of
  a real run (deploy/launch/inmemory.py: the same classes, codec and ledger as gRPC) for FedAvg,
  SCAFFOLD (client state, control variates), QSGD uploads and straggler plans;
- on the quadratic task it equals FedAvg written from the paper in float64 numpy;
- it refuses what it cannot reproduce without measured bytes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import numpy_fedavg_round, quadratic_config


def logreg_text(algorithm: str, extra_algorithm: str = "", extra_clients: str = "", rounds: int = 3) -> str:
    """Minibatch logistic regression on 6 clients, 3 sampled a round: the client streams matter."""
    return f"""
[run]
name = "engine-{algorithm}"
seed = 3
rounds = {rounds}
eval_every = 1
[algorithm]
name = "{algorithm}"
lr = 0.1
local_steps = 4
batch_size = 8
{extra_algorithm}
[data]
dataset = "logreg"
dim = 12
classes = 3
samples_min = 20
samples_max = 60
[model]
kind = "logreg"
[clients]
count = 6
per_round = 3
processes = 2
{extra_clients}
[transport]
kind = "inmemory"
"""


CASES = {
    "fedavg": logreg_text("fedavg"),
    "scaffold": logreg_text("scaffold", rounds=4),
    "fedavg-qsgd": logreg_text("fedavg", 'compress = "qsgd"\nqsgd_levels = 4'),
    "fedavg-stragglers": logreg_text("fedavg", extra_clients="straggler_fraction = 0.5"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_rounds_equal_a_framework_run_bit_for_bit(tmp_path, case):
    cfg = parse_config(CASES[case])
    summary, coord = run_inmemory(cfg, tmp_path)
    assert summary["status"] == "completed"
    engine = RoundEngine(cfg)
    initial = {k: v.clone() for k, v in engine.state.params.items()}
    history = engine.run()
    assert [engine.sample(r) for r in range(1, cfg.run.rounds + 1)] == [h.sampled for h in coord.history]
    assert set(engine.state.params) == set(coord.state.params)
    for name, t in coord.state.params.items():
        torch.testing.assert_close(engine.state.params[name], t, rtol=0, atol=0)
    for name, t in coord.state.extra.items():   # SCAFFOLD's server control variate, ...
        torch.testing.assert_close(engine.state.extra[name], t, rtol=0, atol=0)
    final = {k: v for k, v in history[-1].items() if k != "round"}
    want = {k: v for k, v in coord.history[-1].metrics.items() if not k.startswith(("time_", "sim_", "dropped_"))
            and k != "stragglers"}
    assert final == want
    assert any(not torch.equal(initial[n], t) for n, t in engine.state.params.items())   # it trained


def test_engine_fedavg_equals_numpy_fedavg_from_the_paper():
    rng = np.random.default_rng(2)
    centers, curv, sizes = rng.normal(0, 2, size=(5, 3)), rng.uniform(0.5, 2, size=(5, 3)), [3, 5, 2, 6, 4]
    cfg = parse_config(quadratic_config(centers, curv, sizes, rounds=4, local_steps=3, lr=0.1, per_round=3))
    engine = RoundEngine(cfg)
    w = np.zeros(3)
    for r in range(1, 5):
        sampled, _ = engine.train_round(r)
        assert len(sampled) == 3
        w = numpy_fedavg_round(w, centers, curv, sizes, sampled, 3, 0.1, 1.0)
    np.testing.assert_allclose(engine.state.params["w"].double().numpy(), w, rtol=1e-5, atol=1e-6)


def test_engine_refuses_cuts_that_need_measured_bytes_and_other_topologies():
    deadline = parse_config(logreg_text("fedavg", extra_clients="deadline_seconds = 1.0"))
    with pytest.raises(ValueError, match="deadline_seconds"):
        RoundEngine(deadline).train_round(1)
    hier = parse_config(logreg_text("fedavg").replace("[algorithm]", '[topology]\nkind = "hierarchical"\nedges = 2\n'
                                                                     "[algorithm]"))
    with pytest.raises(ValueError, match="hierarchical"):
        RoundEngine(hier).train_round(1)
