"""Proximal operators of the composite regularisers (seed-001 digest, sections 2.1, 2.5 and 8).

Notation: `R` is the regulariser's norm (l1: sum |w_j|; nuclear: the sum of singular values of a
matrix), `theta > 0` a threshold.

- `prox(u, theta, kind)`            argmin_w 1/2 ||w - u||^2 + theta R(w)   (closed forms:
                                   soft thresholding for l1, singular value thresholding for nuclear)
- `constrained_prox(...)`           the same with the ball R(w - center) <= radius: C-FedDA's CProx.
  There is no closed form; we use the cheap heuristic of the digest (2.5): threshold, then, if the
  ball is violated, project w - center onto the R-ball (Duchi et al. 2008 for l1, the singular
  values onto the l1-ball for nuclear).  It is exact whenever the ball is inactive (the experimental
  regime) and always returns a point inside the ball.
- `dual_averaging_prox(z, ...)`     Prox_t of Fast-FedDA (paper Section 2.1):
      argmin_w <w, z - gamma w0> + (mu A / 2 + gamma) ||w||^2 / 2 + A lam R(w)
    = prox_{(A lam / c) R}(u),  c = mu A / 2 + gamma,  u = (gamma w0 - z) / c
  followed by the optional constraint ball and the optional l2 domain ball ||w|| <= rho (a
  positive rescaling, exact for any norm regulariser, digest 2.1).
- `group_prox(...)`                 the same operators over a dict of named tensors (a model):
  the regulariser is a sum over the regularised tensors, the constraint ball is joint.

All routines work in the dtype of their inputs; callers pass float64.
"""
from __future__ import annotations

import math
from typing import Literal, Mapping

import torch

Kind = Literal["none", "l1", "nuclear"]
KINDS: tuple[str, ...] = ("none", "l1", "nuclear")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"regularizer = {kind!r} is not allowed (allowed: {', '.join(KINDS)})")


# ---------------------------------------------------------------------------- closed forms
def soft_threshold(v: torch.Tensor, theta: float) -> torch.Tensor:
    """S_theta(v) = sign(v) max(|v| - theta, 0): the prox of theta ||.||_1 (exact zeros below theta)."""
    if theta <= 0:
        return v.clone()
    return torch.sign(v) * torch.clamp(v.abs() - theta, min=0.0)


def _as_matrix(m: torch.Tensor, what: str) -> None:
    if m.ndim != 2:
        raise ValueError(f"{what}: the nuclear norm needs a matrix (2-D tensor), got shape {tuple(m.shape)}")


def singular_value_threshold(m: torch.Tensor, theta: float) -> torch.Tensor:
    """U diag(max(s - theta, 0)) V^T: the prox of theta ||.||_* (exactly low rank)."""
    _as_matrix(m, "singular_value_threshold")
    if theta <= 0:
        return m.clone()
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    s = torch.clamp(s - theta, min=0.0)
    keep = int((s > 0).sum())
    return (u[:, :keep] * s[:keep]) @ vh[:keep]


def norm_value(w: torch.Tensor, kind: str) -> float:
    """R(w): the l1 norm, the nuclear norm (2-D), or 0 for "none"."""
    _check_kind(kind)
    if kind == "l1":
        return float(w.abs().sum())
    if kind == "nuclear":
        _as_matrix(w, "norm_value")
        return float(torch.linalg.svdvals(w).sum())
    return 0.0


def prox(u: torch.Tensor, theta: float, kind: str) -> torch.Tensor:
    """argmin_w 1/2 ||w - u||^2 + theta R(w)."""
    _check_kind(kind)
    if kind == "l1":
        return soft_threshold(u, theta)
    if kind == "nuclear":
        return singular_value_threshold(u, theta)
    return u.clone()


# ---------------------------------------------------------------------------- ball projections
def l1_ball_threshold(a: torch.Tensor, radius: float) -> float:
    """The tau >= 0 with sum max(a - tau, 0) = radius for nonnegative `a` with sum(a) > radius
    (the sort-based rule of Duchi et al. 2008, Fig. 1); 0 when sum(a) <= radius."""
    if radius < 0:
        raise ValueError(f"ball radius must be >= 0, got {radius}")
    if float(a.sum()) <= radius:
        return 0.0
    if radius == 0:
        return float(a.max())
    s, _ = torch.sort(a.flatten(), descending=True)
    css = torch.cumsum(s, 0)
    j = torch.arange(1, s.numel() + 1, dtype=s.dtype, device=s.device)
    ok = s - (css - radius) / j > 0
    k = int(torch.nonzero(ok).max()) + 1
    return float((css[k - 1] - radius) / k)


def project_l1_ball(v: torch.Tensor, radius: float) -> torch.Tensor:
    """Euclidean projection of v onto {x : ||x||_1 <= radius}."""
    tau = l1_ball_threshold(v.abs(), radius)
    return soft_threshold(v, tau) if tau > 0 else v.clone()


