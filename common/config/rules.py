"""The config's compatibility rules: what a config may not combine, each one `ConfigError` line
naming the key.  The loader (common/config/parse.py `config_from_dict`) runs them in this order:

1. the model keys (`_check_model_factory`, `_check_model_exchange`): the factory and the exchange
   selector imported now, so a bad path is a config error before any process starts;
2. `_cross_checks`: the rules between keys of the config's own sections (clients, run, security,
   model, the topology's common keys, transport frames, device syntax), then the rules owned by
   what a key chooses, each the owner's `config_problem(cfg) -> str | None`:
   the robust aggregation's (common/engine/robust.py), the transport's
   (common/transport/factory.py), the algorithm's (common/algorithms/__init__.py), the
   compressors' (common/processors/compressors/__init__.py), [privacy]'s (common/privacy/rules.py);
3. (the options check, common/config/options.py)
4. `_topology_checks`: the topology kind's own `check` (topologies/<kind>/__init__.py) and the
   algorithm's rule on the spec's edge steps, both on the topology's validated params;
5. `_check_processors`: every [[processors]] entry built now.
"""
from __future__ import annotations

import copy
from typing import Any

from fedhop.common.algorithms import algorithm_class, edge_step_problem, partial_exchange_algorithms, registry
from fedhop.common.algorithms import config_problem as algorithm_problem
from fedhop.common.config.schema import WORKERS_AUTO, Config, ConfigError, resolve_clients_per_round
from fedhop.common.config.validate import _is_int, build_dataclass
from fedhop.common.privacy.rules import config_problem as privacy_problem
from fedhop.common.processors.compressors import compressor_class
from fedhop.common.processors.compressors import config_problem as compression_problem
from fedhop.common.security.secagg.settings import config_problem as secagg_problem
from fedhop.common.topologies import TopologySpec, spec_for
from fedhop.common.topologies.graphs import cluster_assignment
from fedhop.common.transport.factory import TRANSPORTS
from fedhop.common.transport.factory import config_problem as transport_problem
from fedhop.common.util.plugins import PluginError, check_call, entry_point_names, load_plugin


def _raise(problem: str | None) -> None:
    """An owner's rule broken (its `config_problem` gave a line): that line as the config error."""
    if problem:
        raise ConfigError(problem)


def _topology_spec(cfg: Config) -> TopologySpec | None:
    """The spec of cfg.topology.kind; None for a kind that is unknown or a plug-in that does not
    load (the options check after the cross checks reports it, naming the kind)."""
    try:
        return spec_for(cfg.topology.kind)
    except (KeyError, ValueError):
        return None


def _topology_checks(cfg: Config) -> None:
    """The kind's own checks (topologies/<kind>/__init__.py `check`) and the algorithm's rule on the
    edge steps the spec declares, on the topology's validated params."""
    spec = _topology_spec(cfg)
    if spec is not None and spec.check is not None:
        try:
            spec.check(cfg)
        except ValueError as exc:
            key, _, why = str(exc).partition(": ")
            raise ConfigError(f"config key '{key}': {why}") from None
    _raise(edge_step_problem(cfg))   # the algorithm's rule on the topology's edge steps
    _check_compression_layers(cfg)
    _check_downlink(cfg, spec)
    if spec is not None and not spec.coded_uploads and cfg.compression.up != "none":
        raise ConfigError(f"config key 'compression.up': topology.kind = '{cfg.topology.kind}' moves models by its "
                          f"own methods, which are not coded (allowed: 'none')")
    if spec is not None and not spec.ef21_uploads and cfg.compression.up != "none" \
            and cfg.compression.error_feedback == "ef21":
        raise ConfigError(f"config key 'compression.error_feedback': 'ef21' needs a parent that keeps each client's "
                          f"estimate, which topology.kind = '{cfg.topology.kind}' has not (allowed here: 'none', 'ef')")


