"""The asynchronous server rules, on tensors, with no transport: the staleness functions, FedBuff's
buffer and FedAsync's mixing step (docs/async.md).  The driver (driver.py) feeds them the updates
in the order the clock decided; tests/test_async_fl.py replays the same equations in numpy.

Staleness.  An update computed from model version tau and applied when the server is at version
t has staleness t - tau (the number of server updates in between).  Xie et al. (2019, FedAsync,
Section 5.2 "staleness functions" beside Algorithm 1) weight it by

    constant:    s(t - tau) = 1
    polynomial:  s_a(t - tau) = (t - tau + 1)^(-a)
    hinge:       s_{a,b}(t - tau) = 1                          if t - tau <= b
                                  = 1 / (a (t - tau - b) + 1)  otherwise

and Nguyen et al. (2022, FedBuff) down-weight stale updates by 1 / sqrt(1 + staleness), the
polynomial function with a = 0.5.

FedBuff (Nguyen et al. 2022, Algorithm 1, the server's lines): each arriving client delta
Delta_i = x_i - x_{tau_i} is buffered; when K = `buffer_size` are in,

    x <- x + eta_g * (1/K) * sum_{i=1..K} s(t - tau_i) Delta_i,      t <- t + 1

(the paper writes the client's update as x_{tau} - x_i and subtracts it; the same step).

FedAsync (Xie et al. 2019, Algorithm 1, the updater's line): each arriving local model
x_new = x_tau + Delta is mixed in at once,

    x_t = (1 - a_t) x_{t-1} + a_t x_new,   a_t = alpha * s(t - tau),      t <- t + 1
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def staleness_weight(kind: str, staleness: int, a: float = 0.5, b: int = 4) -> float:
    """s(t - tau) of the module docstring for `staleness` = t - tau >= 0."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((staleness + 1.0) ** (-a))
    if kind == "hinge":
        return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    raise ValueError(f"unknown staleness function '{kind}' (allowed: constant, polynomial, hinge)")


@dataclass
class FedBuffBuffer:
    """FedBuff's server buffer: `add` the weighted deltas as they arrive; `ready` once K are in;
    `flush` applies x <- x + eta_g (1/K) sum_i s_i Delta_i to `params` in place and empties it.
    The sum is accumulated in arrival order (the order the driver decided and run.db records)."""

    size: int
    server_lr: float
    total: dict[str, torch.Tensor] = field(default_factory=dict)
    count: int = 0

    def add(self, delta: dict[str, torch.Tensor], weight: float) -> None:
        for name, d in delta.items():
            term = d * weight
            if name in self.total:
                self.total[name].add_(term)
            else:
                self.total[name] = term.clone()
        self.count += 1

    @property
    def ready(self) -> bool:
        return self.count >= self.size

    def flush(self, params: dict[str, torch.Tensor]) -> None:
        step = self.server_lr / self.size
        for name, w in params.items():
            if name in self.total:
                w.add_(self.total[name].to(w.dtype), alpha=step)
        self.total, self.count = {}, 0


def fedasync_mix(params: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], delta: dict[str, torch.Tensor],
                 alpha_t: float) -> None:
    """x <- (1 - a_t) x + a_t (x_tau + Delta) in place, x_tau the model the client was sent."""
    for name, w in params.items():
        if name in delta:
            local = sent[name] + delta[name].to(w.dtype)
            w.mul_(1.0 - alpha_t).add_(local, alpha=alpha_t)
