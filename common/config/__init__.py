"""Config loading: TOML -> validated `Config` dataclasses (DESIGN.md section 7).

    cfg = load_config("exp.toml", overrides=["run.rounds=5", "algorithm.mu=0.1"])

Errors are `ConfigError` and name the key, the bad value and what is allowed.  Sections with an
`options` field (algorithm, data, topology, clients, transport) collect their extra keys there;
the chosen algorithm / data set / topology validates them against its own params dataclass
(registered with `register_options_schema`) and the result is stored as `section.params`.
`options` keeps the keys given with a value other than their default; `config_to_toml` writes
every key (an optional key whose default is None as a comment), and reading its output back
gives an equal `Config`.  The reference of every key is generated from these dataclasses:
docs/config.md and `fedhop config show` (deploy/configref.py).

This package's `__init__` is the loader: it resolves algorithms, topologies, data sets and
processors by name, so it sits above every other layer of common/ (tests/test_layers.py).
The dataclasses, `ConfigError` and the values derived from a config live in
common/config/schema.py, which is what the modules below the loader import.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Callable

from fedhop.common.config.schema import (
    AlgorithmConfig,
    ClientsConfig,
    Config,
    ConfigError,
    DataConfig,
    EdgesConfig,
    ModelConfig,
    ProcessorConfig,
    RunConfig,
    SecurityConfig,
    TopologyConfig,
    TransportConfig,
    resolve_clients_per_round,
)
from fedhop.common.config.schema import (
    client_local_steps as client_local_steps,
)
from fedhop.common.config.schema import (
    resolve_min_results as resolve_min_results,
)
from fedhop.common.topologies import SPECS, TopologySpec, spec_for
from fedhop.common.topologies.graphs import topology_params
from fedhop.common.transport.factory import params_of, sums_in_collective
from fedhop.common.util.suggest import did_you_mean

SECTIONS: dict[str, type] = {"run": RunConfig, "topology": TopologyConfig, "algorithm": AlgorithmConfig, "data": DataConfig,
            "model": ModelConfig, "clients": ClientsConfig, "edges": EdgesConfig, "transport": TransportConfig,
            "security": SecurityConfig}

_OPTION_SCHEMAS: dict[str, tuple[str, Callable[[str], type | None]]] = {}


def _topology_spec(cfg: Config) -> TopologySpec | None:
    """The spec of cfg.topology.kind; None for a kind that is unknown or a plug-in that does not
    load (the options check after the cross checks reports it, naming the kind)."""
    try:
        return spec_for(cfg.topology.kind)
    except (KeyError, ValueError):
        return None


def _check_sequential_pairing(cfg: Config, spec: TopologySpec | None) -> None:
    """A sequential algorithm (its model walks the edges, common/algorithms/base.py) runs only on a
    topology whose spec says `sequential_algorithms` (its driver refuses the other algorithms at start)."""
    from fedhop.common.algorithms import algorithm_class  # local: the algorithms import this module
    try:
        sequential = getattr(algorithm_class(cfg.algorithm.name), "sequential", False)
    except (KeyError, ValueError):   # an unknown name, a plug-in that does not import
        return   # reported where the algorithm's options are checked
    if sequential and not (spec is not None and spec.sequential_algorithms):
        allowed = ", ".join(k for k, s in SPECS.items() if s.sequential_algorithms)
        raise ConfigError(f"config key 'topology.kind': got '{cfg.topology.kind}', but algorithm '{cfg.algorithm.name}' "
                          f"walks one model over the edges and has no server step (allowed: {allowed})")


def _topology_checks(cfg: Config) -> None:
    """The kind's own checks (common/topologies/<kind>.py `check`) and the edge-step rule the spec
    declares, on the topology's validated params."""
    spec = _topology_spec(cfg)
    if spec is not None and spec.check is not None:
        try:
            spec.check(cfg)
        except ValueError as exc:
            key, _, why = str(exc).partition(": ")
            raise ConfigError(f"config key '{key}': {why}") from None
    _check_edge_steps(cfg, spec)