def _check_compression_layers(cfg: Config) -> None:
    """`[compression] layers`: each value "plain" or a table of compression.up's keys, checked as
    the section's own (on the compressor's validated params, so after the options check)."""
    comp = cfg.compression
    params = getattr(comp, "params", None)   # the compressor, set by the options check
    for pattern, value in comp.layers.items():
        where = f"compression.layers.{pattern!r}"
        if value == "plain":
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{where}': got {value!r}, allowed: \"plain\" or a table of "
                              f"compression.up's keys such as {{ratio = 0.1}}")
        if params is None:
            raise ConfigError(f"config key '{where}': a table of compressor keys needs compression.up (it is 'none')")
        build_dataclass(type(params), {**comp.options, **value}, where)


def _check_downlink(cfg: Config, spec: TopologySpec | None) -> None:
    """`compression.down`: "none", "same" (compression.up's compressor and keys) or a compressor
    with `compression.down_keys`; sets `compression.down_params` (the compressor, or None)."""
    comp = cfg.compression
    down = comp.down
    comp.down_params = None   # type: ignore[attr-defined]
    if down == "none":
        if comp.down_keys:
            raise ConfigError("config key 'compression.down_keys': needs a compressor (compression.down is 'none')")
        return
    if spec is None or not spec.coded_broadcasts:
        raise ConfigError(f"config key 'compression.down': topology.kind = '{cfg.topology.kind}' does not send its "
                          f"broadcast in train calls, which coded broadcasts need (star and hierarchical do; "
                          f"allowed here: 'none')")
    if down == "same":
        if comp.up == "none" or getattr(comp, "params", None) is None:
            raise ConfigError("config key 'compression.down': 'same' needs compression.up (it is 'none')")
        if comp.down_keys:
            raise ConfigError("config key 'compression.down_keys': 'same' takes compression.up's keys; name the "
                              "compressor in compression.down to give it keys of its own")
        comp.down_params = comp.params   # type: ignore[attr-defined]
        return
    try:
        cls = compressor_class(down)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"config key 'compression.down': {exc.args[0] if exc.args else exc}") from None
    if cls is None:
        return
    params, _ = build_dataclass(cls, dict(comp.down_keys), "compression.down_keys")
    comp.down_params = params   # type: ignore[attr-defined]


