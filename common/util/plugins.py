"""Plug-ins: a user's own model, data set and algorithm without editing fedhop (issue 18, item 1).

A plug-in is named in the config in one of two ways:

- by import path, `"package.module:attribute"` (`model.factory = "mypkg.models:make_net"`,
  `data.dataset = "mypkg.data:load"`, `algorithm.name = "mypkg.algos:FedAvgM"`);
- by a name that the user's installed package registers as an entry point in the group
  `fedhop.<group>` (`fedhop.models`, `fedhop.datasets`, `fedhop.algorithms`,
  `fedhop.topologies`, `fedhop.processors`).

Every role process resolves them the same way: the config loader imports them while it validates
the config (common/config/__init__.py), so a path that does not import is a config error, naming the path
and the import error, before any process starts, and the server, edges and clients, which each
parse the same resolved config, import the same objects.  The package must be importable by
every process: installed in the environment (`pip install -e mypkg/`), on PYTHONPATH, or in a folder
of the plug-in search path, `FEDHOP_PLUGIN_PATH`, which `fedhop run` sets to the config's folder and
the working directory (and its children inherit): a package beside the config just works.

A client or edge process runs only the code it was started with (DESIGN.md section 9): its
command line (`--allow-plugin NAME`, repeatable) or its environment (`FEDHOP_ALLOW_PLUGINS`,
comma-separated) lists the plug-ins it may load, and `restrict` makes every other one a
`PluginRefused` before anything is imported or looked up: a config from the parent that names
another module is refused at registration, never imported.  An allow-list entry is a module or
package name (`mymodels` allows `mymodels.nets:make`), a whole reference, or an entry-point
name.  The built-in models, data sets, algorithms and topologies are not plug-ins and are always
allowed.  `fedhop run` passes each child the plug-ins its own config names (`config_plugins`).

What each kind of plug-in is (docs in README, "Bring your own model"):

- model factory: `factory(input_shape: tuple[int, ...], n_outputs: int, **model.factory_args)`
  returning a `torch.nn.Module`; fedhop calls it under the run's seeded RNG, so every process
  builds the same initial model.
- data set: `load(request: DataRequest) -> FederatedData` (per-client arrays, or one torch
  Dataset per client), or a full `fedhop.common.tasks.Task`; an optional `load.Params`
  dataclass declares its extra [data] keys.
- algorithm: a subclass of `fedhop.common.algorithms.base.Algorithm`.
- topology (`topology.kind`): a `fedhop.common.topologies.TopologySpec` (its params, config
  check, process plan, server driver, edge role and client handlers), or, the short form, a
  subclass of `fedhop.server.driver.TopologyDriver` whose optional `Params` dataclass declares
  its extra [topology] keys and optional `process_plan` (cfg, placement) -> ProcessPlan says
  which processes the run starts (default: the star plan, every client process under the
  server); common/topologies `spec_for` loads it and adapts a driver into a spec.
- processor (a `[[processors]]` entry's `name`): a class or factory called with the entry's
  other keys, giving an object with `process(message, ctx) -> message` (common/processors/pipeline.py).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Literal, Sequence

GROUP_PREFIX = "fedhop."
GROUPS = ("models", "datasets", "algorithms", "topologies", "processors")
PLUGIN_PATH_ENV = "FEDHOP_PLUGIN_PATH"   # folders searched for a plug-in package that is not installed
ALLOW_ENV = "FEDHOP_ALLOW_PLUGINS"       # a client's or edge's allow-list (comma-separated)
NOT_ALLOWED = "PLUGIN_NOT_ALLOWED"


class PluginError(ValueError):
    """A plug-in named in the config cannot be loaded."""


class PluginRefused(PluginError):
    """A plug-in that this process was not started with (`restrict`): refused, never imported."""


_allowed: frozenset[str] | None = None   # None: every plug-in (the server, the launcher, in-process use)


def restrict(names: Sequence[str]) -> None:
    """From now on load only the plug-ins `names` allows (module docstring); [] allows none."""
    global _allowed
    _allowed = frozenset(n.strip() for n in names if n.strip())


def unrestricted() -> None:
    """Lift `restrict` (tests)."""
    global _allowed
    _allowed = None


def allow_list_from(flags: Sequence[str] | None, env: str | None = None) -> list[str]:
    """A process's allow-list: its `--allow-plugin` flags (each may be comma-separated) and
    FEDHOP_ALLOW_PLUGINS."""
    env = os.environ.get(ALLOW_ENV, "") if env is None else env
    items = [part for flag in (flags or []) for part in flag.split(",")] + env.split(",")
    return sorted({i.strip() for i in items if i.strip()})


def _module_allowed(module: str, allowed: frozenset[str]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed if ":" not in a)


def check_allowed(ref: str, group: str) -> None:
    """Raise PluginRefused unless `ref` is on this process's allow-list (no-op when unrestricted).
    Nothing is imported: an entry point is judged by its name and the module it names."""
    allowed = _allowed
    if allowed is None or ref in allowed:
        return
    if is_import_path(ref):
        if _module_allowed(ref.partition(":")[0], allowed):
            return
    else:
        eps = [ep for ep in entry_points(group=GROUP_PREFIX + group) if ep.name == ref]
        if not eps:
            return   # not a plug-in at all: the caller reports an unknown name
        if _module_allowed(eps[0].value.partition(":")[0], allowed):
            return
    shown = ", ".join(sorted(allowed)) or "none"
    raise PluginRefused(f"{NOT_ALLOWED}: the config names plug-in {ref!r} (fedhop.{group}), which this process "
                        f"was not started with (allowed: {shown}); start it with --allow-plugin "
                        f"{ref.partition(':')[0] if is_import_path(ref) else ref} or {ALLOW_ENV} to run that code")


def tell_refusal(endpoint: Any, parent: str, request: Any, run_id: str, reason: str) -> None:
    """Tell the parent that this process registered but refuses the run's config (`reason`, one
    line from `parent_config`, common/config/__init__.py): a RegisterRequest with `refusal` set and no clients, so the server
    records it and fails the run at once rather than after its timeouts.  Best effort: the process
    exits with status 2 whether or not the parent answers."""
    import logging
    request.ClearField("clients")
    request.run_id, request.refusal, request.msg_id = run_id, reason, ""
    try:
        endpoint.register(parent, request, 10.0)
    except Exception as exc:   # the parent is gone or refuses: nothing more this process can do
        logging.getLogger("fedhop.plugins").warning("could not tell %s of the refusal: %s", parent, exc)


def config_plugins(cfg: Any) -> list[str]:
    """The plug-in references a resolved config names (model factory, model.exchange selection,
    data set, algorithm, topology, processors): import paths, and names that no built-in registry
    knows (entry points).  The launcher passes them to its children as their allow-list."""
    refs = [(getattr(cfg.model, "factory", "") or "", "models"), (getattr(cfg.model, "exchange", "") or "", "models"),
            (cfg.data.dataset, "datasets"),
            (cfg.algorithm.name, "algorithms"), (cfg.topology.kind, "topologies"),
            *((p.name, "processors") for p in getattr(cfg, "processors", ()))]
    out = []
    for ref, group in refs:
        if not isinstance(ref, str) or not ref:
            continue
        if is_import_path(ref) or ref in entry_point_names(group):
            out.append(ref.partition(":")[0] if is_import_path(ref) else ref)
    return sorted(set(out))


def is_import_path(ref: str) -> bool:
    return ":" in ref


def entry_point_names(group: str) -> list[str]:
    """The names installed packages register under `fedhop.<group>`."""
    return sorted({ep.name for ep in entry_points(group=GROUP_PREFIX + group)})


def search_path() -> list[str]:
    """The folders `FEDHOP_PLUGIN_PATH` lists (os.pathsep-separated): `fedhop run` sets it to the
    config's folder and the working directory, and its children inherit it."""
    return [p for p in os.environ.get(PLUGIN_PATH_ENV, "").split(os.pathsep) if p]


