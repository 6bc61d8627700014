"""FedAdam / FedYogi / FedAdagrad / FedAvgM (common/algorithms/fedopt.py), FedProx and FedExP
against independent numpy computations written from the papers (Reddi et al. 2021 Algorithm 2,
Hsu et al. 2019, Li et al. 2020 Eq. 2, Jhunjhunwala et al. 2023 Eq. 9)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhop.common.algorithms import build_algorithm
from fedhop.common.algorithms.base import Payload
from fedhop.common.config import ConfigError, parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.deploy.launch.inmemory import run_inmemory
from tests.helpers import quadratic_config

RNG = np.random.default_rng(11)
CENTERS = RNG.normal(0, 2, size=(5, 3))
CURV = RNG.uniform(0.3, 2.5, size=(5, 3))
SIZES = [4, 9, 2, 6, 5]


# ----------------------------------------------------------------------------- numpy references
def np_server(kind, x, mean_deltas, eta, beta1=0.9, beta2=0.99, tau=1e-3, v0=1e-6, momentum=0.9, nesterov=False):
    """Apply Reddi et al.'s Algorithm 2 (or FedAvgM) to a list of per-round mean deltas."""
    x = np.array(x, dtype=np.float64)
    m = np.zeros_like(x)
    v = np.full_like(x, v0)
    for d in mean_deltas:
        if kind == "fedavgm":
            m = momentum * m + d
            x = x + eta * ((momentum * m + d) if nesterov else m)
            continue
        m = beta1 * m + (1 - beta1) * d
        if kind == "fedadagrad":
            v = v + d ** 2
        elif kind == "fedyogi":
            v = v - (1 - beta2) * d ** 2 * np.sign(v - d ** 2)
        else:
            v = beta2 * v + (1 - beta2) * d ** 2
        x = x + eta * m / (np.sqrt(v) + tau)
    return x


def np_local(w, i, steps, lr, mu=0.0):
    """Full-batch local GD on f_i plus FedProx's (mu/2)||w - w_t||^2."""
    wi = w.copy()
    for _ in range(steps):
        wi = wi - lr * (CURV[i] * (wi - CENTERS[i]) + mu * (wi - w))
    return wi - w


def np_run(kind, history, steps, lr, eta, weights, mu=0.0, eps=1e-3, **server):
    """Whole runs: clients' local GD, weighted mean delta, then the server rule per round."""
    x = np.zeros(CENTERS.shape[1])
    m = np.zeros_like(x)
    v = np.full_like(x, server.get("v0", 1e-6))
    for participants in history:
        deltas = [np_local(x, i, steps, lr, mu) for i in participants]
        p = np.array([weights[i] for i in participants], dtype=float)
        p = p / p.sum()
        mean = sum(pi * d for pi, d in zip(p, deltas))
        if kind in ("fedavg", "fedprox"):
            x = x + eta * mean
        elif kind == "fedexp":
            sq = sum(pi * float(d @ d) for pi, d in zip(p, deltas))
            eta_g = max(1.0, sq / (2 * (float(mean @ mean) + eps)))
            x = x + eta_g * mean
        else:
            b1, b2, tau = server.get("beta1", 0.9), server.get("beta2", 0.99), server.get("tau", 1e-3)
            if kind == "fedavgm":
                m = server.get("momentum", 0.9) * m + mean
                x = x + eta * m
                continue
            m = b1 * m + (1 - b1) * mean
            if kind == "fedadagrad":
                v = v + mean ** 2
            elif kind == "fedyogi":
                v = v - (1 - b2) * mean ** 2 * np.sign(v - mean ** 2)
            else:
                v = b2 * v + (1 - b2) * mean ** 2
            x = x + eta * m / (np.sqrt(v) + tau)
    return x


def _algo(name, server_lr=1.0, extra=""):
    cfg = parse_config(f'[algorithm]\nname = "{name}"\nserver_lr = {server_lr}\n{extra}')
    return build_algorithm(cfg)


