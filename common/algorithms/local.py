"""Local solvers shared by the algorithms: plain minibatch SGD with optional gradient hooks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from fedhop.common.algorithms.base import ClientContext
from fedhop.common.models.exchange import exchanged_names, named_parameters
from fedhop.common.numerics.sampling import batches_on, local_batches

GradHook = Callable[[str, torch.nn.Parameter, torch.Tensor], torch.Tensor]


def get_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters the model exchanges, by name (detached views): every parameter, or under
    model.exchange = "trainable" or a selection (common/models/exchange.py `select_exchange`) only the
    selected ones.  Everything that travels or is aggregated starts here, so the server state,
    the broadcast, the replies, their spec and the clients' state cover the same names."""
    names = exchanged_names(model)
    return {name: p.detach() for name, p in named_parameters(model) if names is None or name in names}


def _pairs(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(name, the model's parameter, params[name]) for each parameter the model exchanges; the
    shapes must match."""
    names = exchanged_names(model)
    for name, p in named_parameters(model):
        if names is not None and name not in names:
            continue
        src = params[name]
        if src.shape != p.shape:
            raise ValueError(f"parameter '{name}': got shape {tuple(src.shape)}, model has {tuple(p.shape)}")
        yield name, p, src


def bind_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Make the model's exchanged parameters `params`' tensors themselves, not copies of them
    (`load_state_dict(assign=True)`; each keeps the module's requires_grad).  The server's
    evaluation model bound to its state holds no model-sized memory of its own, and binding it
    never writes into a tensor, so no other holder of the old ones (a message being sent) sees a
    change.  A tensor of another dtype or device is bound as a converted copy, the values
    `set_params` would copy in."""
    bound = {name: src.detach() if (src.dtype, src.device) == (p.dtype, p.device)
             else src.detach().to(dtype=p.dtype, device=p.device, copy=True)
             for name, p, src in _pairs(model, params)}
    model.load_state_dict(bound, strict=False, assign=True)


def share_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Leave one copy of each exchanged parameter between `model` and `params` (the server's
    evaluation model and its state).  Where `params[name]` equals the model's tensor bit for bit
    (a fresh state, Algorithm.init_state's clone), the entry becomes the model's own tensor and
    the clone is dropped: the memory allocated last is the memory freed, which the next
    model-sized allocation (the round's accumulator) reuses.  Elsewhere (a resumed state) the
    model is bound to `params` (`bind_params`)."""
    differ = False
    for name, p, src in _pairs(model, params):
        if (src.dtype, src.device) == (p.dtype, p.device) and torch.equal(src, p.detach()):
            params[name] = p.detach()
        else:
            differ = True
    if differ:
        bind_params(model, params)


def set_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy `params` into the model's exchanged parameters (names and shapes must match); the
    parameters it does not exchange keep their values."""
    with torch.no_grad():
        for _, p, src in _pairs(model, params):
            p.copy_(src)


def whole_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`params` (the exchanged part) with the parameters `model` does not exchange added from the
    model itself (the frozen part), in the model's order: what model.safetensors holds.  Under
    model.exchange = "all", `params` itself."""
    if exchanged_names(model) is None:
        return params
    whole = {name: params[name] if name in params else p.detach() for name, p in model.named_parameters()}
    whole.update((name, t) for name, t in params.items() if name not in whole)
    return whole


def frozen_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters `model` does not exchange (none under model.exchange = "all")."""
    names = exchanged_names(model)
    if names is None:
        return {}
    return {name: p.detach() for name, p in model.named_parameters() if name not in names}


@dataclass
class LocalStats:
    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    last_loss: float = float("nan")

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else float("nan")


def local_sgd(ctx: ClientContext, lr: float, batch_size: int, weight_decay: float = 0.0,
              grad_hook: GradHook | None = None, lr_at: Callable[[int], float] | None = None) -> LocalStats:
    """Run this round's minibatch SGD steps on `ctx.model` in place.

    `grad_hook(name, param, grad)` may return a modified gradient (FedProx's proximal term,
    SCAFFOLD's correction); `lr_at(k)` gives the step size of local step k (default `lr`).
    The parameters' gradients are cleared at the end (`p.grad` is None): nothing reads the last
    step's, and a client process would otherwise keep a model's worth of them between rounds.
    """
    data = ctx.task.client_data(ctx.client_id)
    stats = LocalStats()
    on_device: list[torch.Tensor] = []   # a GPU's losses, read once after the loop: no sync per step
    params = [(n, p) for n, p in named_parameters(ctx.model) if p.requires_grad]
    tensors: list[torch.Tensor] = [p for _, p in params]
    fused = bool(tensors) and tensors[0].is_cuda and grad_hook is None and not weight_decay
    batches = local_batches(data.rows, batch_size, ctx.local_steps, ctx.local_epochs, ctx.generator)
    if data.tensors and not data.tensors[0].is_cpu:
        batches = batches_on(batches, data.tensors[0].device)
    for k, idx in enumerate(batches):
        batch = tuple([t[idx] for t in data.tensors])
        for _, p in params:   # Module.zero_grad(set_to_none=True) without its walk over the modules
            p.grad = None
        if ctx.sample_dp is not None:   # DP-SGD: p.grad is the clipped, noised mean of the per-example gradients
            loss = ctx.sample_dp.gradients(ctx.model, ctx.task, batch)
        else:
            loss = ctx.task.loss(ctx.model, batch, ctx.generator)
            loss.backward()
        step = lr_at(k) if lr_at is not None else lr
        with torch.no_grad():
            if fused:   # plain SGD on a GPU: one fused update of every parameter (the same arithmetic)
                torch._foreach_add_(tensors, [p.grad if p.grad is not None else torch.zeros_like(p) for p in tensors],
                                    alpha=-step)
            else:
                for name, p in params:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    if weight_decay:
                        g = g + weight_decay * p
                    if grad_hook is not None:
                        g = grad_hook(name, p, g)
                    p.add_(g, alpha=-step)
        stats.steps += 1
        stats.samples += int(idx.numel())
        if loss.is_cpu:
            value = float(loss.detach())
            stats.loss_sum += value
            stats.last_loss = value
        else:
            on_device.append(loss.detach())
    for _, p in params:   # the last step's gradients: a model's worth of memory, freed before the caller makes its update
        p.grad = None
    if on_device:
        values = torch.stack(on_device).double().cpu().tolist()
        for value in values:
            stats.loss_sum += value
        stats.last_loss = values[-1]
    return stats
