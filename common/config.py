"""Config loading: TOML -> validated `Config` dataclasses (DESIGN.md section 7).

    cfg = load_config("exp.toml", overrides=["run.rounds=5", "algorithm.mu=0.1"])

Errors are `ConfigError` and name the key, the bad value and what is allowed.  Sections with an
`options` field (algorithm, data, topology, clients, transport) collect their extra keys there;
the chosen algorithm / data set / topology validates them against its own params dataclass
(registered with `register_options_schema`) and the result is stored as `section.params`.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Callable

from common.config_schema import (AlgorithmConfig, ClientsConfig, Config, DataConfig, ModelConfig, RunConfig,
                                  TopologyConfig, TransportConfig)


class ConfigError(ValueError):
    """A config key has a bad value, or does not exist."""


SECTIONS: dict[str, type] = {"run": RunConfig, "topology": TopologyConfig, "algorithm": AlgorithmConfig, "data": DataConfig,
            "model": ModelConfig, "clients": ClientsConfig, "transport": TransportConfig}

_OPTION_SCHEMAS: dict[str, tuple[str, Callable[[str], type | None]]] = {}


def register_options_schema(section: str, chooser_key: str, lookup: Callable[[str], type | None]) -> None:
    """`lookup(choice)` gives the params dataclass for the extra keys of `section`."""
    _OPTION_SCHEMAS[section] = (chooser_key, lookup)


# ----------------------------------------------------------------------------- value checks
def _type_name(v: Any) -> str:
    return type(v).__name__


def _allowed_types(annotation: Any) -> tuple[type, ...]:
    if isinstance(annotation, str):
        annotation = eval_annotation(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        out: tuple[type, ...] = ()
        for arg in typing.get_args(annotation):
            out += _allowed_types(arg)
        return out
    if origin is not None:
        return (origin,)
    return (annotation,) if isinstance(annotation, type) else (object,)


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
            if ok:
                break
        if not ok:
            expected = " or ".join("a " + t.__name__ for t in allowed)
            raise ConfigError(f"config key '{key}': got {value!r} ({_type_name(value)}), expected {expected}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}': got {value!r}, must be a finite number")
    if "choices" in rules and value not in rules["choices"]:
        raise ConfigError(f"config key '{key}': got {value!r}, allowed: {', '.join(map(str, rules['choices']))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "min" in rules and value < rules["min"]:
            raise ConfigError(f"config key '{key}': got {value!r}, must be >= {rules['min']}")
        if "min_exclusive" in rules and value <= rules["min_exclusive"]:
            raise ConfigError(f"config key '{key}': got {value!r}, must be > {rules['min_exclusive']}")
        if "max" in rules and value > rules["max"]:
            raise ConfigError(f"config key '{key}': got {value!r}, must be <= {rules['max']}")
    return value


def build_dataclass(cls: type, values: dict[str, Any], where: str, allow_extra: bool = False) -> tuple[Any, dict]:
    """Instantiate `cls` from `values` with every field checked; returns (instance, extra keys)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs, extra = {}, {}
    for key, value in values.items():
        if key not in fields or key in ("options", "params"):
            if allow_extra:
                extra[key] = value
                continue
            allowed = ", ".join(sorted(k for k in fields if k not in ("options", "params"))) or "none"
            raise ConfigError(f"unknown config key '{where}.{key}' = {value!r} (allowed: {allowed})")
        f = fields[key]
        kwargs[key] = check_value(f"{where}.{key}", value, f.type, f.metadata)
    try:
        return cls(**kwargs), extra
    except TypeError as exc:  # pragma: no cover - every field has a default
        raise ConfigError(f"[{where}]: {exc}") from None


