"""Ball and simplex projections against independent implementations (scipy's SLSQP solver of
min ||p - v||^2 over the set, and a bisection on the simplex threshold)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from fedhop.common.numerics.projections import Constraint, project_ball, project_simplex

RNG = np.random.default_rng(7)


def slsqp_projection(v: np.ndarray, constraints: list[dict], bounds=None) -> np.ndarray:
    """argmin_p ||p - v||^2 subject to `constraints`, by a general-purpose QP solver."""
    res = minimize(lambda p: 0.5 * np.sum((p - v) ** 2), x0=np.zeros_like(v), jac=lambda p: p - v,
                   constraints=constraints, bounds=bounds, method="SLSQP",
                   options={"ftol": 1e-12, "maxiter": 500})
    # SLSQP sometimes flags a converged line search as failed; the comparison below is the check
    return res.x


def bisection_simplex(v: np.ndarray, total: float) -> np.ndarray:
    """Projection onto the simplex by bisection on theta: sum max(v - theta, 0) = total."""
    lo, hi = v.min() - total, v.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.maximum(v - mid, 0).sum() > total:
            lo = mid
        else:
            hi = mid
    return np.maximum(v - 0.5 * (lo + hi), 0)


@pytest.mark.parametrize("trial", range(6))
def test_ball_matches_qp_solver(trial):
    d = int(RNG.integers(2, 8))
    v = RNG.normal(0, 2, d)
    radius = float(RNG.uniform(0.3, 3.0))
    got = project_ball(torch.tensor(v), radius).numpy()
    want = slsqp_projection(v, [{"type": "ineq", "fun": lambda p: radius ** 2 - p @ p,
                                 "jac": lambda p: -2 * p}])
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_ball_leaves_interior_points_alone_and_is_idempotent():
    v = torch.tensor([0.3, -0.4])                 # norm 0.5
    assert torch.equal(project_ball(v, 1.0), v)
    out = project_ball(torch.tensor([3.0, 4.0]), 1.0)
    np.testing.assert_allclose(out.numpy(), [0.6, 0.8], rtol=1e-6)
    assert torch.allclose(project_ball(out, 1.0), out)


@pytest.mark.parametrize("trial", range(8))
def test_simplex_matches_qp_solver_and_bisection(trial):
    d = int(RNG.integers(2, 12))
    v = RNG.normal(0, 1.5, d)
    total = float(RNG.choice([1.0, 2.5]))
    got = project_simplex(torch.tensor(v), total).numpy()
    want = slsqp_projection(v, [{"type": "eq", "fun": lambda p: p.sum() - total, "jac": lambda p: np.ones_like(p)}],
                            bounds=[(0, None)] * d)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got, bisection_simplex(v, total), atol=1e-10)
    assert got.min() >= 0 and abs(got.sum() - total) < 1e-10


def test_simplex_closed_form_cases():
    # a point on the simplex stays; a uniform shift is removed; a dominant entry takes all
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    assert torch.allclose(project_simplex(p), p)
    assert torch.allclose(project_simplex(p + 7.0), p)
    assert torch.allclose(project_simplex(torch.tensor([5.0, 0.0, -1.0], dtype=torch.float64)),
                          torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_constraint_spec_round_trip_and_errors():
    for c in (Constraint("none"), Constraint("ball", 2.5), Constraint("simplex", 1.0)):
        assert Constraint.parse(c.spec()) == c
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    with torch.no_grad():
        Constraint("ball", 1.0).project_(p)
    np.testing.assert_allclose(p.detach().numpy(), [0.6, 0.8], rtol=1e-6)
    with pytest.raises(ValueError, match="allowed: none, ball, simplex"):
        Constraint("cube")
    with pytest.raises(ValueError, match="size must be > 0"):
        Constraint("ball", 0.0)
