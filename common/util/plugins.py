"""Plug-ins: a user's own model, data set and algorithm without editing fedhop (issue 18, item 1).

A plug-in is named in the config in one of two ways:

- by import path, `"package.module:attribute"` (`model.factory = "mypkg.models:make_net"`,
  `data.dataset = "mypkg.data:load"`, `algorithm.name = "mypkg.algos:FedAvgM"`);
- by a name that the user's installed package registers as an entry point in the group
  `fedhop.<group>` (`fedhop.models`, `fedhop.datasets`, `fedhop.algorithms`,
  `fedhop.topologies`, `fedhop.processors`, `fedhop.compressors`, `fedhop.transports`).

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
another module is refused at registration, never imported.  An allow-list entry is

- a module or package name: `mymodels` admits `mymodels:Net` and `mymodels.nets:make`;
- one object, `module:Name`: `mymodels:make_net` admits that object and what is defined beneath
  it (`mymodels:Factory.build`, a class's own method), nothing else of the module;
- an entry-point name.

The built-in models, data sets, algorithms and topologies are not plug-ins and are always
allowed.  `fedhop run` passes each child the plug-ins its own config names (`config_plugins`).

Whether or not a process is restricted (the server resolves its own config the same way), a
reference `module:attr.path` reaches only objects DEFINED in `module` or one of its submodules
(`resolve_attribute`): each step of the path must be a class or function whose `__module__` is
there, or an object whose type is; a module object, a builtin (`os.system`, `sys.exit`), a
function or class imported from elsewhere (`torch.load`, `functools.partial`), a method a class
inherits from elsewhere, a dunder name, or a callable object of a foreign type is refused with
one line naming the reference and why.  So an allowed module's own `import os` gives a parent's
config no way to `os.system`.  Then the object's kind is checked for its group (`check_kind`)
before anything calls it, and a caller that passes a config's options checks them against the
object's signature first (`check_call`; processors: common/processors/pipeline.py).

What each kind of plug-in is (docs/plugins.md):

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
- transport (`transport.kind`): a `fedhop.common.transport.entry.Transport`, the `TRANSPORT` of a
  package laid out as a transport folder (common/transport/factory.py `transport` loads it and
  declares its methods); its endpoint, worlds, data planes and handlers are named in it.
- compressor (`[compression] up`): a class with `encode(v, rng)`, `decode(parts, numel)` and
  `encoded_bytes(numel, parts)` (common/processors/compressors/base.py), a dataclass whose
  fields are its further [compression] keys.
- processor (a `[[processors]]` entry's `name`): a class defining `process(message, ctx) ->
  message`, or a factory known to make one without calling it (a classmethod of such a class, a
  function annotated `-> ThatClass`), called with the entry's other keys once they bind to its
  signature; or such an object itself (common/processors/pipeline.py).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import typing
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Literal, Sequence

GROUP_PREFIX = "fedhop."
GROUPS = ("models", "datasets", "algorithms", "topologies", "processors", "compressors", "transports")
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


def _reference_allowed(ref: str, allowed: frozenset[str]) -> bool:
    """An import path `module:attr.path` on the allow-list: its module (or a package above it)
    is an entry, or an object entry `module:Name` names it or an object beneath it."""
    module, _, attr = ref.partition(":")
    if _module_allowed(module, allowed):
        return True
    for entry in allowed:
        e_module, sep, e_attr = entry.partition(":")
        if sep and e_module == module and e_attr and (attr == e_attr or attr.startswith(e_attr + ".")):
            return True
    return False


def check_allowed(ref: str, group: str) -> None:
    """Raise PluginRefused unless `ref` is on this process's allow-list (no-op when unrestricted).
    Nothing is imported: an entry point is judged by its name and the reference it names."""
    allowed = _allowed
    if allowed is None or ref in allowed:
        return
    if is_import_path(ref):
        if _reference_allowed(ref, allowed):
            return
    else:
        eps = [ep for ep in entry_points(group=GROUP_PREFIX + group) if ep.name == ref]
        if not eps:
            return   # not a plug-in at all: the caller reports an unknown name
        if _reference_allowed(f"{eps[0].module}:{eps[0].attr or ''}", allowed):
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
            (getattr(getattr(cfg, "transport", None), "kind", "") or "", "transports"),
            *((p.name, "processors") for p in getattr(cfg, "processors", ())),
            (getattr(getattr(cfg, "compression", None), "up", "") or "", "compressors")]
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
    entry point of group `fedhop.<group>`, resolved by `resolve_attribute` (only objects defined
    in that module) and of the group's kind (`check_kind`); nothing is called.  Raises
    PluginError naming `ref` and the cause (PluginRefused for what the allow-list or the
    defined-here rule refuses); a bare name that no installed package registers raises
    LookupError (the caller knows its built-in names and says which are allowed)."""
    if group not in GROUPS:
        raise ValueError(f"load_plugin: unknown group '{group}' (allowed: {', '.join(GROUPS)})")
    check_allowed(ref, group)   # before any import (module docstring)
    if is_import_path(ref):
        module_name, _, attr = ref.partition(":")
        if not module_name or not attr:
            raise PluginError(f"'{ref}' is not an import path of the form 'package.module:attribute'")
    else:
        found = [ep for ep in entry_points(group=GROUP_PREFIX + group) if ep.name == ref]
        if not found:
            raise LookupError(ref)
        module_name, attr = found[0].module, found[0].attr or ""
        if not attr:
            raise PluginError(f"entry point '{ref}' ({found[0].value}) of group '{GROUP_PREFIX + group}' names a "
                              f"module, not an object 'package.module:attribute'")
    try:
        module = import_plugin_module(module_name)
    except PluginError as exc:
        raise PluginError(f"cannot import '{ref}': {exc}") from None
    except Exception as exc:   # noqa: BLE001 - any failure of the user's import is reported, not raised
        raise PluginError(f"cannot import '{ref}': {type(exc).__name__}: {exc}") from None
    except SystemExit as exc:   # the module called sys.exit() as it was imported: not this process's exit
        raise PluginError(f"cannot import '{ref}': the module called sys.exit({exc.code!r}) as it was imported") from None
    obj = resolve_attribute(module, attr, ref, group)
    check_kind(obj, ref, group, module.__name__)
    return obj


