"""The scalars that drive a server step travel and are summed in float64 (issue 28 item 3):
FedExP's ||Delta_i||^2, FedLi-LU's losses f^i and Fed-Norm-SGDA's p_i n ||a_i||_1.  Each run is the
server's round engine (common/engine/rounds.py: replies encoded, decoded and validated as over a
transport) on a float64 problem for 30 rounds, checked against the method written in float64
numpy to 1e-12.  The same numpy method with that one scalar rounded to float32 (what the wire
carried before) lands farther away than the tolerance, so these tests fail with float32 scalars."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhop.common.algorithms.fedexp import NORM_KEY
from fedhop.common.algorithms.fedli import LOSS_KEY, STEP_KEY
from fedhop.common.algorithms.minimax import A_NORM_KEY
from fedhop.common.config import parse_config
from fedhop.common.engine.rounds import RoundEngine
from tests.helpers import quadratic_config
from tests.test_minimax import mm_toml, numpy_local

ROUNDS = 30
RNG = np.random.default_rng(0)
CENTERS = RNG.normal(size=(6, 5)) * 3                   # heterogeneous optima (FedExP's eta_g grows)
CURVATURES = RNG.uniform(0.5, 1.5, size=(6, 5))
SIZES = [1, 2, 3, 1, 2, 3]
TIGHT = dict(rtol=1e-12, atol=1e-12)


def f32(v: float) -> float:
    return float(np.float32(v))


def engine(text: str) -> RoundEngine:
    text = text.replace('dataset = "quadratic"', 'dataset = "quadratic"\ndtype = "float64"')
    return RoundEngine(parse_config(text.replace('kind = "grpc"', 'kind = "inmemory"')))


def local_gd(w: np.ndarray, a: np.ndarray, c: np.ndarray, steps: int, lr: float) -> tuple[np.ndarray, float]:
    """Full-batch GD on f(w) = 1/2 sum c (w - a)^2; returns (w_K, mean of the losses before each step)."""
    losses = []
    for _ in range(steps):
        losses.append(0.5 * float((c * (w - a) ** 2).sum()))
        w = w - lr * (c * (w - a))
    return w, sum(losses) / steps


# ------------------------------------------------------------------------------------ FedExP
def numpy_fedexp(centers, curvatures, sizes, steps, lr, eps, rounding) -> np.ndarray:
    """Eq. 9 with p_i = n_i / sum n; `rounding` is applied to each client's ||Delta_i||^2."""
    w = np.zeros(centers.shape[1])
    p = np.asarray(sizes, dtype=float)
    for _ in range(ROUNDS):
        deltas = [local_gd(w, a, c, steps, lr)[0] - w for a, c in zip(centers, curvatures)]
        mean = sum(pi * d for pi, d in zip(p, deltas)) / p.sum()
        sq = sum(pi * rounding(float((d * d).sum())) for pi, d in zip(p, deltas)) / p.sum()
        w = w + max(1.0, sq / (2.0 * (float((mean * mean).sum()) + eps))) * mean
    return w


def test_fedexp_matches_float64_numpy_after_30_rounds():
    # Eq. 9's step jumps between 2 and 35 here; with larger steps (lr 0.02, 10 local steps) the run
    # is chaotic and rounding at 1e-16 grows to 1e-5 in 30 rounds, float64 or not
    eng = engine(quadratic_config(CENTERS, CURVATURES, SIZES, rounds=ROUNDS, local_steps=5, lr=0.01,
                                  algorithm="fedexp"))
    assert eng.algorithm.reply_spec(eng.state)[NORM_KEY] == (torch.float64, ())
    for r in range(1, ROUNDS + 1):
        eng.train_round(r)
    got = eng.state.params["w"].numpy()
    want = numpy_fedexp(CENTERS, CURVATURES, SIZES, 5, 0.01, 1e-3, float)
    np.testing.assert_allclose(got, want, **TIGHT)
    assert eng.state.scalars["fedexp_eta_g"] > 5                      # the extrapolated branch of Eq. 9
    rounded = numpy_fedexp(CENTERS, CURVATURES, SIZES, 5, 0.01, 1e-3, f32)
    assert np.abs(rounded - want).max() > 1e3 * 1e-12 * max(1.0, np.abs(want).max())


# ------------------------------------------------------------------------------------ FedLi-LU
HOMOGENEOUS = np.repeat(CENTERS[:1], 6, axis=0)          # f* = 0: the DFW step's gamma stays inside (0, 1)
LU_CURVATURES = np.random.default_rng(1).uniform(0.2, 3.0, size=(6, 5))


