"""fedhop: federated learning with real processes, edge tiers and exact communication accounting.

The Python API (docs/api.md)::

    import fedhop
    result = fedhop.run("exp.toml", set={"run.seed": 1}, out="runs/seed1")
    result.summary, result.rounds, result.totals, result.by_link
    frame = result.to_pandas()            # with pandas installed
    again = fedhop.load("runs/seed1")     # the same object for a finished run

This folder (api/ in the repository) is installed as the package `fedhop`; its sub-packages are
the repository's other top-level folders (fedhop.common is common/, ...; pyproject.toml).
Importing it is cheap: the names below load deploy/api.py (and with it torch) on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # for type checkers and editors only; at run time, __getattr__ below
    from fedhop.common.config import ConfigError
    from fedhop.deploy.api import RunFailed, RunResult, load, run

__all__ = ["run", "load", "RunResult", "RunFailed", "ConfigError", "__version__"]

_LAZY = {"run": "fedhop.deploy.api", "load": "fedhop.deploy.api", "RunResult": "fedhop.deploy.api",
         "RunFailed": "fedhop.deploy.api", "ConfigError": "fedhop.common.config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("fedhop")
        except PackageNotFoundError:
            return "unknown"
    raise AttributeError(f"module 'fedhop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
