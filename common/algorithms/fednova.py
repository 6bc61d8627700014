"""FedNova (Wang, Liu, Liang, Joshi and Poor 2020, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization"), with plain local SGD (a_i = [1, ..., 1], ||a_i||_1 = tau_i).

Clients may take different numbers of local steps tau_i (a list `algorithm.local_steps`, one
entry per client; local epochs over unequal data; stragglers).  FedAvg then converges to a
stationary point of sum_i p_i tau_i f_i / sum_j p_j tau_j (objective inconsistency, Theorem 1);
FedNova normalises each client's update by its step count (Eq. 6-7):

    d_i      = (x_i - x_t) / tau_i                     (normalised update, sent by client i)
    d        = sum_i p_i d_i
    tau_eff  = sum_i p_i tau_i
    x_{t+1}  = x_t + eta_g tau_eff d                   (eta_g = server_lr, 1 in the paper)

Client i replies d_i (under the parameter names: the same d numbers as FedAvg) and tau_i as a
0-dim float32 tensor `nova_tau` (4 bytes: the server's step uses it), both reduced by weighted
sum, so sum_i w_i tau_i / sum_i w_i = tau_eff.  p_i = w_i / sum_{j in S} w_j follows
`algorithm.weighting` (samples: the paper's p_i = n_i / n over the participants).  No server
state.

Hierarchical (documented rule): edges reduce the replies by weighted sums exactly as a star
server would, so the server's step equals the star run's.  HierFAVG kappa2 > 1 is not supported
(the edge would need the normalised step of several iterations); `edge_step` raises.
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
from fedhop.common.algorithms.vectorized import every_parameter, local_sgd_together
from fedhop.common.wire.message import COMPUTE_KEY

TAU_KEY = "nova_tau"


@dataclass
class FedNovaParams(AlgorithmParams):
    pass


class FedNova(Algorithm):
    name = "fednova"
    partial_exchange = True
    Params = FedNovaParams

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        spec = super().reply_spec(state)
        spec[TAU_KEY] = (torch.float32, ())
        return spec

    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        set_params(ctx.model, message.tensors)
        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay)
        local = get_params(ctx.model)
        return Payload(tensors=_normalised(message.tensors, local, stats.steps),
                       scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats.mean_loss,
                                "local_steps": stats.steps})

    @classmethod
    def trains_together(cls) -> bool:
        """Plain local SGD in the vectorized solver ([algorithm] vectorized); each client's
        update normalised by its own step count."""
        return cls.client_update is FedNova.client_update

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client at once (common/algorithms/vectorized.py)."""
        every_parameter(ctxs, messages)
        start, final, stats, seconds = local_sgd_together(ctxs, [m.tensors for m in messages], self.cfg.lr,
                                                          self.cfg.batch_size, self.cfg.weight_decay)
        return [Payload(tensors=_normalised({n: start[n][i] for n in start}, {n: final[n][i] for n in start},
                                            stats[i].steps),
                        scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats[i].mean_loss,
                                 "local_steps": stats[i].steps, COMPUTE_KEY: seconds[i]})
                for i, ctx in enumerate(ctxs)]

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        tau_eff = float(aggregate.tensors[TAU_KEY]) / float(aggregate.scalars[WEIGHT_KEY])
        state.scalars["fednova_tau_eff"] = tau_eff
        for name, x in state.params.items():
            x.add_(weighted_mean(aggregate, name), alpha=self.cfg.server_lr * tau_eff)   # x + eta_g tau_eff d

    edge_iterations = False   # kappa2 > 1 is refused when the config is loaded

    def edge_step(self, message: Payload, partial: Payload) -> Payload:
        raise ValueError("fednova: hierarchical topology with kappa2 > 1 is not supported; use kappa2 = 1")


def _normalised(start: dict[str, torch.Tensor], local: dict[str, torch.Tensor], tau: int) -> dict[str, torch.Tensor]:
    """A client's reply tensors: d_i = (x_i - x_t) / tau_i (Eq. 6) and tau_i."""
    tensors = {name: (local[name] - start[name]) / max(tau, 1) for name in start}
    tensors[TAU_KEY] = torch.tensor(float(tau), dtype=torch.float32)
    return tensors


REGISTER = [FedNova]