def project_nuclear_ball(m: torch.Tensor, radius: float) -> torch.Tensor:
    """Frobenius projection of a matrix onto {X : ||X||_* <= radius} (singular values onto the
    l1-ball; U diag(s') V^T with V transposed, unlike the reference code's bug, digest 2.5)."""
    _as_matrix(m, "project_nuclear_ball")
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    tau = l1_ball_threshold(s, radius)
    if tau == 0:
        return m.clone()
    return (u * torch.clamp(s - tau, min=0.0)) @ vh


def constrained_prox(u: torch.Tensor, theta: float, kind: str, radius: float = math.inf,
                     center: torch.Tensor | None = None) -> torch.Tensor:
    """C-FedDA's CProx (digest 2.5 heuristic): prox, then w <- center + Proj_{R-ball(radius)}(w - center)
    when R(w - center) > radius.  Exact when the ball is inactive; the result is always in the ball."""
    return group_prox({"w": u}, theta, {"w": kind}, radius,
                      None if center is None else {"w": center})["w"]


# ---------------------------------------------------------------------------- models (dicts)
def group_prox(u: Mapping[str, torch.Tensor], theta: float, kinds: Mapping[str, str],
               radius: float = math.inf, center: Mapping[str, torch.Tensor] | None = None,
               rho: float = math.inf) -> dict[str, torch.Tensor]:
    """prox of theta * sum_n R_n(w_n) over named tensors, then the joint R-ball around `center`
    (regularised tensors only; heuristic as `constrained_prox`), then the joint l2 ball ||w|| <= rho.

    `kinds[name]` is the regulariser of tensor `name` ("none" leaves it unregularised).
    """
    out = {name: prox(t, theta, kinds.get(name, "none")) for name, t in u.items()}
    if math.isfinite(radius):
        if center is None:
            raise ValueError("a finite constraint radius needs its center (the stage start w0)")
        _project_ball(out, kinds, radius, center)
    if math.isfinite(rho):
        if rho <= 0:
            raise ValueError(f"rho (l2 domain radius) must be > 0, got {rho}")
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in out.values()))
        if norm > rho:
            out = {name: t * (rho / norm) for name, t in out.items()}
    return out


def _project_ball(w: dict[str, torch.Tensor], kinds: Mapping[str, str], radius: float,
                  center: Mapping[str, torch.Tensor]) -> None:
    """In place: the regularised part of w - center onto the joint ball sum_n R_n(.) <= radius."""
    names = [n for n in w if kinds.get(n, "none") != "none"]
    if not names:
        return
    diffs = {n: w[n] - center[n] for n in names}
    if all(kinds[n] == "l1" for n in names):
        atoms = torch.cat([d.abs().flatten() for d in diffs.values()])
        tau = l1_ball_threshold(atoms, radius)
        if tau > 0:
            for n in names:
                w[n] = center[n] + soft_threshold(diffs[n], tau)
        return
    if all(kinds[n] == "nuclear" for n in names):
        svds = {n: torch.linalg.svd(d, full_matrices=False) for n, d in diffs.items()}
        tau = l1_ball_threshold(torch.cat([s for _, s, _ in svds.values()]), radius)
        if tau > 0:
            for n, (uu, s, vh) in svds.items():
                w[n] = center[n] + (uu * torch.clamp(s - tau, min=0.0)) @ vh
        return
    raise ValueError("one constraint ball cannot mix l1 and nuclear tensors")


def dual_averaging_prox(z: Mapping[str, torch.Tensor], *, A: float, mu: float, gamma: float,
                        w0: Mapping[str, torch.Tensor], lam: float, kinds: Mapping[str, str],
                        radius: float = math.inf, center: Mapping[str, torch.Tensor] | None = None,
                        rho: float = math.inf) -> dict[str, torch.Tensor]:
    """Prox_t(z) of Fast-FedDA (paper Section 2.1, the objective of Eq. 13 before centring):

        argmin_w <w, z - gamma w0> + (mu A/2 + gamma) ||w||^2/2 + A lam R(w)   [+ R(w - center) <= radius]

    = group_prox(u, A lam / c),  c = mu A/2 + gamma,  u = (gamma w0 - z)/c   (digest 2.1 closed form).
    With A = 0 (no gradient yet) it returns w0: the algorithms' start needs no special case.
    """
    c = mu * A / 2.0 + gamma
    if not c > 0:
        raise ValueError(f"dual averaging prox: mu*A/2 + gamma must be > 0 (mu={mu}, A={A}, gamma={gamma})")
    u = {name: (gamma * w0[name] - z[name]) / c for name in z}
    return group_prox(u, A * lam / c, kinds, radius, center, rho)
