"""The config's TOML writer: `config_to_toml(cfg)` writes every key of a resolved config (an optional
key whose default is None as a comment, `# key: unset`), and `parse_config` of its output gives an
equal `Config`.  For that round trip a section's `options` keep only the keys given with a value
other than their default (`_without_defaults`, applied by common/config/options.py).  The run
folder's config.toml, the config a parent sends its children and `fedhop config show` are its output.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import re
from typing import Any

from fedhop.common.config.schema import SECTIONS, Config, ConfigError
from fedhop.common.config.validate import _type_name, field_default


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
