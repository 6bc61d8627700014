"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning"), Algorithm 1 with control-variate option II.

Server -> each sampled client: the model x and the server control variate c (2d numbers).
Client i keeps its control variate c_i in `ctx.state` ("scaffold_ci.NAME", zero at first) across
rounds, in the client process, and runs K local steps of corrected SGD (line 10)

    y <- y - eta_l (g_i(y) - c_i + c)

then (option II, line 12) c_i+ = c_i - c + (x - y) / (K eta_l), and replies (line 13)
Delta y_i = y - x and Delta c_i = c_i+ - c_i (2d numbers; tensors NAME and "scaffold_dc.NAME").
K is the number of steps the client actually took (stragglers take fewer).

Server (lines 16-17), S the participants and N the number of clients:

    x <- x + eta_g sum_{i in S} p_i Delta y_i                    (eta_g = server_lr)
    c <- c + sum_{i in S} q_i Delta c_i,  q_i = w_i / sum_{j=1..N} w_j

With `weighting = "uniform"` (w_i = 1) this is the paper's c <- c + (|S|/N) mean_S Delta c_i, which
keeps c = (1/N) sum_i c_i; with sample weights (w_i = n_i) it keeps c = sum_i (n_i/n) c_i, the
gradient estimate of the sample-weighted objective.  Delta c travels as a weighted sum; the total
weight of all N clients comes from each reply's `total_weight` scalar (reduced with max), since
the server-side algorithm only sees the [algorithm] section.  c lives in `state.extra`
("scaffold_c.NAME").

