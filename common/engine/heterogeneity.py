"""System heterogeneity: straggler draws and per-client device profiles ([clients] keys).

Two independent random decisions, each from its own named seeded stream (common/util/rng.py), so
they are the same for every algorithm and every topology run with the same seed and config:

- **Stragglers** (stream ``("stragglers", round)``): which sampled clients do only part of their
  local work this round, and how much of it.  FedLGA's digest D2 gives two readings of the
  paper (seed-002.md section 2.4), both offered as ``clients.straggler_mode``:

  * ``"exact"`` (default): exactly K1 = round(rho * K) of the K sampled clients straggle; each
    misses m_i ~ U{1..tau_max} units of work, does E_i = E - m_i and reports tau_i = m_i + 1.
  * ``"literal"``: K1 clients are picked the same way, tau_i ~ U{1..tau_max} and
    E_i = E - tau_i + 1, so a "straggler" with tau_i = 1 does full work (effective rho lower).

  A unit of work is an epoch when ``algorithm.local_steps = 0`` and a step otherwise;
  tau_max = ``clients.straggler_tau_max`` (0 means E - 1).

- **Device profiles** (stream ``("devices", client, attribute)``): a compute slowdown factor and
  uplink/downlink bandwidths per client, each drawn once from a named distribution, listed per
  client, or read from a CSV trace.  Only the server needs them (common/engine/vclock.py).

Who decides: the **server** draws the straggler plan and sends it in the round's broadcast
message as the JSON scalar ``straggler_plan`` = {"client id": E_i, ...} (only the clients that do
less than full work; absent when there are none), so the ledger counts it and edges forward it
unchanged.  The client host applies it to the `ClientContext` (`apply_straggler_plan`): fewer
local epochs/steps, and ``ctx.info`` gets ``straggler``, ``work``, ``full_work`` and ``tau``.
"""
from __future__ import annotations

import csv
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fedhop.common.util.rng import numpy_stream
from fedhop.common.util.views import IndexedView

PLAN_KEY = "straggler_plan"           # broadcast scalar: JSON {"cid": work units this round}
ATTRIBUTES = ("slowdown", "uplink_mbps", "downlink_mbps")
DISTRIBUTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (required keys, optional keys)
    "constant": (("value",), ()),
    "uniform": (("low", "high"), ()),
    "normal": (("mean", "std"), ("min",)),
    "lognormal": (("median", "sigma"), ()),
    "pareto": (("shape", "scale"), ()),
    "classes": (("values",), ("probs",)),
    "per_client": (("values",), ()),
}


# ----------------------------------------------------------------------------- config
@dataclass
class DevicesParams:
    """Extra [clients] keys (validated by the config loader; see docs/heterogeneity.md).

    `slowdown`, `uplink_mbps`, `downlink_mbps`: a number (every client the same) or a
    distribution as an inline table, e.g. ``{dist = "classes", values = [1.0, 4.0]}``,
    ``{dist = "lognormal", median = 10.0, sigma = 0.5}``, ``{dist = "per_client", values = [...]}``.
    A bandwidth of 0 means unlimited (no communication time).  `trace` names a CSV file whose
    columns (any of slowdown, uplink_mbps, downlink_mbps, and optionally client) override them.

    `straggler_mode`: how stragglers' work is cut (docs/heterogeneity.md): "exact" (E - m of E
        units) or "literal" (E - tau + 1)
    `compute_time`: a client's simulated compute time: local steps times step_seconds ("steps") or
        the measured local-solver time ("measured"), times its slowdown
    `bytes_kind`: which ledger byte count the simulated clock charges: "framed", "payload" or
        "tensor"
    `slowdown`: compute time multiplier (1 = the reference device): a number, or a distribution
        table such as {dist = "lognormal", median = 2.0, sigma = 0.5} (docs/heterogeneity.md)
    `uplink_mbps`: megabit/s client -> parent, 0 = unlimited: a number or a distribution table (like
        slowdown)
    `downlink_mbps`: megabit/s parent -> client, 0 = unlimited: a number or a distribution table
        (like slowdown)
    """

    straggler_mode: str = field(default="exact", metadata={"choices": ("exact", "literal")})
    straggler_tau_max: int = field(default=0, metadata={"min": 0})      # 0 = E - 1
    slowdown: float | dict = 1.0            # compute time multiplier (1 = the reference device)
    uplink_mbps: float | dict = 0.0         # megabit/s client -> parent; 0 = unlimited
    downlink_mbps: float | dict = 0.0       # megabit/s parent -> client; 0 = unlimited
    trace: str = ""                         # CSV device trace (overrides the three above per column)
    compute_time: str = field(default="steps", metadata={"choices": ("steps", "measured")})
    step_seconds: float = field(default=0.01, metadata={"min": 0.0})   # reference seconds per local step
    latency_seconds: float = field(default=0.0, metadata={"min": 0.0})  # per message, each direction
    bytes_kind: str = field(default="framed", metadata={"choices": ("framed", "payload", "tensor")})
    deadline_seconds: float = field(default=0.0, metadata={"min": 0.0})  # 0 = no deadline
    overcommit: float = field(default=1.0, metadata={"min": 1.0})        # sample ceil(c * S), keep S
    sleep_scale: float = field(default=0.0, metadata={"min": 0.0})      # real s slept per simulated s

    def __post_init__(self) -> None:
        for attr in ATTRIBUTES:
            check_distribution(f"clients.{attr}", getattr(self, attr), attr != "slowdown")