def _check_edge_steps(cfg: Config, spec: TopologySpec | None) -> None:
    """More than one edge aggregation per server round (the spec's `edge_steps_key`, e.g.
    hierarchical's kappa2) only for an algorithm with an edge step (`Algorithm.edge_iterations`)."""
    from fedhop.common.algorithms import algorithm_class  # local: the algorithms import this module
    key = spec.edge_steps_key if spec is not None else None
    steps = getattr(topology_params(cfg), key, 1) if key else 1
    if steps <= 1:
        return
    try:
        edge_step = getattr(algorithm_class(cfg.algorithm.name), "edge_iterations", True)
    except (KeyError, ValueError):   # an unknown name, a plug-in that does not import
        return   # reported where the algorithm's options are checked
    if not edge_step:
        raise ConfigError(f"config key 'topology.{key}': got {steps}, but algorithm '{cfg.algorithm.name}' defines "
                          f"no edge step between server rounds; use {key} = 1")


def register_options_schema(section: str, chooser_key: str, lookup: Callable[[Any], type | None]) -> None:
    """`lookup(choice)` gives the params dataclass for the extra keys of `section`.

    `lookup` is called at validation time (so registries can import lazily) with the value of
    `section.chooser_key`; it returns a dataclass type, or None when that choice takes no extra
    keys, and raises KeyError/ValueError for an unknown choice.  A later registration for the
    same section replaces the earlier one.
    """
    cls = SECTIONS.get(section)
    if cls is None:
        raise ValueError(f"register_options_schema: unknown config section '{section}' "
                         f"(allowed: {', '.join(SECTIONS)})")
    names = {f.name for f in dataclasses.fields(cls)}
    if "options" not in names:
        raise ValueError(f"register_options_schema: section '{section}' has no options field "
                         f"(sections with one: {', '.join(n for n, c in SECTIONS.items() if _has_options(c))})")
    if chooser_key not in names or chooser_key == "options":
        raise ValueError(f"register_options_schema: '{section}.{chooser_key}' is not a key of [{section}]")
    _OPTION_SCHEMAS[section] = (chooser_key, lookup)


def options_schema(section: str, choice: Any) -> type | None:
    """The params dataclass of `section`'s extra keys when `section.<chooser>` is `choice` (None: it
    takes none).  Raises KeyError for a section without an options schema, and what the registered
    lookup raises for an unknown choice."""
    if section not in _OPTION_SCHEMAS:
        raise KeyError(f"config section '{section}' has no choice-dependent keys "
                       f"(sections with some: {', '.join(_OPTION_SCHEMAS)})")
    return _OPTION_SCHEMAS[section][1](choice)


def options_chooser(section: str) -> str:
    """The key whose value picks `section`'s options schema (algorithm -> "name", topology -> "kind")."""
    return _OPTION_SCHEMAS[section][0]


def _has_options(cls: type) -> bool:
    return any(f.name == "options" for f in dataclasses.fields(cls))


# ----------------------------------------------------------------------------- value checks
def _type_name(v: Any) -> str:
    return type(v).__name__