def _cross_checks(cfg: Config) -> None:
    """The rules between keys of the config's own sections, then its owners' rules (module docstring)."""
    count = cfg.clients.count
    per = cfg.clients.per_round
    if isinstance(per, float):
        if not 0 < per <= 1:
            raise ConfigError(f"config key 'clients.per_round': got {per}, a fraction must be in (0, 1]")
    elif not 1 <= per <= count:
        raise ConfigError(f"config key 'clients.per_round': got {per}, must be between 1 and clients.count = {count}")
    if isinstance(cfg.run.workers, str) and cfg.run.workers != WORKERS_AUTO:
        raise ConfigError(f"config key 'run.workers': got {cfg.run.workers!r}, expected a number of worker processes "
                          f"(0: one per CPU core, 1: none) or \"{WORKERS_AUTO}\"")
    mr = cfg.run.min_results
    if isinstance(mr, float) and not 0 < mr <= 1:
        raise ConfigError(f"config key 'run.min_results': got {mr}, a fraction must be in (0, 1]")
    if _is_int(mr) and mr > resolve_clients_per_round(cfg):
        raise ConfigError(f"config key 'run.min_results': got {mr}, more than the {resolve_clients_per_round(cfg)} "
                          f"clients sampled per round (clients.per_round = {per})")
    sec = cfg.security
    if sec.aggregation != "mean":   # the robust rule's own checks
        from fedhop.common.engine.robust import config_problem as robust_problem  # local: robust imports torch
        _raise(robust_problem(cfg))
    _device_checks(cfg)
    if sec.heartbeat_timeout <= sec.heartbeat_interval:
        raise ConfigError(f"config key 'security.heartbeat_timeout': got {sec.heartbeat_timeout}, must exceed "
                          f"security.heartbeat_interval = {sec.heartbeat_interval}")
    if sec.mtls and not sec.certs_dir:
        raise ConfigError("config key 'security.mtls': true needs security.certs_dir (make one with "
                          "`fedhop certs DIR --nodes ...`)")
    if sec.backoff_cap < sec.backoff_base:
        raise ConfigError(f"config key 'security.backoff_cap': got {sec.backoff_cap}, must be >= "
                          f"security.backoff_base = {sec.backoff_base}")
    hidden = cfg.model.hidden
    if not all(_is_int(h) and h >= 1 for h in hidden):
        raise ConfigError(f"config key 'model.hidden': got {hidden!r}, must be a list of ints >= 1")
    steps = cfg.algorithm.local_steps
    if isinstance(steps, list):
        if len(steps) != count or not all(_is_int(s) and s >= 0 for s in steps):
            raise ConfigError(f"config key 'algorithm.local_steps': a list must hold clients.count = {count} "
                              f"non-negative ints, got {steps!r}")
    elif steps < 0:
        raise ConfigError(f"config key 'algorithm.local_steps': got {steps}, must be >= 0")
    idle = steps == 0 if not isinstance(steps, list) else 0 in steps
    if idle and cfg.algorithm.local_epochs == 0:   # a client with no step has no training loss: the run failed as diverged
        raise ConfigError("config key 'algorithm.local_epochs': got 0 with algorithm.local_steps = 0"
                          f"{' for some clients' if isinstance(steps, list) else ''}: those clients would train no "
                          "step; set algorithm.local_epochs >= 1 or algorithm.local_steps >= 1")
    topo = cfg.topology
    spec = _topology_spec(cfg)
    edged = spec is not None and spec.edges   # the run has edge processes
    if edged and topo.edges < 1:
        raise ConfigError(f"config key 'topology.edges': got {topo.edges}, must be >= 1 for "
                          f"topology.kind = '{topo.kind}'")
    if spec is not None and not edged and not spec.edges_optional:
        if topo.edges:
            raise ConfigError(f"config key 'topology.edges': got {topo.edges}, but topology.kind = '{topo.kind}' "
                              f"runs no edge servers ({_edge_kinds()}); remove the key or choose one of those")
        if topo.assignment != "blocks":
            raise ConfigError(f"config key 'topology.assignment': got {topo.assignment!r}, but topology.kind = "
                              f"'{topo.kind}' runs no edge servers to assign clients to ({_edge_kinds()})")
    if edged and topo.edges > count:
        raise ConfigError(f"config key 'topology.edges': got {topo.edges}, more edges than clients.count = {count} "
                          f"(an edge without clients)")
    tr = cfg.transport
    if tr.max_message_bytes < tr.chunk_bytes + 1024:
        raise ConfigError(f"config key 'transport.chunk_bytes': got {tr.chunk_bytes}, but a frame must fit in "
                          f"transport.max_message_bytes = {tr.max_message_bytes} with 1024 bytes of header")
    if isinstance(topo.assignment, list):
        groups = topo.assignment
        if len(groups) != topo.edges:
            raise ConfigError(f"config key 'topology.assignment': {len(groups)} client lists for "
                              f"topology.edges = {topo.edges}")
        for e, group in enumerate(groups):
            if not isinstance(group, list) or not all(_is_int(c) for c in group):
                raise ConfigError(f"config key 'topology.assignment': entry {e} must be a list of client ids, "
                                  f"got {group!r}")
        flat = [c for g in groups for c in g]
        if sorted(flat) != list(range(count)):
            raise ConfigError(f"config key 'topology.assignment': must list each client id 0..{count - 1} exactly "
                              f"once, got {groups!r}")
    elif topo.assignment not in ("blocks", "shuffled"):
        raise ConfigError(f"config key 'topology.assignment': got {topo.assignment!r}, allowed: blocks, shuffled, "
                          f"or a list of client-id lists")
    _check_vectorized(cfg)
    _raise(transport_problem(cfg))   # the transport's rules
    _raise(algorithm_problem(cfg))   # the algorithm's rules
    _raise(compression_problem(cfg))   # the compressors' rules (common/processors/compressors/__init__.py)
    per_round, where = _secagg_group(cfg, spec)
    _raise(secagg_problem(cfg, per_round, tuple(spec.methods) if spec is not None else (),
                          TRANSPORTS[tr.kind].style if tr.kind in TRANSPORTS else "", where,
                          _compression_resolved(cfg)))   # common/security/secagg/settings.py
    _raise(privacy_problem(cfg))   # [privacy]'s rules, with secure aggregation's too (common/privacy/rules.py)
    if cfg.privacy.mode != "none" and cfg.secure_aggregation.enabled and edged:
        raise ConfigError(f"config key 'privacy.mode': '{cfg.privacy.mode}' with secure_aggregation.enabled = true "
                          f"behind edges (topology.kind = '{topo.kind}'): differential privacy on securely aggregated "
                          f"sums is built for the star; behind edges use one of the two")


