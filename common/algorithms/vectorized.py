"""Local SGD of many clients at once ([algorithm] vectorized = true, docs/vectorized.md), and the
gradients of many clients' own local solvers at once (`solve_together`, the composite solvers).

A process that trains several sampled clients of one call (a batch, the in-process engine's
worker, the round engine's loop) stacks their parameters along a new first dimension and makes
each local step of all of them in one computation: every client's loss from the task's stacked
per-sample losses (`Task.stacked_sample_loss`: the dense models' `forward_stacked`, the
quadratic), or else from `torch.func.vmap` of the task's own loss (the model called through
`functional_call` with the client's row of the stack), and every client's gradients from one
backward pass of the sum of those losses.
Each client keeps its own data, its own minibatches (drawn from its own generator, in the
order `local_sgd` draws them) and its own number of steps; at local step k the clients that
have a k-th batch are one such computation, each client's batch padded with zero rows to the
config's batch size and its loss the sum of the task's per-sample losses (`Task.sample_loss`)
over its real rows divided by their count.  (With batch_size = 0, full batches, the clients are
grouped by their batch's size instead, unpadded.)

The arithmetic is `local_sgd`'s up to rounding: the loss is a masked sum over a padded batch
where `local_sgd` takes the mean of the real rows, the step is w - lr * g (two rounded
operations) where `local_sgd` writes w.add_(g, alpha=-lr), which the CPU kernel may fuse, and a
batched matrix product may round differently from one client's.  So a vectorized run agrees
with a one-at-a-time run to float rounding, not bit for bit; but each client's step is computed
on the same shapes whichever clients take theirs beside it, and its result does not depend on
them (tests/test_vectorized.py), so a vectorized run gives the same model in either engine,
batched or not, with any number of client processes.

A solver whose steps are its own (a prox after each step, dual sums) is a generator (`Solver`);
`solve_together` stacks only the points at which its clients' gradients are taken, on the same
minibatches, and runs each client's updates for it alone.
"""
from __future__ import annotations

import itertools
import math
import time
import weakref
from typing import Callable, Generator, Iterator, Sequence

import torch
from torch.func import functional_call, grad_and_value, vmap

from fedhop.common.algorithms.base import ClientContext
from fedhop.common.algorithms.local import LocalStats
from fedhop.common.models.exchange import exchanged_names, named_parameters
from fedhop.common.numerics.sampling import local_batches


class _TaskLoss(torch.nn.Module):
    """A client's loss on a padded batch as a module, so that `functional_call` can run it with
    the client's parameters in place of the model's (their names prefixed by "model."): the
    task's loss of the batch's real rows (`mask` 1; `Task.padded_loss`, by default the mean of
    their per-sample losses, the padding's rows multiplied by 0)."""

    def __init__(self, task, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self._task = (task,)   # not a submodule

    def forward(self, mask: torch.Tensor, *batch: torch.Tensor) -> torch.Tensor:
        return self._task[0].padded_loss(self.model, batch, mask)


def why_not_vectorized(task, model: torch.nn.Module) -> str | None:
    """Why this task and model cannot train clients together (None: they can).  The task's loss
    must be a pure function of the parameters and the batch (`Task.vectorizable`: no draw from
    the client's generator, no Python branch on values), and the model must exchange every
    parameter and keep no buffers (a buffer such as batch norm's running mean is updated in
    place by each client's forward pass)."""
    if not task.vectorizable():
        return (f"the task's loss ({type(task).__name__}) is not one torch.func can vmap: it draws from the "
                f"client's generator (gradient noise) or is a subclass's own")
    if exchanged_names(model) is not None:
        return "model.exchange is not \"all\""
    if any(True for _ in model.buffers()):
        return "the model keeps buffers (batch norm or similar)"
    return None


def check_vectorized(cfg) -> None:
    """Under [algorithm] vectorized, build the run's task and model and raise a ValueError naming
    the key where they cannot train clients together (`fedhop run`, before any process starts):
    `why_not_vectorized`, then one vectorized local round of client 0, so that a model torch.func
    cannot vmap fails here in one line and not in every client's call.  The trial also loads what
    torch.func's first vmapped call imports in `fedhop run`'s process, so the processes it forks
    start with them."""
    if not cfg.algorithm.vectorized:
        return
    from fedhop.common.engine.rounds import client_context
    from fedhop.common.tasks import build_task
    from fedhop.common.wire.message import Payload
    task = build_task(cfg)
    model = task.build_model()
    where = f"with data.dataset = '{cfg.data.dataset}'" + (f" and model.kind = '{cfg.model.kind}'"
                                                            if task.vectorizable() else "")
    problem = why_not_vectorized(task, model)
    if problem is not None:
        raise ValueError(f"config key 'algorithm.vectorized': {where}, {problem}")
    ctx = client_context(cfg, task, model, 0, 1, Payload(), {})
    try:
        local_sgd_together([ctx], [{name: p.detach() for name, p in model.named_parameters()}], cfg.algorithm.lr,
                           cfg.algorithm.batch_size, cfg.algorithm.weight_decay)
    except Exception as exc:  # noqa: BLE001 - torch.func's refusal of the model's operators, named
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"config key 'algorithm.vectorized': {where}, torch.func cannot train the model "
                         f"vectorized ({type(exc).__name__}: {first})") from None


