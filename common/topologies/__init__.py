"""The topologies: one `TopologySpec` per kind (common/topologies/spec.py) and `spec_for`, which
every part of fedhop that depends on the kind reads (the config loader, the process plan, the
server's driver, the edge's and the client's handlers, the live page).

The kinds are `TOPOLOGIES`, a common/util/registry.py `Registry` (the shape of every family's
table): the built-ins are the folders of `fedhop.topologies` (topologies/<kind>/, one package each
whose `__init__` defines `SPEC`), found by scanning that package, listed in their specs' `listed`
order; a kind not built in is a plug-in found by the same lookup (through common/util/plugins.py
`load_plugin` and its allow-list): an import path or an entry point of group
`fedhop.topologies` naming a `TopologySpec` (or a driver class, adapted into one), or a package
laid out as a folder is.  common/ never imports a folder by an import statement: it is
loaded by name (docs/architecture.md, "Topology folders").
"""
from __future__ import annotations

import dataclasses

from fedhop.common.topologies.spec import TopologySpec, resolve
from fedhop.common.util.registry import Registry

SPEC_TYPE = "fedhop.common.topologies.TopologySpec"
DRIVER_BASE = "fedhop.server.driver.TopologyDriver"
FOLDER_PACKAGE = "fedhop.topologies"     # topologies/ (pyproject.toml package-dir)


def _folder_spec(kind: str, spec: object, module: str) -> TopologySpec:
    """A folder's `SPEC`, checked: a TopologySpec named as its folder."""
    if not isinstance(spec, TopologySpec) or spec.name != kind:
        from fedhop.common.util.plugins import PluginError  # local: only for a broken folder
        raise PluginError(f"topology folder '{module}' defines no SPEC (a {SPEC_TYPE} named '{kind}')")
    return spec


def _plugin_spec(ref: str, obj: object) -> TopologySpec:
    """A plug-in's TopologySpec, named `ref` (messages name the kind as the config wrote it), or
    a driver class (one with `run_round`, e.g. a `TopologyDriver` subclass) adapted into a spec:
    its `Params` dataclass, its `process_plan` (default: the star plan) and itself as the driver."""
    if isinstance(obj, TopologySpec):
        return dataclasses.replace(obj, name=ref)
    if isinstance(obj, type) and callable(getattr(obj, "run_round", None)):
        return TopologySpec(name=ref, driver=obj, params=getattr(obj, "Params", None),
                            plan=getattr(obj, "process_plan", None) or "fedhop.common.topologies.plan:star_plan")
    from fedhop.common.util.plugins import PluginError  # local: only for plug-ins
    raise PluginError(f"'{ref}' is not a topology driver (a subclass of {DRIVER_BASE}) or a {SPEC_TYPE}")


#: the folders of `fedhop.topologies` (each `__init__` defines `SPEC`), in `listed` order then by
#: name, and the plug-ins by the reference the config gives.  Eager: importing a folder declares
#: its protocol methods (`TopologySpec.methods`), which authorization and the ledger read for
#: every kind, so the first lookup imports every folder.
TOPOLOGIES: Registry[TopologySpec] = Registry("topology", FOLDER_PACKAGE, "topologies", attribute="SPEC",
                                              folders=True, eager=True, check=_folder_spec, plugin=_plugin_spec,
                                              order=lambda kind, spec: spec.listed, what="DriverClass", keep=True)


def spec_for(kind: str) -> TopologySpec:
    """The spec of topology `kind`: a built-in one (a folder `topologies/<kind>/`), or a
    plug-in's (`load_topology`, on first use)."""
    return TOPOLOGIES.get(kind)


def builtin_specs() -> dict[str, TopologySpec]:
    """Every built-in kind's spec (the folders of `fedhop.topologies`), in `listed` order then by
    name.  A folder without a `TopologySpec` named `SPEC` (or one named otherwise) is a plug-in
    error (PluginError, a ValueError) naming it."""
    return TOPOLOGIES.builtins()


def load_topology(ref: str) -> TopologySpec:
    """The topology `ref` names: a plug-in's (an import path or an entry point of
    `fedhop.topologies`, loaded by common/util/plugins.py `load_plugin` on first use and kept) or a
    built-in.  Raises UnknownName (a KeyError) for a bare name that no package registers,
    PluginError (a ValueError) for one that does not load or is neither a spec nor a driver."""
    return TOPOLOGIES.get(ref)


def replace_spec(spec: TopologySpec) -> None:
    """Put `spec` in place of the spec of the same name (a built-in or a loaded plug-in's), e.g.
    with another process plan (common/topologies/plan.py `register_plan`)."""
    TOPOLOGIES.replace(spec.name, spec)


__all__ = ["TopologySpec", "builtin_specs", "load_topology", "replace_spec", "resolve", "spec_for"]
