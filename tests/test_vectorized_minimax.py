"""[algorithm] vectorized for the federated minimax algorithms (common/algorithms/minimax_local.py
`local_sgda_together`): Local SGDA, Local SGDA+, Fed-Norm-SGDA and Fed-Norm-SGDA+ train a call's
clients together, x descending and y ascending, each client with its own local steps, momentum,
snapshot and projection of y.

What must hold: every reply is the one-at-a-time `local_sgda`'s to float rounding, with the same
steps, weights and ||a_i||_1; a client's result does not depend on the clients beside it, so the
engines give the same model bit for bit. fair_digits, whose loss weighs each class's mean loss by
y, trains together through its own loss of a padded batch (`FairDigitsTask.padded_loss`).
"""
from __future__ import annotations

import pytest
import torch

from fedhop.common.algorithms.minimax import A_NORM_KEY
from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine, local_update, local_updates
from fedhop.common.wire.message import COMPUTE_KEY
from tests.test_minimax import digits_toml, mm_toml
from tests.test_vectorized import _same_ways, engines_agree, fedhop

ALGORITHMS = ["local_sgda", "local_sgda_plus", "fed_norm_sgda", "fed_norm_sgda_plus"]


def _quadratic(algorithm: str, vec: bool, extra: str = "", dtype: str = "float64") -> str:
    """tests/test_minimax.py's four heterogeneous quadratic clients (tau = 2, 5, 3, 1; sizes 1-4),
    all sampled, weight decay on x."""
    return mm_toml(algorithm, per_round=4, dtype=dtype,
                   extra=f"weight_decay = 0.05\n{extra}vectorized = {str(vec).lower()}\n")


def _digits(dataset: str, algorithm: str, vec: bool, extra: str = "") -> str:
    """Robust training on digits (y a universal perturbation in the unit ball) or fair
    classification (y on the simplex), each client 1-2 epochs drawn each round, minibatches of
    32 on a Dirichlet split."""
    text = digits_toml(dataset, algorithm, f"{extra}vectorized = {str(vec).lower()}",
                       lr_y=5.0 if dataset == "robust_digits" else 0.5)
    return text.replace("per_round = 3", "per_round = 6")


CASES = [("quadratic", a, "") for a in ALGORITHMS] + [
    # heavy-ball momentum, a rho for each client (0: plain SGD beside momentum in one stack)
    ("quadratic", "fed_norm_sgda", "client_momentum = [0.0, 0.9, 0.5, 0.7]\n"),
    ("quadratic-float32", "local_sgda_plus", 'solver = "momentum"\n'),
    ("robust", "fed_norm_sgda_plus", "snapshot_period = 2\n"),
    ("robust", "local_sgda", 'solver = "momentum"\nweight_decay = 0.01\n'),
    ("fair", "fed_norm_sgda", 'solver = "momentum"\n'),
    ("fair", "local_sgda_plus", ""),
]


def _text(case: str, algorithm: str, extra: str, vec: bool) -> str:
    if case in ("robust", "fair"):
        return _digits(f"{case}_digits", algorithm, vec, extra)
    return _quadratic(algorithm, vec, extra, "float32" if case.endswith("float32") else "float64")


def _items(engine: RoundEngine, round: int) -> list:
    sampled = engine.sample(round)
    _, own = engine.messages(round, sampled)
    return [(cid, round, own[cid], {}, 0) for cid in sampled]


@pytest.mark.parametrize("case,algorithm,extra", CASES)
def test_minimax_clients_trained_together_are_local_sgda_to_rounding(case, algorithm, extra):
    """Round 1's replies, then 3 rounds of each engine's own loop (SGDA+ past a snapshot refresh)."""
    plain = RoundEngine(parse_config(_text(case, algorithm, extra, False)))
    vec = RoundEngine(parse_config(_text(case, algorithm, extra, True)))
    assert vec.algorithm.trains_together() and vec.cfg.algorithm.vectorized
    items = _items(plain, 1)
    one = [local_update(plain.cfg, plain.task, plain.algorithm, plain.task.build_model(), *item) for item in items]
    both = local_updates(vec.cfg, vec.task, vec.algorithm, vec.task.build_model(), items)
    assert len({int(r.scalars["local_steps"]) for r in one}) > 1   # several step counts in one call
    tight = case == "quadratic"   # float64
    for a, b in zip(one, both):
        assert list(a.tensors) == list(b.tensors)
        for key in ("local_steps", "weight", "pn", "num_clients", "max_constraint"):
            assert a.scalars[key] == b.scalars[key], key
        assert b.scalars["train_loss"] == pytest.approx(a.scalars["train_loss"], rel=1e-12 if tight else 1e-5)
        assert b.scalars[COMPUTE_KEY] > 0
        for name, t in a.tensors.items():
            if name == A_NORM_KEY:
                assert float(t) == float(b.tensors[name])   # p_i n ||a_i||_1: the same steps, the same number
            else:
                assert torch.allclose(t, b.tensors[name], rtol=1e-10 if tight else 1e-4,
                                      atol=1e-12 if tight else 1e-6), name
    plain.run(3)
    vec.run(3)
    for name, w in plain.state.params.items():
        assert torch.allclose(w, vec.state.params[name], rtol=1e-10 if tight else 1e-4,
                              atol=1e-12 if tight else 1e-5), name
    if case == "robust":
        assert float(vec.state.params["y"].norm()) <= 1.0 + 1e-5   # projected onto the ball
    if case == "fair":   # on the simplex, and moved from the uniform start
        y = vec.state.params["y"]
        assert float(y.min()) >= 0 and float(y.sum()) == pytest.approx(1.0, abs=1e-5) and float(y.max()) > 0.11


