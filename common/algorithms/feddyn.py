"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization"), a FedLGA baseline.

Digest: research/seed-002.md section 4, item 5.  Device i, given the server model theta^{t-1},
approximately minimises its dynamically regularised objective (Algorithm 1, line 6)

    R_i(theta) = F_i(theta) - <grad L_i^{t-1}, theta> + (alpha/2) ||theta - theta^{t-1}||^2

by local SGD: each step uses g_i(theta) - grad L_i + alpha (theta - theta^{t-1}).  It then
updates its state (line 7) and sends Delta_i = theta_i^t - theta^{t-1}:

    grad L_i^t = grad L_i^{t-1} - alpha (theta_i^t - theta^{t-1})

The state grad L_i (one tensor per parameter, zero at first) stays on the client across
rounds (`ctx.state`), including rounds it is not sampled in.  Server (lines 9-11), P_t the
round's participants and N = the number of clients:

    h^t       = h^{t-1} - alpha (1/N) sum_{i in P_t} (theta_i^t - theta^{t-1})
    theta^t   = (1/|P_t|) sum_{i in P_t} theta_i^t - (1/alpha) h^t
              = theta^{t-1} + eta_g * mean_i Delta_i - h^t / alpha       (eta_g = server_lr, 1 = paper)

h lives in `state.extra` (checkpointed).  The means are the aggregation-weighted means, so the
formulas are the paper's exactly under algorithm.weighting = "uniform" (the paper's setting);
(1/N) sum_P Delta_i is taken as (|P_t|/N) * mean_P Delta_i.  N comes from the clients' replies
(`num_clients`, reduced by max), as the server-side algorithm does not see the [clients] section.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedhop.common.algorithms.base import (
    COUNT_KEY,
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

STATE_PREFIX = "feddyn_grad."     # client state: grad L_i per parameter
H_PREFIX = "feddyn_h."            # server state: h per parameter


@dataclass
class FedDynParams(AlgorithmParams):
    """[algorithm] keys of feddyn.

    `alpha`: alpha, the weight of the dynamic regularizer (the paper tries 0.1, 0.01, 0.001)
    """

    alpha: float = field(default=0.01, metadata={"min_exclusive": 0.0})   # FedDyn paper: {0.1, 0.01, 0.001}


class FedDyn(Algorithm):
    name = "feddyn"
    partial_exchange = True
    Params = FedDynParams
    params: FedDynParams
    reply_reduce = {"num_clients": "max"}

    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        alpha = self.params.alpha
        set_params(ctx.model, message.tensors)
        start = message.tensors
        grad_state = {name: ctx.state.setdefault(STATE_PREFIX + name, torch.zeros_like(t))
                      for name, t in start.items()}

        def hook(name: str, p: torch.nn.Parameter, g: torch.Tensor) -> torch.Tensor:
            # grad of R_i: g - grad L_i + alpha (theta - theta^{t-1})
            return g - grad_state[name] + alpha * (p - start[name])

        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay, grad_hook=hook)
        local = get_params(ctx.model)
        delta = {name: local[name] - start[name] for name in start}
        for name, d in delta.items():
            grad_state[name].sub_(d, alpha=alpha)          # grad L_i <- grad L_i - alpha Delta_i
        return Payload(tensors=delta, scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats.mean_loss,
                                               "local_steps": stats.steps,
                                               "num_clients": int(ctx.task.num_clients)})

    @classmethod
    def trains_together(cls) -> bool:
        """The regularised local SGD of line 6 in the vectorized solver ([algorithm] vectorized)."""
        return cls.client_update is FedDyn.client_update

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client at once (common/algorithms/vectorized.py): each
        client's grad L_i stacked into the regularizer's gradient at every step (line 6)."""
        every_parameter(ctxs, messages)
        alpha = self.params.alpha
        grad_states = [{name: ctx.state.setdefault(STATE_PREFIX + name, torch.zeros_like(t))
                        for name, t in m.tensors.items()} for ctx, m in zip(ctxs, messages)]
        stacked = {name: torch.stack([g[name] for g in grad_states]) for name in messages[0].tensors}

        def hook(name: str, p: torch.Tensor, g: torch.Tensor, start: torch.Tensor, rows) -> torch.Tensor:
            # grad of R_i: g - grad L_i + alpha (theta - theta^{t-1})
            return g - rows_of(stacked[name], rows) + alpha * (p - start)

        start, final, stats, seconds = local_sgd_together(ctxs, [m.tensors for m in messages], self.cfg.lr,
                                                          self.cfg.batch_size, self.cfg.weight_decay, hook)
        deltas = [{name: final[name][i] - start[name][i] for name in start} for i in range(len(ctxs))]
        for delta, grad_state in zip(deltas, grad_states):   # every delta made: the states move together
            for name, d in delta.items():
                grad_state[name].sub_(d, alpha=alpha)          # grad L_i <- grad L_i - alpha Delta_i
        return [Payload(tensors=delta, scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats[i].mean_loss,
                                                "local_steps": stats[i].steps,
                                                "num_clients": int(ctx.task.num_clients), COMPUTE_KEY: seconds[i]})
                for i, (ctx, delta) in enumerate(zip(ctxs, deltas))]

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        alpha = self.params.alpha
        participants = int(aggregate.scalars.get(COUNT_KEY, 1))
        n_clients = int(aggregate.scalars.get("num_clients", participants))
        for name, w in state.params.items():
            mean = weighted_mean(aggregate, name)
            h = state.extra.setdefault(H_PREFIX + name, torch.zeros_like(w))
            h.sub_(mean, alpha=alpha * participants / n_clients)
            w.add_(mean, alpha=self.cfg.server_lr).sub_(h, alpha=1.0 / alpha)


REGISTER = [FedDyn]
