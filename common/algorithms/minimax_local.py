"""Local solvers of the federated minimax algorithms (seed-003, sections 2.2 and 2.3).

One round of client i's work from (x^(t), y^(t)): tau_i steps of simultaneous stochastic
gradient descent on x and ascent on y,

    x^(k+1) = x^(k) - eta_x d_x^(k),   d_x^(k) = rho d_x^(k-1) + grad_x f_i(x^(k), y^(k); xi_k)
    y^(k+1) = P_Y[ y^(k) + eta_y d_y^(k) ],  d_y^(k) = rho d_y^(k-1) + grad_y f_i(x^(k) | xhat, y^(k); xi_k)

with rho = 0 for plain SGD (a_i = [1, ..., 1]) and heavy-ball momentum otherwise (buffers start
at 0 each round, so the coefficient of step k's gradient is a_i^(k) = (1 - rho^(tau-k))/(1 - rho)).
The "+" variants (SGDA+) take the y-gradient at the snapshot xhat instead of the current x,
on the same minibatch and the same gradient noise (two gradient evaluations per step).
y is projected onto the task's constraint set after every step (P_Y; identity when none).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from fedhop.common.algorithms.base import ClientContext
from fedhop.common.numerics.projections import NO_CONSTRAINT, Constraint
from fedhop.common.numerics.sampling import local_batches


def momentum_coefficients(rho: float, steps: int) -> list[float]:
    """a_i^(k) for k = 0..steps-1 of heavy-ball momentum rho (seed-003 section 2.2); all 1 at rho = 0."""
    if rho == 0:
        return [1.0] * steps
    return [(1.0 - rho ** (steps - k)) / (1.0 - rho) for k in range(steps)]


def a_norm(rho: float, steps: int) -> float:
    """||a_i||_1: tau_i for SGD; (1/(1-rho)) [tau - rho (1 - rho^tau)/(1 - rho)] for momentum."""
    if rho == 0:
        return float(steps)
    return (steps - rho * (1.0 - rho ** steps) / (1.0 - rho)) / (1.0 - rho)


@dataclass
class SgdaResult:
    steps: int = 0
    a_norm: float = 0.0
    loss_sum: float = 0.0

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else float("nan")


@contextmanager
def _swapped(params: Sequence[torch.nn.Parameter], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Temporarily give `params` the data `values` (the snapshot xhat), then restore them."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)


def _grads(loss: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    if not params:
        return []
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def local_sgda(ctx: ClientContext, x_names: Sequence[str], y_names: Sequence[str], lr_x: float, lr_y: float,
               batch_size: int, steps: int, epochs: int, *, rho: float = 0.0, weight_decay: float = 0.0,
               constraint: Constraint = NO_CONSTRAINT,
               snapshot: dict[str, torch.Tensor] | None = None) -> SgdaResult:
    """Run one round of local SGDA (SGDA+ when `snapshot` is given) on `ctx.model` in place.

    `steps > 0` runs exactly that many minibatch steps, else `epochs` passes (common.sampling).
    `weight_decay` adds wd * x to the x-gradient only.  Returns the step count and ||a_i||_1.
    """
    model, task, gen = ctx.model, ctx.task, ctx.generator
    named = dict(model.named_parameters())
    xs = [named[n] for n in x_names if named[n].requires_grad]
    ys = [named[n] for n in y_names if named[n].requires_grad]
    x_hat = None if snapshot is None else [snapshot[n] for n in x_names if named[n].requires_grad]
    buf_x = [torch.zeros_like(p) for p in xs] if rho else []
    buf_y = [torch.zeros_like(p) for p in ys] if rho else []
    data = task.client_data(ctx.client_id)
    out = SgdaResult()
    for idx in local_batches(data.rows, batch_size, steps, epochs, gen):
        batch = tuple(t[idx] for t in data.tensors)
        if x_hat is None:
            loss = task.loss(model, batch, gen)
            grads = _grads(loss, xs + ys)
            gx, gy = grads[:len(xs)], grads[len(xs):]
        else:
            before = gen.get_state()          # same minibatch AND same noise draw xi for both evaluations
            loss = task.loss(model, batch, gen)
            gx = _grads(loss, xs)
            after = gen.get_state()
            with _swapped(xs, x_hat):
                gen.set_state(before)
                gy = _grads(task.loss(model, batch, gen), ys)
            gen.set_state(after)
        with torch.no_grad():
            for j, (p, g) in enumerate(zip(xs, gx)):
                if weight_decay:
                    g = g + weight_decay * p
                if rho:
                    g = buf_x[j].mul_(rho).add_(g)
                p.sub_(g, alpha=lr_x)
            for j, (p, g) in enumerate(zip(ys, gy)):
                if rho:
                    g = buf_y[j].mul_(rho).add_(g)
                p.add_(g, alpha=lr_y)
                constraint.project_(p)
        out.steps += 1
        out.loss_sum += float(loss.detach())
    out.a_norm = a_norm(rho, out.steps)
    return out
