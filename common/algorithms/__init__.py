"""Algorithm registry.

Every module in this package that defines algorithms lists them in a module-level
`REGISTER = [ClassA, ClassB]`; each class's `name` is its config name.  Modules are found by
scanning the package, so adding an algorithm touches no shared file.
"""
from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedhop.common.algorithms.base import Algorithm

_NOT_ALGORITHMS = {"base", "local"}


@lru_cache(maxsize=1)
def registry() -> dict[str, type[Algorithm]]:
    found: dict[str, type[Algorithm]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _NOT_ALGORITHMS or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for cls in getattr(module, "REGISTER", []):
            if cls.name in found and found[cls.name] is not cls:
                raise RuntimeError(f"algorithm name '{cls.name}' registered twice "
                                   f"({found[cls.name].__module__} and {cls.__module__})")
            found[cls.name] = cls
    return found


def partial_exchange_algorithms() -> list[str]:
    """The built-in algorithms that can exchange a part of the model (`Algorithm.partial_exchange`)."""
    return [name for name, cls in registry().items() if cls.partial_exchange]


def algorithm_class(name: str):
    """The Algorithm subclass registered under `name` (built in), or a user's plug-in: an import
    path "pkg.module:Class" or an entry point of group `fedhop.algorithms` (common/util/plugins.py).
    Unknown names raise KeyError, plug-ins that do not load PluginError (a ValueError)."""
    algos = registry()
    if name in algos:
        return algos[name]
    from fedhop.common.algorithms.base import Algorithm
    from fedhop.common.util.plugins import PluginError, entry_point_names, load_plugin
    try:
        cls = load_plugin(name, "algorithms")
    except LookupError:
        allowed = sorted(set(algos) | set(entry_point_names("algorithms")))
        from fedhop.common.util.suggest import did_you_mean
        raise KeyError(f"algorithm.name: unknown algorithm '{name}'{did_you_mean(name, allowed)} "
                       f"(allowed: {', '.join(allowed)}, or an import path 'package.module:Class')") from None
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise PluginError(f"algorithm.name = {name!r} is not a subclass of fedhop.common.algorithms.base.Algorithm")
    return cls


def build_algorithm(cfg):
    """The configured algorithm with its validated hyper-parameters (`cfg` is a Config)."""
    cls = algorithm_class(cfg.algorithm.name)
    params = getattr(cfg.algorithm, "params", None)
    if params is None:
        params = cls.Params(**cfg.algorithm.options)
    algorithm = cls(cfg.algorithm, params)
    rule = getattr(getattr(cfg, "security", None), "aggregation", "mean")
    if rule != "mean":   # Byzantine-robust reduction (common/engine/robust.py), at the server and at every edge
        from fedhop.common.engine.robust import RobustAggregate
        algorithm.aggregate = RobustAggregate(algorithm.reply_reduce, rule, cfg.security.trim, cfg.security.krum_f,
                                              cfg.security.krum_m)
    return algorithm
