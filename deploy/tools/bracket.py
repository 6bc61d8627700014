"""Bracketing a sweep's best setting (docs/sweep.md, "Bracketed grids").

A tuned comparison is only as good as its grid: a best setting whose value of some swept key is
the smallest or largest value tried may be beaten by a value beyond it, so the verdict that rests
on it is not bracketed.  `edges` names those keys for one algorithm; `widen` proposes the next
point beyond each edge, one key at a time from the best setting (a line search along that key,
not a new product grid), stepping geometrically by the grid's own ratio at that edge.

Which keys count: a grid key with at least two distinct numeric values; a random / TPE range
key (`low`, `high`), whose best is on the edge when it lies in the outer EDGE_FRACTION of the span
of the range and every value tried (in log space for `log = true`).  Choices and strings are not
ordered, so they are never on an edge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from fedhop.deploy.tools.sweep_spec import Dist

EDGE_FRACTION = 0.1     # random / TPE: the outer part of a range that counts as its edge
DEFAULT_FACTOR = 3.0    # the step beyond an edge when the grid gives no ratio (a range, one value)


@dataclass(frozen=True)
class Edge:
    """The best setting's value of `key` is the `side` ("low" / "high") end of the values tried."""

    key: str
    value: float | int
    side: str
    tried: tuple[float | int, ...]     # distinct values tried for the key, ascending
    log: bool | None = None            # a random / TPE range key (None: a grid key): whether its range is log

    def describe(self) -> str:
        word = "smallest" if self.side == "low" else "largest"
        tried = ", ".join(map(_g, self.tried))
        return f"{self.key.split('.')[-1]}={_g(self.value)} is the {word} value tried ({tried})"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "side": self.side, "tried": list(self.tried)}


def _g(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def edges(best: dict[str, Any], tried: list[dict[str, Any]], space: dict[str, Dist] | None = None) -> list[Edge]:
    """The keys on whose edge `best` lies, given every setting tried (`tried`, best included) and,
    for a random / TPE search, its ranges (`space`)."""
    out = []
    for key, value in sorted(best.items()):
        if not _numeric(value):
            continue
        values = sorted({v for s in tried for k, v in s.items() if k == key and _numeric(v)})
        dist = (space or {}).get(key)
        if dist is not None and dist.choices is None:
            lo, hi = min(dist.low, values[0]), max(dist.high, values[-1])
            scale = (lambda x: math.log(x)) if dist.log and lo > 0 else (lambda x: float(x))
            span = scale(hi) - scale(lo)
            if span <= 0:
                continue
            where = (scale(value) - scale(lo)) / span
            if where <= EDGE_FRACTION or where >= 1 - EDGE_FRACTION:
                out.append(Edge(key, value, "low" if where <= EDGE_FRACTION else "high", tuple(values),
                                bool(dist.log and lo > 0)))
            continue
        if len(values) < 2:
            continue
        if value == values[0]:
            out.append(Edge(key, value, "low", tuple(values)))
        elif value == values[-1]:
            out.append(Edge(key, value, "high", tuple(values)))
    return out


def step_beyond(edge: Edge, factor: float = 0.0) -> float | int | None:
    """The next value past `edge`: the edge value times (or divided by) the ratio between it and its
    neighbour among the values tried (`factor` > 1 overrides it; DEFAULT_FACTOR for a single value);
    where the two have different signs or one is 0, the same arithmetic step instead.  Integer
    keys stay integers and move by at least 1.  None: no step is possible."""
    values, v = edge.tried, edge.value
    neighbour = (values[1] if edge.side == "low" else values[-2]) if len(values) > 1 else None
    if edge.log is False:                               # a linear range: half the span of the values tried
        neighbour = v - (values[-1] - values[0]) / 2 if edge.side == "high" else v + (values[-1] - values[0]) / 2
        ratio = None
    elif edge.log or (factor and factor > 1):
        ratio = factor if factor and factor > 1 else DEFAULT_FACTOR
    elif neighbour is not None and v * neighbour > 0 and v != neighbour:
        ratio = max(v / neighbour, neighbour / v)
    elif neighbour is None:
        ratio = DEFAULT_FACTOR
    else:
        ratio = None
    if ratio is not None and v != 0:
        grow = (edge.side == "high") == (v > 0)        # moving away from 0 multiplies
        new = v * ratio if grow else v / ratio
    elif neighbour is not None:
        new = v + (v - neighbour)
    else:
        return None
    if isinstance(v, int) and all(isinstance(x, int) for x in values):
        new = round(new)
        if new == v:
            new = v + (1 if edge.side == "high" else -1)
        return int(new)
    return float(new)


def widen(best: dict[str, Any], found: list[Edge], tried: list[dict[str, Any]], factor: float = 0.0,
          valid: Callable[[dict[str, Any]], str | None] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The settings to run next: for each edge, `best` with that key moved one step beyond it (not
    tried yet, and accepted by `valid`, which returns why a setting is not a valid config).
    Returns (settings, notes on edges that cannot be widened)."""
    new, notes = [], []
    seen = [dict(s) for s in tried]
    for edge in found:
        value = step_beyond(edge, factor)
        if value is None:
            notes.append(f"{edge.key}: no step beyond {_g(edge.value)}")
            continue
        setting = {**best, edge.key: value}
        if setting in seen:
            continue
        why = valid(setting) if valid is not None else None
        if why:
            notes.append(f"{edge.key}={_g(value)}: {why}")
            continue
        seen.append(setting)
        new.append(setting)
    return new, notes
