"""The dataclass validator of the config: one value against its annotation and its field's rules
(common/config/schema.py: `choices`, `min`, `max`, ...), and a dataclass built from a TOML table with
every field checked.  Every error is one `ConfigError` line naming the key, the value and what is
allowed.  The loader (common/config/parse.py) builds each section with it, the option-schema
registry (common/config/options.py) each section's choice-dependent params, and
deploy/tools/sweep_spec.py a sweep file's tables.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

from fedhop.common.config.schema import ConfigError
from fedhop.common.util.suggest import did_you_mean


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
    if rules.get("file_name") and isinstance(value, str):
        problem = file_name_problem(value)
        if problem:
            raise ConfigError(f"config key '{key}': got {value!r}, {problem}")
    if rules.get("path") and isinstance(value, str) and "\x00" in value:
        raise ConfigError(f"config key '{key}': got {value!r}, must not hold a NUL character (it names a file or folder)")
    if rules.get("host") and isinstance(value, str):
        problem = host_problem(value)
        if problem:
            raise ConfigError(f"config key '{key}': got {value!r}, {problem}")
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


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?|\[?[0-9A-Fa-f:.]+\]?")


def host_problem(value: str) -> str | None:
    """Why `value` is not a host (a name, an IPv4 or an IPv6 address), or None."""
    if not _HOST.fullmatch(value):
        return "expected a host name or an IP address, e.g. 127.0.0.1 or node1.lan"
    parts = value.split(".")
    if all(p.isdigit() for p in parts) and (len(parts) != 4 or any(int(p) > 255 for p in parts)):
        return "not an IPv4 address (four numbers from 0 to 255)"
    if ":" not in value and (len(value) > 253 or any(len(p) > 63 for p in parts)):
        return "not a host name (at most 253 characters, 63 between dots)"
    return None


def file_name_problem(value: str) -> str | None:
    """Why `value` cannot be one folder name (a run's name becomes runs/NAME-seedS-...): None when it can."""
    if not value.strip():
        return "must not be empty"
    if "/" in value:
        return "must be one folder name, without '/'"
    if value in (".", ".."):
        return "must not be '.' or '..'"
    if "\x00" in value:
        return "must not hold a NUL character"
    if len(value.encode()) > 200:
        return "must be at most 200 bytes (a folder name holds it with a seed and a time stamp)"
    return None


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


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default (a fresh one from a factory); `dataclasses.MISSING` when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
