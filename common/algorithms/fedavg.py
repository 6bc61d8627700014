"""FedAvg (McMahan et al. 2017) with a server learning rate.

Client: start from the broadcast model w_t, run local SGD (steps or epochs), send
Delta_i = w_i - w_t and the weight n_i (samples) or 1 (uniform weighting).
Server: w_{t+1} = w_t + eta_g * sum_i p_i Delta_i,  p_i = n_i / sum_{j in S_t} n_j.
With eta_g = 1 this is the sample-weighted model average of the original paper.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedhop.common.algorithms.base import Algorithm, AlgorithmParams, ClientContext, Payload, ServerState, weighted_mean
from fedhop.common.algorithms.local import get_params, local_sgd, set_params


@dataclass
class FedAvgParams(AlgorithmParams):
    pass


class FedAvg(Algorithm):
    name = "fedavg"
    Params: type[AlgorithmParams] = FedAvgParams

    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        set_params(ctx.model, message.tensors)
        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay)
        local = get_params(ctx.model)
        delta = {name: local[name] - message.tensors[name] for name in message.tensors}
        return Payload(tensors=delta, scalars={"weight": self.client_weight(ctx),
                                               "train_loss": stats.mean_loss,
                                               "local_steps": stats.steps})

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        for name, w in state.params.items():
            w.add_(weighted_mean(aggregate, name), alpha=self.cfg.server_lr)
REGISTER = [FedAvg]
