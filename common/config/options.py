"""The option-schema registry: the params dataclass of a section's choice-dependent keys.

Sections with an `options` field (algorithm, data, topology, clients, transport, compression) collect their
extra keys there; the chosen algorithm / data set / topology / transport validates them against
its own params dataclass, registered with `register_options_schema`, and the result is stored as
`section.params` (`_validate_options`, run by the loader, common/config/parse.py).  `options`
then keeps only the keys given with a value other than their default, so that a config read back
from `config_to_toml` equals the one written (common/config/write.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fedhop.common.algorithms import algorithm_class
from fedhop.common.config.schema import SECTIONS, Config, ConfigError
from fedhop.common.config.validate import build_dataclass
from fedhop.common.config.write import _without_defaults
from fedhop.common.engine.heterogeneity import devices_params_class
from fedhop.common.processors.compressors import compressor_class
from fedhop.common.topologies.graphs import topology_params_class
from fedhop.common.transport.factory import params_of
from fedhop.common.util.suggest import did_you_mean

_OPTION_SCHEMAS: dict[str, tuple[str, Callable[[str], type | None]]] = {}


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
        # a named choice picks the keys; [clients] has one schema whatever its count: no choice to name
        chosen = f" for {section}.{chooser} = '{choice}' (its own keys: " if isinstance(choice, str) else \
            f" (the [{section}] option keys: "
        for key in obj.options:
            if key not in fields:
                near = did_you_mean(key, [*fields, *(f.name for f in dataclasses.fields(obj))])
                raise ConfigError(f"unknown config key '{section}.{key}' = {obj.options[key]!r}{near}{chosen}"
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


def _register_defaults() -> None:
    register_options_schema("algorithm", "name", lambda name: algorithm_class(name).Params)
    register_options_schema("transport", "kind", params_of)   # the transport registry
    register_options_schema("data", "dataset", _dataset_params)
    register_options_schema("topology", "kind", topology_params_class)
    # one schema whatever the choice: the device and straggler keys
    register_options_schema("clients", "count", lambda _count: devices_params_class())
    register_options_schema("compression", "up", compressor_class)   # the compressor's own keys


def _dataset_params(name: str) -> type | None:
    from fedhop.common.tasks import dataset_params_class  # local: the tasks import torch; the loader does not
    return dataset_params_class(name)


_register_defaults()