StackedStep = Callable[..., "tuple[dict[str, torch.Tensor], torch.Tensor]"]
"""`stacked_gradients`' function: (params, fixed, mask, *batch) -> (each row's gradients by name, each row's loss)."""

StackedHook = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""`local_sgd`'s `grad_hook` for a stack of clients: (parameter name, the members' parameters,
their gradients, their start of the round, the members' rows in the cohort or None for every
row) -> the gradients to step with, row i the member's own (FedProx's proximal gradient,
SCAFFOLD's correction, FedDyn's regularizer).  It must compute each row from that row alone,
with `local_sgd`'s hook's operations in its order: a client's result must not depend on the
clients beside it."""


def rows_of(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The members' rows of a cohort-stacked tensor (every row: `t` itself)."""
    return t if rows is None else t[rows]


def every_parameter(ctxs: Sequence[ClientContext], messages: Sequence, skip: str | None = None) -> None:
    """Raise a ValueError unless each message carries every parameter of the model (names
    starting with `skip` left out: an algorithm's own tensors), as the vectorized solver needs."""
    names = {name for name, _ in named_parameters(ctxs[0].model)}
    for ctx, message in zip(ctxs, messages):
        carried = {n for n in message.tensors if skip is None or not n.startswith(skip)}
        if carried != names:
            raise ValueError(f"[algorithm] vectorized needs every parameter in the message to client "
                             f"{ctx.client_id}; it carries {sorted(carried)}")


#: per model, the bytes one example's loss keeps for its backward pass, by the example's shapes
_SAVED_PER_ROW: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, int]]" = weakref.WeakKeyDictionary()


def saved_bytes_per_row(task, model: torch.nn.Module, row: tuple[torch.Tensor, ...]) -> int:
    """The bytes autograd keeps for the backward pass of the task's loss on one example `row`
    (each tensor of the batch with one row), the parameters themselves left out: a forward
    pass under `saved_tensors_hooks` adding up what it saves.  Made once per model and shape."""
    key = tuple((tuple(t.shape), t.dtype) for t in row)
    known = _SAVED_PER_ROW.setdefault(model, {})
    if key not in known:
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if t.untyped_storage().data_ptr() not in own:
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            task.sample_loss(model, row)
        known[key] = total
    return known[key]


