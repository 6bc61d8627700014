"""Sample-level DP-SGD inside a client (Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang,
"Deep Learning with Differential Privacy", CCS 2016, Algorithm 1): each local step's gradient is

    g~ = ( sum_{j in batch} g_j * min(1, C / ||g_j||_2) + N(0, (z C)^2 I) ) / B

with g_j the gradient of example j's loss (over every trainable parameter together), B the batch
size.  The per-example gradients come from torch.func (`vmap` over `grad` of the task's own loss
on a batch of one, the model called through `functional_call`), not from a hand-written backward.
The local solver (common/algorithms/local.py `local_sgd`) then steps with g~ as with any gradient
(weight decay and a proximal term, which do not read the data, are added after it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from fedhop.common.privacy.noise import GaussianSource


class _Bound(torch.nn.Module):
    """`model` called with the given tensors in place of its own (torch.func.functional_call)."""

    def __init__(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._model = [model]   # a list: not registered as a submodule
        self._tensors = tensors

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self._model[0], self._tensors, args, kwargs)


@dataclass
class SampleDP:
    """One client's DP-SGD for one round: the per-example bound C, the noise multiplier z, and the
    client's noise source (seeded ("privacy", "dpsgd", client, "round", r), or os.urandom)."""

    clip_norm: float
    z: float
    source: GaussianSource

    def gradients(self, model: torch.nn.Module, task: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Set each trainable parameter's `.grad` to g~ (module docstring); returns the batch's mean loss."""
        trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        fixed.update(dict(model.named_buffers()))

        def example_loss(params: dict[str, torch.Tensor], *example: torch.Tensor) -> torch.Tensor:
            one = tuple(t.unsqueeze(0) for t in example)
            return task.loss(_Bound(model, {**params, **fixed}), one)

        per = vmap(grad(example_loss), in_dims=(None, *([0] * len(batch))))(trainable, *batch)
        size = int(batch[0].shape[0])
        sq = torch.zeros(size, dtype=torch.float64, device=batch[0].device)
        for g in per.values():
            sq += g.reshape(size, -1).double().pow(2).sum(dim=1)
        norms = sq.sqrt()
        factors = torch.where(norms > self.clip_norm, self.clip_norm / norms.clamp_min(1e-300),
                              torch.ones_like(norms))
        for name, p in model.named_parameters():
            if name not in per:
                continue
            g = per[name]
            total = (g * factors.to(g.dtype).reshape(size, *([1] * (g.dim() - 1)))).sum(dim=0)
            if self.z > 0:
                total = total + self.source.like(total, self.z * self.clip_norm)
            p.grad = total / size
        with torch.no_grad():
            return task.loss(model, batch)