def _check_vectorized(cfg: Config) -> None:
    """[algorithm] vectorized: an algorithm whose local solver trains clients together, and no
    DP-SGD (its per-example clipping is a solver of its own).  The task and the model are checked
    when they are built (common/algorithms/vectorized.py `check_vectorized`)."""
    if not cfg.algorithm.vectorized:
        return
    name = cfg.algorithm.name
    try:
        algorithm = algorithm_class(name)
    except (KeyError, ValueError):
        return   # an unknown name or a plug-in that does not load: reported where algorithm.name is read
    if not algorithm.trains_together():
        able = sorted(n for n, cls in registry().items() if cls.trains_together())
        raise ConfigError(f"config key 'algorithm.vectorized': algorithm.name = '{name}' has a local solver of its "
                          f"own that does not train clients together (it works with {', '.join(able)}, and with a "
                          f"plug-in written as SolverAlgorithm.local_solver, docs/plugins.md)")
    if cfg.privacy.mode == "dpsgd":
        raise ConfigError("config key 'algorithm.vectorized': privacy.mode = 'dpsgd' clips each example's gradient "
                          "in a solver of its own; use one of the two")


def _edge_kinds() -> str:
    """The built-in topology kinds that run edge servers, for a message: "edges: a, b; optional: c"."""
    from fedhop.common.topologies import builtin_specs
    specs = sorted(builtin_specs().values(), key=lambda s: (s.listed, s.name))
    need = ", ".join(s.name for s in specs if s.edges)
    optional = ", ".join(s.name for s in specs if s.edges_optional)
    return f"kinds with edges: {need}" + (f"; with topology.edges optional: {optional}" if optional else "")


def _compression_resolved(cfg: Config) -> Any:
    """`cfg.compression` with its compressor's keys resolved (`params`, defaults included), which the
    options check sets only later: secure aggregation's code reads them (rounding's bits, QSGD's
    levels)."""
    comp = cfg.compression
    try:
        cls = compressor_class(comp.up)
    except (KeyError, ValueError):   # an unknown name: the options check names it
        return comp
    if cls is None:
        return comp
    out = copy.copy(comp)
    out.params, _ = build_dataclass(cls, comp.options, "compression")   # type: ignore[attr-defined]
    return out


def _secagg_group(cfg: Config, spec: TopologySpec | None) -> tuple[int, str]:
    """The clients of the smallest secure-aggregation round and what they are: the round's
    sampled clients in the star; behind edges (each edge runs the protocol for its cluster) the
    smallest cluster's, capped by the clients per round."""
    per_round = resolve_clients_per_round(cfg)
    if spec is None or not spec.edges or not cfg.secure_aggregation.enabled:
        return per_round, "clients per round"
    smallest = min(len(group) for group in cluster_assignment(cfg))
    return min(smallest, per_round), "clients in the smallest cluster"


