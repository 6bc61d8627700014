"""Euclidean projections onto the constraint sets of the minimax tasks.

The minimax algorithms (common/algorithms/minimax.py) keep the maximising variable y feasible
by projecting it after every local step and after the server step (seed-003 digest, section
2.3: the paper's Algorithm 1 is unconstrained, its experiments are not).  A task names its set
with a `Constraint`; `Constraint.spec()` is a short string ("none", "ball:1.0", "simplex:1.0")
that can travel as a payload scalar, so the server can project without building the task.

    ball    {y : ||y||_2 <= r}              P(v) = v * min(1, r / ||v||)
    simplex {y : y >= 0, sum_j y_j = s}     P(v) = max(v - theta, 0), theta from the sorted v
                                            (Held, Wolfe & Crowder 1974; Duchi et al. 2008, Fig. 1)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CONSTRAINT_KINDS = ("none", "ball", "simplex")


def project_ball(v: torch.Tensor, radius: float = 1.0) -> torch.Tensor:
    """Projection of `v` (any shape, treated as one vector) onto {y : ||y||_2 <= radius}."""
    if not radius > 0:
        raise ValueError(f"ball radius must be > 0, got {radius}")
    norm = torch.linalg.vector_norm(v)
    if norm <= radius:
        return v.clone()
    return v * (radius / norm)


def project_simplex(v: torch.Tensor, total: float = 1.0) -> torch.Tensor:
    """Projection of `v` (any shape, treated as one vector) onto {y >= 0, sum y = total}.

    Sort-based algorithm (Duchi et al. 2008, Figure 1): with u sorted in decreasing order,
    rho = max{j : u_j - (sum_{k<=j} u_k - total) / j > 0},
    theta = (sum_{k<=rho} u_k - total) / rho, and P(v) = max(v - theta, 0).
    """
    if not total > 0:
        raise ValueError(f"simplex total must be > 0, got {total}")
    flat = v.reshape(-1)
    u, _ = torch.sort(flat, descending=True)
    css = torch.cumsum(u, 0) - total
    j = torch.arange(1, flat.numel() + 1, dtype=flat.dtype, device=flat.device)
    positive = (u - css / j) > 0
    rho = int(torch.nonzero(positive).max()) + 1   # positive[0] is always true
    theta = css[rho - 1] / rho
    return torch.clamp(flat - theta, min=0).reshape(v.shape)


@dataclass(frozen=True)
class Constraint:
    """A convex set for the maximising variable: kind "none" | "ball" | "simplex".

    `size` is the ball's radius or the simplex's total.
    """

    kind: str = "none"
    size: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not allowed (allowed: {', '.join(CONSTRAINT_KINDS)})")
        if self.kind != "none" and not self.size > 0:
            raise ValueError(f"constraint {self.kind}: size must be > 0, got {self.size}")

    def project(self, v: torch.Tensor) -> torch.Tensor:
        if self.kind == "ball":
            return project_ball(v, self.size)
        if self.kind == "simplex":
            return project_simplex(v, self.size)
        return v

    def project_(self, p: torch.Tensor) -> None:
        """Project in place (e.g. a parameter under torch.no_grad())."""
        if self.kind != "none":
            p.copy_(self.project(p))

    def spec(self) -> str:
        return "none" if self.kind == "none" else f"{self.kind}:{self.size!r}"

    @classmethod
    def parse(cls, spec: str) -> "Constraint":
        """Inverse of `spec()`: "none", "ball:1.0", "simplex:1.0"."""
        kind, _, size = str(spec).partition(":")
        try:
            return cls(kind, float(size) if size else 1.0)
        except ValueError as exc:
            raise ValueError(f"bad constraint spec {spec!r}: {exc}") from None


NO_CONSTRAINT = Constraint("none")