def stack_size(ctxs: Sequence[ClientContext], batch_size: int, budget_bytes: int) -> int:
    """How many of `ctxs` one vectorized stack may train within `budget_bytes`
    ([algorithm] vectorized_memory_mb): each client in a stack holds its start, its parameters,
    their gradients and the next step's parameters (4 x the model), and its batch's activations
    for the backward pass with as much again for their gradients (2 x rows x
    `saved_bytes_per_row`).  At least 1."""
    model, task = ctxs[0].model, ctxs[0].task
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    datas = (task.client_data(ctx.client_id) for ctx in ctxs)   # a client's data may be made when asked for
    first = next((d for d in datas if d.rows > 0), None)
    if first is None:
        return max(1, len(ctxs))
    rows = batch_size if batch_size > 0 else max(task.client_data(ctx.client_id).rows for ctx in ctxs)
    per_client = 4 * model_bytes + 2 * rows * saved_bytes_per_row(task, model, tuple(t[:1] for t in first.tensors))
    return max(1, budget_bytes // max(per_client, 1))


#: the words of vmap's refusal of an operator that has no batching rule outside `grad`
_NO_BATCHING_RULE = "Batching rule not implemented"

#: per model, whether its vmapped forward pass needs torch.func's gradient transform around it
#: (True: `vmap(grad_and_value(loss))`; False: vmapped losses and one backward pass)
_GRAD_TRANSFORM: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


#: elements of one client's tensor from which a gradient laid out otherwise than its parameters is
#: copied row by row before the step (`_laid_out_as`); a smaller one is read in place, which costs
#: less than a copy per client
ROW_COPY_MIN = 1 << 16


def _laid_out_as(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `g` (the shape of contiguous `p`), made one row (one client's
    tensor) at a time.  A vmapped linear layer's weight gradient comes transposed in each row
    (strides (out * in, 1, out); `stacked_linear`'s, common/models/dense.py, comes laid out as
    the weight); an elementwise step that reads it beside contiguous parameters walks one of
    them across rows of memory, and so does a single copy of the whole stack, while a
    two-dimensional transpose copies in cache-sized blocks: leaf_cnn's 6.4 M-weight layer, 4
    clients, 293 ms for `p - g * lr` against 87 ms for these copies and the same arithmetic
    (docs/vectorized.md).  The values, and so the step's bits, are the same."""
    out = torch.empty_like(p)
    for row, source in zip(out, g):
        row.copy_(source)
    return out


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in named_parameters(model) if p.requires_grad]


StackedLosses = Callable[..., torch.Tensor]
"""`stacked_losses`' function: (params, fixed, mask, *batch) -> each row's loss."""


def _stacked_loss_functions(model: torch.nn.Module, task) -> tuple[Callable[..., torch.Tensor], StackedLosses]:
    """A client's loss as a function of its parameters (`_TaskLoss` through `functional_call`),
    and every member's loss of a stack (`losses_of` below)."""
    loss_of = _TaskLoss(task, model)

    def loss(params: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor], mask: torch.Tensor,
             *batch: torch.Tensor) -> torch.Tensor:
        return functional_call(loss_of, {f"model.{name}": t for name, t in {**params, **fixed}.items()},
                               (mask, *batch))

    stacked_loss = task.stacked_sample_loss(model)   # the dense models and the quadratic: no vmap

    def losses_of(params: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor], mask: torch.Tensor,
                  *batch: torch.Tensor) -> torch.Tensor:
        """Every member's loss, the model run once on the stacked parameters: directly where the
        task computes a stack's per-sample losses (`Task.stacked_sample_loss`), else vmapped."""
        if stacked_loss is None:
            return vmapped_losses(params, fixed, mask, *batch)
        per = stacked_loss({**params, **fixed}, batch)
        return (per * mask).sum(1) / mask.sum(1)   # `_TaskLoss` of each row

    vmapped_losses = vmap(loss)
    return loss, losses_of


def stacked_losses(model: torch.nn.Module, task) -> StackedLosses:
    """The function that gives each row's loss of a stack, without gradients: (params, fixed,
    mask, *batch) as `stacked_gradients`' function takes them.  A stack of one is computed as
    a stack of two, the client twice, as `stacked_gradients` does, so a row's loss does not
    depend on how many rows are beside it (a line search's trials, fewer as clients accept).
    A model whose gradients take the gradient transform (`_GRAD_TRANSFORM`, decided by the
    first stacked gradient) has its losses from that transform too: vmap batches one of its
    operators only under `grad`."""
    loss, losses_of = _stacked_loss_functions(model, task)
    values_of = vmap(grad_and_value(loss))

    def losses(params: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor], mask: torch.Tensor,
               *batch: torch.Tensor) -> torch.Tensor:
        if mask.shape[0] == 1:
            return losses({name: torch.cat([t, t]) for name, t in params.items()},
                          {name: torch.cat([t, t]) for name, t in fixed.items()}, torch.cat([mask, mask]),
                          *(torch.cat([t, t]) for t in batch))[:1]
        if _GRAD_TRANSFORM.get(model, False):
            return values_of(params, fixed, mask, *batch)[1].detach()
        with torch.no_grad():
            return losses_of(params, fixed, mask, *batch)
    return losses