def _reply(delta: dict[str, np.ndarray], weight: float) -> Payload:
    return Payload(tensors={k: torch.tensor(v, dtype=torch.float64) for k, v in delta.items()},
                   scalars={"weight": weight})


# ----------------------------------------------------------------------------- server steps, by hand
# three rounds of two or three clients' deltas over two tensors; the first round is large (Yogi's
# v grows: sign(v - d^2) < 0), the last small (v shrinks: sign > 0), and signs flip between rounds
ROUNDS = [
    [({"a": [1.0, -2.0, 0.5], "b": [[0.3, -0.1], [2.0, 0.0]]}, 2.0),
     ({"a": [0.5, -1.0, -0.5], "b": [[-0.3, 0.4], [1.0, 0.2]]}, 1.0)],
    [({"a": [-0.4, 0.1, 0.2], "b": [[0.1, 0.1], [-1.0, 0.3]]}, 1.0),
     ({"a": [-0.2, 0.3, 0.0], "b": [[0.0, -0.2], [-0.5, 0.1]]}, 3.0),
     ({"a": [0.1, 0.1, 0.1], "b": [[0.2, 0.2], [0.2, 0.2]]}, 1.0)],
    [({"a": [0.01, -0.02, 0.005], "b": [[0.001, 0.0], [-0.01, 0.002]]}, 1.0),
     ({"a": [0.02, 0.0, -0.01], "b": [[0.0, 0.003], [0.01, -0.002]]}, 1.0)],
]


def _hand_mean(clients, name):
    w = np.array([wt for _, wt in clients])
    return sum(wi * np.asarray(d[name]) for (d, _), wi in zip(clients, w)) / w.sum()


@pytest.mark.parametrize("kind,extra", [
    ("fedadam", ""), ("fedyogi", ""), ("fedadagrad", ""), ("fedavgm", ""),
    ("fedadam", "beta1 = 0.5\nbeta2 = 0.9\ntau = 0.01\nv0 = 0.0"),
    ("fedyogi", "beta1 = 0.0\nbeta2 = 0.5\ntau = 0.1"),
    ("fedadagrad", "beta1 = 0.2\ntau = 1e-2\nv0 = 0.5"),
    ("fedavgm", "momentum = 0.5\nnesterov = true"),
])
def test_server_step_equals_hand_computation(kind, extra):
    algo = _algo(kind, server_lr=0.3, extra=extra)
    x0 = {"a": np.array([0.5, -0.5, 1.0]), "b": np.array([[1.0, 2.0], [3.0, -4.0]])}
    state = algo.init_state({k: torch.tensor(v, dtype=torch.float64) for k, v in x0.items()})
    for clients in ROUNDS:
        agg = algo.aggregate([(i, _reply(d, w)) for i, (d, w) in enumerate(clients)])
        algo.server_update(state, agg, 1)
    options = dict(line.split(" = ") for line in extra.splitlines())
    kwargs = {k: (v == "true") if v in ("true", "false") else float(v) for k, v in options.items()}
    for name in x0:
        want = np_server(kind, x0[name], [_hand_mean(c, name) for c in ROUNDS], 0.3, **kwargs)
        np.testing.assert_allclose(state.params[name].numpy(), want, rtol=1e-12, atol=1e-12)
    # the rules differ from each other and from plain averaging on these inputs
    plain = x0["a"] + 0.3 * sum(_hand_mean(c, "a") for c in ROUNDS)
    assert np.abs(state.params["a"].numpy() - plain).max() > 1e-2


def test_the_four_rules_give_four_different_models():
    finals = []
    for kind in ("fedadam", "fedyogi", "fedadagrad", "fedavgm"):
        algo = _algo(kind, server_lr=0.3)
        state = algo.init_state({"a": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(2, 2, dtype=torch.float64)})
        for clients in ROUNDS:
            algo.server_update(state, algo.aggregate([(i, _reply(d, w)) for i, (d, w) in enumerate(clients)]), 1)
        finals.append(state.params["a"].numpy().copy())
    for i in range(4):
        for j in range(i + 1, 4):
            assert np.abs(finals[i] - finals[j]).max() > 1e-3