def _device_checks(cfg: Config) -> None:
    """The device keys' syntax (docs/gpus.md); whether the devices exist is checked where the
    processes start (deploy/launch/launcher.py, each role's start-up: common/transport/placement.py)."""
    from fedhop.common.transport.placement import DeviceError, check_gpus, check_spec  # local: torch
    try:
        check_spec("run.device", cfg.run.device)
        check_spec("edges.device", cfg.edges.device)
        check_spec("clients.device", cfg.clients.device)
        check_gpus(cfg.clients.gpus)
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.clients.gpus and cfg.clients.device == "cpu":
        raise ConfigError(f"config key 'clients.gpus' = {cfg.clients.gpus}: needs clients.device = \"cuda\" or "
                          f"\"auto\" (it is \"cpu\")")


#: built-in data sets whose task defines its model (a factory cannot replace it) or builds it from model.*
FIXED_MODEL_DATASETS = ("quadratic", "logreg", "lasso", "lowrank", "minimax_quadratic")
FACTORY_DATASETS = ("digits", "breast_cancer", "mnist", "npz", "robust_digits", "fair_digits")


def _check_model_factory(cfg: Config) -> None:
    """Import the user's model factory now, so a bad path is a config error before any process starts."""
    ref = cfg.model.factory
    if not ref:
        return
    if cfg.data.dataset in FIXED_MODEL_DATASETS:
        raise ConfigError(f"config key 'model.factory': data.dataset = '{cfg.data.dataset}' defines its own model "
                          f"(its parameters are the problem's variables); a model factory works with "
                          f"{', '.join(FACTORY_DATASETS)} and data-set plug-ins")
    try:
        make = load_plugin(ref, "models")
    except PluginError as exc:
        raise ConfigError(f"config key 'model.factory': {exc}") from None
    except LookupError:
        names = ", ".join(entry_point_names("models")) or "none installed"
        raise ConfigError(f"config key 'model.factory': got {ref!r}, which is neither an import path "
                          f"'package.module:function' nor an entry point of group 'fedhop.models' ({names})") from None
    if not callable(make):
        raise ConfigError(f"config key 'model.factory': {ref!r} is a {type(make).__name__}, not a function")
    try:   # factory_args against its signature now: a parent's config never calls it with others
        check_call(make, ref, "model.factory_args", (1,), 1, **cfg.model.factory_args)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


def _check_model_exchange(cfg: Config) -> None:
    """model.freeze and model.exchange (common/models/exchange.py `select_exchange`): their form, the
    selection plug-in imported now (a client's allow-list applies), and an algorithm that can
    exchange part of the model.  Whether the patterns name parameters is checked when the model
    is built (`check_model_selection`, before `fedhop run` starts a process)."""
    from fedhop.common.models.exchange import EXCHANGE_CHOICES, load_selector  # local: torch
    for i, pattern in enumerate(cfg.model.freeze):
        if not pattern.strip():
            raise ConfigError(f"config key 'model.freeze[{i}]': got {pattern!r}, expected a glob pattern on "
                              f"parameter names such as 'conv1.*'")
    ref = cfg.model.exchange
    if ref in EXCHANGE_CHOICES:
        pass
    elif not ref:
        raise ConfigError("config key 'model.exchange': got '', allowed: all, trainable, or a plug-in "
                          "'package.module:select'")
    else:
        try:
            load_selector(ref)
        except ValueError as exc:   # PluginError, PluginRefused, not a function
            raise ConfigError(f"config key 'model.exchange': {exc}") from None
    if ref != "all":
        name = cfg.algorithm.name
        if name in registry() and not registry()[name].partial_exchange:
            raise ConfigError(f"config key 'model.exchange': got {ref!r}, but algorithm.name = '{name}' exchanges "
                              f"the whole model (a part works with {', '.join(sorted(partial_exchange_algorithms()))})")


def _check_processors(cfg: Config) -> None:
    """Every [[processors]] entry: its methods, roles and reference, the processor imported and
    constructed with its options now (a client's or edge's allow-list applies, common/util/plugins.py),
    so a bad entry is a config error before any process starts."""
    from fedhop.common.processors.pipeline import build_processor  # local: the chain imports torch
    for i, entry in enumerate(cfg.processors):
        try:
            build_processor(entry, f"processors[{i}]")
        except ValueError as exc:   # PluginError and PluginRefused too: one line naming the key
            raise ConfigError(str(exc)) from None