def devices_params_class(_choice: Any = None) -> type:
    """The [clients] options schema (registered in common/config/__init__.py for every choice)."""
    return DevicesParams


def devices_params(cfg: Any) -> DevicesParams:
    params = getattr(cfg.clients, "params", None)
    return params if isinstance(params, DevicesParams) else DevicesParams(**getattr(cfg.clients, "options", {}))


def check_distribution(key: str, spec: float | int | dict, allow_zero: bool) -> None:
    """Raise ValueError naming `key` unless `spec` is a valid number or distribution table."""
    if isinstance(spec, bool):
        raise ValueError(f"config key '{key}': got {spec!r}, expected a number or a distribution table")
    if isinstance(spec, (int, float)):
        if not math.isfinite(spec) or spec < 0 or (spec == 0 and not allow_zero):
            raise ValueError(f"config key '{key}': got {spec!r}, must be {'>= 0' if allow_zero else '> 0'}")
        return
    if not isinstance(spec, dict):
        raise ValueError(f"config key '{key}': got {spec!r}, expected a number or a distribution table")
    dist = spec.get("dist")
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"config key '{key}.dist': got {dist!r}, allowed: {', '.join(DISTRIBUTIONS)}")
    required, optional = DISTRIBUTIONS[dist]
    for k in spec:
        if k != "dist" and k not in required + optional:
            raise ValueError(f"config key '{key}.{k}': not a parameter of dist = '{dist}' "
                             f"(allowed: {', '.join(required + optional)})")
    for k in required:
        if k not in spec:
            raise ValueError(f"config key '{key}.{k}' is required for dist = '{dist}'")
    for k, v in spec.items():
        if k == "dist":
            continue
        values = v if isinstance(v, list) else [v]
        if not values or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                 and x >= 0 for x in values):
            raise ValueError(f"config key '{key}.{k}': got {v!r}, expected non-negative finite number(s)")
    if dist == "uniform" and spec["low"] > spec["high"]:
        raise ValueError(f"config key '{key}': low = {spec['low']} > high = {spec['high']}")
    if dist == "pareto" and (spec["shape"] <= 0 or spec["scale"] <= 0):
        raise ValueError(f"config key '{key}': pareto shape and scale must be > 0")
    if dist == "classes" and "probs" in spec:
        probs = spec["probs"]
        if len(probs) != len(spec["values"]) or abs(sum(probs) - 1.0) > 1e-6:
            raise ValueError(f"config key '{key}.probs': got {probs!r}, must have one entry per value "
                             f"({len(spec['values'])}) and sum to 1")
    if not allow_zero:
        vals = [spec[k] for k in ("value", "low", "median", "scale") if k in spec] + list(spec.get("values", []))
        if any(v == 0 for v in vals):
            raise ValueError(f"config key '{key}': a slowdown must be > 0, got {spec!r}")


