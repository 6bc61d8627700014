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

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from fedhop.common.algorithms.base import ClientContext
from fedhop.common.algorithms.vectorized import (
    call_batches,
    cohort_steps,
    compute_shares,
    rows_of,
    stack_starts,
    stacked_gradients,
)
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


def local_sgda_together(ctxs: Sequence[ClientContext], starts: Sequence[dict[str, torch.Tensor]],
                        x_names: Sequence[str], y_names: Sequence[str], lr_x: float, lr_y: float, batch_size: int,
                        budgets: Sequence[tuple[int, int]], rhos: Sequence[float], *, weight_decay: float = 0.0,
                        constraint: Constraint = NO_CONSTRAINT,
                        snapshots: Sequence[dict[str, torch.Tensor]] | None = None,
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[SgdaResult], list[float]]:
    """`local_sgda` of each client in `ctxs` from its own start, all at once ([algorithm]
    vectorized, common/algorithms/vectorized.py): client i takes `budgets[i]` (steps, epochs)
    with heavy-ball coefficient `rhos[i]` (0: plain SGD) and, for SGDA+, its own snapshot
    `snapshots[i]`.  At local step k one stacked computation gives the x- and y-gradients of
    the clients taking it (SGDA+: a second one at their snapshots gives the y-gradients, on the
    same minibatches), and each client's step, momentum buffer and projection of y are its own
    row's, with `local_sgda`'s operations in its order.

    Returns the start and final parameters stacked (row i: client i's), each client's
    SgdaResult and its share of the seconds spent."""
    started = time.perf_counter()
    model, task = ctxs[0].model, ctxs[0].task
    _, start, stacked, frozen = stack_starts(model, starts)
    xs, ys = [n for n in x_names if n in stacked], [n for n in y_names if n in stacked]
    gradients = stacked_gradients(model, task)
    dtype = next(iter(start.values())).dtype
    _, plans, batches = call_batches(ctxs, batch_size, dtype, budgets)
    rho = torch.tensor(list(rhos), dtype=dtype, device=next(iter(start.values())).device)
    buffers = {n: torch.zeros_like(stacked[n]) for n in xs + ys} if any(rhos) else {}
    x_hat = None if snapshots is None else {n: torch.stack([s[n].to(dtype) for s in snapshots]) for n in xs}
    results = [SgdaResult() for _ in ctxs]
    for _, members, rows, params, fixed, mask, batch in cohort_steps(plans, batch_size, batches, stacked, frozen):
        grads, losses = gradients(params, fixed, mask, *batch)
        if x_hat is not None:   # SGDA+: the y-gradient at (xhat, y), on the same minibatch
            at_hat, _ = gradients({**params, **{n: rows_of(x_hat[n], rows) for n in xs}}, fixed, mask, *batch)
            grads = {**grads, **{n: at_hat[n] for n in ys}}
        with torch.no_grad():
            for n, sign, lr in [(n, -1.0, lr_x) for n in xs] + [(n, 1.0, lr_y) for n in ys]:
                p, g = params[n], grads[n]
                if weight_decay and sign < 0:   # on x only
                    g = g + weight_decay * p
                if buffers:   # d = rho d + g, each row its own rho (0: d = g)
                    g = rows_of(buffers[n], rows) * rows_of(rho, rows).view(-1, *([1] * (g.dim() - 1))) + g
                    if rows is None:
                        buffers[n] = g
                    else:
                        buffers[n][rows] = g
                new = p - g * lr if sign < 0 else p + g * lr   # x descends, y ascends
                if sign > 0 and constraint.kind != "none":
                    for row in new:   # P_Y, each client's y alone
                        constraint.project_(row)
                if rows is None:
                    stacked[n] = new
                else:
                    stacked[n][rows] = new
        for i, loss in zip(members, losses.detach().double().tolist()):
            results[i].steps += 1
            results[i].loss_sum += loss
    for result, r in zip(results, rhos):
        result.a_norm = a_norm(r, result.steps)
    return start, {**stacked, **frozen}, results, compute_shares(started, [r.steps for r in results])
