"""What a model exchanges: model.freeze (parameters the local solvers leave as built) and
model.exchange (which parameters travel and are aggregated).  An algorithm declares whether its
parties can exchange a part of the model (`Algorithm.partial_exchange`, common/algorithms/base.py);
the config loader refuses model.exchange != "all" for one that cannot."""
from __future__ import annotations

import fnmatch
import weakref
from typing import Any, Callable, Sequence

from torch import nn

EXCHANGE_CHOICES = ("all", "trainable")
#: the names of the parameters a model exchanges, set by `select_exchange`; absent: every parameter
EXCHANGED_ATTR = "_fedhop_exchanged"


class _Walk:
    """One walk of a model's modules: its named parameters, and what shows it still holds."""

    __slots__ = ("params", "modules")

    def __init__(self, model: nn.Module) -> None:
        self.params: list[tuple[str, nn.Parameter]] = list(model.named_parameters())
        modules = list(model.modules())
        # each module's children and parameters as they were: (their dicts, a copy of each)
        self.modules: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]] = [
            (m._modules, dict(m._modules), m._parameters, dict(m._parameters)) for m in modules]

    def holds(self) -> bool:
        for children, seen_children, params, seen_params in self.modules:
            if len(children) != len(seen_children) or len(params) != len(seen_params):
                return False
            for key, child in children.items():
                if seen_children.get(key) is not child:
                    return False
            for key, param in params.items():
                if seen_params.get(key) is not param:
                    return False
        return True


_WALKS: "weakref.WeakKeyDictionary[nn.Module, _Walk]" = weakref.WeakKeyDictionary()


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`list(model.named_parameters())`, kept per model and checked before each use: each
    module's children and parameters are still the objects they were (a module or parameter
    replaced, added or removed makes a new walk).  A client's round reads the list three times
    (load, train, update), and a walk over the modules costs more than the check."""
    walk = _WALKS.get(model)
    if walk is None or not walk.holds():
        walk = _WALKS[model] = _Walk(model)
    return walk.params


def exchanged_names(model: nn.Module) -> frozenset[str] | None:
    """The names of the parameters `model` exchanges, or None for every parameter."""
    return model.__dict__.get(EXCHANGED_ATTR)


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Set requires_grad = False on the parameters whose names match one of the glob `patterns`
    (fnmatch: `*` also crosses dots, so "layers.*" freezes every layer); returns their names.
    A pattern that matches no parameter is a ValueError naming it."""
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"model.freeze: pattern {pattern!r} matches no parameter of the model ({shown})")
    frozen = []
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def select_exchange(model: nn.Module, freeze: Sequence[str] = (), exchange: str = "all") -> nn.Module:
    """Freeze `freeze`'s parameters, then mark which parameters `model` exchanges (in place).

    exchange: "all" (every parameter travels, frozen ones too: no mark, today's messages),
    "trainable" (those with requires_grad after freezing: a factory's own frozen backbone
    counts too), or a plug-in `select(name, parameter) -> bool` by import path or fedhop.models
    entry point.  Whatever is not exchanged is frozen (requires_grad = False): it keeps the value
    every party built from the seeded init, the factory or a checkpoint, so a process hosting
    many logical clients never carries one client's update of it to the next.
    """
    if freeze:
        freeze_parameters(model, freeze)
    if exchange == "all":
        return model
    if exchange == "trainable":
        keep = [n for n, p in model.named_parameters() if p.requires_grad]
        if not keep:
            raise ValueError("model.exchange = 'trainable': every parameter is frozen, nothing is left to exchange "
                             "(loosen model.freeze)")
    else:
        select = load_selector(exchange)
        keep = [n for n, p in model.named_parameters() if bool(select(n, p))]
        if not keep:
            raise ValueError(f"model.exchange = {exchange!r} selects no parameter of the model, nothing is left to "
                             f"exchange")
        chosen = set(keep)
        for name, p in model.named_parameters():
            if name not in chosen:
                p.requires_grad_(False)
    model.__dict__[EXCHANGED_ATTR] = frozenset(keep)
    return model


def load_selector(ref: str) -> Callable[[str, nn.Parameter], bool]:
    """The user's selection `select(name, parameter) -> bool` named by `ref` (common/util/plugins.py,
    group fedhop.models, so a client's plug-in allow-list applies)."""
    from fedhop.common.util.plugins import check_call, load_plugin
    try:
        select = load_plugin(ref, "models")
    except LookupError:
        raise ValueError(f"model.exchange = {ref!r}: not all, trainable, an import path 'package.module:function' "
                         f"nor an entry point of group 'fedhop.models'") from None
    if not callable(select):
        raise ValueError(f"model.exchange = {ref!r} is a {type(select).__name__}, not a function (name, parameter) "
                         f"-> bool")
    check_call(select, ref, "model.exchange", "name", None)   # called as select(name, parameter)
    return select


def selects_part(model_cfg: Any) -> bool:
    """Whether a [model] section freezes or selects parameters (the default does neither)."""
    return bool(getattr(model_cfg, "freeze", ())) or getattr(model_cfg, "exchange", "all") != "all"


def with_model_selection(task: Any, model_cfg: Any) -> Any:
    """`task`, whose `build_model` now applies model.freeze and model.exchange (`select_exchange`)
    to every model it builds, whichever task kind it is; untouched under the defaults."""
    if not selects_part(model_cfg):
        return task
    build = task.build_model
    freeze, exchange = tuple(model_cfg.freeze), model_cfg.exchange

    def build_model() -> nn.Module:
        return select_exchange(build(), freeze, exchange)

    task.build_model = build_model   # the instance's own: the task's class and type checks stay as they were
    return task


def check_model_selection(cfg: Any) -> None:
    """Build the run's model once and apply model.freeze / model.exchange, so a pattern that matches
    nothing or a selection that leaves nothing to exchange is a ValueError before any process
    starts (`fedhop run`); nothing is built under the defaults."""
    if not selects_part(cfg.model):
        return
    from fedhop.common.tasks import build_task
    build_task(cfg).build_model()
