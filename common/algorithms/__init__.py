"""Algorithm registry.

Every module in this package that defines algorithms lists them in a module-level
`REGISTER = [ClassA, ClassB]`; each class's `name` is its config name.  `ALGORITHMS` is a
common/util/registry.py `Registry`, the shape every family's table has: it finds the modules by
scanning the package, so adding an algorithm touches no shared file, and a plug-in (an import path
"pkg.module:Class" or an entry point of group `fedhop.algorithms`) is found by the same lookup.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedhop.common.topologies import TopologySpec, builtin_specs, spec_for
from fedhop.common.topologies.graphs import topology_params
from fedhop.common.util.registry import Registry

if TYPE_CHECKING:
    from fedhop.common.algorithms.base import Algorithm


def _algorithm_plugin(ref: str, cls: Any) -> type[Algorithm]:
    from fedhop.common.algorithms.base import Algorithm  # local: base imports torch
    from fedhop.common.util.plugins import PluginError
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise PluginError(f"algorithm.name = {ref!r} is not a subclass of fedhop.common.algorithms.base.Algorithm")
    return cls


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", __name__, "algorithms", plugin=_algorithm_plugin)


def registry() -> dict[str, type[Algorithm]]:
    """The built-in algorithms by name (every module of this package imported)."""
    return ALGORITHMS.builtins()


def partial_exchange_algorithms() -> list[str]:
    """The built-in algorithms that can exchange a part of the model (`Algorithm.partial_exchange`)."""
    return [name for name, cls in registry().items() if cls.partial_exchange]


def algorithm_class(name: str) -> type[Algorithm]:
    """The Algorithm subclass registered under `name` (built in), or a user's plug-in: an import
    path "pkg.module:Class" or an entry point of group `fedhop.algorithms` (common/util/plugins.py).
    Unknown names raise UnknownName (a KeyError), plug-ins that do not load PluginError (a ValueError)."""
    return ALGORITHMS.get(name)


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
        algorithm.aggregate = RobustAggregate(  # type: ignore[method-assign]  # this instance's reduction
            algorithm.reply_reduce, rule, cfg.security.trim, cfg.security.krum_f, cfg.security.krum_m)
    from fedhop.common.privacy.mechanism import PrivateAggregate, enabled, settings
    if enabled(cfg):   # differential privacy (common/privacy/): clipped replies, the server's noise
        algorithm.aggregate = PrivateAggregate(  # type: ignore[method-assign]  # this instance's reduction
            algorithm.reply_reduce, settings(cfg), cfg.run.seed)
    return algorithm


# ----------------------------------------------------------------------------- the algorithm's config rules
def config_problem(cfg: Any) -> str | None:
    """Why the configured algorithm cannot run with the rest of `cfg` (one config-error line naming
    the key), or None.  The config loader raises it (common/config/rules.py) before the options are
    validated; an algorithm name that does not resolve is left to the options check, which names it.

    - a sequential algorithm (`Algorithm.sequential`: its model walks the edges) runs only on a
      topology whose spec says `sequential_algorithms` (its driver refuses the other algorithms);
    - a robust `security.aggregation` replaces the default weighted mean (common/engine/robust.py),
      so not the reduction of an algorithm that overrides `Algorithm.aggregate`;
    - `algorithm.regularizer` and `reg` (a composite term R(w)) only for an algorithm that applies
      it (`Algorithm.composite_term`); a built-in one that does not would silently ignore it;
    - a built-in minimax algorithm (descent on x, ascent on y) only on a built-in minimax task,
      and a minimax task only with a minimax algorithm or a plug-in (`minimax_problem`).
    """
    try:
        cls = algorithm_class(cfg.algorithm.name)
    except (KeyError, ValueError):   # an unknown name, a plug-in that does not import
        return None
    if getattr(cls, "sequential", False):
        spec = _spec_of(cfg.topology.kind)
        if not (spec is not None and spec.sequential_algorithms):
            allowed = ", ".join(k for k, s in builtin_specs().items() if s.sequential_algorithms)
            return (f"config key 'topology.kind': got '{cfg.topology.kind}', but algorithm '{cfg.algorithm.name}' "
                    f"walks one model over the edges and has no server step (allowed: {allowed})")
    privacy = getattr(getattr(cfg, "privacy", None), "mode", "none")
    if privacy != "none" and not exchanges_delta(cls):
        allowed = ", ".join(sorted(n for n, c in registry().items() if exchanges_delta(c)))
        return (f"config key 'privacy.mode': '{privacy}' clips and noises a model delta, but algorithm "
                f"'{cfg.algorithm.name}' does not reply with one delta per parameter reduced by weighted sum "
                f"(allowed: {allowed})")
    regularizer, reg = getattr(cfg.algorithm, "regularizer", "none"), getattr(cfg.algorithm, "reg", 0.0)
    if (regularizer != "none" or reg > 0) and cfg.algorithm.name in ALGORITHMS \
            and not getattr(cls, "composite_term", False):
        key, value = ("regularizer", repr(regularizer)) if regularizer != "none" else ("reg", str(reg))
        allowed = ", ".join(sorted(n for n, c in registry().items() if getattr(c, "composite_term", False)))
        return (f"config key 'algorithm.{key}': got {value}, but algorithm '{cfg.algorithm.name}' has no composite "
                f"term R(w) and would ignore it (one with: {allowed})")
    problem = minimax_problem(cfg, cls)
    if problem is not None:
        return problem
    rule = cfg.security.aggregation
    if rule != "mean" and cfg.algorithm.name in ALGORITHMS:
        from fedhop.common.algorithms.base import Algorithm  # local: base imports torch
        if cls.aggregate is not Algorithm.aggregate:
            return (f"config key 'security.aggregation': '{rule}' replaces the weighted mean, but algorithm "
                    f"'{cfg.algorithm.name}' reduces its replies its own way; use 'mean'")
    return None


def minimax_problem(cfg: Any, cls: type) -> str | None:
    """A built-in minimax algorithm trains a model's maximising part y by ascent, which only the
    minimax tasks have: on another built-in data set its clients would all fail at their first
    call.  Another built-in algorithm would descend on a minimax task's y.  A plug-in algorithm or
    data set may bring its own, so only built-in pairs are checked."""
    from fedhop.common.algorithms.minimax import MinimaxAlgorithm  # local: imports torch
    from fedhop.common.tasks import builtin_datasets
    from fedhop.common.tasks.minimax import REGISTER  # the tasks whose model has a maximising part y
    minimax_tasks = tuple(REGISTER)
    dataset, name = cfg.data.dataset, cfg.algorithm.name
    if name not in ALGORITHMS or dataset not in builtin_datasets():
        return None
    minimax = issubclass(cls, MinimaxAlgorithm)
    if minimax and dataset not in minimax_tasks:
        return (f"config key 'data.dataset': got '{dataset}', but algorithm '{name}' ascends on a model's "
                f"maximising part y, which only a minimax task has (allowed: {', '.join(minimax_tasks)})")
    if not minimax and dataset in minimax_tasks:
        allowed = ", ".join(sorted(n for n, c in registry().items() if issubclass(c, MinimaxAlgorithm)))
        return (f"config key 'algorithm.name': got '{name}', but data.dataset = '{dataset}' is a minimax "
                f"problem whose y must ascend (allowed: {allowed})")
    return None


def exchanges_delta(cls: type) -> bool:
    """Whether an algorithm's reply is exactly a model delta, one tensor per parameter reduced by
    weighted sum, and its server step moves the model by their mean: FedAvg and the subclasses that
    keep its reply and its reduction (FedProx, FedAvgM, FedAdam/Yogi/Adagrad), what the private
    mechanism (common/privacy/mechanism.py) can clip and noise."""
    from fedhop.common.algorithms.base import Algorithm  # local: base imports torch
    from fedhop.common.algorithms.fedavg import FedAvg
    return (isinstance(cls, type) and issubclass(cls, FedAvg) and cls.reply_spec is Algorithm.reply_spec
            and cls.aggregate is Algorithm.aggregate and cls.reply_reduce == {})


def edge_step_problem(cfg: Any) -> str | None:
    """More than one edge aggregation per server round (the topology spec's `edge_steps_key`, e.g.
    hierarchical's kappa2) needs an algorithm with an edge step (`Algorithm.edge_iterations`); the
    message, or None.  Reads the topology's validated params, so the loader asks after the options
    check."""
    spec = _spec_of(cfg.topology.kind)
    key = spec.edge_steps_key if spec is not None else None
    steps = getattr(topology_params(cfg), key, 1) if key else 1
    if steps <= 1:
        return None
    try:
        edge_step = getattr(algorithm_class(cfg.algorithm.name), "edge_iterations", True)
    except (KeyError, ValueError):   # an unknown name, a plug-in that does not import
        return None   # reported where the algorithm's options are checked
    if not edge_step:
        return (f"config key 'topology.{key}': got {steps}, but algorithm '{cfg.algorithm.name}' defines "
                f"no edge step between server rounds; use {key} = 1")
    return None


def _spec_of(kind: str) -> TopologySpec | None:
    """The spec of topology `kind`; None for a kind that is unknown or a plug-in that does not load
    (the config's options check reports it, naming the kind)."""
    try:
        return spec_for(kind)
    except (KeyError, ValueError):
        return None
