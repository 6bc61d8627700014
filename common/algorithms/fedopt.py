"""Adaptive server optimizers: FedAdagrad, FedYogi, FedAdam (Reddi et al. 2021, "Adaptive
Federated Optimization", Algorithm 2) and FedAvgM (server momentum, Hsu et al. 2019).

Clients are FedAvg clients: local SGD from x_t, reply Delta_i = x_i - x_t (the model change,
pointing downhill) and the weight (n_i, or 1 under `weighting = "uniform"`).  The server treats
the weighted mean Delta_t = sum_i p_i Delta_i as a negative pseudo-gradient (Algorithm 2, line 9):

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t                                (line 10)
    FedAdagrad: v_t = v_{t-1} + Delta_t^2                                    (line 11)
    FedYogi:    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)   (line 12)
    FedAdam:    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                  (line 13)
    x_{t+1}   = x_t + eta m_t / (sqrt(v_t) + tau)                           (line 14)

eta is `algorithm.server_lr`; no bias correction (as in the paper).  The paper initialises
v_{-1} >= tau^2; the default `v0 = 1e-6` is tau^2 for the default tau (Flower starts at 0).
FedAvgM (Hsu et al. 2019, Algorithm "FedAvgM"): m_t = beta m_{t-1} + Delta_t,
x_{t+1} = x_t + eta m_t (Nesterov variant: x_{t+1} = x_t + eta (beta m_t + Delta_t)).

Server state m, v lives in `ServerState.extra` ("fedopt_m.NAME", "fedopt_v.NAME"), created
at `init_state`, so checkpoints hold it from round 0.  Hierarchical: the replies are plain
weighted deltas, so an edge's reduction is a partial sum and the server step sees the same
Delta_t as in a star run (HierFAVG's kappa2 > 1: the edge's total model change, base.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedhop.common.algorithms.base import AlgorithmParams, Payload, ServerState, weighted_mean
from fedhop.common.algorithms.fedavg import FedAvg

M_PREFIX = "fedopt_m."
V_PREFIX = "fedopt_v."


def _check_beta(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"algorithm.{name} = {value} must be in [0, 1)")


@dataclass
class FedAdamParams(AlgorithmParams):
    """[algorithm] keys of fedadam and fedyogi (Reddi et al. 2021, Algorithm 2).

    `beta1`: beta_1, the decay of the server's first moment (momentum); must be < 1
    `beta2`: beta_2, the decay of the server's second moment; must be < 1
    """

    beta1: float = field(default=0.9, metadata={"min": 0.0, "max_exclusive": 1.0})
    beta2: float = field(default=0.99, metadata={"min": 0.0, "max_exclusive": 1.0})
    tau: float = field(default=1e-3, metadata={"min_exclusive": 0.0})     # adaptivity (epsilon)
    v0: float = field(default=1e-6, metadata={"min": 0.0})                # v_{-1}; paper: >= tau^2

    def __post_init__(self) -> None:
        _check_beta("beta1", self.beta1)
        _check_beta("beta2", self.beta2)


@dataclass
class FedAdagradParams(AlgorithmParams):
    """[algorithm] keys of fedadagrad (Reddi et al. 2021, Algorithm 2).

    `beta1`: beta_1, the decay of the server's first moment (momentum); must be < 1
    `tau`: tau, the adaptivity (epsilon) of the server step
    `v0`: v_{-1}, the initial second moment (paper: >= tau^2)
    """

    beta1: float = field(default=0.9, metadata={"min": 0.0, "max_exclusive": 1.0})
    tau: float = field(default=1e-3, metadata={"min_exclusive": 0.0})
    v0: float = field(default=1e-6, metadata={"min": 0.0})

    def __post_init__(self) -> None:
        _check_beta("beta1", self.beta1)


class _AdaptiveServer(FedAvg):
    """FedAvg clients, Algorithm 2 server.  Subclasses define `second_moment`."""

    name = "_adaptive"
    Params: type[AlgorithmParams] = FedAdamParams
    params: FedAdamParams | FedAdagradParams

    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        for name, w in state.params.items():
            state.extra[M_PREFIX + name] = torch.zeros_like(w)
            state.extra[V_PREFIX + name] = torch.full_like(w, self.params.v0)
        return state

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        p = self.params
        for name, x in state.params.items():
            delta = weighted_mean(aggregate, name)                         # Delta_t (line 9)
            m = state.extra.setdefault(M_PREFIX + name, torch.zeros_like(x))
            v = state.extra.setdefault(V_PREFIX + name, torch.full_like(x, p.v0))
            m.mul_(p.beta1).add_(delta, alpha=1.0 - p.beta1)               # line 10
            self.second_moment(v, delta * delta)                           # lines 11-13
            x.add_(m / (v.sqrt() + p.tau), alpha=self.cfg.server_lr)       # line 14


class FedAdagrad(_AdaptiveServer):
    name = "fedadagrad"
    Params = FedAdagradParams
    params: FedAdagradParams

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.add_(delta_sq)                                                   # line 11


class FedYogi(_AdaptiveServer):
    name = "fedyogi"
    Params = FedAdamParams
    params: FedAdamParams

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.sub_((1.0 - self.params.beta2) * delta_sq * torch.sign(v - delta_sq))   # line 12


class FedAdam(_AdaptiveServer):
    name = "fedadam"
    Params = FedAdamParams
    params: FedAdamParams

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.mul_(self.params.beta2).add_(delta_sq, alpha=1.0 - self.params.beta2)   # line 13


@dataclass
class FedAvgMParams(AlgorithmParams):
    """[algorithm] keys of fedavgm (FedAvg with server momentum, Hsu et al. 2019).

    `nesterov`: Nesterov momentum at the server (x + eta (beta m + Delta)) instead of heavy ball

    `momentum`: beta, the server momentum (Hsu et al. try 0.7 to 0.997); must be < 1
    """

    momentum: float = field(default=0.9, metadata={"min": 0.0, "max_exclusive": 1.0})   # Hsu et al.: beta in {0.7..0.997}
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_beta("momentum", self.momentum)


class FedAvgM(FedAvg):
    """FedAvg with server momentum: m_t = beta m_{t-1} + Delta_t, x_{t+1} = x_t + eta m_t."""

    name = "fedavgm"
    Params = FedAvgMParams
    params: FedAvgMParams

    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        for name, w in state.params.items():
            state.extra[M_PREFIX + name] = torch.zeros_like(w)
        return state

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        beta = self.params.momentum
        for name, x in state.params.items():
            delta = weighted_mean(aggregate, name)
            m = state.extra.setdefault(M_PREFIX + name, torch.zeros_like(x))
            m.mul_(beta).add_(delta)
            step = m * beta + delta if self.params.nesterov else m
            x.add_(step, alpha=self.cfg.server_lr)


REGISTER = [FedAdagrad, FedYogi, FedAdam, FedAvgM]
