"""FedExP (Jhunjhunwala, Wang and Joshi 2023, "FedExP: Speeding Up Federated Averaging via
Extrapolation"): FedAvg with an adaptive server step from the POCS extrapolation rule.

Client i: FedAvg's local SGD; it sends Delta_i = x_i - x_t, its weight, and ||Delta_i||^2 (sum
over every parameter tensor) as a 0-dim float64 tensor `delta_sq_norm` (8 bytes on the ledger:
the server cannot compute the norms itself once an edge has summed the deltas).  The norm drives
the server step, so it is accumulated, sent and summed in float64: rounded to float32 it moves
the run away from the float64 method (by 1.7 after 25 rounds on a heterogeneous quadratic).
Server, p_i the aggregation weights (uniform 1/M in the paper, Eq. 9):

    Delta_t   = sum_i p_i Delta_i
    eta_g^t   = max(1, sum_i p_i ||Delta_i||^2 / (2 (||Delta_t||^2 + eps)))          (Eq. 9)
    x_{t+1}   = x_t + eta_g^t Delta_t        (times algorithm.server_lr, 1 = the paper)

eps defaults to 1e-3 (the FedLi paper's grid optimum and FedExP's common choice).

A note on Eq. 9: where the clients' optima differ, the clients' deltas stay apart as the average
delta shrinks near the fixed point, so the ratio, and the step, grows without bound (measured: 198
at round 25 and 822 at round 60 on a deterministic heterogeneous quadratic, ending farther from
the optimum than FedAvg; docs/claims.md).  `max_server_step = c > 0` caps the step,
eta_g = min(c, Eq. 9): a safeguard that is NOT in the paper, off (0) by default.  With
`average_last_two = true` the model that is evaluated and saved (`state.params`) is
(x_{t+1} + x_t)/2, the paper's reported iterate (Section 5: the last iterates oscillate), while
the iterate x_{t+1} that clients receive lives in `state.extra` ("fedexp_x.NAME").  The last
step size is in `state.scalars["fedexp_eta_g"]`.

Hierarchical: both `delta` and `delta_sq_norm` are weighted sums, so edges reduce them exactly
and the server's step equals the star run's.  With HierFAVG kappa2 > 1 an edge acts as one
FedExP client: its partial carries W_e ||Delta_e||^2 for its total model change Delta_e.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedhop.common.algorithms.base import (
    WEIGHT_KEY,
    AlgorithmParams,
    ClientContext,
    Payload,
    ServerState,
    weighted_mean,
)
from fedhop.common.algorithms.fedavg import FedAvg
from fedhop.common.algorithms.local import get_params, local_sgd, set_params

NORM_KEY = "delta_sq_norm"
X_PREFIX = "fedexp_x."


@dataclass
class FedExPParams(AlgorithmParams):
    """[algorithm] keys of fedexp (FedAvg with the adaptive extrapolated server step).

    `eps`: epsilon of the step rule eta_g = max(1, sum p_i ||Delta_i||^2 / (2 (||Delta||^2 + eps)))
        (Eq. 9)
    `average_last_two`: evaluate and save (x_{t+1} + x_t) / 2, the paper's reported iterate; clients
        still receive x_{t+1}
    """

    eps: float = field(default=1e-3, metadata={"min": 0.0})
    average_last_two: bool = False
    max_server_step: float = field(default=0.0, metadata={"min": 0.0})   # > 0: cap eta_g (not in the paper)


def fedexp_step(weighted_sq_norms: float, mean_delta_sq_norm: float, eps: float) -> float:
    """eta_g = max(1, sum_i p_i ||Delta_i||^2 / (2 (||sum_i p_i Delta_i||^2 + eps)))   (Eq. 9)."""
    denom = 2.0 * (mean_delta_sq_norm + eps)
    if denom <= 0.0:      # eps = 0 and every delta zero: nothing to extrapolate
        return 1.0
    return max(1.0, weighted_sq_norms / denom)


class FedExP(FedAvg):
    name = "fedexp"
    Params = FedExPParams
    params: FedExPParams

    # ------------------------------------------------------------------ server side
    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        if self.params.average_last_two:
            for name, w in state.params.items():
                state.extra[X_PREFIX + name] = w.clone()
        state.scalars["fedexp_eta_g"] = 1.0
        return state

    def _iterate(self, state: ServerState) -> dict[str, torch.Tensor]:
        if not self.params.average_last_two:
            return state.params
        return {name: state.extra.setdefault(X_PREFIX + name, w.clone()) for name, w in state.params.items()}

    def broadcast(self, state: ServerState, round: int) -> Payload:
        return Payload(tensors=dict(self._iterate(state)))

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        spec = super().reply_spec(state)
        spec[NORM_KEY] = (torch.float64, ())
        return spec

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        x = self._iterate(state)
        means = {name: weighted_mean(aggregate, name).double() for name in x}
        mean_sq = float(sum(float(m.pow(2).sum()) for m in means.values()))
        sq_norms = float(aggregate.tensors[NORM_KEY]) / float(aggregate.scalars[WEIGHT_KEY])
        eta_g = fedexp_step(sq_norms, mean_sq, self.params.eps)
        if self.params.max_server_step > 0:   # the safeguard (module docstring), not in the paper
            eta_g = min(eta_g, self.params.max_server_step)
        state.scalars["fedexp_eta_g"] = eta_g
        for name, w in x.items():
            previous = w.clone()
            w.add_(means[name].to(w.dtype), alpha=eta_g * self.cfg.server_lr)
            if self.params.average_last_two:
                state.params[name].copy_((w + previous) / 2)

    # ------------------------------------------------------------------ client side
    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        set_params(ctx.model, message.tensors)
        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay)
        local = get_params(ctx.model)
        delta = {name: local[name] - message.tensors[name] for name in message.tensors}
        tensors = dict(delta)
        tensors[NORM_KEY] = _sq_norm(delta)
        return Payload(tensors=tensors, scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats.mean_loss,
                                                 "local_steps": stats.steps})

    @classmethod
    def trains_together(cls) -> bool:
        """FedAvg's vectorized solver, each client's ||Delta_i||^2 added to its reply."""
        return cls.client_update is FedExP.client_update

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        replies = super().client_updates(ctxs, messages)
        for reply in replies:
            reply.tensors[NORM_KEY] = _sq_norm(dict(reply.tensors))
        return replies

    # ------------------------------------------------------------------ edge side (kappa2 > 1)
    def edge_partial(self, start: Payload, current: Payload, last: Payload) -> Payload:
        partial = super().edge_partial(start, current, last)
        weight = float(last.scalars[WEIGHT_KEY])
        change = {n: t / weight for n, t in partial.tensors.items()} if weight > 0 else partial.tensors
        partial.tensors[NORM_KEY] = _sq_norm(change) * weight
        return partial


def _sq_norm(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over tensors of ||t||^2, accumulated and sent as a 0-dim float64 tensor (on the tensors' device)."""
    total: torch.Tensor | None = None
    for t in tensors.values():
        term = t.double().pow(2).sum()
        total = term if total is None else total + term
    return total if total is not None else torch.zeros((), dtype=torch.float64)


REGISTER = [FedExP]
