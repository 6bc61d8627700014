"""One shape for every table of named kinds: algorithms, data sets, models, compressors, processors,
topologies and transports each keep a `Registry`, and a built-in and a plug-in are found by the
same lookup, `Registry.get(name)`.

A registry knows

- its family ("algorithm") and the plug-in group of common/util/plugins.py ("algorithms");
- its package (None: plug-ins only, the processors).  The built-ins are the entries that the
  package's modules list in one module attribute, `REGISTER` (a folder package's `SPEC` or
  `TRANSPORT`, `folders`), so adding a built-in is a module with that attribute and no edit of a
  shared file.  The attribute holds a dict `{"name": entry}`, a list of entries, or one entry;
  an entry outside a dict is named by `name_of` (an algorithm's or a compressor's `name`), a
  folder's entry by its folder;
- how a plug-in's object becomes an entry (`plugin`: a data set's `load` wrapped into a
  builder, a driver class adapted into a TopologySpec) and how a built-in's is checked (`check`);
  whether a plug-in's entry is kept after its first load (`keep`: a made entry, such as a
  wrapped builder or a transport whose methods were declared; otherwise the plug-in loader,
  whose imports Python caches, is asked on every lookup);
- the order of the full list (`order`; default: module name, then the attribute's order).

Any other name is a plug-in: an import path "package.module:Name" or an entry point of group
`fedhop.<group>`, loaded by `load_plugin` (its allow-list, its defined-here rule, its kind); a name that is neither raises `UnknownName`, one line naming the family, the name, a
did-you-mean and the available names.

Lazy import.  A module is imported only when a name it declares is asked for or the full list is
needed (`names`, `builtins`), so asking for data set "digits" does not import the torchvision or
LEAF tasks.  To know which module declares a name without importing it, the registry reads each
module's source once (`ast`, no code run): a `REGISTER = {"name": ...}` whose keys are string
literals names its entries; a module without the attribute is no registry module and is never
imported; any other form (a list of classes, a computed dict) is imported when a name is not
found among the literal ones.  The names are derived from the modules rather than kept in a
second, hand-written table that could disagree with them.  An `eager` registry imports every
module on its first lookup: a topology or transport folder declares its protocol methods when
imported, and authorization and the ledger read every kind's (common/wire/methods.py).
"""
from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

from fedhop.common.util.suggest import did_you_mean

T = TypeVar("T")

DEFAULT_ATTRIBUTE = "REGISTER"


class UnknownName(KeyError, ValueError):
    """A name that is neither a built-in of its family nor a plug-in (a KeyError and a ValueError:
    callers caught one or the other before the registries shared one shape)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class _Source:
    """A module of a registry's package and the names it declares (None: known only by importing it)."""

    module: str
    names: tuple[str, ...] | None


def declared_names(source: str, attribute: str) -> tuple[str, ...] | None:
    """The names `attribute` declares in a module's `source`, read without running it: () when the
    module never assigns `attribute`, the keys of a top-level dict literal with string keys, else None.
    A source that names `attribute` once, in a statement at the start of a line, has only that
    statement parsed (a whole module's parse costs tens of milliseconds)."""
    mentions = len(re.findall(rf"\b{re.escape(attribute)}\b", source))
    if not mentions:
        return ()
    lines = source.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(rf"{re.escape(attribute)}\s*(:[^=]*)?=[^=]", line)]
    if len(starts) == 1 and mentions == 1:
        for end in range(starts[0] + 1, len(lines) + 1):
            try:
                tree = ast.parse("\n".join(lines[starts[0]:end]))
            except SyntaxError:
                continue
            return _literal_keys(tree, attribute)
    return _literal_keys(ast.parse(source), attribute)


def _literal_keys(tree: ast.Module, attribute: str) -> tuple[str, ...] | None:
    """`declared_names` on a parsed module (or its one statement that names `attribute`)."""
    names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == attribute]
    stores = [n for n in names if isinstance(n.ctx, ast.Store)]
    if not stores:
        return ()
    values = [stmt.value for stmt in tree.body
              if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attribute for t in stmt.targets)
              or isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == attribute]
    if len(values) != 1 or len(names) != 1 or not isinstance(values[0], ast.Dict):
        return None   # assigned twice, changed or read elsewhere in the module, or not a dict
    keys = values[0].keys
    if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys):
        return None
    return tuple(str(k.value) for k in keys if isinstance(k, ast.Constant))