def import_plugin_module(module_name: str) -> ModuleType:
    """`importlib.import_module(module_name)`; a top-level package that is not installed is then
    looked for in the plug-in search path, without changing sys.path (DESIGN.md 1).  Its
    submodules import through the package as usual; a plain module found there that imports a
    sibling module by a top-level name needs to be a package or installed instead."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        if exc.name != top:
            raise
        folders = search_path()
        spec = importlib.machinery.PathFinder.find_spec(top, folders) if folders else None
        if spec is None or spec.loader is None:
            where = f"nor in the plug-in search path ({', '.join(folders)})" if folders else \
                f"and {PLUGIN_PATH_ENV} is empty"
            raise PluginError(f"ModuleNotFoundError: No module named '{top}': not installed or on PYTHONPATH, "
                              f"{where}; `fedhop run` looks in the config's folder and the working "
                              f"directory") from None
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(top, None)
        raise
    return importlib.import_module(module_name)


def load_plugin(ref: str, group: str) -> Any:
    """The object named by `ref`: an import path `"pkg.module:attr"` (attr may be dotted), or an
    entry point of group `fedhop.<group>`.  Raises PluginError naming `ref` and the cause; a
    bare name that no installed package registers raises LookupError (the caller knows its
    built-in names and says which are allowed)."""
    if group not in GROUPS:
        raise ValueError(f"load_plugin: unknown group '{group}' (allowed: {', '.join(GROUPS)})")
    check_allowed(ref, group)   # before any import (module docstring)
    if is_import_path(ref):
        module_name, _, attr = ref.partition(":")
        if not module_name or not attr:
            raise PluginError(f"'{ref}' is not an import path of the form 'package.module:attribute'")
        try:
            obj: Any = import_plugin_module(module_name)
        except PluginError as exc:
            raise PluginError(f"cannot import '{ref}': {exc}") from None
        except Exception as exc:   # noqa: BLE001 - any failure of the user's import is reported, not raised
            raise PluginError(f"cannot import '{ref}': {type(exc).__name__}: {exc}") from None
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise PluginError(f"cannot import '{ref}': module '{module_name}' has no attribute '{attr}'")
            obj = getattr(obj, part)
        return obj
    found = [ep for ep in entry_points(group=GROUP_PREFIX + group) if ep.name == ref]
    if not found:
        raise LookupError(ref)
    try:
        return found[0].load()
    except Exception as exc:   # noqa: BLE001
        raise PluginError(f"cannot load entry point '{ref}' ({found[0].value}) of group "
                          f"'{GROUP_PREFIX + group}': {type(exc).__name__}: {exc}") from None


# ----------------------------------------------------------------------------- data sets
@dataclass(frozen=True)
class DataRequest:
    """What a data-set plug-in is asked for."""

    num_clients: int          # clients.count: return exactly this many client data sets
    seed: int                 # from the run's seed (stream "data/plugin"): use it for every random choice
    params: Any               # the plug-in's Params instance built from the extra [data] keys, or None
    data_dir: str             # data.data_dir, where pre-staged files are looked up


@dataclass
class FederatedData:
    """A data-set plug-in's answer: one data set per client, and an optional test set.

    Each client's data (and `test`) is either a pair `(x, y)` of arrays or tensors with the
    samples along the first axis, or a map-style torch Dataset whose items are `(x, y)`; a
    Dataset is read into memory once when the task is built.  Features keep their shape (a CNN
    gets (C, H, W) images); the model's `input_shape` is the shape of one sample.
    """

    clients: Sequence[Any]
    test: Any = None
    task: Literal["classification", "regression"] = "classification"
    n_classes: int | None = None   # classification: default max label + 1
