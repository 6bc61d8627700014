"""common/numerics/prox.py against closed forms and against generic solvers (scipy) on random inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from fedhop.common.numerics.prox import (
    constrained_prox,
    dual_averaging_prox,
    group_prox,
    norm_value,
    project_l1_ball,
    project_nuclear_ball,
    prox,
    singular_value_threshold,
    soft_threshold,
)

T = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731


# ---------------------------------------------------------------------------- generic solvers
def l1_composite_min(lin: np.ndarray, c: float, theta: float, l2_radius: float | None = None,
                     l1_ball: tuple[np.ndarray, float] | None = None) -> np.ndarray:
    """argmin_w <w, lin> + c/2 ||w||^2 + theta ||w||_1 [s.t. ||w|| <= l2_radius, ||w - w0||_1 <= r]
    as a smooth problem in w = p - n, p, n >= 0 (theta ||w||_1 = theta sum(p + n) at the optimum)."""
    d = lin.size

    def f(x):
        p, n = x[:d], x[d:]
        w = p - n
        val = lin @ w + 0.5 * c * w @ w + theta * (p.sum() + n.sum())
        gw = lin + c * w
        return val, np.concatenate([gw + theta, -gw + theta])

    x0 = np.zeros(2 * d)
    if l2_radius is None and l1_ball is None:
        res = minimize(f, x0, jac=True, method="L-BFGS-B", bounds=[(0, None)] * (2 * d),
                       options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 10_000})
        return res.x[:d] - res.x[d:]
    cons = []
    if l2_radius is not None:
        cons.append({"type": "ineq", "fun": lambda x: l2_radius ** 2 - np.sum((x[:d] - x[d:]) ** 2)})
    if l1_ball is not None:
        # ||w - w0||_1 <= r with w = w0 + p - n: re-parametrise around w0
        w0, r = l1_ball
        lin0 = lin + c * w0  # <w0 + v, lin> + c/2 ||w0 + v||^2 = const + <v, lin + c w0> + c/2 ||v||^2

        def g(x):
            p, n = x[:d], x[d:]
            v = p - n
            w = w0 + v
            val = lin0 @ v + 0.5 * c * v @ v + theta * np.abs(w).sum()
            return val
        cons = [{"type": "ineq", "fun": lambda x: r - x.sum()}]
        res = minimize(g, np.zeros(2 * d), method="SLSQP", bounds=[(0, None)] * (2 * d), constraints=cons,
                       options={"ftol": 1e-14, "maxiter": 2000})
        return w0 + res.x[:d] - res.x[d:]
    res = minimize(lambda x: f(x)[0], x0, jac=lambda x: f(x)[1], method="SLSQP", bounds=[(0, None)] * (2 * d),
                   constraints=cons, options={"ftol": 1e-14, "maxiter": 2000})
    return res.x[:d] - res.x[d:]


def nuclear_composite_min(lin: np.ndarray, c: float, theta: float, seed: int) -> np.ndarray:
    """argmin_W <W, lin> + c/2 ||W||_F^2 + theta ||W||_* by the Burer-Monteiro factorisation
    W = P Q^T, ||W||_* = min (||P||^2 + ||Q||^2)/2 (full-rank factors: every local minimum is
    global), solved by L-BFGS from a random start.  Independent of any SVD."""
    m, n = lin.shape
    k = min(m, n)
    rng = np.random.default_rng(seed)

    def f(x):
        p, q = x[:m * k].reshape(m, k), x[m * k:].reshape(n, k)
        w = p @ q.T
        val = np.sum(lin * w) + 0.5 * c * np.sum(w * w) + 0.5 * theta * (np.sum(p * p) + np.sum(q * q))
        gw = lin + c * w
        return val, np.concatenate([(gw @ q + theta * p).ravel(), (gw.T @ p + theta * q).ravel()])

    res = minimize(f, rng.normal(0, 0.5, (m + n) * k), jac=True, method="L-BFGS-B",
                   options={"ftol": 1e-16, "gtol": 1e-12, "maxiter": 50_000, "maxcor": 30})
    p, q = res.x[:m * k].reshape(m, k), res.x[m * k:].reshape(n, k)
    return p @ q.T


def nuclear_objective(w: np.ndarray, lin: np.ndarray, c: float, theta: float) -> float:
    return float(np.sum(lin * w) + 0.5 * c * np.sum(w * w) + theta * np.linalg.svd(w, compute_uv=False).sum())


# ---------------------------------------------------------------------------- l1
def test_soft_threshold_matches_elementwise_closed_form():
    rng = np.random.default_rng(0)
    v = rng.normal(0, 2, 200)
    theta = 0.7
    expected = np.where(v > theta, v - theta, np.where(v < -theta, v + theta, 0.0))
    got = soft_threshold(T(v), theta).numpy()
    np.testing.assert_array_equal(got == 0, np.abs(v) <= theta)   # exact zeros
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_l1_prox_matches_generic_solver(seed):
    rng = np.random.default_rng(seed)
    u = rng.normal(0, 1.5, 30)
    theta = float(rng.uniform(0.2, 1.0))
    got = prox(T(u), theta, "l1").numpy()
    # 1/2 ||w - u||^2 + theta ||w||_1 = <w, -u> + 1/2 ||w||^2 + theta ||w||_1 + const
    ref = l1_composite_min(-u, 1.0, theta)
    np.testing.assert_allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("seed", [4, 5])
def test_dual_averaging_prox_l1_matches_generic_solver(seed):
    rng = np.random.default_rng(seed)
    d = 25
    z, w0 = rng.normal(0, 3, d), rng.normal(0, 1, d)
    A, mu, gamma, lam = 37.0, 0.1, 5.5, 0.08
    got = dual_averaging_prox({"w": T(z)}, A=A, mu=mu, gamma=gamma, w0={"w": T(w0)}, lam=lam,
                              kinds={"w": "l1"})["w"].numpy()
    # argmin <w, z - gamma w0> + (mu A/2 + gamma)||w||^2/2 + A lam ||w||_1
    ref = l1_composite_min(z - gamma * w0, mu * A / 2 + gamma, A * lam)
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert (got == 0).sum() > 0   # the threshold A lam / c is large enough to zero some entries


def test_dual_averaging_prox_with_no_gradient_returns_w0():
    w0 = T(np.linspace(-1, 1, 7))
    got = dual_averaging_prox({"w": torch.zeros(7, dtype=torch.float64)}, A=0.0, mu=0.1, gamma=3.0,
                              w0={"w": w0}, lam=0.5, kinds={"w": "l1"})["w"]
    torch.testing.assert_close(got, w0, rtol=0, atol=1e-15)


@pytest.mark.parametrize("seed", [6, 7])
def test_l1_ball_projection_matches_constrained_solver(seed):
    rng = np.random.default_rng(seed)
    v = rng.normal(0, 1, 15)
    r = 0.4 * np.abs(v).sum()
    got = project_l1_ball(T(v), r).numpy()
    assert np.abs(got).sum() <= r + 1e-12
    # projection = argmin 1/2 ||w - v||^2 s.t. ||w||_1 <= r
    ref = l1_composite_min(-v, 1.0, 0.0, l1_ball=(np.zeros_like(v), r))
    np.testing.assert_allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("kind", ["l1", "nuclear"])
def test_constrained_prox_stays_in_ball_and_is_exact_when_inactive(kind):
    g = torch.Generator().manual_seed(3)
    shape = (40,) if kind == "l1" else (6, 5)
    u = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    center = torch.randn(shape, generator=g, dtype=torch.float64)
    theta = 0.3
    free = prox(u, theta, kind)
    dist = norm_value(free - center, kind)
    for radius in (0.05 * dist, 0.5 * dist, 0.99 * dist):
        w = constrained_prox(u, theta, kind, radius=radius, center=center)
        assert norm_value(w - center, kind) <= radius * (1 + 1e-9) + 1e-12
        assert norm_value(w - center, kind) >= radius * (1 - 1e-9)   # active ball: on its boundary
    w_big = constrained_prox(u, theta, kind, radius=1.01 * dist, center=center)
    torch.testing.assert_close(w_big, free, rtol=0, atol=0)           # inactive: exactly the prox


def test_constrained_l1_prox_matches_exact_solver_when_ball_is_active():
    """The heuristic is not the exact CProx in general, but both are feasible and the heuristic's
    objective is within a small margin of the exact constrained minimum on this instance."""
    rng = np.random.default_rng(11)
    u, center = rng.normal(0, 2, 12), rng.normal(0, 0.2, 12)
    theta = 0.4
    free = soft_threshold(T(u), theta).numpy()
    r = 0.5 * np.abs(free - center).sum()
    heur = constrained_prox(T(u), theta, "l1", radius=r, center=T(center)).numpy()
    exact = l1_composite_min(-u, 1.0, theta, l1_ball=(center, r))
    obj = lambda w: 0.5 * np.sum((w - u) ** 2) + theta * np.abs(w).sum()  # noqa: E731
    assert np.abs(exact - center).sum() <= r + 1e-6
    assert obj(exact) <= obj(heur) + 1e-7          # the exact one is no worse (sanity of the solver)
    assert obj(heur) <= obj(exact) * 1.05           # the heuristic is close


def test_l2_domain_ball_is_exact_for_l1():
    rng = np.random.default_rng(12)
    u = rng.normal(0, 2, 10)
    theta, rho = 0.3, 1.0
    got = group_prox({"w": T(u)}, theta, {"w": "l1"}, rho=rho)["w"].numpy()
    assert np.linalg.norm(got) <= rho + 1e-12
    ref = l1_composite_min(-u, 1.0, theta, l2_radius=rho)
    np.testing.assert_allclose(got, ref, atol=1e-5)


# ---------------------------------------------------------------------------- nuclear
def test_svt_matches_closed_form_on_known_spectrum():
    rng = np.random.default_rng(13)
    q1, _ = np.linalg.qr(rng.normal(size=(7, 7)))
    q2, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    s = np.array([3.0, 2.0, 1.0, 0.5, 0.1])
    m = q1[:, :5] @ np.diag(s) @ q2.T
    got = singular_value_threshold(T(m), 0.75).numpy()
    expected = q1[:, :5] @ np.diag(np.maximum(s - 0.75, 0)) @ q2.T
    np.testing.assert_allclose(got, expected, atol=1e-12)
    assert np.linalg.matrix_rank(got) == 3


@pytest.mark.parametrize("seed", [14, 15, 16])
def test_nuclear_prox_matches_generic_solver(seed):
    rng = np.random.default_rng(seed)
    u = rng.normal(0, 1, (6, 5))
    theta = 0.9
    got = prox(T(u), theta, "nuclear").numpy()
    ref = nuclear_composite_min(-u, 1.0, theta, seed)
    assert nuclear_objective(got, -u, 1.0, theta) <= nuclear_objective(ref, -u, 1.0, theta) + 1e-9
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_dual_averaging_prox_nuclear_matches_generic_solver():
    rng = np.random.default_rng(17)
    z, w0 = rng.normal(0, 4, (5, 5)), rng.normal(0, 1, (5, 5))
    A, mu, gamma, lam = 12.0, 0.1, 6.0, 0.2
    got = dual_averaging_prox({"W": T(z)}, A=A, mu=mu, gamma=gamma, w0={"W": T(w0)}, lam=lam,
                              kinds={"W": "nuclear"})["W"].numpy()
    lin, c = z - gamma * w0, mu * A / 2 + gamma
    ref = nuclear_composite_min(lin, c, A * lam, 17)
    np.testing.assert_allclose(got, ref, atol=1e-4)
    assert np.linalg.matrix_rank(got, tol=1e-9) < 5


def test_nuclear_ball_projection_satisfies_the_projection_inequality():
    """P = Proj_C(V) iff <V - P, X - P> <= 0 for every X in C; checked on random points of the
    ball and on its extreme points r u v^T."""
    rng = np.random.default_rng(18)
    v = rng.normal(0, 1, (6, 4))
    r = 0.3 * np.linalg.svd(v, compute_uv=False).sum()
    p = project_nuclear_ball(T(v), r).numpy()
    assert np.linalg.svd(p, compute_uv=False).sum() <= r * (1 + 1e-12)
    for _ in range(300):
        x = rng.normal(0, 1, (6, 4))
        x *= rng.uniform(0, 1) * r / np.linalg.svd(x, compute_uv=False).sum()
        a, b = rng.normal(size=6), rng.normal(size=4)
        ext = r * np.outer(a / np.linalg.norm(a), b / np.linalg.norm(b))
        for point in (x, ext):
            assert np.sum((v - p) * (point - p)) <= 1e-10


def test_group_prox_regularises_only_listed_tensors_and_projects_jointly():
    g = torch.Generator().manual_seed(5)
    u = {"weight": torch.randn(4, 3, generator=g, dtype=torch.float64) * 2,
         "bias": torch.randn(3, generator=g, dtype=torch.float64)}
    kinds = {"weight": "l1", "bias": "none"}
    out = group_prox(u, 0.5, kinds)
    torch.testing.assert_close(out["bias"], u["bias"], rtol=0, atol=0)
    torch.testing.assert_close(out["weight"], soft_threshold(u["weight"], 0.5), rtol=0, atol=0)
    center = {k: torch.zeros_like(v) for k, v in u.items()}
    r = 0.25 * float(out["weight"].abs().sum())
    ball = group_prox(u, 0.5, kinds, radius=r, center=center)
    assert float(ball["weight"].abs().sum()) <= r * (1 + 1e-12)
    torch.testing.assert_close(ball["bias"], u["bias"], rtol=0, atol=0)


def test_bad_kind_and_bad_shape_are_rejected():
    with pytest.raises(ValueError, match="allowed: none, l1, nuclear"):
        prox(torch.zeros(3), 0.1, "l2")
    with pytest.raises(ValueError, match="matrix"):
        prox(torch.zeros(3), 0.1, "nuclear")
    with pytest.raises(ValueError, match="center"):
        group_prox({"w": torch.zeros(3)}, 0.1, {"w": "l1"}, radius=1.0)