class Registry(Generic[T]):
    """The built-in and plug-in kinds of one family (module docstring)."""

    def __init__(self, family: str, package: str | None, group: str, *, attribute: str = DEFAULT_ATTRIBUTE,
                 name_of: Callable[[Any], str] | None = None, folders: bool = False, eager: bool = False,
                 check: Callable[[str, Any, str], T] | None = None, plugin: Callable[[str, Any], T] | None = None,
                 order: Callable[[str, T], Any] | None = None, what: str = "Class",
                 error: type[UnknownName] = UnknownName, also: tuple[str, ...] = (), keep: bool = False) -> None:
        self.family, self.package, self.group, self.attribute = family, package, group, attribute
        self.also = also   # names the family's callers take besides its entries (a compressor's "none")
        self.keep = keep   # keep a plug-in's entry after its first load (else `load_plugin` on each lookup)
        self.folders, self.eager, self.what, self.error = folders, eager, what, error
        self._name_of, self._check, self._plugin, self._order = name_of, check, plugin, order
        self._lock = threading.RLock()
        self._sources: list[_Source] | None = None
        self._loaded: set[str] = set()            # modules whose entries are in the table
        self._rank: dict[str, tuple[int, int]] = {}   # built-in name -> (module index, index in its attribute)
        self._complete = False
        self._plugins: set[str] = set()
        #: every kind found so far, built-ins then plug-ins (by the reference the config gives)
        self.table: dict[str, T] = {}

    # ------------------------------------------------------------------ built-ins
    def sources(self) -> list[_Source]:
        """The package's modules that may declare entries, by name, each with the names its source
        declares (module docstring); nothing is imported but the package itself."""
        with self._lock:
            if self._sources is None:
                self._sources = self._scan()
            return self._sources

    def _scan(self) -> list[_Source]:
        if self.package is None:
            return []
        try:
            root = importlib.import_module(self.package)
        except ImportError:   # an optional package of kinds that is not installed
            return []
        found: list[_Source] = []
        if hasattr(root, self.attribute):   # the package's own entries: imported already, so named by them
            found.append(_Source(self.package, tuple(name for name, _ in self._entries(root))))
        for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda i: i.name):
            if info.name.startswith("_") or (self.folders and not info.ispkg):
                continue
            full = f"{self.package}.{info.name}"
            if self.folders:
                found.append(_Source(full, (info.name,)))
                continue
            spec = info.module_finder.find_spec(full, None)
            names: tuple[str, ...] | None = None
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                with open(spec.origin, encoding="utf-8") as fh:
                    names = declared_names(fh.read(), self.attribute)
            if names != ():
                found.append(_Source(full, names))
        return found

    def _entries(self, module: ModuleType) -> Iterator[tuple[str, Any]]:
        value = getattr(module, self.attribute, None)
        if value is None:
            return
        if self.folders:
            yield module.__name__.rpartition(".")[2], value
        elif isinstance(value, Mapping):
            yield from value.items()
        elif isinstance(value, (list, tuple)):
            yield from ((self._name(v), v) for v in value)
        else:
            yield self._name(value), value

    def _name(self, entry: Any) -> str:
        return self._name_of(entry) if self._name_of is not None else str(getattr(entry, "name"))

    def _load(self, index: int, source: _Source) -> None:
        if source.module in self._loaded:
            return
        module = importlib.import_module(source.module)
        for j, (name, raw) in enumerate(self._entries(module)):
            entry = self._check(name, raw, source.module) if self._check is not None else raw
            if name in self._rank and self.table.get(name) is not entry:
                raise RuntimeError(f"{self.family} '{name}' registered twice ({source.module} and "
                                   f"{self.sources()[self._rank[name][0]].module})")
            self.table[name], self._rank[name] = entry, (index, j)
        self._loaded.add(source.module)

    def _load_all(self) -> None:
        if self._complete:
            return
        for i, source in enumerate(self.sources()):
            self._load(i, source)
        rank = self._rank
        order = self._order
        key: Callable[[str], Any] = ((lambda n: (order(n, self.table[n]), rank[n])) if order is not None
                                     else (lambda n: rank[n]))
        ordered = sorted((n for n in self.table if n in rank), key=key)
        rest = {n: e for n, e in self.table.items() if n not in rank}
        snapshot = {**{n: self.table[n] for n in ordered}, **rest}
        self.table.clear()
        self.table.update(snapshot)   # the same dict object: whoever holds `table` sees the order
        self._complete = True

    def find(self, name: str) -> T | None:
        """The built-in entry `name`, importing only the module that declares it (an `eager`
        registry: every module); None when no built-in has that name."""
        with self._lock:
            if name in self._rank and name in self.table:
                return self.table[name]
            if self.eager or self._complete:
                self._load_all()
                return self.table.get(name) if name in self._rank else None
            sources = self.sources()
            for i, source in enumerate(sources):
                if source.names is not None and name in source.names:
                    self._load(i, source)
            if name not in self._rank:
                for i, source in enumerate(sources):
                    if source.names is None:
                        self._load(i, source)
            return self.table.get(name) if name in self._rank else None

    def builtins(self) -> dict[str, T]:
        """Every built-in entry by name, in the registry's order (imports every module)."""
        with self._lock:
            self._load_all()
            return {n: e for n, e in self.table.items() if n in self._rank}

    def names(self) -> list[str]:
        """The built-in names, in the registry's order."""
        return list(self.builtins())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def replace(self, name: str, entry: T) -> None:
        """Put `entry` in place of the built-in or loaded plug-in `name`."""
        with self._lock:
            if self.find(name) is None and name not in self._plugins:
                raise KeyError(f"{self.family} '{name}' is neither built in nor a loaded plug-in")
            self.table[name] = entry

    # ------------------------------------------------------------------ plug-ins
    def add(self, name: str, entry: T) -> None:
        """Keep `entry` under `name` as a plug-in (a name the config gives: an import path, an
        entry point, a name a user's program chose)."""
        with self._lock:
            self.table[name] = entry
            self._plugins.add(name)
            self._rank.pop(name, None)

    def get(self, name: str) -> T:
        """The entry `name`: a built-in, else a plug-in (an import path or an entry point of group
        `fedhop.<group>`, through common/util/plugins.py `load_plugin`); a kept plug-in (`keep`)
        is still checked against this process's allow-list on every lookup.  Raises
        `UnknownName` for a name that is neither, PluginError (a ValueError) for a plug-in that is
        refused, does not load or is not of the family's kind."""
        from fedhop.common.util.plugins import check_allowed, load_plugin
        entry = self.find(name)
        if entry is not None:
            return entry
        with self._lock:
            if name in self.table:   # a kept plug-in, or one `add` put there
                if name in self._plugins:
                    check_allowed(name, self.group)
                return self.table[name]
        try:
            obj = load_plugin(name, self.group)
        except LookupError:
            raise self.unknown(name) from None
        entry = self._plugin(name, obj) if self._plugin is not None else obj
        if self.keep:
            self.add(name, entry)
        return entry

    def available(self) -> list[str]:
        """The built-in names, then the entry points of the group that are not built-in names."""
        from fedhop.common.util.plugins import entry_point_names
        names = [*self.also, *self.names()]
        return names + [n for n in entry_point_names(self.group) if n not in names]

    def unknown(self, name: object) -> UnknownName:
        """The one error for a name of this family that is neither built in nor a plug-in."""
        names = self.available()
        shown = ", ".join(names) + ", or " if names else ""
        return self.error(f"unknown {self.family} '{name}'{did_you_mean(name, names)} (allowed: {shown}an import "
                          f"path 'package.module:{self.what}' or an entry point of group "
                          f"'fedhop.{self.group}')")
