"""An algorithm plug-in: FedAvg with server momentum (FedAvgM; Hsu, Qi and Brown 2019, Algorithm 1).

Clients run FedAvg's local SGD and send Delta_i = w_i - w_t.  The server keeps a momentum buffer:
    v_{t+1} = beta v_t + sum_i p_i Delta_i,     w_{t+1} = w_t + eta_g v_{t+1}.
beta = 0 is FedAvg.  The buffer is server state, so checkpoints keep it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedhop.common.algorithms.base import AlgorithmParams, Payload, ServerState, weighted_mean
from fedhop.common.algorithms.fedavg import FedAvg


@dataclass
class FedAvgMParams(AlgorithmParams):
    beta: float = 0.9   # [algorithm] beta = ...


class FedAvgM(FedAvg):
    name = "server_momentum"
    Params = FedAvgMParams

    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        state.extra.update({f"momentum.{k}": torch.zeros_like(v) for k, v in params.items()})
        return state

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        for name, w in state.params.items():
            v = state.extra[f"momentum.{name}"]
            v.mul_(self.params.beta).add_(weighted_mean(aggregate, name))
            w.add_(v, alpha=self.cfg.server_lr)