def draw_attribute(spec: float | int | dict, seed: int, client: int, count: int, attribute: str) -> float:
    """One client's value of a device attribute, from stream ("devices", client, attribute)."""
    if isinstance(spec, (int, float)):
        return float(spec)
    dist = spec["dist"]
    if dist == "per_client":
        values = spec["values"]
        if len(values) != count:
            raise ValueError(f"config key 'clients.{attribute}': dist = 'per_client' needs clients.count = "
                             f"{count} values, got {len(values)}")
        return float(values[client])
    rng = numpy_stream(seed, "devices", client, attribute)
    if dist == "constant":
        return float(spec["value"])
    if dist == "uniform":
        return float(rng.uniform(spec["low"], spec["high"]))
    if dist == "normal":
        return float(max(rng.normal(spec["mean"], spec["std"]), spec.get("min", 1e-3)))
    if dist == "lognormal":
        return float(spec["median"] * math.exp(rng.normal(0.0, spec["sigma"])))
    if dist == "pareto":  # classical Pareto(shape) with minimum `scale`
        return float(spec["scale"] * (1.0 + rng.pareto(spec["shape"])))
    if dist == "classes":
        values = spec["values"]
        probs = spec.get("probs") or [1.0 / len(values)] * len(values)
        return float(values[int(rng.choice(len(values), p=probs))])
    raise ValueError(f"config key 'clients.{attribute}.dist': unknown distribution {dist!r}")  # pragma: no cover


@dataclass(frozen=True)
class DeviceProfile:
    """One client's device: compute slowdown and link bandwidths (0 = unlimited)."""

    slowdown: float = 1.0
    uplink_mbps: float = 0.0
    downlink_mbps: float = 0.0


def read_trace(path: str | Path) -> list[dict[str, float]]:
    """Rows of a CSV device trace: columns among client, slowdown, uplink_mbps, downlink_mbps."""
    path = Path(path)
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            columns = [c.strip() for c in (reader.fieldnames or [])]
            unknown = [c for c in columns if c not in ATTRIBUTES + ("client",)]
            if unknown or not any(c in ATTRIBUTES for c in columns):
                raise ValueError(f"config key 'clients.trace': {path} has columns {columns}; allowed: client, "
                                 f"{', '.join(ATTRIBUTES)} (at least one of the last three)")
            rows = []
            for n, row in enumerate(reader, start=2):
                out = {}
                for k, v in row.items():
                    try:
                        out[k.strip()] = float(v)
                    except (TypeError, ValueError):
                        raise ValueError(f"config key 'clients.trace': {path} line {n}: column {k!r} "
                                         f"= {v!r} is not a number") from None
                    if not math.isfinite(out[k.strip()]) or out[k.strip()] < 0:
                        raise ValueError(f"config key 'clients.trace': {path} line {n}: {k} = {v} must be a "
                                         f"finite number >= 0")
                if out.get("slowdown", 1.0) <= 0:
                    raise ValueError(f"config key 'clients.trace': {path} line {n}: slowdown must be > 0")
                rows.append(out)
    except OSError as exc:
        raise ValueError(f"config key 'clients.trace': cannot read {path}: {exc.strerror}") from None
    if not rows:
        raise ValueError(f"config key 'clients.trace': {path} has no data rows")
    return rows


class DeviceProfiles(IndexedView[DeviceProfile]):
    """Every client's profile, drawn when asked: client c's attributes come from its own streams
    ("devices", c, attribute), so drawing one costs the same whatever the number of clients and
    holding the sequence costs nothing per registered client (a run of 1,000,000 clients looks
    up only the sampled ones; docs/performance.md, the scale section).  Where every attribute is
    one number and there is no trace, every client shares one profile.  Trace rows map to
    clients by their `client` column when present (every client must then have a row), else
    client i takes row i mod (number of rows).  A config the draws cannot serve (a per-client
    list of the wrong length, a trace missing a client) raises ValueError here, not at the
    first look-up."""

    CACHED = 1 << 16   # the profiles kept drawn (the clients sampled most recently)

    def __init__(self, params: DevicesParams, seed: int, count: int) -> None:
        self.params, self.seed, self.clients = params, seed, count
        self._rows: dict[int, dict[str, float]] | list[dict[str, float]] | None = None
        if params.trace:
            rows = read_trace(params.trace)
            if any("client" in r for r in rows):
                by_client = {int(r["client"]): r for r in rows}
                missing = [c for c in range(count) if c not in by_client]
                if missing:
                    raise ValueError(f"config key 'clients.trace': {params.trace} has no row for clients "
                                     f"{missing[:10]} (the client column must list 0..{count - 1})")
                self._rows = by_client
            else:
                self._rows = rows
        self._shared = (DeviceProfile(**{a: float(getattr(params, a)) for a in ATTRIBUTES})
                        if self._rows is None and all(isinstance(getattr(params, a), (int, float)) for a in ATTRIBUTES)
                        else None)
        self._draw = functools.lru_cache(maxsize=self.CACHED)(self._profile)
        if count:
            self[0]   # a per-client list of the wrong length fails now

    def _profile(self, c: int) -> DeviceProfile:
        rows = self._rows
        row = (rows.get(c, {}) if isinstance(rows, dict) else rows[c % len(rows)]) if rows is not None else {}
        return DeviceProfile(**{attr: row[attr] if attr in row else
                                draw_attribute(getattr(self.params, attr), self.seed, c, self.clients, attr)
                                for attr in ATTRIBUTES})

    def __len__(self) -> int:
        return self.clients

    def _at(self, c: int) -> DeviceProfile:
        return self._shared if self._shared is not None else self._draw(c)


