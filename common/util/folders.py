"""Kinds as folders: the sub-packages of a package, imported, for the registries that find their
built-in kinds by scanning (topologies/ through common/topologies, transports/ through
common/transport/factory.py).  Each registry reads its own attribute of each folder's module
(`SPEC`, `TRANSPORT`) and checks its type."""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def folder_modules(package: str) -> dict[str, ModuleType]:
    """The folders of `package` (its sub-packages, names starting with "_" left out), each imported,
    by name in sorted order; {} when `package` itself is not installed."""
    try:
        root = importlib.import_module(package)
    except ImportError:
        return {}
    names = sorted(m.name for m in pkgutil.iter_modules(root.__path__) if m.ispkg and not m.name.startswith("_"))
    return {name: importlib.import_module(f"{package}.{name}") for name in names}