@pytest.mark.parametrize("case,algorithm,extra", [CASES[4], CASES[6], CASES[8]])
def test_a_minimax_clients_result_does_not_depend_on_the_clients_beside_it(case, algorithm, extra):
    engine = RoundEngine(parse_config(_text(case, algorithm, extra, True)))
    engine.run(2)   # SGDA+: clients now hold a snapshot
    _same_ways(engine, _items(engine, 3), engine.task.build_model())


def test_minimax_gives_one_model_in_both_engines_and_the_plain_runs_bytes(tmp_path):
    """From a user's folder: Fed-Norm-SGDA+ on robust digits, vectorized in processes and
    in-process, the same model bit for bit with the one-at-a-time run's messages and bytes."""
    (tmp_path / "robust.toml").write_text(_digits("robust_digits", "fed_norm_sgda_plus", False,
                                                  "snapshot_period = 2\n").replace('kind = "inmemory"', 'kind = "grpc"'))
    engines_agree(tmp_path, "robust.toml")


def test_fair_digits_padded_loss_is_its_loss_on_the_real_rows():
    """`padded_loss` against `loss` (index_add per class) on batches with a class missing,
    padded with zero rows (labels 0, so padding would count towards class 0 if the mask failed)."""
    engine = RoundEngine(parse_config(_digits("fair_digits", "fed_norm_sgda", True)))
    task, model = engine.task, engine.task.build_model()
    with torch.no_grad():
        model.y.copy_(torch.softmax(torch.randn(model.y.shape, generator=torch.Generator().manual_seed(0)), 0))
    x, labels = task.client_data(0).tensors[:2]
    for rows in (3, 8, int(labels.numel())):
        real = (x[:rows], labels[:rows])
        padded = (torch.cat([real[0], torch.zeros(5, *x.shape[1:])]),
                  torch.cat([real[1], torch.zeros(5, dtype=labels.dtype)]))
        mask = torch.cat([torch.ones(rows), torch.zeros(5)])
        with torch.no_grad():
            want = float(task.loss(model, real))
            assert float(task.padded_loss(model, padded, mask)) == pytest.approx(want, rel=1e-6)
            assert float(task.padded_loss(model, padded, torch.ones(rows + 5))) != pytest.approx(want, rel=1e-6)


def test_a_minimax_task_with_noise_is_refused_in_one_line(tmp_path):
    """The quadratic's gradient noise draws from the client's generator."""
    (tmp_path / "q.toml").write_text(mm_toml("local_sgda", noise=0.1, extra="vectorized = true"))
    out = fedhop(["run", "q.toml"], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.vectorized" in lines[0] and "MinimaxQuadraticTask" in lines[0], out.stderr


@pytest.mark.parametrize("dataset,algorithm,key", [
    ("digits", "fed_norm_sgda", "data.dataset"),             # no maximising part y: every client would fail
    ("minimax_quadratic", "fedavg", "algorithm.name"),       # y would descend
    ("fair_digits", "scaffold", "algorithm.name"),
])
def test_a_minimax_algorithm_and_a_task_of_another_kind_are_refused_in_one_line(tmp_path, dataset, algorithm, key):
    """From a user's folder: the built-in pairing is refused when the config loads (exit 2, one
    line naming the key, no run folder); the matching pairs load (the tests above run them)."""
    (tmp_path / "x.toml").write_text(f'[algorithm]\nname = "{algorithm}"\n[data]\ndataset = "{dataset}"\n'
                                     + ("dim = 2\n" if dataset == "minimax_quadratic" else ""))
    out = fedhop(["run", "x.toml"], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"config key '{key}'" in lines[0] and "minimax" in lines[0], out.stderr
    assert not any(tmp_path.glob("runs"))
    parse_config(f'[algorithm]\nname = "local_sgda"\n[data]\ndataset = "{dataset}"\n'
                 if key == "algorithm.name" else f'[algorithm]\nname = "{algorithm}"\n[data]\ndataset = "fair_digits"\n')