def _defined_in(home: object, scope: str) -> bool:
    return isinstance(home, str) and (home == scope or home.startswith(scope + "."))


# values that carry no code and that Python shares between modules (small ints, interned strings)
_PLAIN_VALUES = (int, float, complex, str, bytes, bool, type(None))


def _held_elsewhere(value: Any, scope: str) -> str | None:
    """The name of a loaded module outside `scope` whose globals hold `value` itself (a value the
    plug-in's module imported), or None.  The packages above `scope` do not count: a package's
    __init__ re-exports what its modules make.  Plain values carry no code and are not looked for."""
    if isinstance(value, _PLAIN_VALUES):
        return None
    above = {".".join(scope.split(".")[:i]) for i in range(1, scope.count(".") + 1)}
    for name, module in list(sys.modules.items()):
        if module is None or _defined_in(name, scope) or name in above:
            continue
        try:
            held = vars(module).values()
        except TypeError:   # a module object without a __dict__
            continue
        if any(v is value for v in held):
            return name
    return None


def _home(obj: Any) -> tuple[str, str]:
    """What `obj` is and the module that defines it, for the defined-here rule: a class or a
    function (a bound method: its function) by its own `__module__` (a builtin: its C module or
    "builtins"); any other object by its type's."""
    target = obj.__func__ if inspect.ismethod(obj) else obj
    if inspect.isclass(target):
        return "class", str(getattr(target, "__module__", None) or "builtins")
    if inspect.isfunction(target):
        return "function", str(getattr(target, "__module__", None) or "builtins")
    if inspect.isroutine(target):
        return "built-in", str(getattr(target, "__module__", None) or "builtins")
    return f"{type(obj).__name__} object", type(obj).__module__


def resolve_attribute(module: ModuleType, attr: str, ref: str, group: str = "models") -> Any:
    """`module`'s object at the dotted path `attr` (of the reference `ref`), taking only objects
    defined in `module` or its submodules (module docstring): every step must be a class or
    function defined there, or an object whose type is (a step that goes on must be a class or
    such an object); a module, a builtin, an object imported from elsewhere, a dunder name is a
    PluginRefused, one line, and nothing found on the way is called."""
    scope = module.__name__

    def refuse(why: str) -> PluginRefused:
        return PluginRefused(f"{NOT_ALLOWED}: plug-in {ref!r} (fedhop.{group}) {why}; a reference admits only "
                             f"objects defined in its module '{scope}' (or its submodules)")

    obj: Any = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        if not part.isidentifier():
            raise PluginError(f"'{ref}' is not an import path of the form 'package.module:attribute'")
        if part.startswith("__") and part.endswith("__"):
            raise refuse(f"names the special attribute '{part}'")
        if not hasattr(obj, part):
            raise PluginError(f"cannot import '{ref}': module '{scope}' has no attribute '{attr}'")
        obj = getattr(obj, part)
        last = i == len(parts) - 1
        at = "" if last else f" (at '{'.'.join(parts[:i + 1])}')"
        if isinstance(obj, ModuleType):
            raise refuse(f"passes through the module '{obj.__name__}'{at}")
        what, home = _home(obj)
        if last and what.endswith("object") and not callable(obj):
            # a value (a TopologySpec, a transport entry): nothing to call, and its type may be defined
            # anywhere; but one that another module holds too was imported, not made here
            held = _held_elsewhere(obj, scope)
            if held is not None:
                raise refuse(f"is a {what} that the module '{held}' holds too: imported into '{scope}', not "
                             f"made there")
            continue   # its kind is checked next (`check_kind`)
        if not _defined_in(home, scope):
            raise refuse(f"is a {what} defined in '{home}'{at}, not in '{scope}'")
        if not last and not (what == "class" or what.endswith("object")):
            raise refuse(f"passes through a {what}{at}: a path steps only through a class or an object")
    return obj