def stacked_gradients(model: torch.nn.Module, task) -> StackedStep:
    """The function that gives a stack's gradients and losses on `model`'s task loss:
    (params, fixed, mask, *batch) -> (gradients by name, row i d loss_i / d w_i; each row's
    loss).  `params`: the trainable parameters, each stacked along a first dimension;
    `fixed`: the frozen ones (model.freeze), used as they are; `mask` and `batch`: each row's
    padded minibatch and the mask of its real rows (`Batches.step`)."""
    loss, losses_of = _stacked_loss_functions(model, task)
    grads_of = vmap(grad_and_value(loss))

    def step_all(params: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor], mask: torch.Tensor,
                 *batch: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each member's gradients (row i: d loss_i / d w_i) and losses.  One backward pass of
        the sum of the losses: row i of the stack enters loss i alone, so its gradient is loss i's,
        computed by the same kernels as a vmapped `grad` (0.3 ms a step less than
        `vmap(grad_and_value(loss))` on W2's MLP, the same bits).  A model with an operator that
        vmap batches only under `grad` (the LSTM of char_lstm) takes `grad_and_value` at every
        step (`_GRAD_TRANSFORM`), so each model always takes the same path.  A stack of one is
        computed as a stack of two, the client twice: vmap may run a batch of one through other
        kernels (char_lstm's gradients then differ in the last bits from the same client's in a
        larger stack)."""
        if mask.shape[0] == 1:
            twice, losses = step_all({name: torch.cat([t, t]) for name, t in params.items()},
                                     {name: torch.cat([t, t]) for name, t in fixed.items()}, torch.cat([mask, mask]),
                                     *(torch.cat([t, t]) for t in batch))
            return {name: g[:1] for name, g in twice.items()}, losses[:1]
        if not _GRAD_TRANSFORM.get(model, False):
            leaves = {name: t.detach().requires_grad_(True) for name, t in params.items()}
            try:
                with torch.enable_grad():
                    losses = losses_of(leaves, fixed, mask, *batch)
                    found = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
            except RuntimeError as exc:
                # only vmap's refusal of an operator decides the way: any other error (memory, a
                # shape) is the stack's, and must not send this process's model another way
                if model in _GRAD_TRANSFORM or _NO_BATCHING_RULE not in str(exc):
                    raise
            else:
                _GRAD_TRANSFORM[model] = False
                return ({name: g if g is not None else torch.zeros_like(leaves[name])
                         for name, g in zip(leaves, found)}, losses.detach())
            _GRAD_TRANSFORM[model] = True   # an operator vmap batches only under `grad`
        return grads_of(params, fixed, mask, *batch)
    return step_all


def stack_starts(model: torch.nn.Module, starts: Sequence[dict[str, torch.Tensor]]
                 ) -> tuple[list[str], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The clients' starts stacked, row i client i's: (the trainable parameters' names, every
    parameter's start, a copy of the trainable ones to train, the frozen ones (model.freeze),
    used as they are)."""
    names = trainable_names(model)
    start = {name: torch.stack([s[name].detach() for s in starts]) for name in starts[0]}
    stacked = {name: start[name].clone() for name in names}
    frozen = {name: t for name, t in start.items() if name not in stacked}
    return names, start, stacked, frozen


def local_sgd_together(ctxs: Sequence[ClientContext], starts: Sequence[dict[str, torch.Tensor]], lr: float,
                       batch_size: int, weight_decay: float = 0.0, grad_hook: StackedHook | None = None,
                       step_sizes: Sequence[Sequence[float]] | None = None,
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[LocalStats], list[float]]:
    """Local SGD of each client in `ctxs` from its own start (`starts[i]`, every parameter by
    name: the trainable ones trained, the frozen ones (model.freeze) used as they are), all at
    once.

    `grad_hook` changes each step's gradients after the weight decay, as an algorithm's hook on
    `local_sgd` does (`StackedHook`).  `step_sizes[i][k]`: client i's step size at its local
    step k, in place of `lr` (`local_sgd`'s `lr_at`); each row is multiplied by its own.

    Returns the start and the final parameters stacked (row i: client i's), each client's LocalStats and
    each client's share of the seconds spent (the seconds times its steps over all steps).
    `ctxs` share one model (the process's) and one task."""
    started = time.perf_counter()
    model, task = ctxs[0].model, ctxs[0].task
    names, start, stacked, frozen = stack_starts(model, starts)
    step_all = stacked_gradients(model, task)
    dtype = next(iter(start.values())).dtype if start else torch.float32
    _, plans, batches = call_batches(ctxs, batch_size, dtype)
    stats = [LocalStats() for _ in ctxs]
    for k, members, rows, params, fixed, mask, batch in cohort_steps(plans, batch_size, batches, stacked, frozen):
        grads, losses = step_all(params, fixed, mask, *batch)
        etas = (None if step_sizes is None else   # each member's own step size at step k
                torch.tensor([step_sizes[i][k] for i in members], dtype=dtype, device=losses.device))
        with torch.no_grad():
            for name in names:
                p, g = params[name], grads[name]
                if weight_decay:
                    g = g + weight_decay * p
                if grad_hook is not None:
                    g = grad_hook(name, p, g, rows_of(start[name], rows), rows)
                step = lr if etas is None else etas.view(-1, *([1] * (g.dim() - 1)))
                if g.is_contiguous() and p.is_contiguous():
                    new = g * step   # w_{k+1} = w_k - lr * g_k, one client per row (row i: its own step size),
                    torch.sub(p, new, out=new)   # made in lr * g_k's memory
                elif not p.is_contiguous() or g.dim() < 3 or g[0].numel() < ROW_COPY_MIN:
                    new = p - g * step   # the same, g read in place
                else:   # the same values, g first laid out as p (`_laid_out_as`)
                    new = p - _laid_out_as(g, p).mul_(step)
                if rows is None:
                    stacked[name] = new
                else:
                    stacked[name][rows] = new
        _count_step(stats, plans, members, k, losses)
    return start, {**stacked, **frozen}, stats, compute_shares(started, [s.steps for s in stats])


def cohorts(plans: Sequence[list[torch.Tensor]], batch_size: int
             ) -> Iterator[tuple[int, int, list[int], torch.Tensor | None]]:
    """The stacked computations of a call, in order: (local step k, width of the padded batch,
    the members: the clients that take step k with a batch of that width, their rows in the
    cohort or None for every client)."""
    for k in range(max((len(plan) for plan in plans), default=0)):
        groups: dict[int, list[int]] = {}   # width of the padded batch -> the clients taking step k
        for i, plan in enumerate(plans):
            if k < len(plan):
                groups.setdefault(batch_size if batch_size > 0 else int(plan[k].numel()), []).append(i)
        for width, members in groups.items():
            yield k, width, members, None if len(members) == len(plans) else torch.tensor(members)


def cohort_steps(plans: Sequence[list[torch.Tensor]], batch_size: int, batches: "Batches",
                 stacked: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor]
                 ) -> Iterator[tuple[int, list[int], torch.Tensor | None, dict[str, torch.Tensor],
                                     dict[str, torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...]]]:
    """`cohorts` with each computation's inputs: (local step k, the members, their rows or None
    for every client, their trainable parameters as `stacked` holds them when the step comes,
    their frozen ones, the mask and their padded minibatches)."""
    for k, width, members, rows in cohorts(plans, batch_size):
        params = stacked if rows is None else {name: t[rows] for name, t in stacked.items()}
        fixed = frozen if rows is None else {name: t[rows] for name, t in frozen.items()}
        mask, batch = batches.step(rows, k, width)
        yield k, members, rows, params, fixed, mask, batch


