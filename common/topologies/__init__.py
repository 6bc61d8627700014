"""The topologies: one `TopologySpec` per kind (common/topologies/spec.py), one module per
built-in kind, and `spec_for`, which every part of fedhop that depends on the kind reads (the
config loader, the process plan, the server's driver, the edge's and the client's handlers, the
live page).  A kind not built in is a plug-in (`load_topology`, through common/util/plugins.py
`load_plugin` and its allow-list): an import path or an entry point of group
`fedhop.topologies` naming a `TopologySpec` (or a driver class, adapted into one).

Adding a built-in kind: a folder `topologies/<kind>/` (the package `fedhop.topologies.<kind>`) whose
`__init__` defines `SPEC`, found by `spec_for` on first use like a plug-in (`folder_kinds`,
`folder_spec`; docs/architecture.md, "Topology folders"); or a module here defining `SPEC`, listed
in `_BUILTIN` below.  common/ never imports a folder by an import statement: it is loaded by name.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from fedhop.common.topologies import chain, gossip, hierarchical, relay, sequential, star
from fedhop.common.topologies.spec import TopologySpec, resolve

_BUILTIN = (star, hierarchical, sequential, chain, relay, gossip)   # the order error messages list them in

SPECS: dict[str, TopologySpec] = {m.SPEC.name: m.SPEC for m in _BUILTIN}


_PLUGINS: dict[str, TopologySpec] = {}   # plug-in kinds, by the reference the config gives
_FOLDERS: dict[str, TopologySpec] = {}   # folder kinds (topologies/<kind>/), loaded on first use
SPEC_TYPE = "fedhop.common.topologies.TopologySpec"
DRIVER_BASE = "fedhop.server.driver.TopologyDriver"
FOLDER_PACKAGE = "fedhop.topologies"     # topologies/ (pyproject.toml package-dir)


def spec_for(kind: str) -> TopologySpec:
    """The spec of topology `kind`: a built-in one (a module here, or a folder `topologies/<kind>/`:
    `folder_spec`), or a plug-in's (`load_topology`, on first use)."""
    spec = SPECS.get(kind)
    if spec is not None:
        return spec
    spec = folder_spec(kind)
    return spec if spec is not None else load_topology(kind)


def folder_kinds() -> list[str]:
    """The kinds that are folders of `fedhop.topologies` (topologies/<kind>/, a package each), sorted."""
    try:
        package = importlib.import_module(FOLDER_PACKAGE)
    except ImportError:   # an install without the topologies folder
        return []
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg and not m.name.startswith("_"))


def folder_spec(kind: str) -> TopologySpec | None:
    """The spec of folder kind `kind` (the `SPEC` its package `fedhop.topologies.<kind>` defines),
    None where no such folder is; a folder without a `TopologySpec` named `SPEC` is a plug-in
    error (PluginError, a ValueError) naming it."""
    if kind in _FOLDERS:
        return _FOLDERS[kind]
    if kind not in folder_kinds():
        return None
    spec = getattr(importlib.import_module(f"{FOLDER_PACKAGE}.{kind}"), "SPEC", None)
    if not isinstance(spec, TopologySpec):
        from fedhop.common.util.plugins import PluginError  # local: as in load_topology
        raise PluginError(f"topology folder '{FOLDER_PACKAGE}.{kind}' defines no SPEC (a {SPEC_TYPE})")
    _FOLDERS[kind] = spec
    return spec


def builtin_specs() -> dict[str, TopologySpec]:
    """Every built-in kind's spec: the modules here (`SPECS`), then the folders (`folder_kinds`)."""
    out = dict(SPECS)
    for kind in folder_kinds():
        spec = folder_spec(kind)
        if kind not in out and spec is not None:
            out[kind] = spec
    return out


def load_topology(ref: str) -> TopologySpec:
    """The plug-in topology named by `ref` (an import path or an entry point of `fedhop.topologies`,
    loaded by common/util/plugins.py `load_plugin`), its spec named `ref` (messages name the kind as the
    config wrote it).  `ref` names a `TopologySpec`, or a driver class (one with `run_round`, e.g.
    a `TopologyDriver` subclass), adapted into a spec: its `Params` dataclass, its `process_plan`
    (default: the star plan) and itself as the driver.  Raises KeyError for a bare name that no
    package registers, PluginError (a ValueError) for one that does not load or is neither."""
    if ref in _PLUGINS:
        return _PLUGINS[ref]
    from fedhop.common.util.plugins import PluginError, entry_point_names, load_plugin  # local: only for plug-ins
    try:
        obj = load_plugin(ref, "topologies")
    except LookupError:
        builtin = list(SPECS) + [k for k in folder_kinds() if k not in SPECS]
        names = builtin + [n for n in entry_point_names("topologies") if n not in builtin]
        from fedhop.common.util.suggest import did_you_mean
        raise KeyError(f"unknown topology '{ref}'{did_you_mean(ref, names)} (allowed: {', '.join(names)}, or an "
                       f"import path 'package.module:DriverClass')") from None
    if isinstance(obj, TopologySpec):
        spec = dataclasses.replace(obj, name=ref)
    elif isinstance(obj, type) and callable(getattr(obj, "run_round", None)):
        spec = TopologySpec(name=ref, driver=obj, params=getattr(obj, "Params", None),
                            plan=getattr(obj, "process_plan", None) or "fedhop.common.topologies.plan:star_plan")
    else:
        raise PluginError(f"'{ref}' is not a topology driver (a subclass of {DRIVER_BASE}) or a {SPEC_TYPE}")
    _PLUGINS[ref] = spec
    return spec


def replace_spec(spec: TopologySpec) -> None:
    """Put `spec` in place of the spec of the same name (a built-in or a loaded plug-in's), e.g.
    with another process plan (common/topologies/plan.py `register_plan`)."""
    table = SPECS if spec.name in SPECS else _FOLDERS if spec.name in _FOLDERS else _PLUGINS
    if spec.name not in table:
        raise KeyError(f"topology '{spec.name}' is neither built in nor a loaded plug-in")
    table[spec.name] = spec


__all__ = ["SPECS", "TopologySpec", "builtin_specs", "folder_kinds", "folder_spec", "load_topology", "replace_spec",
           "resolve", "spec_for"]
