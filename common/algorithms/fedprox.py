"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks").

Client k approximately minimises the proximal local objective (Eq. 2)

    h_k(w; w_t) = F_k(w) + (mu/2) ||w - w_t||^2

by local SGD: each step uses g_k(w) + mu (w - w_t) (`local_sgd`'s grad hook).  It sends
Delta_k = w_k - w_t and its weight.  The server is FedAvg's: w_{t+1} = w_t + eta_g sum_k p_k Delta_k
(eta_g = server_lr, 1 in the paper).  mu defaults to 0.01 (the FedLi code's `fedprox_mu`; the
FedProx paper tunes mu in {0.001, 0.01, 0.1, 1}).  The traffic is FedAvg's.

Hierarchical: identical to FedAvg; with HierFAVG kappa2 > 1 the proximal centre of an edge
iteration is the edge's current model (the model the client received).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedhop.common.algorithms.base import WEIGHT_KEY, AlgorithmParams, ClientContext, Payload
from fedhop.common.algorithms.fedavg import FedAvg
from fedhop.common.algorithms.local import get_params, local_sgd, set_params


@dataclass
class FedProxParams(AlgorithmParams):
    """[algorithm] keys of fedprox.

    `mu`: mu, the weight of the proximal term mu/2 ||w - w_t||^2 in the clients' local objective
    """

    mu: float = field(default=0.01, metadata={"min": 0.0})


class FedProx(FedAvg):
    name = "fedprox"
    Params = FedProxParams
    params: FedProxParams

    @classmethod
    def trains_together(cls) -> bool:
        """FedAvg's vectorized solver with the proximal gradient ([algorithm] vectorized)."""
        return cls.client_update is FedProx.client_update

    def proximal_mu(self) -> float:
        return self.params.mu

    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        mu = self.params.mu
        set_params(ctx.model, message.tensors)
        start = {name: t.detach().clone() for name, t in message.tensors.items()}

        def prox(name: str, p: torch.nn.Parameter, g: torch.Tensor) -> torch.Tensor:
            return g + mu * (p - start[name])          # grad of h_k (Eq. 2)

        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay,
                          grad_hook=prox if mu > 0 else None)
        local = get_params(ctx.model)
        delta = {name: local[name] - start[name] for name in start}
        return Payload(tensors=delta, scalars={WEIGHT_KEY: self.client_weight(ctx), "train_loss": stats.mean_loss,
                                               "local_steps": stats.steps})


REGISTER = [FedProx]
