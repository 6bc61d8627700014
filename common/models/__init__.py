"""Models: plain torch.nn modules with stable parameter names and seeded initialisation, and the
table of built-in kinds.

Each module of this package that defines models lists its kinds in a module-level
`REGISTER = {"kind": build, ...}`; `MODELS` is a common/util/registry.py `Registry` (the shape of
every family's table) that finds them by scanning the package: adding a model is a module here plus its name among
model.kind's choices (common/config/schema.py, which sits below this layer; tests/test_model_registry.py
checks that the two agree).  A builder has
the signature of a user's model factory, `build(input_shape, n_outputs, **options) -> nn.Module`,
so a built-in kind and a plug-in (model.factory, an import path or a `fedhop.models` entry point)
are found by the same lookup (`MODELS.get`) and called the same way; the built-ins receive the [model] keys `hidden`, `bias` and `task` as
options and ignore those they do not use.

`build_model` constructs a model inside `torch.random.fork_rng()` after `torch.manual_seed`, so
the same seed gives the same initial parameters in every process and the caller's global RNG
is left untouched.  That RNG is one per process, so builds are serialised by a lock: threads of
one process (the in-memory transport's clients, a client process's hosts) that built at once
would reseed it under each other and draw different "seeded" parameters.  Parameter names
(state_dict keys) are fixed by the attribute names in the modules; the wire format and
checkpoints rely on them.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
from torch import nn

from fedhop.common.util.plugins import check_call
from fedhop.common.util.registry import Registry

#: held while a model is built under the process's global RNG (see the module's docstring)
_BUILD_LOCK = threading.RLock()   # re-entrant: a user's model factory may build a built-in model inside

#: build(input_shape, n_outputs, **options) -> nn.Module: a built-in kind's builder or a user's factory
ModelBuilder = Callable[..., nn.Module]

#: model.kind -> builder (the modules' REGISTER tables), and model.factory's plug-ins by reference
MODELS: Registry[ModelBuilder] = Registry("model", __name__, "models", what="function", order=lambda kind, _: kind)


def registry() -> dict[str, ModelBuilder]:
    """model.kind -> builder, over every module of this package that has a `REGISTER` table."""
    return MODELS.builtins()


def model_kinds() -> list[str]:
    """The built-in model kinds, sorted (the choices of model.kind)."""
    return MODELS.names()


def zero_(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def build_model(kind: str, input_shape: Sequence[int], n_outputs: int,
                hidden: Sequence[int] = (64,), init: str = "default", seed: int = 0,
                *, bias: bool = True, task: str = "classification", factory: str = "",
                factory_args: dict | None = None) -> nn.Module:
    """A fresh model of `kind` for inputs of shape `input_shape` (without the batch dim).

    kind: a built-in kind (`registry()`): "logreg", "mlp", "cnn", ... (classifiers with `n_outputs`
    logits), or "linear" (a regression model for `task == "regression"`, the same affine map as
    logreg otherwise).  factory: a user's model factory (an import path or a `fedhop.models` entry
    point, common/util/plugins.py), called as `factory(input_shape, n_outputs, **factory_args)`; it
    replaces `kind`.  init: "default" (torch's initialisation under `seed`) or "zeros".
    """
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be non-empty with positive sizes, got {tuple(input_shape)}")
    if init not in ("default", "zeros"):
        raise ValueError(f"model.init = {init!r} is not allowed (allowed: default, zeros)")
    build = MODELS.get(factory or kind)   # UnknownName (a ValueError) names the kinds; PluginError a bad plug-in
    if factory:
        check_call(build, factory, "model.factory_args", shape, int(n_outputs), **(factory_args or {}))   # before the call
    model: nn.Module
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        if factory:
            model = build(shape, int(n_outputs), **(factory_args or {}))
            if not isinstance(model, nn.Module):
                raise ValueError(f"model.factory = {factory!r} returned a {type(model).__name__}, not a "
                                 f"torch.nn.Module")
        else:
            model = build(shape, n_outputs, hidden=tuple(hidden), bias=bias, task=task)
    if init == "zeros":
        zero_(model)
    return model


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