def numpy_fedli_lu(steps, lr, eta, eps, mu, rounding) -> tuple[np.ndarray, list[float]]:
    """Algorithm 2 / Eq. 21 with lambda = 0 (r_t = 0) and the DFW code's momentum mu:
    gamma = clip((f - 0) / (eta ||D||^2 + eps));  z <- mu z - eta gamma D;  w <- w - eta gamma D + mu z."""
    w, z = np.zeros(HOMOGENEOUS.shape[1]), np.zeros(HOMOGENEOUS.shape[1])
    p = np.asarray(SIZES, dtype=float)
    gammas = []
    for _ in range(ROUNDS):
        runs = [local_gd(w, a, c, steps, lr) for a, c in zip(HOMOGENEOUS, LU_CURVATURES)]
        d = -sum(pi * (wi - w) for pi, (wi, _) in zip(p, runs)) / p.sum()      # D_t = w_t - avg w^i
        f = sum(pi * rounding(fi) for pi, (_, fi) in zip(p, runs)) / p.sum()
        gamma = min(max(f / (eta * float((d * d).sum()) + eps), 0.0), 1.0)
        gammas.append(gamma)
        w = w - eta * (gamma * d)
        z = mu * z - (eta * gamma) * d
        w = w + mu * z
    return w, gammas


def test_fedli_lu_matches_float64_numpy_after_30_rounds():
    extra = "eta = 2.0\nserver_weight_decay = 0.0\nmomentum = 0.9"
    eng = engine(quadratic_config(HOMOGENEOUS, LU_CURVATURES, SIZES, rounds=ROUNDS, local_steps=10, lr=0.05,
                                  algorithm="fedli_lu", extra_algorithm=extra))
    assert eng.algorithm.reply_spec(eng.state)[LOSS_KEY] == (torch.float64, ())
    for r in range(1, ROUNDS + 1):
        eng.train_round(r)
    want, gammas = numpy_fedli_lu(10, 0.05, 2.0, 1e-5, 0.9, float)
    assert all(0.0 < g < 1.0 for g in gammas[5:])                   # the loss sets every late step
    np.testing.assert_allclose(eng.state.params["w"].numpy(), want, **TIGHT)
    assert eng.state.scalars["fedli_gamma"] == pytest.approx(gammas[-1], rel=1e-12)
    rounded, _ = numpy_fedli_lu(10, 0.05, 2.0, 1e-5, 0.9, f32)
    assert np.abs(rounded - want).max() > 10 * 1e-12 * np.abs(want).max()


def test_fedli_ls_step_size_travels_as_float64():
    eng = engine(quadratic_config(CENTERS, CURVATURES, SIZES, rounds=1, algorithm="fedli_ls",
                                  extra_algorithm='server_step = "max"'))
    assert eng.algorithm.reply_spec(eng.state)[STEP_KEY] == (torch.float64, ())
    _, aggregate = eng.train_round(1)
    assert aggregate.tensors[STEP_KEY].dtype == torch.float64
    assert eng.state.scalars["fedli_server_step"] == float(aggregate.tensors[STEP_KEY])


# ------------------------------------------------------------------------------------ Fed-Norm-SGDA
def numpy_fed_norm(task, taus, rho, eta, gamma, sampled_sets, rounding) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 with heavy-ball clients: g_i = -+delta_i / (eta ||a_i||_1), w~_i = p_i n / |C|,
    tau_eff = sum_C p_i n ||a_i||_1 / sum_C p_i n (`rounding` on each client's p_i n ||a_i||_1)."""
    n = task.num_clients
    p = np.asarray(task.weights, dtype=float)
    x, y = np.zeros(task.dim), np.zeros(task.dim)
    for chosen in sampled_sets:
        sx, sy, num, den = np.zeros_like(x), np.zeros_like(y), 0.0, 0.0
        for i in chosen:
            xi, yi = numpy_local(task.a[i], task.c[i], task.u[i], task.v[i], task.b, x, y, taus[i], eta, eta, rho)
            a_norm = sum((1.0 - rho ** (taus[i] - k)) / (1.0 - rho) for k in range(taus[i]))
            pn = p[i] * n
            sx += pn * (-(xi - x) / (eta * a_norm))
            sy += pn * ((yi - y) / (eta * a_norm))
            num += rounding(pn * a_norm)
            den += pn
        tau = num / den
        x, y = x + (-tau * gamma) * (sx / len(chosen)), y + (tau * gamma) * (sy / len(chosen))
    return x, y


def test_fed_norm_sgda_with_momentum_clients_matches_float64_numpy_after_30_rounds():
    text = mm_toml("fed_norm_sgda", rounds=ROUNDS, per_round=3, extra='solver = "momentum"\nmomentum = 0.7')
    eng = RoundEngine(parse_config(text))
    assert eng.algorithm.reply_spec(eng.state)[A_NORM_KEY] == (torch.float64, ())
    sets = []
    for r in range(1, ROUNDS + 1):
        sampled, aggregate = eng.train_round(r)
        sets.append(sampled)
        assert aggregate.tensors[A_NORM_KEY].dtype == torch.float64
    taus = [2, 5, 3, 1]                                  # mm_toml's local_steps
    x, y = numpy_fed_norm(eng.task, taus, 0.7, 0.1, 0.1, sets, float)
    np.testing.assert_allclose(eng.state.params["x"].numpy(), x, **TIGHT)
    np.testing.assert_allclose(eng.state.params["y"].numpy(), y, **TIGHT)
    xr, yr = numpy_fed_norm(eng.task, taus, 0.7, 0.1, 0.1, sets, f32)
    assert max(np.abs(xr - x).max(), np.abs(yr - y).max()) > 10 * 1e-12 * max(np.abs(x).max(), 1.0)
