"""The `fedhop sweep` spec: a TOML file validated into dataclasses (docs/sweep.md).

    [sweep]
    config = "../examples/fedavg_digits.toml"   # base experiment, relative to this file
    algorithms = ["fedavg", "fedexp"]           # values of algorithm.name; one table each
    seeds = [0, 1, 2]                           # values of run.seed
    method = "grid"                             # grid | random | tpe
    trials = 8                                  # random / tpe: settings tried per algorithm
    parallel = 2                                # runs at a time on this machine
    set = ["run.rounds=20"]                     # fixed overrides of every run (as `--set` takes them)
    extend = 3                                  # widen a grid past an edge best up to 3 times (0: only mark it)
    extend_factor = 0.0                         # the step past an edge: 0 = the grid's own ratio there

    [grid]                                      # grid: dotted key -> list of values
    "algorithm.lr" = [0.03, 0.1, 0.3]

    [space]                                     # random / tpe: dotted key -> a distribution
    "algorithm.lr" = { low = 0.01, high = 1.0, log = true }
    "algorithm.local_epochs" = { choices = [1, 2, 5] }

    [criterion]
    kind = "final"            # final | rounds_to_target | bytes_to_target
    metric = "test_accuracy"  # default: test_accuracy, else objective (as `fedhop report`)
    target = 0.9              # rounds_to_target / bytes_to_target
    link = "busiest"          # bytes_to_target: busiest | total | a link name (client-server, edge-server, ...)
    bytes = "tensor"          # tensor | payload | framed

    [per_algorithm.fedexp]    # optional, per algorithm: more fixed overrides, its own grid / space
    set = ["algorithm.eps=0.001"]
    grid = { "algorithm.lr" = [0.1, 1.0] }

Every error is one line naming the bad key (`SweepSpecError`; the CLI exits 2).
"""
from __future__ import annotations

import itertools
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhop.common.config import ConfigError, apply_overrides, build_dataclass, config_from_dict
from fedhop.common.wire.ledger import LINKS

CRITERIA = ("final", "rounds_to_target", "bytes_to_target")
METHODS = ("grid", "random", "tpe")
BYTE_KINDS = ("tensor", "payload", "framed")


class SweepSpecError(ValueError):
    """A bad sweep spec: the message names the key."""


def _f(default: Any = None, *, factory: Any = None, **rules: Any) -> Any:
    if factory is not None:
        return field(default_factory=factory, metadata=rules)
    return field(default=default, metadata=rules)


@dataclass
class SweepSection:
    config: str
    algorithms: list[str] = _f(factory=list)       # empty: the base config's algorithm.name
    seeds: list[int] = _f(factory=lambda: [0])
    method: str = _f("grid", choices=METHODS)
    trials: int = _f(8, min=1)
    parallel: int = _f(1, min=1)
    sampler_seed: int = _f(0, min=0)
    set: list[str] = _f(factory=list)
    extend: int = _f(0, min=0)              # widenings past an edge best per algorithm (deploy/tools/bracket.py)
    extend_factor: float = _f(0.0, min=0.0)  # > 1: the geometric step past an edge (0: the grid's ratio)


@dataclass
class CriterionSection:
    kind: str = _f("final", choices=CRITERIA)
    metric: str = ""
    target: float | None = None
    link: str = "busiest"
    bytes: str = _f("tensor", choices=BYTE_KINDS)


@dataclass
class Dist:
    """One search dimension of a random / TPE search: a range or a list of choices."""

    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: list | None = None


@dataclass
class PerAlgorithm:
    set: list[str] = _f(factory=list)
    grid: dict = _f(factory=dict)
    space: dict = _f(factory=dict)


