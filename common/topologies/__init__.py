"""The topologies: one `TopologySpec` per kind (common/topologies/spec.py), one module per
built-in kind, and `spec_for`, which every part of fedhop that depends on the kind reads (the
config loader, the process plan, the server's driver, the edge's and the client's handlers, the
live page).  A kind not built in is a plug-in (`load_topology`, through common/util/plugins.py
`load_plugin` and its allow-list): an import path or an entry point of group
`fedhop.topologies` naming a `TopologySpec` (or a driver class, adapted into one).

Adding a built-in kind: a module here defining `SPEC`, listed in `_BUILTIN` below.
"""
from __future__ import annotations

import dataclasses

from fedhop.common.topologies import chain, gossip, hierarchical, relay, sequential, star
from fedhop.common.topologies.spec import TopologySpec, resolve

_BUILTIN = (star, hierarchical, sequential, chain, relay, gossip)   # the order error messages list them in

SPECS: dict[str, TopologySpec] = {m.SPEC.name: m.SPEC for m in _BUILTIN}


_PLUGINS: dict[str, TopologySpec] = {}   # plug-in kinds, by the reference the config gives
SPEC_TYPE = "fedhop.common.topologies.TopologySpec"
DRIVER_BASE = "fedhop.server.driver.TopologyDriver"


def spec_for(kind: str) -> TopologySpec:
    """The spec of topology `kind`: a built-in one, or a plug-in's (`load_topology`, on first use)."""
    spec = SPECS.get(kind)
    return spec if spec is not None else load_topology(kind)


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
        names = list(SPECS) + [n for n in entry_point_names("topologies") if n not in SPECS]
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
    table = SPECS if spec.name in SPECS else _PLUGINS
    if spec.name not in table:
        raise KeyError(f"topology '{spec.name}' is neither built in nor a loaded plug-in")
    table[spec.name] = spec


__all__ = ["SPECS", "TopologySpec", "load_topology", "replace_spec", "resolve", "spec_for"]