def test_moments_live_in_server_state_extra():
    algo = _algo("fedadam", extra="v0 = 0.25")
    state = algo.init_state({"w": torch.zeros(3)})
    assert set(state.extra) == {"fedopt_m.w", "fedopt_v.w"}
    assert torch.equal(state.extra["fedopt_v.w"], torch.full((3,), 0.25))
    algo.server_update(state, algo.aggregate([(0, Payload({"w": torch.ones(3)}, {"weight": 1.0}))]), 1)
    np.testing.assert_allclose(state.extra["fedopt_m.w"].numpy(), 0.1)                    # (1 - 0.9) * 1
    np.testing.assert_allclose(state.extra["fedopt_v.w"].numpy(), 0.99 * 0.25 + 0.01, rtol=1e-6)


# ----------------------------------------------------------------------------- whole runs
def _run(tmp_path, algorithm, extra="", server_lr=1.0, per_round=3, rounds=4, weighting="samples", topology="",
         local_steps=6, lr=0.1):
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=rounds, local_steps=local_steps, lr=lr, per_round=per_round,
                            algorithm=algorithm, server_lr=server_lr, topology=topology,
                            extra_algorithm=f'{extra}\nweighting = "{weighting}"')
    summary, coord = run_inmemory(parse_config(text), tmp_path)
    assert summary["status"] == "completed", summary["error"]
    return summary, coord


@pytest.mark.parametrize("kind,extra,server_lr,weighting", [
    ("fedadam", "", 0.1, "samples"), ("fedyogi", "", 0.1, "uniform"), ("fedadagrad", "tau = 0.01", 0.2, "samples"),
    ("fedavgm", "momentum = 0.7", 0.8, "uniform"), ("fedprox", "mu = 0.5", 1.0, "samples"),
    ("fedexp", "", 1.0, "uniform"), ("fedexp", "eps = 0.1", 1.0, "samples"),
])
def test_inmemory_run_matches_numpy(tmp_path, kind, extra, server_lr, weighting):
    _, coord = _run(tmp_path, kind, extra, server_lr=server_lr, weighting=weighting)
    history = [r.participants for r in coord.history]
    assert any(set(h) != set(history[0]) for h in history)            # partial participation
    weights = SIZES if weighting == "samples" else [1] * len(SIZES)
    options = dict(line.split(" = ") for line in extra.splitlines())
    mu = float(options.pop("mu", 0.0))
    eps = float(options.pop("eps", 1e-3))
    want = np_run(kind, history, 6, 0.1, server_lr, weights, mu=mu, eps=eps,
                  **{k: float(v) for k, v in options.items()})
    np.testing.assert_allclose(coord.state.params["w"].double().numpy(), want, rtol=2e-5, atol=2e-6)
    fedavg = np_run("fedavg", history, 6, 0.1, server_lr, weights)
    assert np.abs(want - fedavg).max() > 1e-3                          # the rule made a difference


def test_fedprox_mu_zero_is_fedavg(tmp_path):
    _, prox = _run(tmp_path / "p", "fedprox", "mu = 0.0")
    _, avg = _run(tmp_path / "a", "fedavg")
    assert torch.equal(prox.state.params["w"], avg.state.params["w"])


def test_hierarchical_one_edge_equals_star_fedadam(tmp_path):
    _, star = _run(tmp_path / "star", "fedadam", server_lr=0.1)
    _, hier = _run(tmp_path / "hier", "fedadam", server_lr=0.1, topology='kind = "hierarchical"\nedges = 1')
    assert [r.participants for r in star.history] == [r.participants for r in hier.history]
    assert torch.equal(star.state.params["w"], hier.state.params["w"])
    for key in ("fedopt_m.w", "fedopt_v.w"):
        assert torch.equal(star.state.extra[key], hier.state.extra[key])