def _union_members(annotation: Any) -> tuple[Any, ...]:
    """`int | list[int]` -> (int, list[int]); a plain annotation -> (annotation,)."""
    if isinstance(annotation, str):
        annotation = eval_annotation(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        out: tuple[Any, ...] = ()
        for arg in typing.get_args(annotation):
            out += _union_members(arg)
        return out
    return (annotation,)


def _allowed_types(annotation: Any) -> tuple[type, ...]:
    out: tuple[type, ...] = ()
    for member in _union_members(annotation):
        origin = typing.get_origin(member)
        if member is typing.Any:
            out += (object,)
        elif origin is typing.Literal:
            out += tuple(type(a) for a in typing.get_args(member))
        elif origin is not None:
            out += (origin,) if isinstance(origin, type) else (object,)
        else:
            out += (member,) if isinstance(member, type) else (object,)
    return out


def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (string annotations resolved in the class's module)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: fall back to the simple names
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


_ANNOTATIONS = {"None": type(None), "int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict,
                "int | float": int | float, "str | list": str | list, "int | list": int | list}


def eval_annotation(text: str) -> Any:
    """Resolve the string annotations of the schema (they come from `from __future__ import annotations`)."""
    if text in _ANNOTATIONS:
        return _ANNOTATIONS[text]
    parts = [p.strip() for p in text.split("|")]
    if all(p in _ANNOTATIONS for p in parts):
        out = _ANNOTATIONS[parts[0]]
        for p in parts[1:]:
            out = out | _ANNOTATIONS[p]
        return out
    return object


def check_value(key: str, value: Any, annotation: Any, rules: typing.Mapping[str, Any]) -> Any:
    """Type-check and range-check one value; returns it (ints widened to float where a float is wanted)."""
    allowed = _allowed_types(annotation)
    if object not in allowed:
        ok = False
        for t in allowed:
            if t is bool and isinstance(value, bool):
                ok = True
            elif t is int and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            elif t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                ok = True
                if int not in allowed:  # a float field given an int: widen it
                    value = float(value)
            elif t in (str, list, dict) and isinstance(value, t):
                ok = True
            elif t is tuple and isinstance(value, list):  # TOML has arrays only
                ok, value = True, tuple(value)
            if ok:
                break
        if not ok:
            expected = " or ".join(("an " if t.__name__[0] in "aeiou" else "a ") + t.__name__ for t in allowed)
            raise ConfigError(f"config key '{key}': got {value!r} ({_type_name(value)}), expected {expected}")
        if isinstance(value, list):
            value = _check_list_items(key, value, annotation)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}': got {value!r}, must be a finite number")
    if "choices" in rules and value not in rules["choices"]:
        raise ConfigError(f"config key '{key}': got {value!r}{did_you_mean(value, rules['choices'])}, allowed: "
                          f"{', '.join(map(str, rules['choices']))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "min" in rules and value < rules["min"]:
            raise ConfigError(f"config key '{key}': got {value!r}, must be >= {rules['min']}")
        if "min_exclusive" in rules and value <= rules["min_exclusive"]:
            raise ConfigError(f"config key '{key}': got {value!r}, must be > {rules['min_exclusive']}")
        if "max" in rules and value > rules["max"]:
            raise ConfigError(f"config key '{key}': got {value!r}, must be <= {rules['max']}")
        if "max_exclusive" in rules and value >= rules["max_exclusive"]:
            raise ConfigError(f"config key '{key}': got {value!r}, must be < {rules['max_exclusive']}")
    return value


def _check_list_items(key: str, value: list, annotation: Any) -> list:
    """Check the items of a list against `list[T]` (a bare `list` leaves them unchecked)."""
    item_types = [typing.get_args(m)[0] for m in _union_members(annotation)
                  if typing.get_origin(m) is list and typing.get_args(m)]
    if len(item_types) != 1:
        return value
    return [check_value(f"{key}[{i}]", item, item_types[0], {}) for i, item in enumerate(value)]


def build_dataclass(cls: type, values: dict[str, Any], where: str, allow_extra: bool = False) -> tuple[Any, dict]:
    """Instantiate `cls` from `values` with every field checked; returns (instance, extra keys)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types_ = _field_types(cls)
    kwargs, extra = {}, {}
    for key, value in values.items():
        if key not in fields or key in ("options", "params"):
            if allow_extra:
                extra[key] = value
                continue
            allowed = ", ".join(sorted(k for k in fields if k not in ("options", "params"))) or "none"
            near = did_you_mean(key, [k for k in fields if k not in ("options", "params")])
            raise ConfigError(f"unknown config key '{where}.{key}' = {value!r}{near} (allowed: {allowed})")
        f = fields[key]
        kwargs[key] = check_value(f"{where}.{key}", value, types_[key], f.metadata)
    missing = [f.name for f in fields.values() if f.name not in kwargs and f.init
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"config key '{where}.{missing[0]}' is required (missing: "
                          f"{', '.join(where + '.' + m for m in missing)})")
    try:
        return cls(**kwargs), extra
    except (TypeError, ValueError) as exc:  # a __post_init__ check of the dataclass itself
        raise ConfigError(f"[{where}]: {exc}") from None


# ----------------------------------------------------------------------------- parsing
def _parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value).

    The value is read as a TOML value (`5`, `0.1`, `true`, `[8, 4]`, `"x"`); text that is not
    one is taken as a bare string (`algorithm.name=fedprox`).  A schema field typed `str` takes
    the text as given even when it would read as another TOML value (`run.name=2024`).
    """
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected SECTION.KEY=VALUE")
    path, raw = item.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"override '{item}': the key must be SECTION.KEY")
    raw = raw.strip()
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return keys, raw  # a bare string such as algorithm.name=fedprox
    value = parsed.get("v", raw) if len(parsed) == 1 else raw
    if not isinstance(value, str) and len(keys) == 2 and keys[0] in SECTIONS:
        annotation = _field_types(SECTIONS[keys[0]]).get(keys[1])
        if annotation is not None and _allowed_types(annotation) == (str,):
            value = raw
    return keys, value


def apply_overrides(data: dict, overrides: typing.Iterable[str]) -> dict:
    for item in overrides:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{k}' is not a section")
        node[keys[-1]] = value
    return data


def parse_config(text: str, overrides: typing.Iterable[str] = ()) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config is not valid TOML: {exc}") from None
    return config_from_dict(apply_overrides(data, overrides))


def load_config(path: str | Path, overrides: typing.Iterable[str] = ()) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start})") from None
    overrides = list(overrides)
    try:
        return parse_config(text, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{_blamed(path, overrides, str(exc))}: {exc}") from None


def _blamed(path: Path, overrides: list[str], message: str) -> str:
    """Where a config error comes from: the override that set the key the message names (`--set` on
    the command line, `set=` in the Python API), else the file."""
    for item in reversed(overrides):     # the last override of a key is the one in force
        key = item.split("=", 1)[0].strip()
        section = key.split(".", 1)[0]
        if f"'{key}'" in message or f"{key} =" in message or f"'[{section}]'" in message \
                or message.startswith(f"override '{item}'"):
            return f"override '{item}'"
    return str(path)


def config_from_dict(data: dict) -> Config:
    data = dict(data)
    processors = _processor_tables(data.pop("processors", []))
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        key = unknown[0]
        if not isinstance(data[key], dict):
            raise ConfigError(f"config key '{key}' = {data[key]!r} is outside any section; keys belong in a "
                              f"section (allowed: {', '.join(SECTIONS)})")
        raise ConfigError(f"unknown config section '[{key}]'{did_you_mean(key, [*SECTIONS, 'processors'])} "
                          f"(allowed: {', '.join(SECTIONS)}, [[processors]])")
    sections = {}
    for name, cls in SECTIONS.items():
        raw = data.get(name, {})
        if not isinstance(raw, dict):
            raise ConfigError(f"config key '{name}' must be a section ([{name}]), got {raw!r}")
        has_options = _has_options(cls)
        obj, extra = build_dataclass(cls, raw, name, allow_extra=has_options)
        if has_options:
            obj.options = extra
        sections[name] = obj
    cfg = Config(**sections, processors=processors)
    _check_model_factory(cfg)
    _check_model_exchange(cfg)
    _cross_checks(cfg)
    _validate_options(cfg)   # also imports a data-set or algorithm plug-in named by import path or entry point
    _topology_checks(cfg)    # after the options check: the kind's checks read its validated params
    _check_processors(cfg)
    return cfg


def _processor_tables(raw: Any) -> list[ProcessorConfig]:
    """`[[processors]]`: an array of tables, each a `ProcessorConfig` whose other keys are the
    processor's keyword options."""
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(f"config key 'processors' must be an array of tables ([[processors]] with name = "
                          f"\"package.module:Class\"), got {raw!r}")
    out = []
    for i, table in enumerate(raw):
        entry, extra = build_dataclass(ProcessorConfig, table, f"processors[{i}]", allow_extra=True)
        entry.options = extra
        out.append(entry)
    return out


def _check_processors(cfg: Config) -> None:
    """Every [[processors]] entry: its methods, roles and reference, the processor imported and
    constructed with its options now (a client's or edge's allow-list applies, common/util/plugins.py),
    so a bad entry is a config error before any process starts."""
    from fedhop.common.processors.pipeline import build_processor  # local: the chain imports the wire layer and torch
    for i, entry in enumerate(cfg.processors):
        try:
            build_processor(entry, f"processors[{i}]")
        except ValueError as exc:   # PluginError and PluginRefused too: one line naming the key
            raise ConfigError(str(exc)) from None


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
    from fedhop.common.util.plugins import PluginError, entry_point_names, load_plugin
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
    from fedhop.common.util.plugins import check_call
    try:   # factory_args against its signature now: a parent's config never calls it with others
        check_call(make, ref, "model.factory_args", (1,), 1, **cfg.model.factory_args)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


def _check_model_exchange(cfg: Config) -> None:
    """model.freeze and model.exchange (common/models/exchange.py `select_exchange`): their form, the
    selection plug-in imported now (a client's allow-list applies), and an algorithm that can
    exchange part of the model.  Whether the patterns name parameters is checked when the model
    is built (`check_model_selection`, before `fedhop run` starts a process)."""
    from fedhop.common.models.exchange import EXCHANGE_CHOICES, load_selector
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
        from fedhop.common.algorithms import (  # local: the algorithms import this module
            partial_exchange_algorithms,
            registry,
        )
        name = cfg.algorithm.name
        if name in registry() and not registry()[name].partial_exchange:
            raise ConfigError(f"config key 'model.exchange': got {ref!r}, but algorithm.name = '{name}' exchanges "
                              f"the whole model (a part works with {', '.join(sorted(partial_exchange_algorithms()))})")


def _validate_options(cfg: Config) -> None:
    for section, (chooser, lookup) in _OPTION_SCHEMAS.items():
        obj = getattr(cfg, section)
        choice = getattr(obj, chooser)
        try:
            cls = lookup(choice)
        except (KeyError, ValueError, ImportError) as exc:
            msg = exc.args[0] if exc.args else str(exc)
            raise ConfigError(f"config key '{section}.{chooser}': {msg}") from None
        common = ", ".join(f.name for f in dataclasses.fields(obj) if f.name != "options")
        if cls is None:
            if obj.options:
                key = next(iter(obj.options))
                near = did_you_mean(key, [f.name for f in dataclasses.fields(obj) if f.name != "options"])
                raise ConfigError(f"unknown config key '{section}.{key}' = {obj.options[key]!r}{near} "
                                  f"({section}.{chooser} = '{choice}' takes no extra keys; "
                                  f"common [{section}] keys: {common})")
            obj.params = None
            continue
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in obj.options:
            if key not in fields:
                near = did_you_mean(key, [*fields, *(f.name for f in dataclasses.fields(obj))])
                raise ConfigError(f"unknown config key '{section}.{key}' = {obj.options[key]!r}{near} for "
                                  f"{section}.{chooser} = '{choice}' (its own keys: "
                                  f"{', '.join(sorted(fields)) or 'none'}; common [{section}] keys: {common})")
        params, _ = build_dataclass(cls, obj.options, section)
        obj.params = params
        obj.options = _without_defaults(cls, obj.options)
    for name in SECTIONS:
        obj = getattr(cfg, name)
        if hasattr(obj, "options") and name not in _OPTION_SCHEMAS:
            if obj.options:
                key = next(iter(obj.options))
                allowed = ", ".join(f.name for f in dataclasses.fields(obj) if f.name != "options")
                near = did_you_mean(key, [f.name for f in dataclasses.fields(obj) if f.name != "options"])
                raise ConfigError(f"unknown config key '{name}.{key}' = {obj.options[key]!r}{near} "
                                  f"(allowed: {allowed})")
            obj.params = None


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default (a fresh one from a factory); `dataclasses.MISSING` when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _same_toml(a: Any, b: Any) -> bool:
    """Whether two values are written as the same TOML text (1 and 1.0, 0.0 and -0.0 are not)."""
    try:
        return toml_value(a) == toml_value(b)
    except ConfigError:
        return False


def _without_defaults(cls: type, given: dict) -> dict:
    """`given` less the keys set to exactly their default: the canonical `options`, so that a
    config read back from `config_to_toml` (which writes every key) equals the one written."""
    defaults = {f.name: field_default(f) for f in dataclasses.fields(cls)}
    return {k: v for k, v in given.items()
            if k not in defaults or defaults[k] in (None, dataclasses.MISSING) or not _same_toml(v, defaults[k])}


def _device_checks(cfg: Config) -> None:
    """The device keys' syntax (docs/gpus.md); whether the devices exist is checked where the
    processes start (deploy/launcher.py, each role's start-up: common/transport/placement.py)."""
    from fedhop.common.transport.placement import DeviceError, check_gpus, check_spec
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


def _cross_checks(cfg: Config) -> None:
    count = cfg.clients.count
    per = cfg.clients.per_round
    if isinstance(per, float):
        if not 0 < per <= 1:
            raise ConfigError(f"config key 'clients.per_round': got {per}, a fraction must be in (0, 1]")
    elif not 1 <= per <= count:
        raise ConfigError(f"config key 'clients.per_round': got {per}, must be between 1 and clients.count = {count}")
    mr = cfg.run.min_results
    if isinstance(mr, float) and not 0 < mr <= 1:
        raise ConfigError(f"config key 'run.min_results': got {mr}, a fraction must be in (0, 1]")
    if _is_int(mr) and mr > resolve_clients_per_round(cfg):
        raise ConfigError(f"config key 'run.min_results': got {mr}, more than the {resolve_clients_per_round(cfg)} "
                          f"clients sampled per round (clients.per_round = {per})")
    sec = cfg.security
    _robust_checks(cfg)
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
    topo = cfg.topology
    spec = _topology_spec(cfg)
    edged = spec is not None and spec.edges   # the run has edge processes
    if edged and topo.edges < 1:
        raise ConfigError(f"config key 'topology.edges': got {topo.edges}, must be >= 1 for "
                          f"topology.kind = '{topo.kind}'")
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
    if sums_in_collective(cfg.transport.kind):
        compress = getattr(cfg.algorithm, "compress", "none")
        if compress != "none":   # collectives reduce raw float sums; a QSGD-coded upload cannot be summed
            raise ConfigError(f"config key 'algorithm.compress': got '{compress}', but transport.kind = "
                              f"'{cfg.transport.kind}' reduces uploads as raw float sums in a collective (allowed "
                              f"there: 'none'); use transport.kind = 'grpc' for QSGD")
    _check_sequential_pairing(cfg, spec)


def _robust_checks(cfg: Config) -> None:
    """security.aggregation other than "mean" replaces the algorithm's reduction (common/engine/robust.py):
    only where that reduction is the default weighted sum and replies are reduced in Python."""
    rule = cfg.security.aggregation
    if rule == "mean":
        return
    from fedhop.common.algorithms import registry  # local: the algorithms import this module
    from fedhop.common.algorithms.base import Algorithm
    spec = _topology_spec(cfg)
    if spec is None or spec.robust is None:   # the spec says how a robust rule groups updates
        kinds = " or ".join(f"'{k}'" for k, s in SPECS.items() if s.robust is not None)
        raise ConfigError(f"config key 'security.aggregation': '{rule}' works in topology.kind = {kinds}, "
                          f"got '{cfg.topology.kind}'")
    if sums_in_collective(cfg.transport.kind):
        raise ConfigError(f"config key 'security.aggregation': '{rule}' needs every update apart, but "
                          f"transport.kind = '{cfg.transport.kind}' sums them in a collective; use "
                          f"transport.kind = 'grpc'")
    cls = registry().get(cfg.algorithm.name)
    if cls is not None and cls.aggregate is not Algorithm.aggregate:
        raise ConfigError(f"config key 'security.aggregation': '{rule}' replaces the weighted mean, but algorithm "
                          f"'{cfg.algorithm.name}' reduces its replies its own way; use 'mean'")
    from fedhop.common.engine.robust import config_group_problem  # local: robust imports the algorithms
    problem = config_group_problem(cfg)   # groups too small for the rule, a trim of 0
    if problem:
        raise ConfigError(problem)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- helpers
def parent_config(text: str, node_id: str, parent: str, role: str = "") -> Any:
    """The run's config as a client's or edge's parent sent it, parsed here, and its processors
    for `role` (edge, client) installed in this process's chains (common/processors/pipeline.py `configure`).
    A config this process cannot use (one naming a plug-in it was not started with: refused by
    `check_allowed`, common/util/plugins.py, before any import) is one RuntimeError line; the role then exits with status 2."""
    from fedhop.common.processors.pipeline import configure  # local: the chain imports torch
    try:
        cfg = parse_config(text)
        if role:
            configure(cfg, role)
        return cfg
    except (ValueError, KeyError) as exc:   # ConfigError, PluginError and PluginRefused
        raise RuntimeError(f"{node_id}: refusing the run's config from {parent}: {exc}") from None


# ----------------------------------------------------------------------------- TOML writer
def toml_value(v: Any, key: str = "") -> str:
    """One value as TOML text (`key` names it in the error for a value TOML cannot hold)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"config key '{key}': {v} cannot be written to TOML")
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, (datetime.datetime, datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x, key) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(x, key)}" for k, x in v.items()) + "}"
    raise ConfigError(f"config key '{key}': cannot write a {_type_name(v)} to TOML")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_string(s: str) -> str:
    """A TOML basic string: quotes, backslashes and every control character escaped."""
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_string(k)


def _option_lines(obj: Any, section: str) -> list[tuple[str, str | None]]:
    """(key, TOML value) for every choice-dependent key of a section: the options given, then the
    defaults of the params dataclass's other fields (None: an unset optional key)."""
    options = getattr(obj, "options", {})
    params = getattr(obj, "params", None)
    out: list[tuple[str, str | None]] = []
    written = {f.name for f in dataclasses.fields(obj)}   # a params field named like a common key: see shadowed_keys
    if dataclasses.is_dataclass(params):
        for f in dataclasses.fields(params):
            if f.name in written:
                continue
            if f.name in options:
                value = options[f.name]
            else:
                value = field_default(f)
                if value is dataclasses.MISSING:
                    value = getattr(params, f.name)
            out.append((f.name, None if value is None else toml_value(value, f"{section}.{f.name}")))
            written.add(f.name)
    out += [(k, toml_value(v, f"{section}.{k}")) for k, v in options.items() if k not in written]
    return out


def shadowed_keys(section: str, params_cls: type) -> list[str]:
    """The fields of a params dataclass named like a common key of `section`: the [section] table
    gives that key to the common field, so these stay at their defaults (data.alpha is the
    Dirichlet concentration, not logreg's Synthetic alpha)."""
    common = {f.name for f in dataclasses.fields(SECTIONS[section])}
    return [f.name for f in dataclasses.fields(params_cls) if f.name in common]


def _unset_line(params: Any, key: str) -> str:
    """`# key: unset`, with the value the params dataclass resolved it to when it did."""
    value = getattr(params, key)
    try:
        return f"# {key}: unset" + ("" if value is None else f" (resolved: {toml_value(value, key)})")
    except ConfigError:
        return f"# {key}: unset"


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML, every key included; `parse_config(config_to_toml(cfg)) == cfg`.

    A section's choice-dependent keys are its `options` and the defaults of the rest of its params
    dataclass (module docstring); an optional key left unset (default None) is written as a comment,
    `# key: unset`, so the file names every key."""
    lines: list[str] = []
    for name in SECTIONS:
        obj = getattr(cfg, name)
        lines.append(f"[{name}]")
        for f in dataclasses.fields(obj):
            if f.name == "options":
                continue
            lines.append(f"{f.name} = {toml_value(getattr(obj, f.name), name + '.' + f.name)}")
        for key, text in _option_lines(obj, name):
            lines.append(f"{_toml_key(key)} = {text}" if text is not None else _unset_line(obj.params, key))
        lines.append("")
    for i, entry in enumerate(cfg.processors):   # arrays of tables come after every table
        lines.append("[[processors]]")
        for f in dataclasses.fields(entry):
            if f.name != "options":
                lines.append(f"{f.name} = {toml_value(getattr(entry, f.name), f'processors[{i}].{f.name}')}")
        for key, value in entry.options.items():
            lines.append(f"{_toml_key(key)} = {toml_value(value, f'processors[{i}].{key}')}")
        lines.append("")
    return "\n".join(lines)


def _register_defaults() -> None:
    def algorithm_params(name: str):
        from fedhop.common.algorithms import algorithm_class
        return algorithm_class(name).Params

    def dataset_params(name: str):
        from fedhop.common.tasks import dataset_params_class
        return dataset_params_class(name)

    def topology_params_of(kind: str):
        from fedhop.common.topologies.graphs import topology_params_class
        return topology_params_class(kind)

    register_options_schema("algorithm", "name", algorithm_params)
    register_options_schema("transport", "kind", params_of)   # the transport registry
    register_options_schema("data", "dataset", dataset_params)
    register_options_schema("topology", "kind", topology_params_of)

    def clients_params(_count: int):  # one schema whatever the choice: device and straggler keys
        from fedhop.common.engine.heterogeneity import devices_params_class
        return devices_params_class()

    register_options_schema("clients", "count", clients_params)


_register_defaults()
