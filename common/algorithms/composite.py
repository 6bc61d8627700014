"""Federated composite optimisation, min_w sum_k p_k L_k(w) + lam R(w), R = l1 or nuclear norm:
shared machinery and the two baselines of Yuan, Zaheer & Reddi (2021), FedMiD and FedDA.

The three dual-averaging methods of Bao et al. (ICML 2022; digest research/seed-001.md),
Fast-FedDA, C-FedDA and MC-FedDA, live in `common.algorithms.dual_averaging` and use the
machinery here.  Config: `[algorithm] regularizer = "l1" | "nuclear"`, `reg = lam`;
`lr` = eta_c and `server_lr` = eta_s for the baselines.

Which tensors are regularised: l1 applies to every parameter except those named `*bias`;
nuclear applies to every 2-D parameter (a linear layer's weight, the low-rank task's W); the
rest are left unregularised (paper: "the code uses no bias", digest 2.6).

Numerics (digest 2.1, 7 "State"): every algorithm state (primal iterate, dual sums) is kept in
float64, on the server in `ServerState.extra` and on the client during its round; the wire
carries the tensors in `wire_dtype` ("float32", what the papers count, or "float64") and the
ledger counts exactly those bytes.  A client casts what it receives to float64 and its reply
(a difference of its float64 state) to `wire_dtype`.

Messages per sampled client and round (p = model entries; digest 2.6):

    algorithm   downlink                 uplink        server step
    fedmid      w            (p)         dw  (p)       w <- prox_{eta_s eta_c lam R}(w + eta_s mean dw)
    fedda       z + round    (p)         dz  (p)       z <- z + eta_s mean dz; w = prox(z)
    fast_fedda  g, w~ + t    (2p)        dg, dw~ (2p)  see dual_averaging.py
    c_fedda     g, w~ + r    (2p)        dg  (p)
    mc_fedda    as c_fedda, + w0 (p) in stages >= 1

Every reply is a weighted sum over clients ("wsum" in `reply_reduce`), so an edge server
pre-aggregates its clients and the server's step is unchanged (hierarchical topology with
kappa2 = 1; an edge-level prox between kappa2 > 1 iterations is not defined by the papers and
is refused).

FedMiD (Yuan et al. 2021, Algorithm 2 with psi = 1/2 ||.||^2; the server prox scale eta_s eta_c
lam follows the authors' reference code, digest 3):
    client: E steps  w <- prox_{eta_c lam R}(w - eta_c grad f(w; xi)),  from the server model
    server: w <- prox_{eta_s eta_c lam R}(w + eta_s sum_k p_k (w_k - w))
FedDA / FedDualAvg (Yuan et al. 2021, Algorithm 3, psi = 1/2 ||.||^2, round r = 0, 1, ...):
    client: z_c = z; for k = 0..E-1: eta~ = eta_s eta_c r E + eta_c k; w = prox_{eta~ lam R}(z_c);
            z_c <- z_c - eta_c grad f(w; xi)
    server: z <- z + eta_s sum_k p_k (z_c^k - z);  model w = prox_{eta_s eta_c (r+1) E lam R}(z)
    (z_0 = w_0.  The reference code's r is 1-based; we follow the paper's 0-based r.)

Each algorithm's client loop is a generator, `local_solver` (common/algorithms/solver.py
`SolverAlgorithm`): it yields the point of each local step (float64) and is sent the minibatch
gradient there.  One at a time the gradient is taken on the process's model; under [algorithm]
vectorized the solvers of a call's clients run side by side and each step's gradients come
from one stacked computation.  The solvers' updates (the proxes, the dual sums) are the same
code either way, run for each client alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from fedhop.common.algorithms.base import AlgorithmParams, ClientContext, Payload, ServerState, weighted_mean
from fedhop.common.algorithms.local import LocalStats
from fedhop.common.algorithms.solver import SolverAlgorithm
from fedhop.common.algorithms.vectorized import Solver, Tensors
from fedhop.common.numerics.prox import group_prox

F64 = torch.float64
WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}
WEIGHT_SCHEDULES = ("uniform", "poly2")
GAMMA_CONVENTIONS = ("code", "paper")


# ---------------------------------------------------------------------------- params
def check_fields(obj: Any, where: str = "algorithm") -> None:
    """Enforce the `choices` / `min` / `max` / `min_exclusive` / `max_exclusive` metadata of a Params dataclass
    (the config loader does too; this keeps direct construction in tests honest)."""
    for f in dataclasses.fields(obj):
        value, rules = getattr(obj, f.name), f.metadata
        at = f"{where}.{f.name} = {value!r}"
        if "choices" in rules and value not in rules["choices"]:
            raise ValueError(f"{at} is not allowed (allowed: {', '.join(map(str, rules['choices']))})")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if "min" in rules and value < rules["min"]:
                raise ValueError(f"{at}: must be >= {rules['min']}")
            if "max" in rules and value > rules["max"]:
                raise ValueError(f"{at}: must be <= {rules['max']}")
            if "max_exclusive" in rules and value >= rules["max_exclusive"]:
                raise ValueError(f"{at}: must be < {rules['max_exclusive']}")
            if "min_exclusive" in rules and value <= rules["min_exclusive"]:
                raise ValueError(f"{at}: must be > {rules['min_exclusive']}")


def wire_field() -> Any:
    return field(default="float32", metadata={"choices": tuple(WIRE_DTYPES)})


@dataclass
class BaselineParams(AlgorithmParams):
    """FedMiD / FedDA: eta_c = [algorithm] lr, eta_s = server_lr; only the wire dtype is their own.

    `wire_dtype`: dtype of the tensors on the wire (float64: the exact float64 sums, twice the
        bytes)
    """

    wire_dtype: str = wire_field()

    def __post_init__(self) -> None:
        check_fields(self)


# ---------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class WeightSchedule:
    """Dual-averaging weights alpha_t and their running totals A_t = sum_{i=0}^t alpha_i.

    "uniform": alpha_t = 1 (the authors' code, A_t = t + 1);
    "poly2":   alpha_t = (t + a)^2 (Theorems 2.1 / 3.1),
               A_t = (t+1) a^2 + a t (t+1) + t (t+1) (2t+1) / 6.
    A_{-1} = 0 (no gradient yet).  Totals reach ~1e17 for long poly2 runs, which is why the
    algorithms keep their sums in float64.
    """

    kind: str = "uniform"
    a: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_SCHEDULES:
            raise ValueError(f"algorithm.weights = {self.kind!r} is not allowed (allowed: {', '.join(WEIGHT_SCHEDULES)})")

    def alpha(self, t: int) -> float:
        return 1.0 if self.kind == "uniform" else float((t + self.a) ** 2)

    def total(self, t: int) -> float:
        if t < 0:
            return 0.0
        if self.kind == "uniform":
            return float(t + 1)
        a = self.a
        return float((t + 1) * a * a + a * t * (t + 1) + t * (t + 1) * (2 * t + 1) / 6)


# ---------------------------------------------------------------------------- helpers
def regularized_kinds(shapes: Mapping[str, tuple[int, ...]], regularizer: str) -> dict[str, str]:
    """name -> "l1" | "nuclear" | "none" (see the module docstring for the rule)."""
    if regularizer not in ("none", "l1", "nuclear"):
        raise ValueError(f"algorithm.regularizer = {regularizer!r} is not allowed (allowed: none, l1, nuclear)")
    kinds = {}
    for name, shape in shapes.items():
        if regularizer == "l1":
            kinds[name] = "none" if name.split(".")[-1] == "bias" else "l1"
        elif regularizer == "nuclear":
            kinds[name] = "nuclear" if len(shape) == 2 else "none"
        else:
            kinds[name] = "none"
    if regularizer == "nuclear" and all(k == "none" for k in kinds.values()):
        raise ValueError(f"algorithm.regularizer = 'nuclear' needs a matrix (2-D) parameter; the model has "
                         f"{', '.join(f'{n}{tuple(s)}' for n, s in shapes.items())}")
    return kinds


def to64(tensors: Mapping[str, torch.Tensor]) -> Tensors:
    return {n: t.detach().to(F64).clone() for n, t in tensors.items()}


def prefixed(prefix: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> Tensors:
    """{prefix/name: tensor} (cast to `dtype` for the wire when given)."""
    return {f"{prefix}/{n}": (t.to(dtype) if dtype is not None else t) for n, t in tensors.items()}


def unprefixed(prefix: str, tensors: Mapping[str, torch.Tensor], names: list[str]) -> Tensors:
    """The float64 copies of {name: tensors[prefix/name]}; names a missing tensor clearly."""
    out = {}
    for n in names:
        key = f"{prefix}/{n}"
        if key not in tensors:
            raise ValueError(f"message lacks tensor '{key}' (has: {', '.join(sorted(tensors))})")
        out[n] = tensors[key].to(F64)
    return out


def axpy(y: Tensors, a: float, x: Mapping[str, torch.Tensor]) -> Tensors:
    """y + a x, tensor by tensor (new tensors)."""
    return {n: y[n] + a * x[n] for n in y}


class CompositeAlgorithm(SolverAlgorithm):
    """Shared machinery of the five composite algorithms (each a `local_solver`, common/algorithms/solver.py)."""

    #: the algorithm needs every client to run the same number E of local steps (a shared
    #: step counter t or the FedDA prox scale r E): [algorithm] local_steps must be an int > 0
    needs_fixed_steps = True
    composite_term = True

    def __init__(self, cfg: Any, params: AlgorithmParams | None = None) -> None:
        super().__init__(cfg, params)
        self.regularizer = getattr(cfg, "regularizer", "none")
        self.lam = float(getattr(cfg, "reg", 0.0))
        if self.lam < 0:
            raise ValueError(f"algorithm.reg = {self.lam}: must be >= 0")
        self.wire = WIRE_DTYPES[getattr(self.params, "wire_dtype", "float32")]
        steps = getattr(cfg, "local_steps", 0)
        self.E = steps if isinstance(steps, int) and not isinstance(steps, bool) else 0
        if self.needs_fixed_steps and self.E < 1:
            raise ValueError(f"algorithm.local_steps = {steps!r}: {self.name} needs one positive integer E "
                             f"(the same number of local steps on every client; epochs and per-client lists are "
                             f"not allowed)")
        self._kinds: dict[str, str] | None = None
        self._initial: dict[int, Tensors] = {}

    # ------------------------------------------------------------------ shared pieces
    def kinds_for(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
        if self._kinds is None:
            self._kinds = regularized_kinds(shapes, self.regularizer)
        return self._kinds

    def kinds_of(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
        return self.kinds_for({n: tuple(t.shape) for n, t in tensors.items()})

    def prox_h(self, u: Tensors, scale: float) -> Tensors:
        """prox_{scale * lam * R}(u) over the model's tensors."""
        return group_prox(u, scale * self.lam, self.kinds_of(u))

    def initial_params(self, ctx: ClientContext) -> Tensors:
        """The run's initial model w0 in float64: every process builds the same one from the
        config (DESIGN.md 8), so it never needs to travel."""
        key = id(ctx.task)
        if key not in self._initial:
            model = ctx.task.build_model()
            self._initial[key] = {n: p.detach().to(F64).clone() for n, p in model.named_parameters()}
        return self._initial[key]

    def check_steps(self, ctx: ClientContext) -> None:
        if self.needs_fixed_steps and not 1 <= ctx.local_steps <= self.E:
            raise ValueError(f"{self.name}: client {ctx.client_id} was given {ctx.local_steps} local steps; "
                             f"it needs between 1 and algorithm.local_steps = {self.E}")

    def reply(self, ctx: ClientContext, tensors: Tensors, stats: LocalStats) -> Payload:
        """The reply's tensors in `wire_dtype`."""
        return Payload(tensors={n: t.to(self.wire) for n, t in tensors.items()},
                       scalars={"weight": self.client_weight(ctx), "train_loss": stats.mean_loss,
                                "local_steps": stats.steps})

    def spec(self, state: ServerState, *prefixes: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {f"{p}/{n}": (self.wire, tuple(t.shape)) for p in prefixes for n, t in state.params.items()}

    @staticmethod
    def mean(aggregate: Payload, prefix: str, names: list[str]) -> Tensors:
        """sum_k p_k x_k / sum_k p_k of a reply field, in float64."""
        return {n: weighted_mean(aggregate, f"{prefix}/{n}").to(F64) for n in names}

    @staticmethod
    def set_model(state: ServerState, w: Tensors) -> None:
        for n, t in state.params.items():
            t.copy_(w[n])

    edge_iterations = False   # kappa2 > 1 is refused when the config is loaded

    def edge_step(self, message: Payload, partial: Payload) -> Payload:
        raise ValueError(f"{self.name}: hierarchical rounds with kappa2 > 1 are not supported (an edge-level "
                         f"prox step is not defined by the papers); use kappa2 = 1, where edges only "
                         f"pre-aggregate their clients' weighted sums")


# ---------------------------------------------------------------------------- FedMiD
class FedMiD(CompositeAlgorithm):
    """Federated Mirror Descent with psi = 1/2 ||.||^2 (proximal local SGD + primal averaging)."""

    name = "fedmid"
    Params = BaselineParams
    needs_fixed_steps = False

    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        state.extra.update(prefixed("w", to64(params)))
        return state

    def broadcast(self, state: ServerState, round: int) -> Payload:
        return Payload(tensors={n: state.extra[f"w/{n}"].to(self.wire) for n in state.params})

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self.spec(state, "dw")

    def local_solver(self, ctx: ClientContext, message: Payload, steps: int) -> Solver:
        start = to64(message.tensors)
        w = dict(start)
        lr = float(self.cfg.lr)
        for _ in range(steps):
            grad = yield w
            w = self.prox_h(axpy(w, -lr, grad), lr)         # w <- prox_{eta_c h}(w - eta_c g)
        return prefixed("dw", {n: w[n] - start[n] for n in w})

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        names = list(state.params)
        w = {n: state.extra[f"w/{n}"] for n in names}
        eta_s, eta_c = float(self.cfg.server_lr), float(self.cfg.lr)
        w = self.prox_h(axpy(w, eta_s, self.mean(aggregate, "dw", names)), eta_s * eta_c)
        state.extra.update(prefixed("w", w))
        self.set_model(state, w)


# ---------------------------------------------------------------------------- FedDA
class FedDA(CompositeAlgorithm):
    """Federated Dual Averaging (FedDualAvg) with psi = 1/2 ||.||^2."""

    name = "fedda"
    Params = BaselineParams

    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        state.extra.update(prefixed("z", to64(params)))      # z_0 = grad psi(w_0) = w_0
        return state

    def broadcast(self, state: ServerState, round: int) -> Payload:
        return Payload(tensors={f"z/{n}": state.extra[f"z/{n}"].to(self.wire) for n in state.params},
                       scalars={"r": round - 1})

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self.spec(state, "dz")

    def local_solver(self, ctx: ClientContext, message: Payload, steps: int) -> Solver:
        names = [n for n, _ in ctx.model.named_parameters()]
        z0 = unprefixed("z", message.tensors, names)
        z = dict(z0)
        r = int(message.scalars["r"])
        eta_s, eta_c = float(self.cfg.server_lr), float(self.cfg.lr)
        for k in range(steps):
            w = self.prox_h(z, eta_s * eta_c * r * self.E + eta_c * k)   # eta~_{r,k}
            z = axpy(z, -eta_c, (yield w))
        return prefixed("dz", {n: z[n] - z0[n] for n in names})

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        names = list(state.params)
        eta_s, eta_c = float(self.cfg.server_lr), float(self.cfg.lr)
        z = axpy({n: state.extra[f"z/{n}"] for n in names}, eta_s, self.mean(aggregate, "dz", names))
        state.extra.update(prefixed("z", z))
        self.set_model(state, self.prox_h(z, eta_s * eta_c * round * self.E))   # (r+1) E with r = round - 1


REGISTER = [FedMiD, FedDA]