def device_profiles(params: DevicesParams, seed: int, count: int) -> list[DeviceProfile]:
    """Every client's profile as a list (`DeviceProfiles` draws them one at a time)."""
    return list(DeviceProfiles(params, seed, count))


# ----------------------------------------------------------------------------- stragglers
@dataclass(frozen=True)
class StragglerDraw:
    """One sampled client's work this round: `work` of `full_work` units, tau = E - E_i + 1."""

    work: int
    full_work: int

    @property
    def tau(self) -> int:
        return self.full_work - self.work + 1


def straggler_count(rho: float, k: int) -> int:
    """K1 = round(rho * K), halves rounded up (Python's round() would round 2.5 to 2)."""
    return min(k, int(math.floor(rho * k + 0.5)))


def draw_stragglers(seed: int, round: int, sampled: list[int], rho: float, full_work: Mapping[int, int],
                    tau_max: int = 0, mode: str = "exact") -> dict[int, StragglerDraw]:
    """The straggler plan of one round: client -> StragglerDraw, for clients doing less than E.

    Stream ("stragglers", round): first a permutation of the sorted sampled ids (the first K1
    straggle), then one integer per straggler in increasing id order.  Nothing here depends on
    the algorithm, so every algorithm sees the same pattern for the same seed (fair comparisons).
    """
    if mode not in ("exact", "literal"):
        raise ValueError(f"config key 'clients.straggler_mode': got {mode!r}, allowed: exact, literal")
    ids = sorted(sampled)
    k1 = straggler_count(rho, len(ids))
    if k1 == 0:
        return {}
    rng = numpy_stream(seed, "stragglers", round)
    order = rng.permutation(len(ids))
    chosen = sorted(ids[int(i)] for i in order[:k1])
    plan = {}
    for cid in chosen:
        full = int(full_work[cid])
        cap = min(tau_max, full - 1) if tau_max > 0 else full - 1
        if cap < 1:
            raise ValueError(f"clients.straggler_fraction = {rho} needs at least 2 units of local work per "
                             f"client (client {cid} has {full}: raise algorithm.local_epochs or local_steps)")
        draw = int(rng.integers(1, cap + 1))
        work = full - draw if mode == "exact" else full - draw + 1
        if work < full:
            plan[cid] = StragglerDraw(work=work, full_work=full)
    return plan


def plan_to_scalar(plan: Mapping[int, StragglerDraw]) -> str:
    return json.dumps({str(c): d.work for c, d in sorted(plan.items())}, separators=(",", ":"))


def apply_straggler_plan(ctx: Any, message: Any) -> None:
    """Client side: cut this client's local work to its planned E_i (from the message's plan scalar).

    Called by the client host before the local solver runs; every algorithm then does the
    reduced work through `ctx.local_epochs` / `ctx.local_steps` and may read `ctx.info`.
    """
    raw = message.scalars.get(PLAN_KEY)   # read, not popped: one message may serve several clients
    if raw is None:
        return
    from fedhop.common.wire.codec import PayloadError  # local import: codec imports the algorithm base
    try:
        plan = json.loads(str(raw))
        if not isinstance(plan, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raise PayloadError("BAD_SCALAR", f"{PLAN_KEY} is not a JSON object of client id -> work ({exc})") from None
    full = ctx.local_steps if ctx.local_steps > 0 else ctx.local_epochs
    work = plan.get(str(ctx.client_id))
    if work is None:
        ctx.info.update(straggler=False, work=full, full_work=full, tau=1)
        return
    if not isinstance(work, int) or isinstance(work, bool) or not 1 <= work < full:
        raise PayloadError("BAD_SCALAR", f"{PLAN_KEY}: work {work!r} for client {ctx.client_id} must be an int "
                                         f"in [1, {full - 1}]")
    if ctx.local_steps > 0:
        ctx.local_steps = work
    else:
        ctx.local_epochs = work
    ctx.info.update(straggler=True, work=work, full_work=full, tau=full - work + 1)