def _routine(obj: Any) -> bool:
    """A Python function or a bound method of one (a classmethod of a plug-in's class)."""
    return inspect.isfunction(obj) or (inspect.ismethod(obj) and inspect.isfunction(obj.__func__))


def _product(make: Any) -> Any:
    """What the factory `make` makes, known without calling it: the class of a classmethod, or
    the function's return annotation (None when it has none or it does not resolve)."""
    if inspect.ismethod(make) and inspect.isclass(make.__self__):
        return make.__self__
    try:
        return typing.get_type_hints(make).get("return")
    except Exception:   # noqa: BLE001 - an annotation that does not resolve: not known
        return None


KINDS = {"models": "a function or class (a model factory `(input_shape, n_outputs, **factory_args)`, or a "
                   "selection `(name, parameter) -> bool`)",
         "datasets": "a function or class `load(request) -> FederatedData | Task`",
         "algorithms": "a subclass of fedhop.common.algorithms.base.Algorithm",
         "topologies": "a topology driver class or a TopologySpec",
         "processors": "a class defining process(message, ctx), a factory of one (a classmethod of that class, "
                       "or a function whose return annotation is that class), or an object with process(message, ctx)",
         "compressors": "a class defining encode(v, rng), decode(parts, numel) and encoded_bytes(numel, parts) "
                        "(common/processors/compressors/base.py)",
         "transports": "a fedhop.common.transport.entry.Transport (a transport folder's TRANSPORT)"}


def check_kind(obj: Any, ref: str, group: str, scope: str) -> None:
    """Raise PluginError unless `obj` (resolved from `ref` in module `scope`) is the kind of
    object its group calls (`KINDS`), judged without calling anything: a processor class must
    define `process` before it is ever instantiated, a processor object be of a type defined in
    `scope`."""
    if group in ("models", "datasets"):
        ok = _routine(obj) or inspect.isclass(obj)
    elif group == "algorithms":
        ok = inspect.isclass(obj)
    elif group == "topologies":
        ok = inspect.isclass(obj) or not callable(obj)
    elif group == "transports":   # an entry object; common/transport/factory.py checks its type
        ok = not inspect.isclass(obj) and not callable(obj)
    elif group == "compressors":
        ok = inspect.isclass(obj) and all(callable(getattr(obj, m, None)) for m in ("encode", "decode", "encoded_bytes"))
    else:   # processors
        has_process = callable(getattr(obj, "process", None))
        if inspect.isclass(obj):
            if not has_process:
                raise PluginError(f"'{ref}' is a class without a process(message, ctx) method; a processor is "
                                  f"{KINDS[group]}")
            ok = True
        elif _routine(obj):
            product = _product(obj)
            if not (inspect.isclass(product) and callable(getattr(product, "process", None))):
                raise PluginError(f"'{ref}' is a function that is not known to make a processor: a processor "
                                  f"factory is a classmethod of a class defining process(message, ctx), or a "
                                  f"function whose return annotation is such a class")
            ok = True
        else:
            if not has_process:
                raise PluginError(f"'{ref}' is a {type(obj).__name__} without a process(message, ctx) method; a "
                                  f"processor is {KINDS[group]}")
            ok = _defined_in(type(obj).__module__, scope)
    if not ok:
        what, home = _home(obj)
        raise PluginError(f"'{ref}' is not {KINDS[group]} (found: {what} of '{home}')")


def check_call(obj: Any, ref: str, key: str, *args: Any, **options: Any) -> None:
    """Raise PluginError unless `obj(*args, **options)` binds to `obj`'s signature: the options a
    config passes (`key` names them) are checked before the call, never found wrong by it.  An
    object whose signature cannot be read is refused: its options cannot be checked."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        raise PluginError(f"config key '{key}': '{ref}' has no signature to check its options against") from None
    try:
        signature.bind(*args, **options)
    except TypeError as exc:
        raise PluginError(f"config key '{key}': '{ref}' does not take these arguments: {exc} (options given: "
                          f"{', '.join(options) or 'none'})") from None


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