def _count_step(stats: list[LocalStats], plans: Sequence[list[torch.Tensor]], members: list[int], k: int,
                losses: torch.Tensor) -> None:
    """Step k of each member counted in its LocalStats, with its loss."""
    for i, value in zip(members, losses.detach().double().cpu().tolist()):
        s = stats[i]
        s.steps += 1
        s.samples += int(plans[i][k].numel())
        s.loss_sum += value
        s.last_loss = value


def compute_shares(started: float, steps: Sequence[int]) -> list[float]:
    """Each client's share of the seconds since `started`: the seconds times its steps over all steps."""
    seconds = time.perf_counter() - started
    total = sum(steps)
    return [seconds * n / total if total else seconds / len(steps) for n in steps]


Tensors = dict[str, torch.Tensor]
Solver = Generator[Tensors, Tensors, Tensors]
"""A client's local solver written as a generator (common/algorithms/solver.py): it yields
each local step's point w_k (every parameter by name, in the solver's dtype), is sent the
minibatch gradient there (plus weight_decay * w_k, in the point's dtype), and returns the
tensors of its reply once it has been sent as many gradients as it was told it takes steps."""


def solve_alone(solve: Solver, gradient_at: Callable[[Tensors], Tensors]) -> Tensors:
    """Run one client's `solve`, each gradient from `gradient_at(point)` (the one-at-a-time
    solver: the client's next minibatch on the process's model)."""
    try:
        point = next(solve)
        while True:
            point = solve.send(gradient_at(point))
    except StopIteration as done:
        return done.value


