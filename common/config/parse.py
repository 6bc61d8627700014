"""Reading a config: TOML text or a file, `--set SECTION.KEY=VALUE` overrides, then every section
built and checked (DESIGN.md section 7).

    cfg = load_config("exp.toml", overrides=["run.rounds=5", "algorithm.mu=0.1"])

`config_from_dict` is the one path: each section's dataclass built with every value checked
(common/config/validate.py), the compatibility rules (common/config/rules.py), each section's
choice-dependent keys against the chosen params dataclass (common/config/options.py), the
topology's own checks and the [[processors]] entries.  Errors are one `ConfigError` line naming
the key, the bad value and what is allowed; `load_config` prefixes it with where it came from
(the file, or the override that set the key).
"""
from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any

from fedhop.common.config.options import _has_options, _validate_options
from fedhop.common.config.rules import (
    _check_model_exchange,
    _check_model_factory,
    _check_processors,
    _cross_checks,
    _topology_checks,
)
from fedhop.common.config.schema import SECTIONS, Config, ConfigError, ProcessorConfig
from fedhop.common.config.validate import _allowed_types, _field_types, build_dataclass
from fedhop.common.util.suggest import did_you_mean


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
    text = text.removeprefix("\ufeff")   # a byte order mark, as some editors save UTF-8: not part of the TOML
    overrides = list(overrides)
    try:
        return parse_config(text, overrides)
    except ConfigError as exc:
        where = _blamed(path, overrides, str(exc))
        raise ConfigError(str(exc) if str(exc).startswith(f"{where}:") else f"{where}: {exc}") from None


def _blamed(path: Path, overrides: list[str], message: str) -> str:
    """Where a config error comes from: the override that set the key the message names (`--set` on
    the command line, `set=` in the Python API), else the file."""
    for item in reversed(overrides):     # the last override of a key is the one in force
        parts = [k.strip() for k in item.split("=", 1)[0].split(".")]
        # the key, or a table above it that the override made (data.x.y=3 makes the key 'data.x')
        keys = [".".join(parts[:n]) for n in range(len(parts), 1, -1)]
        if any(f"'{key}'" in message or f"{key} =" in message for key in keys) \
                or f"'[{parts[0]}]'" in message or message.startswith(f"override '{item}'"):
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
    _check_secagg_switch(data.get("secure_aggregation", {}))
    _check_model_factory(cfg)
    _check_model_exchange(cfg)
    _cross_checks(cfg)
    _validate_options(cfg)   # also imports a data-set or algorithm plug-in named by import path or entry point
    _topology_checks(cfg)    # after the options check: the kind's checks read its validated params
    _check_processors(cfg)
    return cfg


def _check_secagg_switch(raw: dict) -> None:
    """[secure_aggregation] keys given without `enabled`: secure aggregation is off by default, so
    the user who set them believes the run aggregates securely and it would not.  `enabled = false`
    given with them (a plain run to compare with a secure one) is taken as meant."""
    given = sorted(k for k in raw if k != "enabled")
    if given and "enabled" not in raw:
        raise ConfigError(f"config key 'secure_aggregation.{given[0]}' = {raw[given[0]]!r} is set, but "
                          f"secure_aggregation.enabled is not (its default is false: the run would not aggregate "
                          f"securely); set secure_aggregation.enabled = true, or = false to run without it")


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
