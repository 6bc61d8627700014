"""FedAvg (McMahan et al. 2017) with a server learning rate.

Client: start from the broadcast model w_t, run local SGD (steps or epochs), send
Delta_i = w_i - w_t and the weight n_i (samples) or 1 (uniform weighting).
Server: w_{t+1} = w_t + eta_g * sum_i p_i Delta_i,  p_i = n_i / sum_{j in S_t} n_j.
With eta_g = 1 this is the sample-weighted model average of the original paper.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from fedhop.common.algorithms.base import Algorithm, AlgorithmParams, ClientContext, Payload, ServerState, weighted_mean
from fedhop.common.algorithms.local import get_params, local_sgd, set_params
from fedhop.common.algorithms.vectorized import every_parameter, local_sgd_together
from fedhop.common.wire.message import CHUNK, COMPUTE_KEY, WEIGHT_KEY, _top, tensor_finite


@dataclass
class FedAvgParams(AlgorithmParams):
    pass


class FedAvg(Algorithm):
    name = "fedavg"
    partial_exchange = True   # the subclasses (FedAvgM, FedAdam/Yogi/Adagrad, FedProx, FedExP) too
    Params: type[AlgorithmParams] = FedAvgParams

    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        set_params(ctx.model, message.tensors)
        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay)
        local = get_params(ctx.model)
        delta = {name: local[name] - message.tensors[name] for name in message.tensors}
        return Payload(tensors=delta, scalars={"weight": self.client_weight(ctx),
                                               "train_loss": stats.mean_loss,
                                               "local_steps": stats.steps})

    @classmethod
    def trains_together(cls) -> bool:
        """FedAvg's local solver, and its subclasses' where they keep it (FedAvgM, FedAdam, ...)."""
        return cls.client_update is FedAvg.client_update

    def proximal_mu(self) -> float:
        """The weight of a proximal term in the local objective (FedProx's mu; none here)."""
        return 0.0

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client at once (common/algorithms/vectorized.py): each
        message must carry every parameter (model.exchange = "all"); a frozen one's delta is 0."""
        every_parameter(ctxs, messages)
        mu = self.proximal_mu()

        def prox(name: str, p: torch.Tensor, g: torch.Tensor, start: torch.Tensor, rows) -> torch.Tensor:
            return g + mu * (p - start)   # FedProx, Eq. 2: the gradient of mu/2 ||w - w_t||^2

        start, final, stats, seconds = local_sgd_together(ctxs, [m.tensors for m in messages], self.cfg.lr,
                                                          self.cfg.batch_size, self.cfg.weight_decay,
                                                          prox if mu > 0 else None)
        delta = {name: final[name] - start[name] for name in start}   # Delta_i = w_i - w_t, row i
        return [Payload(tensors={name: d[i] for name, d in delta.items()},
                        scalars={"weight": self.client_weight(ctx), "train_loss": stats[i].mean_loss,
                                 "local_steps": stats[i].steps, COMPUTE_KEY: seconds[i]})
                for i, ctx in enumerate(ctxs)]

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        for name, w in state.params.items():
            w.add_(weighted_mean(aggregate, name), alpha=self.cfg.server_lr)

    def server_update_checked(self, state: ServerState, aggregate: Payload, round: int) -> str | None:
        """`server_update`, made only where every new parameter is finite; otherwise the state is
        left as it was and the reason returned (common/processors/validation.py `finite_streamed`: no copy of
        the state to roll back to).  Where max |w| + eta_g max |sum_i p_i Delta_i| stays below the
        dtype's largest value no element can overflow; near it every new element is computed
        piece by piece and checked before any is written.  With eta_g = 1 the step is made piece
        by piece too, through a small scratch buffer instead of a model-sized weighted mean: the
        same two elementwise operations, the same bits."""
        lr, total = self.cfg.server_lr, float(aggregate.scalars[WEIGHT_KEY])
        for name, w in state.params.items():
            if not w.is_floating_point():
                continue
            agg = aggregate.tensors[name]
            limit = torch.finfo(w.dtype).max
            reach = ((_top(w) + abs(lr) * _top(agg) / abs(total)) * (1 + 8 * torch.finfo(w.dtype).eps)
                     if total else math.inf)
            if reach <= limit:
                continue
            for w_piece, a_piece, scratch in _pieces(w, agg):
                torch.div(a_piece, total, out=scratch)
                if not tensor_finite(torch.add(w_piece, scratch, alpha=lr, out=scratch)):
                    return f"the new model's tensor '{name}' holds NaN or Inf"
        for name, w in state.params.items():
            agg = aggregate.tensors[name]
            if lr != 1.0 or not _piecewise(w, agg):
                w.add_(weighted_mean(aggregate, name), alpha=lr)
                continue
            for w_piece, a_piece, scratch in _pieces(w, agg):   # w += eta_g (sum_i p_i Delta_i) / W
                w_piece.add_(torch.div(a_piece, total, out=scratch), alpha=lr)
        return None


def _piecewise(w: torch.Tensor, agg: torch.Tensor) -> bool:
    return (w.numel() > CHUNK and w.shape == agg.shape and w.dtype == agg.dtype and w.device.type == "cpu"
            and agg.device.type == "cpu" and w.is_contiguous() and agg.is_contiguous())


def _pieces(w: torch.Tensor, agg: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(w piece, aggregate piece, scratch piece) over CHUNK-element pieces (whole, for a small or
    non-contiguous tensor: the scratch is then its size)."""
    if not _piecewise(w, agg):
        yield w, agg, torch.empty_like(w)
        return
    a, b = w.view(-1), agg.reshape(-1)
    scratch = torch.empty(CHUNK, dtype=w.dtype)
    for s in range(0, a.numel(), CHUNK):
        e = min(s + CHUNK, a.numel())
        yield a[s:e], b[s:e], scratch[:e - s]
REGISTER = [FedAvg]
