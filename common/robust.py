"""Byzantine-robust aggregation rules (`security.aggregation`), for runs whose participants
cannot all be trusted.

The default reduction (`reduce_payloads`, "mean") is the weighted mean of the clients'
updates: one client that sends a large update moves the model as far as it likes.  The rules
here replace the weighted sum of each `wsum` tensor by a statistic that a minority of
arbitrary values cannot drag far:

- "median": the coordinate-wise median of the n updates (Yin, Chen, Ramchandran, Bartlett,
  "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018,
  Definition 1 "coordinate-wise median").  numpy's convention: the mean of the two middle
  values when n is even.
- "trimmed_mean": per coordinate, drop the k = floor(trim * n) largest and k smallest values
  and average the rest (same paper, Definition 2 "coordinate-wise trimmed mean", beta = trim).
- "krum": the one update whose summed squared distance to its n - f - 2 nearest neighbours is
  smallest (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with Adversaries:
  Byzantine Tolerant Gradient Descent", NeurIPS 2017, section 4, score s(i) = sum over the
  n - f - 2 closest j of ||V_i - V_j||^2); needs n >= 2f + 3.

Each rule is unweighted over the updates it sees (a client's sample count is what an attacker
would inflate).  The result is returned in the shape the algorithms expect from `aggregate`:
each robust tensor multiplied by the total weight W, so `weighted_mean(aggregate, name)` (the
server step's sum_i w_i x_i / W) reads the robust value.  A partial aggregate from an edge
(carrying `num_results`) enters as its own mean (tensor / weight), so hierarchical runs apply the
rule at the edges over their clients and again at the server over the edges' robust means.
Where a round has too few updates for the rule (trimmed mean: n <= 2k; Krum: n < 2f + 3) the
coordinate-wise median is used instead, which needs none.
"""
from __future__ import annotations

import logging
import math
from typing import Iterable, Mapping

import torch

from fedhop.common.algorithms.base import COUNT_KEY, WEIGHT_KEY, Payload, ReduceOp, reduce_payloads

log = logging.getLogger("fedhop.robust")

RULES = ("mean", "median", "trimmed_mean", "krum")


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 of an (n, ...) stack; the mean of the two middle values for even n."""
    n = stack.shape[0]
    ordered = torch.sort(stack, dim=0).values
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trimmed_mean(stack: torch.Tensor, trim: float) -> torch.Tensor:
    """Mean over dim 0 after dropping the floor(trim * n) largest and smallest values per coordinate."""
    n = stack.shape[0]
    k = int(math.floor(trim * n))
    if n - 2 * k < 1:
        return coordinate_median(stack)
    ordered = torch.sort(stack, dim=0).values
    return ordered[k:n - k].mean(dim=0)


def krum_index(vectors: torch.Tensor, f: int) -> int:
    """Index of the row of an (n, d) matrix with the smallest Krum score (ties: the lowest index)."""
    n = vectors.shape[0]
    closest = n - f - 2
    d2 = torch.cdist(vectors.double(), vectors.double()).pow(2)
    scores = []
    for i in range(n):
        others = torch.cat([d2[i, :i], d2[i, i + 1:]])
        scores.append(float(torch.sort(others).values[:closest].sum()))
    return min(range(n), key=lambda i: (scores[i], i))


def _own_value(p: Payload, name: str) -> torch.Tensor:
    """A payload's update for a `wsum` tensor: a client's as sent, a partial's as its weighted mean."""
    t = p.tensors[name]
    if COUNT_KEY in p.scalars:
        w = float(p.scalars[WEIGHT_KEY])
        return t / w if w > 0 else torch.zeros_like(t)
    return t


def robust_reduce(payloads: list[Payload], ops: Mapping[str, ReduceOp], rule: str, *,
                  trim: float = 0.1, krum_f: int = 1) -> Payload:
    """`reduce_payloads` with the `wsum` tensors combined by `rule` (module docstring)."""
    out = reduce_payloads(payloads, ops)
    if rule == "mean":
        return out
    names = [n for n in payloads[0].tensors if ops.get(n, "wsum") == "wsum"
             and all(n in p.tensors for p in payloads)]
    if not names:
        return out
    total = float(out.scalars[WEIGHT_KEY])
    n = len(payloads)
    if rule == "krum" and n < 2 * krum_f + 3:
        log.warning("krum with f = %d needs at least %d updates, got %d: coordinate-wise median instead",
                    krum_f, 2 * krum_f + 3, n)
        rule = "median"
    if rule == "krum":
        flat = torch.stack([torch.cat([_own_value(p, nm).reshape(-1).double() for nm in names]) for p in payloads])
        chosen = payloads[krum_index(flat, krum_f)]
        for nm in names:
            out.tensors[nm] = (_own_value(chosen, nm) * total).to(out.tensors[nm].dtype)
        return out
    for nm in names:
        stack = torch.stack([_own_value(p, nm).double() for p in payloads])
        value = coordinate_median(stack) if rule == "median" else trimmed_mean(stack, trim)
        out.tensors[nm] = (value * total).to(out.tensors[nm].dtype)
    return out


class RobustAggregate:
    """An algorithm's `aggregate` with a robust rule (installed by `build_algorithm`)."""

    def __init__(self, ops: Mapping[str, ReduceOp], rule: str, trim: float, krum_f: int) -> None:
        self.ops, self.rule, self.trim, self.krum_f = ops, rule, trim, krum_f

    def __call__(self, replies: Iterable[tuple[int, Payload]]) -> Payload:
        return robust_reduce([p for _, p in replies], self.ops, self.rule, trim=self.trim, krum_f=self.krum_f)