Hierarchical (documented rule): edges forward (x, c) to their clients and reduce the replies
(weighted sums, as a star server would), so the server's step equals the star run's.  HierFAVG
kappa2 > 1 is not supported: a client's Delta c over several edge iterations is not an edge
partial aggregate; `edge_step` raises a clear error.
"""
from __future__ import annotations

from dataclasses import dataclass

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
from fedhop.common.algorithms.vectorized import every_parameter, local_sgd_together, rows_of
from fedhop.common.wire.message import COMPUTE_KEY

C_PREFIX = "scaffold_c."       # server control variate, in the broadcast and in state.extra
DC_PREFIX = "scaffold_dc."     # Delta c_i in the reply
CI_PREFIX = "scaffold_ci."     # client control variate, in ctx.state
TOTAL_KEY = "total_weight"     # reply scalar: sum of the aggregation weights of all N clients


@dataclass
class ScaffoldParams(AlgorithmParams):
    pass


def total_client_weight(task, uniform: bool) -> float:
    """sum_{j=1..N} w_j: N (uniform weighting) or the total sample count."""
    if uniform:
        return float(task.num_clients)
    return float(sum(task.num_samples(j) for j in range(task.num_clients)))   # without loading their data


class Scaffold(Algorithm):
    name = "scaffold"
    partial_exchange = True
    Params = ScaffoldParams
    reply_reduce = {TOTAL_KEY: "max"}

    def __init__(self, cfg, params=None) -> None:
        super().__init__(cfg, params)
        self._total_weight: dict[int, float] = {}   # per task object (client processes reuse one task)

    # ------------------------------------------------------------------ server side
    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        for name, w in state.params.items():
            state.extra[C_PREFIX + name] = torch.zeros_like(w)
        return state

    def broadcast(self, state: ServerState, round: int) -> Payload:
        tensors = dict(state.params)
        for name, w in state.params.items():
            tensors[C_PREFIX + name] = state.extra.setdefault(C_PREFIX + name, torch.zeros_like(w))
        return Payload(tensors=tensors)

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        spec = super().reply_spec(state)
        spec.update({DC_PREFIX + name: (t.dtype, tuple(t.shape)) for name, t in state.params.items()})
        return spec

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        total = float(aggregate.scalars.get(TOTAL_KEY, 0.0))
        if total <= 0:
            raise ValueError(f"scaffold: the aggregate lacks a positive '{TOTAL_KEY}' scalar")
        for name, x in state.params.items():
            x.add_(weighted_mean(aggregate, name), alpha=self.cfg.server_lr)           # line 16
            c = state.extra.setdefault(C_PREFIX + name, torch.zeros_like(x))
            c.add_(aggregate.tensors[DC_PREFIX + name], alpha=1.0 / total)             # line 17

    # ------------------------------------------------------------------ client side
    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        params = {n: t for n, t in message.tensors.items() if not n.startswith(C_PREFIX)}
        set_params(ctx.model, params)
        x = {n: t.detach().clone() for n, t in params.items()}
        c = {n: message.tensors[C_PREFIX + n] for n in params}
        c_i = {n: ctx.state.setdefault(CI_PREFIX + n, torch.zeros_like(t)) for n, t in params.items()}
        correction = {n: c[n] - c_i[n] for n in params}

        def hook(name: str, p: torch.nn.Parameter, g: torch.Tensor) -> torch.Tensor:
            return g + correction[name]                   # g_i(y) - c_i + c   (line 10)

        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay, grad_hook=hook)
        y = get_params(ctx.model)
        tensors, new_cis = self._reply_tensors(x, y, c, c_i, stats.steps)
        for n, new_ci in new_cis.items():
            c_i[n].copy_(new_ci)
        return Payload(tensors=tensors, scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats.mean_loss,
                                                 "local_steps": stats.steps,
                                                 TOTAL_KEY: self._total(ctx)})

    def _reply_tensors(self, x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], c: dict[str, torch.Tensor],
                       c_i: dict[str, torch.Tensor], steps: int
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """A client's reply tensors (Delta y_i and Delta c_i, line 13) and its new control
        variate c_i+ (option II, line 12), from the round's start x, its local model y and the
        K = `steps` steps it took."""
        tensors: dict[str, torch.Tensor] = {}
        new_cis: dict[str, torch.Tensor] = {}
        for n in x:
            dy = y[n] - x[n]
            if steps > 0 and self.cfg.lr > 0:
                new_ci = c_i[n] - c[n] - dy / (steps * self.cfg.lr)     # option II (line 12)
            else:
                new_ci = c_i[n].clone()
            tensors[n] = dy
            tensors[DC_PREFIX + n] = new_ci - c_i[n]
            new_cis[n] = new_ci
        return tensors, new_cis

    @classmethod
    def trains_together(cls) -> bool:
        """The corrected local SGD of line 10 in the vectorized solver ([algorithm] vectorized)."""
        return cls.client_update is Scaffold.client_update

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client at once (common/algorithms/vectorized.py): each
        client's correction c - c_i stacked, added to its gradients at every step (line 10)."""
        every_parameter(ctxs, messages, skip=C_PREFIX)
        starts = [{n: t for n, t in m.tensors.items() if not n.startswith(C_PREFIX)} for m in messages]
        cs = [{n: m.tensors[C_PREFIX + n] for n in start} for m, start in zip(messages, starts)]
        c_is = [{n: ctx.state.setdefault(CI_PREFIX + n, torch.zeros_like(t)) for n, t in start.items()}
                for ctx, start in zip(ctxs, starts)]
        correction = {n: torch.stack([c[n] - c_i[n] for c, c_i in zip(cs, c_is)]) for n in starts[0]}

        def hook(name: str, p: torch.Tensor, g: torch.Tensor, start: torch.Tensor, rows) -> torch.Tensor:
            return g + rows_of(correction[name], rows)           # g_i(y) - c_i + c   (line 10)

        x, y, stats, seconds = local_sgd_together(ctxs, starts, self.cfg.lr, self.cfg.batch_size,
                                                  self.cfg.weight_decay, hook)
        made = [self._reply_tensors({n: x[n][i] for n in x}, {n: y[n][i] for n in x}, c, c_i, stats[i].steps)
                for i, (c, c_i) in enumerate(zip(cs, c_is))]
        for (_, new_cis), c_i in zip(made, c_is):   # every reply made: the clients' states move together
            for n, new_ci in new_cis.items():
                c_i[n].copy_(new_ci)
        return [Payload(tensors=tensors, scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats[i].mean_loss,
                                                  "local_steps": stats[i].steps, TOTAL_KEY: self._total(ctx),
                                                  COMPUTE_KEY: seconds[i]})
                for i, (ctx, (tensors, _)) in enumerate(zip(ctxs, made))]

    def _total(self, ctx: ClientContext) -> float:
        key = id(ctx.task)
        if key not in self._total_weight:
            uniform = getattr(self.cfg, "weighting", "samples") == "uniform"
            self._total_weight[key] = total_client_weight(ctx.task, uniform)
        return self._total_weight[key]

    # ------------------------------------------------------------------ edge side
    edge_iterations = False   # kappa2 > 1 is refused when the config is loaded

    def edge_step(self, message: Payload, partial: Payload) -> Payload:
        raise ValueError("scaffold: hierarchical topology with kappa2 > 1 is not supported (a client's Delta c "
                         "over several edge iterations is not an edge partial aggregate); use kappa2 = 1")


REGISTER = [Scaffold]