def solve_together(ctxs: Sequence[ClientContext], solver: Callable[[int, int], Solver], batch_size: int,
                   weight_decay: float = 0.0) -> tuple[list[Tensors], list[LocalStats], list[float]]:
    """The local solvers of the clients in `ctxs` (`solver(i, steps)`: client i's, told its
    number of local steps), their gradients computed together: at local step k the points of
    the clients that take it are stacked, cast to the model's dtype (as `set_params` copies a
    point into the model), and one stacked computation (`stacked_gradients`) gives every
    member's gradient, cast back to the point's dtype, weight_decay * w added, as the
    one-at-a-time solver's gradient is.  Each client's minibatches are `local_sgd`'s (its own
    generator, in the same order) and its update is its own solver's code, run for it alone:
    only the gradients are computed in a stack, so a client's result does not depend on the
    clients beside it.

    Returns each client's reply tensors, LocalStats and share of the seconds spent."""
    started = time.perf_counter()
    model, task = ctxs[0].model, ctxs[0].task
    trainable = set(trainable_names(model))
    dtype = next(model.parameters()).dtype
    step_all = stacked_gradients(model, task)
    _, plans, batches = call_batches(ctxs, batch_size, dtype)
    stats = [LocalStats() for _ in ctxs]
    solvers = [solver(i, len(plan)) for i, plan in enumerate(plans)]
    points: list[Tensors | None] = []
    results: list[Tensors | None] = [None] * len(ctxs)
    for i, solve in enumerate(solvers):
        try:
            points.append(next(solve))
        except StopIteration as done:   # no local step
            points.append(None)
            results[i] = done.value
    for k, width, members, rows in cohorts(plans, batch_size):
        at = [point for point in (points[i] for i in members) if point is not None]
        if len(at) < len(members):
            raise RuntimeError("a local solver yielded fewer points than its steps")
        stacked = {name: torch.stack([p[name] for p in at]).to(dtype) for name in at[0]}
        mask, batch = batches.step(rows, k, width)
        grads, losses = step_all({n: t for n, t in stacked.items() if n in trainable},
                                 {n: t for n, t in stacked.items() if n not in trainable}, mask, *batch)
        for row, (i, point) in enumerate(zip(members, at)):
            gradient = {}
            for name, w in point.items():
                g = grads[name][row].to(w.dtype) if name in grads else torch.zeros(w.shape, dtype=w.dtype, device=w.device)
                gradient[name] = g + weight_decay * w if weight_decay else g
            try:
                points[i] = solvers[i].send(gradient)
            except StopIteration as done:
                points[i], results[i] = None, done.value
        _count_step(stats, plans, members, k, losses)
    if any(r is None for r in results):
        raise RuntimeError("a local solver yielded more points than its steps")
    return [r for r in results if r is not None], stats, compute_shares(started, [s.steps for s in stats])


