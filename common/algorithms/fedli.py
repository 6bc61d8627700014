"""FedLi (Geetika, Uniyal, Chatterjee, "Towards Hyper-parameter-free Federated Learning").

Paper: shared/papers/000_793ef46f86c42b90.txt; digest: shared/research/seed-000.md (section
numbers below are the digest's).  Two instances of the paper's Algorithm 1:

FedLi-LS (`fedli_ls`, digest 2.2-2.3).  Clients run SGD with the stochastic Armijo line search
(Appendix A.1, Algorithms 3-4, the SLS method of Vaswani et al. 2019).  At local step k, on the
minibatch i_k that gave the gradient g = grad f_{i_k}(w):

    eta  <- reset(eta, eta_max, delta, b/n, k, opt)               # Algorithm 4
    eta  <- min(eta, eta_max)                                     # only with cap = true (Eq. 9)
    try eta, beta*eta, beta^2*eta, ... until
        f_{i_k}(w - eta g) <= f_{i_k}(w) - c * eta * ||g||^2      # Armijo condition, Eq. 10 / 22
    w    <- w - eta g

and send Delta_i and eta^i_{t,K}, the step size accepted at their last local step.  Server:
w_{t+1} = w_t + eta_g * sum_i p_i Delta_i with eta_g = 1 (`unit`, default: the convex case,
Lemma 3, and the paper's Appendix C), max_i eta^i_{t,K} (`max`, the paper's non-convex
heuristic, Section 3) or algorithm.server_lr (`const`, Theorems 1-3).

FedLi-LU (`fedli_lu`, digest 2.4-2.5).  Clients run plain SGD and send Delta_i and a loss
f^i_{t,K}.  The server takes one Deep-Frank-Wolfe step (Algorithm 2, Eq. 21) on the averaged
client loss f^g_t = sum_i p_i f^i_{t,K} with the bracketing of digest 2.7.2:

    r_t     = lambda w_t                                                  # grad of (lambda/2)||w||^2
    gamma_t = clip_[0,1]( (f^g_t - eta <D_t, r_t>) / (eta ||D_t||^2 + eps) )
    w_{t+1} = w_t - eta (r_t + gamma_t D_t)
    momentum mu > 0 (DFW reference code, not in Algorithm 2):
        z <- mu z - eta gamma_t (D_t + r_t);   w_{t+1} <- w_{t+1} + mu z

Sign convention: the paper's D_t = w_t - avg w^i (points like a gradient); fedhop's replies
carry Delta_i = w^i - w_t (as FedAvg's do), so D_t = -sum_i p_i Delta_i below.

Wire (common brief, "wire accounting rule"): the communicated numbers, eta^i_{t,K} and
f^i_{t,K}, travel as 0-dim float64 tensors ("step_size", "loss") so the ledger's tensor_bytes
shows exactly one more scalar, 8 bytes, per client reply than FedAvg (digest 2.6).  They set the
server step (eta_g = max_i eta^i, gamma_t from sum_i p_i f^i), so they are carried and summed in
float64: a float32 loss moves FedLi-LU away from the float64 method (3e-2 after 25 rounds).  `step_size` is reduced
by max (so an edge's partial holds the max of its clients, and the server's max over edges is
the max over all clients), `loss` by weighted sum (an edge forwards sum_i w_i f_i with W_e =
sum_i w_i, and the server's weighted mean over edges equals the flat one).  The aggregation
weights p_i follow algorithm.weighting (samples or uniform) for both Delta and f.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypedDict

import torch

from fedhop.common.algorithms.base import (
    WEIGHT_KEY,
    Algorithm,
    AlgorithmParams,
    ClientContext,
    Payload,
    ServerState,
    weighted_mean,
)
from fedhop.common.algorithms.local import get_params, local_sgd, set_params
from fedhop.common.algorithms.vectorized import (
    call_batches,
    cohort_steps,
    compute_shares,
    every_parameter,
    local_sgd_together,
    stack_starts,
    stacked_gradients,
    stacked_losses,
)
from fedhop.common.numerics.sampling import local_batches
from fedhop.common.wire.message import COMPUTE_KEY

STEP_KEY = "step_size"    # FedLi-LS: eta^i_{t,K}, 0-dim float64 tensor, reduced by max
LOSS_KEY = "loss"         # FedLi-LU: f^i_{t,K}, 0-dim float64 tensor, reduced by weighted sum
FORWARDS_KEY = "ls_forwards"   # FedLi-LS bookkeeping: loss evaluations of the line search (sum)
MOMENTUM_PREFIX = "fedli_lu_z."  # FedLi-LU server state: DFW momentum buffer per parameter
FALLBACK_STEP = 1e-6      # SLS: the step taken when no trial passes within max_backtracks


# ============================================================================ FedLi-LS client
@dataclass
class FedLiLSParams(AlgorithmParams):
    """Armijo constants: the SLS defaults (the paper names them but gives no values, digest 2.2).

    `reset`: the first trial step of each local step: "keep" the last, "max" (eta_max), or "grow"
        (eta * delta^(b/n), SLS)
    `max_backtracks`: trials of the line search before it takes a small fallback step
    `server_step`: the server step eta_g: "unit" (1), "max" (the largest client step, the paper's
        non-convex heuristic) or "const" (algorithm.server_lr)
    """

    c: float = field(default=0.1, metadata={"min_exclusive": 0.0})           # Armijo constant, < 1
    beta: float = field(default=0.9, metadata={"min_exclusive": 0.0})        # backtracking factor, < 1
    eta_max: float = field(default=1.0, metadata={"min_exclusive": 0.0})     # eta_lmax: first step (k = 1), cap
    reset: str = field(default="grow", metadata={"choices": ("keep", "max", "grow")})
    delta: float = field(default=2.0, metadata={"min_exclusive": 0.0})       # reset growth: eta * delta^(b/n)
    cap: bool = False                   # eta <- min(eta, eta_max) after the reset (theory; SLS does not)
    max_backtracks: int = field(default=100, metadata={"min": 1})
    min_grad_norm: float = field(default=1e-8, metadata={"min": 0.0})        # below: no search, take the step
    server_step: str = field(default="unit", metadata={"choices": ("unit", "max", "const")})

    def __post_init__(self) -> None:
        for name in ("c", "beta"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"config key 'algorithm.{name}': got {value!r}, must be in (0, 1)")


@dataclass
class ArmijoTrial:
    """What the line search saw at one local step (for instrumentation and tests)."""

    client: int                  # the client's id
    step: int                    # local step index k (0-based)
    batch: torch.Tensor          # the minibatch's row indices
    start: dict[str, torch.Tensor]   # w before the step (copies)
    grad_sq: float               # ||g||^2 (g includes the weight-decay gradient)
    loss_before: float           # f_{i_k}(w)
    loss_after: float            # f_{i_k}(w - eta g)
    eta: float                   # the step taken
    accepted: bool               # the Armijo condition held (False: fallback step or no search)
    backtracks: int


@dataclass
class ArmijoStats:
    steps: int = 0
    loss_sum: float = 0.0
    last_eta: float = float("nan")
    forwards: int = 0            # loss evaluations (one at w plus one per trial)
    backtracks: int = 0
    fallbacks: int = 0

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else float("nan")


def reset_step(eta: float, k: int, p: FedLiLSParams, batch_fraction: float) -> float:
    """Algorithm 4 (paper's opt 0/1/2 = keep/max/grow; SLS's reset_option 0/2/1).

    k == 0 (the paper's k = 1) always starts at eta_max, so every round starts afresh, as in
    FedML where the client optimiser is rebuilt each round.  `grow` is SLS's eta * delta^(b/n)
    (digest 2.2: the paper's printed `eta*delta*b/n` is garbled), b/n = batch / local samples."""
    if k == 0 or p.reset == "max":
        out = p.eta_max
    elif p.reset == "keep":
        out = eta
    else:
        out = eta * p.delta ** batch_fraction
    return min(out, p.eta_max) if p.cap else out


def armijo_sgd(ctx: ClientContext, p: FedLiLSParams, batch_size: int, weight_decay: float = 0.0,
               observer: Callable[[ArmijoTrial], None] | None = None) -> ArmijoStats:
    """One round of SGD with the stochastic Armijo line search (Algorithm 3) on `ctx.model`.

    The objective of the condition is the minibatch loss plus (weight_decay/2)||w||^2, the
    function whose gradient is stepped along.  Tasks that draw gradient noise from the client's
    generator see the same draw at every trial (the generator is rewound), so the condition is
    checked on one stochastic function f_{i_k}, as the method requires."""
    data = ctx.task.client_data(ctx.client_id)
    params = [(n, q) for n, q in ctx.model.named_parameters() if q.requires_grad]
    bs = data.rows if batch_size <= 0 else min(batch_size, data.rows)
    fraction = bs / max(data.rows, 1)
    stats = ArmijoStats()
    eta = p.eta_max

    def objective(batch: tuple[torch.Tensor, ...], rewind) -> tuple[torch.Tensor, torch.Tensor]:
        """(task loss, task loss + (weight_decay/2)||w||^2) on `batch`."""
        if rewind is not None:
            ctx.generator.set_state(rewind)
        value = ctx.task.loss(ctx.model, batch, ctx.generator)
        if weight_decay:
            return value, value + 0.5 * weight_decay * sum((q * q).sum() for _, q in params)
        return value, value

    for k, idx in enumerate(local_batches(data.rows, batch_size, ctx.local_steps, ctx.local_epochs,
                                          ctx.generator)):
        batch = tuple(t[idx] for t in data.tensors)
        rewind = ctx.generator.get_state()
        ctx.model.zero_grad(set_to_none=True)
        task_loss, loss = objective(batch, None)
        loss.backward()
        after_draw = ctx.generator.get_state()
        f0 = float(loss.detach())
        with torch.no_grad():
            start = {n: q.detach().clone() for n, q in params}
            grads = {n: (q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q)) for n, q in params}
            grad_sq = float(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        eta = reset_step(eta, k, p, fraction)
        stats.forwards += 1
        accepted, tries, f1 = False, 0, f0
        with torch.no_grad():
            if math.sqrt(grad_sq) < p.min_grad_norm:
                trial_eta = eta
                for n, q in params:
                    q.copy_(start[n] - trial_eta * grads[n])
            else:
                trial_eta = eta
                for tries in range(p.max_backtracks):
                    for n, q in params:
                        q.copy_(start[n] - trial_eta * grads[n])
                    f1 = float(objective(batch, rewind)[1])
                    stats.forwards += 1
                    if f1 <= f0 - p.c * trial_eta * grad_sq:      # Armijo, Eq. 10
                        accepted = True
                        break
                    trial_eta *= p.beta
                if not accepted:                                   # SLS fallback
                    trial_eta = min(FALLBACK_STEP, eta)
                    stats.fallbacks += 1
                    for n, q in params:
                        q.copy_(start[n] - trial_eta * grads[n])
                    f1 = float(objective(batch, rewind)[1])
                    stats.forwards += 1
        ctx.generator.set_state(after_draw)
        eta = trial_eta
        stats.steps += 1
        stats.loss_sum += float(task_loss.detach())      # reported train_loss: without the decay term, as FedAvg
        stats.last_eta = eta
        stats.backtracks += tries
        if observer is not None:
            observer(ArmijoTrial(ctx.client_id, k, idx, start, grad_sq, f0, f1, eta, accepted, tries))
    return stats


def armijo_sgd_together(ctxs: Sequence[ClientContext], starts: Sequence[dict[str, torch.Tensor]], p: FedLiLSParams,
                        batch_size: int, weight_decay: float = 0.0,
                        observer: Callable[[ArmijoTrial], None] | None = None,
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[ArmijoStats], list[float]]:
    """`armijo_sgd` of each client in `ctxs` from its own start, all at once
    ([algorithm] vectorized, common/algorithms/vectorized.py): at local step k one stacked
    computation gives the gradients and losses of the clients taking it, then each trial of the
    line search evaluates, in one stacked forward pass, the loss of every client still searching
    at its own trial point.  Each client's step size, trials, fallback and counts are its own,
    decided by the same arithmetic as `armijo_sgd`'s, so its result does not depend on the
    clients beside it; its losses agree with `armijo_sgd`'s to float rounding, so a trial at the
    edge of the Armijo condition could be decided the other way.

    Returns the start and final parameters stacked (row i: client i's), each client's
    ArmijoStats and its share of the seconds spent.  The task's loss draws nothing from the
    client's generator (`why_not_vectorized`), so no trial needs the generator rewound."""
    started = time.perf_counter()
    model, task = ctxs[0].model, ctxs[0].task
    names, start, stacked, frozen = stack_starts(model, starts)
    gradients, losses_at = stacked_gradients(model, task), stacked_losses(model, task)
    dtype = next(iter(start.values())).dtype if start else torch.float32
    device = next(iter(start.values())).device if start else torch.device("cpu")
    datas, plans, batches = call_batches(ctxs, batch_size, dtype)
    fractions = [(data.rows if batch_size <= 0 else min(batch_size, data.rows)) / max(data.rows, 1) for data in datas]
    stats = [ArmijoStats() for _ in ctxs]
    etas = [p.eta_max] * len(ctxs)

    def decayed(losses: torch.Tensor, params: dict[str, torch.Tensor]) -> list[float]:
        """Each row's objective: its loss plus (weight_decay/2)||w||^2, as `armijo_sgd`'s."""
        if weight_decay:
            losses = losses + 0.5 * weight_decay * sum((t * t).flatten(1).sum(1) for t in params.values())
        return losses.double().tolist()

    def moved(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], step: list[float]
              ) -> dict[str, torch.Tensor]:
        """w - eta g, row i with its own eta."""
        column = torch.tensor(step, dtype=dtype, device=device)
        return {name: params[name] - column.view(-1, *([1] * (params[name].dim() - 1))) * grads[name]
                for name in params}

    def objectives_after(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                         fixed: dict[str, torch.Tensor], mask: torch.Tensor, batch: tuple[torch.Tensor, ...],
                         rows: list[int], step: list[float]) -> list[float]:
        """The objective at w - eta g of each of the stack's `rows`, on its minibatch, row i with step[i]."""
        at = torch.tensor(rows)
        point = moved({name: t[at] for name, t in params.items()}, {name: t[at] for name, t in grads.items()}, step)
        return decayed(losses_at(point, {name: t[at] for name, t in fixed.items()}, mask[at], *(t[at] for t in batch)),
                       point)

    for k, members, rows, params, fixed, mask, batch in cohort_steps(plans, batch_size, batches, stacked, frozen):
        grads, task_losses = gradients(params, fixed, mask, *batch)
        with torch.no_grad():
            if weight_decay:
                grads = {name: grads[name] + weight_decay * params[name] for name in names}
            f0 = decayed(task_losses, params)
            squares = torch.zeros(len(members), dtype=torch.float64, device=device)
            for name in names:
                squares += (grads[name].double() ** 2).flatten(1).sum(1)
            grad_sq: list[float] = squares.tolist()
            first = [reset_step(etas[i], k, p, fractions[i]) for i in members]
            trial, f1, tries = list(first), list(f0), [0] * len(members)
            accepted = [False] * len(members)
            searching = [j for j in range(len(members)) if math.sqrt(grad_sq[j]) >= p.min_grad_norm]
            for attempt in range(p.max_backtracks):
                if not searching:
                    break
                values = objectives_after(params, grads, fixed, mask, batch, searching, [trial[j] for j in searching])
                still = []
                for j, value in zip(searching, values):
                    stats[members[j]].forwards += 1
                    tries[j], f1[j] = attempt, value
                    if value <= f0[j] - p.c * trial[j] * grad_sq[j]:      # Armijo, Eq. 10
                        accepted[j] = True
                    else:
                        trial[j] *= p.beta
                        still.append(j)
                searching = still
            if searching:                                                  # SLS fallback
                for j in searching:
                    trial[j] = min(FALLBACK_STEP, first[j])
                    stats[members[j]].fallbacks += 1
                    stats[members[j]].forwards += 1
                values = objectives_after(params, grads, fixed, mask, batch, searching, [trial[j] for j in searching])
                for j, value in zip(searching, values):
                    f1[j] = value
            new = moved(params, grads, trial)
            for name in names:
                if rows is None:
                    stacked[name] = new[name]
                else:
                    stacked[name][rows] = new[name]
        for j, (i, loss) in enumerate(zip(members, task_losses.detach().double().tolist())):
            s = stats[i]
            s.forwards += 1
            s.steps += 1
            s.loss_sum += loss                      # reported train_loss: without the decay term, as FedAvg
            s.last_eta = etas[i] = trial[j]
            s.backtracks += tries[j]
            if observer is not None:
                observer(ArmijoTrial(ctxs[i].client_id, k, plans[i][k], {name: params[name][j].clone() for name in names},
                                     grad_sq[j], f0[j], f1[j], trial[j], accepted[j], tries[j]))
    return start, {**stacked, **frozen}, stats, compute_shares(started, [s.steps for s in stats])


#: dtype of the 0-dim scalars that feed the server step (8 bytes each on the ledger)
SCALAR_DTYPE = torch.float64


def _scalar_tensor(value: float, like: torch.Tensor | None = None) -> torch.Tensor:
    """A 0-dim float64 tensor on `like`'s device (the reply's tensors' device)."""
    return torch.tensor(float(value), dtype=SCALAR_DTYPE, device=None if like is None else like.device)


def _extras_spec(names: tuple[str, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (SCALAR_DTYPE, ()) for name in names}


class _FedLiBase(Algorithm):
    """Shared: reply spec with the 0-dim extras, and the hierarchical edge_partial rule."""

    extras: tuple[str, ...] = ()
    partial_exchange = True   # FedLi-LS and FedLi-LU

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        spec = super().reply_spec(state)
        spec.update(_extras_spec(self.extras))
        return spec

    def edge_partial(self, start: Payload, current: Payload, last: Payload) -> Payload:
        """kappa2 > 1 at an edge: the model change as the base class computes it, and the extra
        values of the edge's last iteration as reduced there (max step size; sum_i w_i f_i with
        the partial's weight W_e of that iteration), i.e. the clients' last results."""
        out = super().edge_partial(start, current, last)
        for name in self.extras:
            out.tensors[name] = last.tensors[name].clone()
        return out


# ============================================================================ FedLi-LS
class FedLiLS(_FedLiBase):
    name = "fedli_ls"
    Params = FedLiLSParams
    params: FedLiLSParams
    extras = (STEP_KEY,)
    reply_reduce = {STEP_KEY: "max", FORWARDS_KEY: "sum"}
    #: tests may set an observer on an instance to see every line-search step
    observer: Callable[[ArmijoTrial], None] | None = None

    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        set_params(ctx.model, message.tensors)
        stats = armijo_sgd(ctx, self.params, self.cfg.batch_size, self.cfg.weight_decay, self.observer)
        local = get_params(ctx.model)
        return self.reply(ctx, {name: local[name] - message.tensors[name] for name in message.tensors}, stats)

    def reply(self, ctx: ClientContext, delta: dict[str, torch.Tensor], stats: ArmijoStats) -> Payload:
        """Delta_i and eta^i_{t,K}, the step of the client's last local step (eta_max where it took none)."""
        tensors = dict(delta)
        tensors[STEP_KEY] = _scalar_tensor(stats.last_eta if stats.steps else self.params.eta_max,
                                           next(iter(tensors.values()), None))
        return Payload(tensors=tensors, scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats.mean_loss,
                                                 "local_steps": stats.steps, FORWARDS_KEY: stats.forwards})

    @classmethod
    def trains_together(cls) -> bool:
        """FedLi-LS's clients run `armijo_sgd` (`client_updates`); a subclass with a solver of its own does not."""
        return cls.client_update is FedLiLS.client_update

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client, their line searches run side by side
        (`armijo_sgd_together`)."""
        every_parameter(ctxs, messages)
        start, final, stats, seconds = armijo_sgd_together(ctxs, [m.tensors for m in messages], self.params,
                                                           self.cfg.batch_size, self.cfg.weight_decay, self.observer)
        replies = []
        for i, (ctx, message) in enumerate(zip(ctxs, messages)):
            reply = self.reply(ctx, {name: final[name][i] - start[name][i] for name in message.tensors}, stats[i])
            reply.scalars[COMPUTE_KEY] = seconds[i]
            replies.append(reply)
        return replies

    def server_step(self, aggregate: Payload) -> float:
        """eta_g of digest 2.3: 1, max_i eta^i_{t,K}, or algorithm.server_lr."""
        rule = self.params.server_step
        if rule == "unit":
            return 1.0
        if rule == "max":
            return float(aggregate.tensors[STEP_KEY])
        return float(self.cfg.server_lr)

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        eta_g = self.server_step(aggregate)
        for name, w in state.params.items():
            w.add_(weighted_mean(aggregate, name), alpha=eta_g)      # w_t - eta_g D_t
        state.scalars["fedli_server_step"] = eta_g
        state.scalars["fedli_client_step_max"] = float(aggregate.tensors[STEP_KEY])


# ============================================================================ FedLi-LU
class DFWPreset(TypedDict):
    """A preset's DFW constants; eta None: algorithm.server_lr."""

    eta: float | None
    server_weight_decay: float
    momentum: float


PRESETS: dict[str, DFWPreset] = {
    # paper reading (Algorithm 2, App. C: eta_g = 10^0, weight decay 1e-3, no momentum); eta None:
    # algorithm.server_lr (default 1.0)
    "paper": {"eta": None, "server_weight_decay": 1e-3, "momentum": 0.0},
    # the public code's server optimiser: DFW(lr=0.01, momentum=0.9, weight_decay=1e-5)
    "code": {"eta": 0.01, "server_weight_decay": 1e-5, "momentum": 0.9},
}


@dataclass
class FedLiLUParams(AlgorithmParams):
    """Server DFW constants; a value left out comes from `preset` (digest 2.5, 2.7.3).

    `preset`: where the unset DFW constants come from: "paper" (eta = server_lr, weight decay 1e-3,
        no momentum) or "code" (eta 0.01, weight decay 1e-5, momentum 0.9)
    `eps`: epsilon in the denominator of the DFW step gamma_t
    `loss_report`: the loss a client reports: the epoch-mean minibatch loss, the last minibatch's,
        or the full local loss after training ("post_train")
    """

    preset: str = field(default="paper", metadata={"choices": tuple(PRESETS)})
    eta: float | None = field(default=None, metadata={"min_exclusive": 0.0})        # DFW proximal coefficient
    server_weight_decay: float | None = field(default=None, metadata={"min": 0.0})  # lambda
    momentum: float | None = field(default=None, metadata={"min": 0.0})             # mu
    eps: float = field(default=1e-5, metadata={"min": 0.0})
    loss_report: str = field(default="epoch_mean", metadata={"choices": ("epoch_mean", "last_batch", "post_train")})

    def __post_init__(self) -> None:
        if self.momentum is not None and self.momentum >= 1.0:
            raise ValueError(f"config key 'algorithm.momentum': got {self.momentum!r}, must be in [0, 1)")


@dataclass
class DFWStep:
    """One server step's numbers (for logging and tests)."""

    gamma: float
    f_global: float
    eta: float
    delta_sq: float          # ||D_t||^2
    delta_dot_r: float       # <D_t, r_t>


def dfw_gamma(f_global: float, delta_sq: float, delta_dot_r: float, eta: float, eps: float) -> float:
    """gamma_t = clip_[0,1]((f - eta <D, r>) / (eta ||D||^2 + eps)), digest 2.5 / 2.7.2."""
    raw = (f_global - eta * delta_dot_r) / (eta * delta_sq + eps)
    return min(max(raw, 0.0), 1.0)


class FedLiLU(_FedLiBase):
    name = "fedli_lu"
    Params = FedLiLUParams
    params: FedLiLUParams
    extras = (LOSS_KEY,)
    reply_reduce = {LOSS_KEY: "wsum"}

    def resolved(self) -> tuple[float, float, float]:
        """(eta, lambda, mu) after the preset fills the values left out."""
        preset = PRESETS[self.params.preset]
        eta = self.params.eta if self.params.eta is not None else preset["eta"]
        eta = float(self.cfg.server_lr) if eta is None else float(eta)
        lam = self.params.server_weight_decay
        lam = float(preset["server_weight_decay"] if lam is None else lam)
        mu = self.params.momentum
        mu = float(preset["momentum"] if mu is None else mu)
        return eta, lam, mu

    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        set_params(ctx.model, message.tensors)
        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay)
        local = get_params(ctx.model)
        tensors = {name: local[name] - message.tensors[name] for name in message.tensors}
        tensors[LOSS_KEY] = _scalar_tensor(self.reported_loss(ctx, stats), next(iter(tensors.values()), None))
        return Payload(tensors=tensors, scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats.mean_loss,
                                                 "local_steps": stats.steps})

    @classmethod
    def trains_together(cls) -> bool:
        """FedLi-LU's clients run plain local SGD (`client_updates`); a subclass with a solver of its own does not."""
        return cls.client_update is FedLiLU.client_update

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client, their local SGD trained together
        (common/algorithms/vectorized.py); each reply's loss is reported from the client's own
        stats, or after training from its own final parameters (`post_train`)."""
        every_parameter(ctxs, messages)
        start, final, stats, seconds = local_sgd_together(ctxs, [m.tensors for m in messages], self.cfg.lr,
                                                          self.cfg.batch_size, self.cfg.weight_decay)
        delta = {name: final[name] - start[name] for name in start}   # Delta_i = w_i - w_t, row i
        replies = []
        for i, (ctx, message) in enumerate(zip(ctxs, messages)):
            tensors = {name: delta[name][i] for name in message.tensors}
            if self.params.loss_report == "post_train":
                set_params(ctx.model, {name: final[name][i] for name in message.tensors})
            tensors[LOSS_KEY] = _scalar_tensor(self.reported_loss(ctx, stats[i]), next(iter(tensors.values()), None))
            replies.append(Payload(tensors=tensors, scalars={
                WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats[i].mean_loss,
                "local_steps": stats[i].steps, COMPUTE_KEY: seconds[i]}))
        return replies

    def reported_loss(self, ctx: ClientContext, stats) -> float:
        """f^i_{t,K}: the epoch-mean minibatch loss (FedML trainer, default), the last minibatch's
        loss, or the full local loss after training (digest 2.4)."""
        how = self.params.loss_report
        if how == "epoch_mean":
            return stats.mean_loss
        if how == "last_batch":
            return stats.last_loss
        data = ctx.task.client_data(ctx.client_id)
        with torch.no_grad():
            return float(ctx.task.loss(ctx.model, data.tensors))

    def dfw_step(self, state: ServerState, aggregate: Payload) -> DFWStep:
        """gamma_t and its inputs for this round; sums over every parameter tensor in float64."""
        eta, lam, _ = self.resolved()
        f_global = float(weighted_mean(aggregate, LOSS_KEY))
        delta_sq, delta_dot_r = 0.0, 0.0
        for name, w in state.params.items():
            d = -weighted_mean(aggregate, name).double()          # D_t = w_t - avg w^i
            delta_sq += float((d * d).sum())
            delta_dot_r += float((d * (lam * w.double())).sum())
        gamma = dfw_gamma(f_global, delta_sq, delta_dot_r, eta, self.params.eps)
        return DFWStep(gamma, f_global, eta, delta_sq, delta_dot_r)

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        eta, lam, mu = self.resolved()
        step = self.dfw_step(state, aggregate)
        for name, w in state.params.items():
            d = -weighted_mean(aggregate, name)                     # D_t
            r = lam * w                                             # r_t = lambda w_t
            w.sub_(eta * (r + step.gamma * d))                      # Eq. 21: w - eta (r + gamma D)
            if mu > 0:
                z = state.extra.setdefault(MOMENTUM_PREFIX + name, torch.zeros_like(w))
                z.mul_(mu).sub_(eta * step.gamma * (d + r))         # DFW code: z <- mu z - eta gamma (D + r)
                w.add_(z, alpha=mu)
        state.scalars["fedli_gamma"] = step.gamma
        state.scalars["fedli_f_global"] = step.f_global
        state.scalars["fedli_gamma_clipped_rounds"] = int(state.scalars.get("fedli_gamma_clipped_rounds", 0)) + \
            int(step.gamma >= 1.0)


REGISTER = [FedLiLS, FedLiLU]