@pytest.mark.parametrize("kind", ["fedyogi", "fedavgm", "fedprox", "fedexp"])
def test_hierarchical_two_edges_match_star(tmp_path, kind):
    _, star = _run(tmp_path / "star", kind, server_lr=0.1 if kind == "fedyogi" else 1.0)
    _, hier = _run(tmp_path / "hier", kind, server_lr=0.1 if kind == "fedyogi" else 1.0,
                   topology='kind = "hierarchical"\nedges = 2')
    np.testing.assert_allclose(hier.state.params["w"].numpy(), star.state.params["w"].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("edges", [1, 2])
def test_fedexp_with_edge_iterations_kappa2(tmp_path, edges):
    """HierFAVG kappa2 = 2: an edge acts as one FedExP client (its partial carries W_e ||Delta_e||^2).
    With one edge the server sees a single 'client', so eta_g = max(1, ~1/2) = 1: FedAvg exactly."""
    topology = f'kind = "hierarchical"\nedges = {edges}\nkappa2 = 2'
    _, exp = _run(tmp_path / "exp", "fedexp", topology=topology, per_round=5)
    _, avg = _run(tmp_path / "avg", "fedavg", topology=topology, per_round=5)
    same = torch.equal(exp.state.params["w"], avg.state.params["w"])
    assert same if edges == 1 else not same


# ----------------------------------------------------------------------------- FedExP
def _fedexp_step(clients: list[tuple[list[float], float]], eps=1e-3, server_lr=1.0):
    algo = _algo("fedexp", server_lr=server_lr, extra=f"eps = {eps}")
    state = algo.init_state({"w": torch.zeros(2, dtype=torch.float64)})
    replies = []
    for i, (d, wt) in enumerate(clients):
        delta = torch.tensor(d, dtype=torch.float64)
        replies.append((i, Payload({"w": delta, "delta_sq_norm": delta @ delta}, {"weight": wt})))
    algo.server_update(state, algo.aggregate(replies), 1)
    return state


@pytest.mark.parametrize("clients,eta,mean", [
    # ||D1||^2 = ||D2||^2 = 5, mean [0, 1]: eta = 5 / (2 (1 + 1e-3)) = 5 / 2.002
    ([([2.0, 1.0], 1.0), ([-2.0, 1.0], 1.0)], 5 / 2.002, [0.0, 1.0]),
    # sample weights 3 : 1: mean (3 [2, 1] + [-2, 1]) / 4 = [1, 1]; sum p_i ||D_i||^2 = 5: eta = 5 / 4.002
    ([([2.0, 1.0], 3.0), ([-2.0, 1.0], 1.0)], 5 / 4.002, [1.0, 1.0]),
    # identical deltas: 2 / (2 (2 + 1e-3)) < 1, so eta = 1 (FedAvg)
    ([([1.0, 1.0], 1.0), ([1.0, 1.0], 2.0)], 1.0, [1.0, 1.0]),
    # three clients: norms 1, 4, 9; mean [0, 0.5]... (1 [1,0] + 1 [0,-2] + 2 [-0.5, 2.0]) / 4 = [0, 0.5]
    ([([1.0, 0.0], 1.0), ([0.0, -2.0], 1.0), ([-0.5, 2.0], 2.0)], (1 + 4 + 2 * 4.25) / 4 / (2 * (0.25 + 1e-3)),
     [0.0, 0.5]),
])
def test_fedexp_step_equals_formula_by_hand(clients, eta, mean):
    state = _fedexp_step(clients)
    assert state.scalars["fedexp_eta_g"] == pytest.approx(eta, rel=1e-6)
    np.testing.assert_allclose(state.params["w"].numpy(), eta * np.array(mean), rtol=1e-6)


def test_fedexp_step_is_never_below_one_and_matches_numpy():
    rng = np.random.default_rng(5)
    above = 0
    for _ in range(200):
        k = int(rng.integers(1, 5))
        deltas = rng.normal(0, 1, size=(k, 2)) + rng.normal(0, 1.0, size=2) * rng.integers(0, 2)
        weights = rng.integers(1, 10, size=k).astype(float)
        eps = float(10 ** rng.uniform(-4, 0))
        state = _fedexp_step([(list(d), w) for d, w in zip(deltas, weights)], eps=eps)
        p = weights / weights.sum()
        mean = p @ deltas
        want = max(1.0, float(p @ (deltas ** 2).sum(1)) / (2 * (float(mean @ mean) + eps)))
        got = state.scalars["fedexp_eta_g"]
        assert got >= 1.0
        assert got == pytest.approx(want, rel=1e-5)
        above += got > 1.0
    assert 20 < above < 200          # both branches of the max were exercised


def test_fedexp_average_of_last_two_iterates():
    algo = _algo("fedexp", extra="average_last_two = true")
    state = algo.init_state({"w": torch.zeros(2, dtype=torch.float64)})
    x = np.zeros(2)
    for d1, d2 in [([2.0, 1.0], [-2.0, 1.0]), ([1.0, 0.0], [1.0, 0.0])]:
        assert torch.equal(algo.broadcast(state, 1).tensors["w"], torch.tensor(x))    # clients get x_t, not the average
        replies = [(i, Payload({"w": torch.tensor(d, dtype=torch.float64),
                                "delta_sq_norm": torch.tensor(float(np.dot(d, d)), dtype=torch.float64)}, {"weight": 1.0}))
                   for i, d in enumerate((d1, d2))]
        algo.server_update(state, algo.aggregate(replies), 1)
        mean = (np.array(d1) + np.array(d2)) / 2
        sq = (np.dot(d1, d1) + np.dot(d2, d2)) / 2
        previous, x = x, x + max(1.0, sq / (2 * (mean @ mean + 1e-3))) * mean
        np.testing.assert_allclose(state.params["w"].numpy(), (x + previous) / 2, rtol=1e-7)
    np.testing.assert_allclose(state.extra["fedexp_x.w"].numpy(), x, rtol=1e-7)


def test_fedexp_reply_carries_one_float64_scalar_more_than_fedavg(tmp_path):
    """||Delta_i||^2 travels as a 0-dim float64 tensor: 8 tensor bytes more per reply."""
    rounds, per_round = 3, 3
    up = {}
    for kind in ("fedavg", "fedexp"):
        _run(tmp_path / kind, kind, rounds=rounds, per_round=per_round)
        up[kind] = RunStore(tmp_path / kind / "run.db").bytes_by_link_direction()["client-server"]["up"]["tensor_bytes"]
    assert up["fedavg"] == rounds * per_round * 4 * CENTERS.shape[1]
    assert up["fedexp"] - up["fedavg"] == rounds * per_round * 8


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("text,key", [
    ('name = "fedadam"\nbeta1 = 1.0', "beta1"), ('name = "fedyogi"\nbeta2 = 1.5', "beta2"),
    ('name = "fedadam"\ntau = 0', "tau"), ('name = "fedavgm"\nmomentum = 1.0', "momentum"),
    ('name = "fedprox"\nmu = -0.1', "mu"), ('name = "fedexp"\neps = -1', "eps"),
    ('name = "fedadagrad"\nbeta2 = 0.9', "beta2"),
])
def test_bad_hyper_parameters_are_named(text, key):
    with pytest.raises(ConfigError, match=key):
        parse_config(f"[algorithm]\n{text}")


def test_papers_defaults():
    assert (_algo("fedadam").params.beta1, _algo("fedadam").params.beta2, _algo("fedadam").params.tau) == (0.9, 0.99, 1e-3)
    assert _algo("fedprox").params.mu == 0.01
    assert _algo("fedexp").params.eps == 1e-3 and _algo("fedexp").params.average_last_two is False
    assert _algo("fedavgm").params.momentum == 0.9