@dataclass
class SweepSpec:
    path: Path
    sweep: SweepSection
    criterion: CriterionSection
    grid: dict[str, list]
    space: dict[str, Dist]
    per_algorithm: dict[str, PerAlgorithm]
    max_settings: int | None = None   # `--max-settings`: the first N grid settings per algorithm

    @property
    def base_config(self) -> Path:
        p = Path(self.sweep.config)
        return p if p.is_absolute() else (self.path.parent / p)

    def algorithms(self) -> list[str]:
        return self.sweep.algorithms or [""]   # "": the base config's own algorithm

    def fixed_overrides(self, algorithm: str) -> list[str]:
        extra = self.per_algorithm.get(algorithm, PerAlgorithm())
        name = [f"algorithm.name={algorithm}"] if algorithm else []
        return [*self.sweep.set, *name, *extra.set]

    def grid_for(self, algorithm: str) -> dict[str, list]:
        extra = self.per_algorithm.get(algorithm)
        return {**self.grid, **(extra.grid if extra else {})}

    def space_for(self, algorithm: str) -> dict[str, Dist]:
        extra = self.per_algorithm.get(algorithm)
        return {**self.space, **(extra.space if extra else {})}


def _section(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise SweepSpecError(f"sweep spec key '{where}' must be a table, got {data!r}")
    try:
        return build_dataclass(cls, data, where)[0]
    except ConfigError as exc:
        raise SweepSpecError(str(exc).replace("config key", "sweep spec key")) from None


def _check_dotted(key: str, where: str) -> None:
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise SweepSpecError(f"sweep spec key '{where}.\"{key}\"': a swept key must be SECTION.KEY (as --set takes it)")


def _grid(data: Any, where: str) -> dict[str, list]:
    if not isinstance(data, dict):
        raise SweepSpecError(f"sweep spec key '{where}' must be a table of SECTION.KEY = [values]")
    for key, values in data.items():
        _check_dotted(key, where)
        if not isinstance(values, list) or not values:
            raise SweepSpecError(f"sweep spec key '{where}.\"{key}\"': got {values!r}, expected a non-empty list")
    return dict(data)


def _space(data: Any, where: str) -> dict[str, Dist]:
    if not isinstance(data, dict):
        raise SweepSpecError(f"sweep spec key '{where}' must be a table of SECTION.KEY = {{low, high}} or {{choices}}")
    out = {}
    for key, raw in data.items():
        _check_dotted(key, where)
        name = f"{where}.\"{key}\""
        dist = _section(Dist, raw, name)
        if dist.choices is not None:
            if not dist.choices or dist.low is not None or dist.high is not None:
                raise SweepSpecError(f"sweep spec key '{name}': give either a non-empty choices list or low and high")
        elif dist.low is None or dist.high is None or not dist.low < dist.high:
            raise SweepSpecError(f"sweep spec key '{name}': needs low < high (or choices)")
        elif dist.log and dist.low <= 0:
            raise SweepSpecError(f"sweep spec key '{name}': log = true needs low > 0")
        out[key] = dist
    return out


def parse_spec(text: str, path: Path) -> SweepSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SweepSpecError(f"{path}: not valid TOML: {exc}") from None
    allowed = ("sweep", "criterion", "grid", "space", "per_algorithm")
    for key in data:
        if key not in allowed:
            raise SweepSpecError(f"unknown sweep spec key '{key}' (allowed: {', '.join(allowed)})")
    if "sweep" not in data:
        raise SweepSpecError("sweep spec key 'sweep' is required: a [sweep] table with at least config")
    sweep = _section(SweepSection, data["sweep"], "sweep")
    criterion = _section(CriterionSection, data.get("criterion", {}), "criterion")
    if criterion.kind != "final" and criterion.target is None:
        raise SweepSpecError(f"sweep spec key 'criterion.target' is required for criterion.kind = '{criterion.kind}'")
    if criterion.link not in ("busiest", "total", *LINKS):
        raise SweepSpecError(f"sweep spec key 'criterion.link': got {criterion.link!r}, allowed: busiest, total, "
                             f"{', '.join(LINKS)}")
    if 0 < sweep.extend_factor <= 1:
        raise SweepSpecError(f"sweep spec key 'sweep.extend_factor': got {sweep.extend_factor!r}, expected 0 (the "
                             f"grid's own ratio) or a factor > 1")
    check_seeds(sweep.seeds, "sweep spec key 'sweep.seeds'")
    per_algorithm = {}
    raw_per = data.get("per_algorithm", {})
    if not isinstance(raw_per, dict):
        raise SweepSpecError("sweep spec key 'per_algorithm' must be a table of [per_algorithm.NAME] tables")
    for name, raw in raw_per.items():
        if sweep.algorithms and name not in sweep.algorithms:
            raise SweepSpecError(f"sweep spec key 'per_algorithm.{name}': {name!r} is not in sweep.algorithms")
        entry = _section(PerAlgorithm, raw, f"per_algorithm.{name}")
        entry.grid = _grid(entry.grid, f"per_algorithm.{name}.grid")
        entry.space = _space(entry.space, f"per_algorithm.{name}.space")
        per_algorithm[name] = entry
    spec = SweepSpec(path=path, sweep=sweep, criterion=criterion, grid=_grid(data.get("grid", {}), "grid"),
                     space=_space(data.get("space", {}), "space"), per_algorithm=per_algorithm)
    if sweep.method != "grid" and not any(spec.space_for(a) for a in spec.algorithms()):
        raise SweepSpecError(f"sweep spec key 'space': sweep.method = '{sweep.method}' needs a [space] table")
    check_base_config(spec)
    return spec


MAX_SEED = (1 << 63) - 1   # run.seed's range (common/config/schema.py)
MAX_CHECKED_POINTS = 10_000   # grid points checked before a sweep starts (more: the first point only)


def check_seeds(seeds: list[int], where: str) -> None:
    """The seeds of a sweep: at least one, distinct, each a valid run.seed."""
    if not seeds or len(set(seeds)) != len(seeds) or not all(0 <= s <= MAX_SEED for s in seeds):
        raise SweepSpecError(f"{where}: got {seeds!r}, expected distinct seeds from 0 to {MAX_SEED}")


def check_base_config(spec: SweepSpec) -> None:
    """Every algorithm's fixed overrides with each point of its grid (up to MAX_CHECKED_POINTS of
    them; a random search's first point) must make a valid config, so a misspelt key or a value
    that does not fit the base config fails here, at once, not in a run."""
    path = spec.base_config
    try:
        base = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SweepSpecError(f"sweep spec key 'sweep.config': cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SweepSpecError(f"sweep spec key 'sweep.config': {path} is not valid TOML: {exc}") from None
    for algorithm in spec.algorithms():
        for probe in _points(spec, algorithm):
            try:
                config_from_dict(apply_overrides(_copy(base), [*spec.fixed_overrides(algorithm), *probe]))
            except ConfigError as exc:
                where = f"per_algorithm.{algorithm}" if algorithm else "sweep"
                setting = f" with {', '.join(probe)}" if len(probe) > 0 and spec.sweep.method == "grid" else ""
                raise SweepSpecError(f"sweep spec ({where}, base {path.name}{setting}): {exc}") from None


def _points(spec: SweepSpec, algorithm: str) -> list[list[str]]:
    """The settings `check_base_config` checks: a grid's every point (its first only past
    MAX_CHECKED_POINTS), a random search's first."""
    if spec.sweep.method != "grid":
        return [[f"{k}={toml_value(d.choices[0] if d.choices is not None else d.low)}"
                 for k, d in spec.space_for(algorithm).items()]]
    grid = spec.grid_for(algorithm)
    points = math.prod(len(v) for v in grid.values())
    combos = itertools.product(*grid.values()) if points <= MAX_CHECKED_POINTS else [tuple(v[0] for v in grid.values())]
    return [[f"{k}={toml_value(v)}" for k, v in zip(grid, combo)] for combo in combos]


def setting_error(spec: SweepSpec, algorithm: str, overrides: list[str]) -> str | None:
    """Why the base config with `algorithm`'s fixed overrides and `overrides` is not a valid config
    (one line), or None."""
    try:
        base = tomllib.loads(spec.base_config.read_text())
        config_from_dict(apply_overrides(base, [*spec.fixed_overrides(algorithm), *overrides]))
    except (OSError, tomllib.TOMLDecodeError, ConfigError) as exc:
        return str(exc)
    return None


def _copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_copy(v) for v in data]
    return data


def toml_value(v: Any) -> str:
    """A value as `--set` reads it back (TOML), so 0.1 stays a float and "x" a string."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def load_spec(path: str | Path) -> SweepSpec:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SweepSpecError(f"cannot read sweep spec {p}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SweepSpecError(f"sweep spec {p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                             f"{exc.start})") from None
    return parse_spec(text, p)