def call_batches(ctxs: Sequence[ClientContext], batch_size: int, dtype: torch.dtype,
                 budgets: Sequence[tuple[int, int]] | None = None) -> tuple[list, list[list[torch.Tensor]], "Batches"]:
    """A call's clients' data, their minibatch plans (`local_batches`: each client's own
    generator, in the order the one-at-a-time solver draws them; `budgets[i]` the (steps,
    epochs) of client i, by default its context's) and the padded minibatches of those plans."""
    task = ctxs[0].task
    datas = [task.client_data(ctx.client_id) for ctx in ctxs]
    budgets = [(ctx.local_steps, ctx.local_epochs) for ctx in ctxs] if budgets is None else budgets
    plans = [list(local_batches(data.rows, batch_size, steps, epochs, ctx.generator))
             for ctx, data, (steps, epochs) in zip(ctxs, datas, budgets)]
    return datas, plans, Batches(datas, plans, dtype, batch_size)


class Batches:
    """The cohort's minibatches, padded, gathered a step at a time with a fixed number of tensor
    operations whatever the number of clients: every client's data concatenated once, with one
    row of zeros after it (the padding's source), and, made once for the whole call, the source
    row of every slot of every client's every step and the mask of the real ones."""

    def __init__(self, datas: Sequence, plans: Sequence[list[torch.Tensor]], dtype: torch.dtype,
                 batch_size: int) -> None:
        first = datas[0].tensors
        device = first[0].device
        data = [torch.cat([d.tensors[j] for d in datas]) for j in range(len(first))]
        pad = sum(d.rows for d in datas)   # the zero row's index
        self.data = [torch.cat([t, torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=t.device)]) for t in data]
        offsets = list(itertools.accumulate((d.rows for d in datas[:-1]), initial=0))
        steps = max((len(plan) for plan in plans), default=0)
        self.width = batch_size if batch_size > 0 else max((int(t.numel()) for plan in plans for t in plan), default=0)
        shape = (len(plans), steps, self.width)
        pairs = [(i, k, t) for i, plan in enumerate(plans) for k, t in enumerate(plan)]
        source = torch.full((math.prod(shape),), pad, dtype=torch.int64)
        mask = torch.zeros(math.prod(shape), dtype=dtype)
        if pairs:
            counts = torch.tensor([int(t.numel()) for _, _, t in pairs])
            starts = torch.cumsum(counts, 0) - counts
            first_slot = torch.tensor([(i * steps + k) * self.width for i, k, _ in pairs])
            slot = (torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
                    + torch.repeat_interleave(first_slot, counts))
            source[slot] = (torch.cat([t for _, _, t in pairs])
                            + torch.repeat_interleave(torch.tensor([offsets[i] for i, _, _ in pairs]), counts))
            mask[slot] = 1
        self.source, self.mask = source.view(shape).to(device), mask.view(shape).to(device)

    def step(self, rows: torch.Tensor | None, k: int, width: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The k-th minibatch of each member (`rows`: the members, None for every client),
        stacked and padded with zero rows to `width` rows, and the mask of its real rows.  Every
        batch of a run is padded to the same width (the config's batch size), so a client's
        step is computed on the same shapes whichever clients take their step beside it."""
        source = self.source[:, k, :width] if rows is None else self.source[rows.to(self.source.device), k, :width]
        mask = self.mask[:, k, :width] if rows is None else self.mask[rows.to(self.mask.device), k, :width]
        return mask, tuple(t[source] for t in self.data)
