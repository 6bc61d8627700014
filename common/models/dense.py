"""Dense models: softmax and linear regression and the fully connected ReLU network (model.kind
linear, logreg, mlp).  Inputs of any shape are flattened."""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class _StackedLinear(torch.autograd.Function):
    """`stacked_linear` with a backward pass that gives the weight's gradient laid out as the
    weight, (m, out, in) contiguous: g^T h for each client, as `F.linear`'s backward computes
    one client's.  Autograd's own backward of `baddbmm(b, h, W^T)` computes h^T g and hands it
    back transposed in each row, and an elementwise step that reads it beside the contiguous
    parameters walks across rows of memory: for leaf_cnn's 6.4 M-weight layer that read, or the
    copy that avoids it, cost more than the layer's products (docs/vectorized.md)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        if bias is None:
            return torch.bmm(h, weight.transpose(1, 2))
        return torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        h, weight = ctx.saved_tensors
        wants_h, wants_weight, wants_bias = ctx.needs_input_grad
        return (torch.bmm(g, weight) if wants_h else None,                     # dL/dh = g W
                torch.bmm(g.transpose(1, 2), h) if wants_weight else None,     # dL/dW = g^T h
                g.sum(1) if ctx.has_bias and wants_bias else None)             # dL/db = sum_B g


def stacked_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of m clients at once: h (m, B, in), weight (m, out, in), bias (m, out) or None ->
    (m, B, out), client i's rows from its own weight and bias (`_StackedLinear`)."""
    return _StackedLinear.apply(h, weight, bias)


def stacked_forward(model: nn.Module) -> Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor] | None:
    """The model's `forward_stacked`, where the class that defines its `forward` defines it too
    (a subclass with a `forward` of its own and no `forward_stacked` beside it would otherwise be
    trained with its parent's) and, where that class says when its stacked forward pays
    (`forward_stacked_pays`, common/models/conv.py), it does for this model; None otherwise
    (the task's loss is then vmapped: common/algorithms/vectorized.py)."""
    owner = next((cls for cls in type(model).__mro__ if "forward" in vars(cls)), None)
    if owner is None or "forward_stacked" not in vars(owner):
        return None
    pays = vars(owner).get("forward_stacked_pays")
    if pays is not None and not pays(model):
        return None
    return model.forward_stacked   # type: ignore[return-value]  # checked just above


class LogReg(nn.Module):
    """Multinomial logistic regression: one affine map to the logits (input is flattened)."""

    def __init__(self, in_features: int, n_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))

    def forward_stacked(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`forward` of m parameter sets at once (common/algorithms/vectorized.py): every
        parameter stacked along a first dimension of m, x (m, B, ...) -> logits (m, B, classes)."""
        return stacked_linear(x.flatten(2), params["linear.weight"], params["linear.bias"])


class MLP(nn.Module):
    """Fully connected ReLU network; parameters `layers.<i>.{weight,bias}` and `out.*`."""

    def __init__(self, in_features: int, hidden: Sequence[int], n_classes: int) -> None:
        super().__init__()
        widths = [int(in_features), *[int(h) for h in hidden]]
        if any(w < 1 for w in widths[1:]):
            raise ValueError(f"model.hidden widths must be >= 1, got {list(hidden)}")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = nn.Linear(widths[-1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)
        for layer in self.layers:
            h = F.relu(layer(h))
        return self.out(h)

    def forward_stacked(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`forward` of m parameter sets at once (`LogReg.forward_stacked`)."""
        h = x.flatten(2)
        for i in range(len(self.layers)):
            h = F.relu(stacked_linear(h, params[f"layers.{i}.weight"], params[f"layers.{i}.bias"]))
        return stacked_linear(h, params["out.weight"], params["out.bias"])


class Linear(nn.Module):
    """Linear regression y = W x (+ b); with d_out == 1 the output is squeezed to (N,)."""

    def __init__(self, d_in: int, d_out: int = 1, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x.flatten(1))
        return out.squeeze(1) if out.shape[1] == 1 else out

    def forward_stacked(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`forward` of m parameter sets at once (`LogReg.forward_stacked`): (m, B) or (m, B, out)."""
        out = stacked_linear(x.flatten(2), params["linear.weight"], params.get("linear.bias"))
        return out.squeeze(2) if out.shape[2] == 1 else out


def build_linear(shape: tuple[int, ...], n_outputs: int, *, bias: bool = True, task: str = "classification",
                 **_: Any) -> nn.Module:
    """model.kind = "linear": the regression model y = W x (+ b) for a regression task, the same affine
    map as logreg (softmax regression) for a classifier."""
    features = math.prod(shape)
    return Linear(features, n_outputs, bias) if task == "regression" else LogReg(features, n_outputs)


def build_logreg(shape: tuple[int, ...], n_outputs: int, **_: Any) -> nn.Module:
    return LogReg(math.prod(shape), n_outputs)


def build_mlp(shape: tuple[int, ...], n_outputs: int, *, hidden: Sequence[int] = (64,), **_: Any) -> nn.Module:
    return MLP(math.prod(shape), list(hidden), n_outputs)


REGISTER = {"linear": build_linear, "logreg": build_logreg, "mlp": build_mlp}