# ----------------------------------------------------------------------------- parsing
def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected SECTION.KEY=VALUE")
    path, raw = item.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"override '{item}': the key must be SECTION.KEY")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string such as algorithm.name=fedprox
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
    try:
        return parse_config(text, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def config_from_dict(data: dict) -> Config:
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown config section '[{unknown[0]}]' (allowed: {', '.join(SECTIONS)})")
    sections = {}
    for name, cls in SECTIONS.items():
        raw = data.get(name, {})
        if not isinstance(raw, dict):
            raise ConfigError(f"config key '{name}' must be a section ([{name}]), got {raw!r}")
        has_options = any(f.name == "options" for f in dataclasses.fields(cls))
        obj, extra = build_dataclass(cls, raw, name, allow_extra=has_options)
        if has_options:
            obj.options = extra
        sections[name] = obj
    cfg = Config(**sections)
    _cross_checks(cfg)
    _validate_options(cfg)
    return cfg


def _validate_options(cfg: Config) -> None:
    for section, (chooser, lookup) in _OPTION_SCHEMAS.items():
        obj = getattr(cfg, section)
        choice = getattr(obj, chooser)
        try:
            cls = lookup(choice)
        except (KeyError, ValueError, ImportError) as exc:
            msg = exc.args[0] if exc.args else str(exc)
            raise ConfigError(f"config key '{section}.{chooser}': {msg}") from None
        if cls is None:
            if obj.options:
                key = next(iter(obj.options))
                raise ConfigError(f"unknown config key '{section}.{key}' ({section}.{chooser} = '{choice}' "
                                  f"takes no extra keys)")
            obj.params = None
            continue
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in obj.options:
            if key not in fields:
                raise ConfigError(f"unknown config key '{section}.{key}' for {section}.{chooser} = '{choice}' "
                                  f"(its own keys: {', '.join(sorted(fields)) or 'none'})")
        params, _ = build_dataclass(cls, obj.options, section)
        obj.params = params
    for name in SECTIONS:
        obj = getattr(cfg, name)
        if hasattr(obj, "options") and name not in _OPTION_SCHEMAS:
            if obj.options:
                key = next(iter(obj.options))
                allowed = ", ".join(f.name for f in dataclasses.fields(obj) if f.name != "options")
                raise ConfigError(f"unknown config key '{name}.{key}' = {obj.options[key]!r} (allowed: {allowed})")
            obj.params = None


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
    steps = cfg.algorithm.local_steps
    if isinstance(steps, list):
        if len(steps) != count or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
            raise ConfigError(f"config key 'algorithm.local_steps': a list must hold clients.count = {count} "
                              f"non-negative ints, got {steps!r}")
    elif steps < 0:
        raise ConfigError(f"config key 'algorithm.local_steps': got {steps}, must be >= 0")
    topo = cfg.topology
    if topo.kind in ("hierarchical", "sequential") and topo.edges < 1:
        raise ConfigError(f"config key 'topology.edges': got {topo.edges}, must be >= 1 for "
                          f"topology.kind = '{topo.kind}'")
    if isinstance(topo.assignment, list):
        groups = topo.assignment
        if len(groups) != topo.edges:
            raise ConfigError(f"config key 'topology.assignment': {len(groups)} client lists for "
                              f"topology.edges = {topo.edges}")
        flat = [c for g in groups for c in (g if isinstance(g, list) else [g])]
        if sorted(flat) != list(range(count)):
            raise ConfigError(f"config key 'topology.assignment': must list each client id 0..{count - 1} exactly "
                              f"once, got {groups!r}")
    elif topo.assignment not in ("blocks", "shuffled"):
        raise ConfigError(f"config key 'topology.assignment': got {topo.assignment!r}, allowed: blocks, shuffled, "
                          f"or a list of client-id lists")


# ----------------------------------------------------------------------------- helpers
def resolve_clients_per_round(cfg: Config) -> int:
    per = cfg.clients.per_round
    if isinstance(per, float):
        return max(1, math.ceil(per * cfg.clients.count))
    return int(per)


def resolve_min_results(cfg: Config, sampled: int) -> int:
    mr = cfg.run.min_results
    if isinstance(mr, float):
        return max(1, math.ceil(mr * sampled))
    return min(int(mr), sampled)


def client_local_steps(cfg: Config, client_id: int) -> int:
    steps = cfg.algorithm.local_steps
    return int(steps[client_id]) if isinstance(steps, list) else int(steps)


# ----------------------------------------------------------------------------- TOML writer
def _toml_value(v: Any, key: str = "") -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"config key '{key}': {v} cannot be written to TOML")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x, key) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x, key)}" for k, x in v.items()) + "}"
    raise ConfigError(f"config key '{key}': cannot write a {_type_name(v)} to TOML")


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml_value(k)


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML; `parse_config(config_to_toml(cfg)) == cfg`."""
    lines: list[str] = []
    for name in SECTIONS:
        obj = getattr(cfg, name)
        lines.append(f"[{name}]")
        for f in dataclasses.fields(obj):
            if f.name == "options":
                continue
            lines.append(f"{f.name} = {_toml_value(getattr(obj, f.name), name + '.' + f.name)}")
        for k, v in getattr(obj, "options", {}).items():
            lines.append(f"{_toml_key(k)} = {_toml_value(v, name + '.' + k)}")
        lines.append("")
    return "\n".join(lines)


def _register_defaults() -> None:
    def algorithm_params(name: str):
        from common.algorithms import algorithm_class
        return algorithm_class(name).Params

    def dataset_params(name: str):
        from common.tasks import dataset_params_class
        return dataset_params_class(name)

    def topology_params(kind: str):
        from common.topology import topology_params_class
        return topology_params_class(kind)

    def transport_params(kind: str):
        if kind == "torch":
            from common.transport.torchdist import TorchParams
            return TorchParams
        return None

    register_options_schema("algorithm", "name", algorithm_params)
    register_options_schema("transport", "kind", transport_params)
    register_options_schema("data", "dataset", dataset_params)
    register_options_schema("topology", "kind", topology_params)


_register_defaults()
