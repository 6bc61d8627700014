"""Fast-FedDA, C-FedDA and MC-FedDA (Bao, Crawshaw, Luo & Liu, "Fast Composite Optimization and
Statistical Recovery in Federated Learning", ICML 2022; digest research/seed-001.md).

Shared notation: E local steps per round ([algorithm] local_steps, one int for all clients),
lam = [algorithm] reg, R = the regulariser (l1 / nuclear), w0 = the initial point, mu and gamma
the strong-convexity and proximity weights, alpha / A the weight schedule
(`common.algorithms.composite.WeightSchedule`: "uniform" alpha = 1 as in the authors' code, or
"poly2" alpha_t = (t + a)^2 as in the theorems).  All sums are float64 (`ServerState.extra`);
`common.prox.dual_averaging_prox` is the closed-form prox of every step.

gamma conventions (`gamma_convention`, digest 2.3 and 2.7 item 8): "paper" takes `gamma` as the
paper's gamma.  "code" takes it as the authors' MATLAB code's gamma, which normalises the round
prox of C-/MC-FedDA by r E instead of r, so gamma_paper = gamma_code / E there (600 <-> 60 for
E = 10); for Fast-FedDA both conventions coincide.  `gamma_theory = true` ignores `gamma` and
uses the theorems' gamma_paper = 2 mu a^3.  The value in use is exposed as `self.gamma`.

Fast-FedDA (Algorithm 1), global step t = 0..T-1, round r starts at t_r = r E:
    Prox_t(z) = argmin_w <w, z - gamma w0> + (mu A_t/2 + gamma) ||w||^2/2 + A_t lam R(w)   (Sec. 2.1)
    server state: g = g_{t_r - 1} = sum_{i<t_r} alpha_i G_i,   w~ = w~_{t_r - 1} = sum_{i<t_r} alpha_i w_i
    downlink: g, w~, t_r.  Every party derives w_{t_r} = Prox_{t_r - 1}(g - mu w~/2) (= w0 when
        t_r = 0, A_{-1} = 0) and w~_{t_r} = w~ + alpha_{t_r} w_{t_r}: 2p floats instead of 3p.
    client, for t = t_r .. t_{r+1} - 1 (Alg. 1 lines 6-12):
        G = grad f(w; xi_t);  g += alpha_t G
        if t < t_{r+1} - 1:  w = Prox_t(g - mu w~/2);  w~ += alpha_{t+1} w        (no prox at the last step)
    uplink: dg = g^k - g_{t_r - 1},  dw~ = w~^k - w~_{t_r}                         (2p floats)
    server: g += mean dg;  w~ = w~_{t_r} + mean dw~  (= w~_{t_{r+1} - 1});
            model w_{t_{r+1}} = Prox_{t_{r+1} - 1}(g - mu w~/2)                    (Alg. 1 lines 14-17)
    ("mean" = sum_k p_k x_k / sum_k p_k over the sampled clients: the paper's full-participation
    average, and the code's average over the sampled clients.)

C-FedDA (Algorithm 2), round r = 0..R, one weight alpha_r per round, A_r = sum_{j<=r} alpha_j:
    CProx_r(z) = argmin_{R(w - w0) <= eps0} <w, z - gamma E w0> + (mu A_r/2 + gamma) E ||w||^2/2 + A_r E lam R(w)
               = dual_averaging_prox(z / E; A_r, mu, gamma, w0, lam) + the constraint ball (heuristic of
                 digest 2.5, exact when inactive; `radius` = 0, the default, means no ball)
    server state: g (sum over all past local steps of alpha_r G), w~ = w~_{r-1} = sum_{j<r} alpha_j wbar_j
    downlink: g, w~_{r-1}, r.  Every party derives wbar_r = CProx_{r-1}(g - mu E w~_{r-1}/2) (= w0 at r = 0)
        and w~_r = w~_{r-1} + alpha_r wbar_r.
    client: w = wbar_r; E steps: G = grad f(w; xi); g += alpha_r G; if not last: w = CProx_r(g - mu E w~_r/2)
    uplink: dg (p floats; w~ holds server iterates only)
    server: g += mean dg;  wbar_{r+1} = CProx_r(g - mu E w~_r / 2)  (the model);
            output ŵ = sum_r alpha_r wbar_{r+1} / A_R kept as a running average in extra "avg/*".
    `output` picks the model (evaluated, checkpointed, saved as model.safetensors): "last" = wbar_R,
    the authors' code; "average" = ŵ, the output of Algorithm 2 / Theorem 3.1.  Both are evaluated
    every evaluation round (metrics `last_*` and `average_*`) and saved (model-last/-average.safetensors).

MC-FedDA (Algorithm 3): stages m = 0..M-1 of C-FedDA with lam_m (default 2^{-(M-1-m)} reg, so the
last stage uses reg = lam_opt), radius eps_m (given, or 108 psi^2 lam_m / mu, Theorem 3.2) and a
full restart at each stage: g <- 0, w~ <- 0, counters r <- 0, w0 <- ŵ_m (the last server iterate
by default, as the authors' code; `warm_start = "average"` uses the paper's weighted average).
The new w0 travels with every broadcast of stages >= 1 (clients sampled later in a stage have
not seen it; the initial w0 of stage 0 is known to every process).  The last stage runs until
the run ends.  The restart happens when the next stage's first round is broadcast, not in the
server step of the stage's last round: that round's model, its evaluated outputs ("last" = wbar,
"average" = ŵ_m) and its checkpoint are the stage's own iterates (`state.scalars["mc_fedda_stage"]`
is the stage the state belongs to, so a run resumed from that checkpoint restarts on its next
broadcast).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fedhop.common.algorithms.base import AlgorithmParams, ClientContext, Payload, ServerState
from fedhop.common.algorithms.composite import (
    F64,
    GAMMA_CONVENTIONS,
    WEIGHT_SCHEDULES,
    CompositeAlgorithm,
    Tensors,
    WeightSchedule,
    axpy,
    check_fields,
    prefixed,
    to64,
    unprefixed,
    wire_field,
)
from fedhop.common.algorithms.vectorized import Solver
from fedhop.common.numerics.prox import dual_averaging_prox

STAGE_KEY = "mc_fedda_stage"   # MC-FedDA: the stage whose sums the server state holds


@dataclass
class FastFedDAParams(AlgorithmParams):
    """[algorithm] keys of fast_fedda (defaults: the paper's synthetic runs, digest 4.1 and 8).

    `mu`: mu, the strong-convexity weight of the dual-averaging prox
    `gamma`: gamma, the proximity weight of the prox (read as `gamma_convention` says)
    `gamma_convention`: how `gamma` is read: "code" (the authors' MATLAB code: gamma_paper = gamma /
        E for C-/MC-FedDA) or "paper"
    `weights`: the dual-averaging weights alpha_t: "uniform" (alpha = 1, the authors' code) or
        "poly2" ((t + a)^2, the theorems)
    `a`: the offset a of the "poly2" weights (t + a)^2

    `wire_dtype`: dtype of the tensors on the wire (float64: the exact float64 sums, twice the
        bytes)
    """

    mu: float = field(default=0.1, metadata={"min": 0.0})
    gamma: float = field(default=550.0, metadata={"min_exclusive": 0.0})
    gamma_convention: str = field(default="code", metadata={"choices": GAMMA_CONVENTIONS})
    gamma_theory: bool = False          # true: gamma_paper = 2 mu a^3 (Theorems 2.1, 3.1)
    weights: str = field(default="uniform", metadata={"choices": WEIGHT_SCHEDULES})
    a: float = field(default=1.0, metadata={"min": 0.0})
    rho: float = field(default=0.0, metadata={"min": 0.0})      # l2 domain ||w|| <= rho; 0 = none (R^p)
    wire_dtype: str = wire_field()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.gamma_theory and not (self.mu > 0 and self.a > 0):
            raise ValueError(f"algorithm.gamma_theory = true sets gamma = 2 mu a^3, which needs mu > 0 and a > 0 "
                             f"(got mu = {self.mu}, a = {self.a})")


@dataclass
class CFedDAParams(FastFedDAParams):
    """[algorithm] keys of c_fedda: those of fast_fedda (gamma default 600 in the code's convention,
    i.e. 60 in the paper's for E = 10) and the constraint radius eps0 around w0.

    `output`: the model (evaluated, checkpointed, saved): the "last" server iterate (the authors'
        code) or the weighted "average" (Algorithm 2)
    """

    gamma: float = field(default=600.0, metadata={"min_exclusive": 0.0})
    radius: float = field(default=0.0, metadata={"min": 0.0})   # eps0; 0 = no ball (the experiments)
    output: str = field(default="last", metadata={"choices": ("last", "average")})   # which one is the model


@dataclass
class MCFedDAParams(CFedDAParams):
    """[algorithm] keys of mc_fedda (defaults: the Lasso schedule of the authors' code, digest 2.4).

    `warm_start`: the restart point w0 of each stage: the "last" server iterate (the authors' code)
        or the stage's weighted "average" (the paper)
    """

    stage_rounds: list = field(default_factory=lambda: [250, 250, 1500])   # M entries; the last stage runs on
    stage_reg: list = field(default_factory=list)       # lam_m; empty: reg * 2^-(m - M + 1)
    stage_radius: list = field(default_factory=list)    # eps_m; empty: `radius_psi_sq` rule, else `radius`
    radius_psi_sq: float = field(default=0.0, metadata={"min": 0.0})   # > 0: eps_m = 108 psi^2 lam_m / mu
    warm_start: str = field(default="last", metadata={"choices": ("last", "average")})

    def __post_init__(self) -> None:
        super().__post_init__()
        m = len(self.stage_rounds)
        if m < 1 or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in self.stage_rounds):
            raise ValueError(f"algorithm.stage_rounds = {self.stage_rounds!r}: expected a non-empty list of "
                             f"integers >= 1 (rounds per stage)")
        for key in ("stage_reg", "stage_radius"):
            value = getattr(self, key)
            if value and (len(value) != m or not all(isinstance(v, (int, float)) and v > 0 for v in value)):
                raise ValueError(f"algorithm.{key} = {value!r}: expected {m} positive numbers (one per stage, "
                                 f"like stage_rounds) or an empty list")
        if self.radius_psi_sq > 0 and self.mu <= 0:
            raise ValueError("algorithm.radius_psi_sq > 0 sets eps_m = 108 psi^2 lam_m / mu, which needs mu > 0")


class FastFedDA(CompositeAlgorithm):
    name = "fast_fedda"
    Params = FastFedDAParams
    params: FastFedDAParams
    #: gamma_paper = gamma_code / round_scale under gamma_convention = "code"
    round_scale_in_code = False

    def __init__(self, cfg: Any, params: Any = None) -> None:
        super().__init__(cfg, params)
        p = self.params
        self.mu = float(p.mu)
        self.schedule = WeightSchedule(p.weights, float(p.a))
        self.gamma = self.paper_gamma()
        self.rho = float(p.rho) or math.inf

    def paper_gamma(self) -> float:
        """gamma in the paper's convention (see the module docstring)."""
        p = self.params
        if p.gamma_theory:
            return 2.0 * p.mu * p.a ** 3
        if p.gamma_convention == "code" and self.round_scale_in_code:
            return float(p.gamma) / self.E
        return float(p.gamma)

    def prox(self, g: Tensors, wt: Tensors, A: float, w0: Tensors) -> Tensors:
        """Prox_t(g - mu w~ / 2) with A = A_t."""
        z = {n: g[n] - 0.5 * self.mu * wt[n] for n in g}
        return dual_averaging_prox(z, A=A, mu=self.mu, gamma=self.gamma, w0=w0, lam=self.lam,
                                   kinds=self.kinds_of(g), rho=self.rho)

    # ------------------------------------------------------------------ server
    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        w0 = to64(params)
        zeros = {n: torch.zeros_like(t) for n, t in w0.items()}
        state.extra.update(prefixed("w0", w0))
        state.extra.update(prefixed("g", zeros))
        state.extra.update(prefixed("wt", {n: t.clone() for n, t in zeros.items()}))
        state.extra.update(prefixed("w", {n: t.clone() for n, t in w0.items()}))
        return state

    def broadcast(self, state: ServerState, round: int) -> Payload:
        tensors = {f"{k}/{n}": state.extra[f"{k}/{n}"].to(self.wire) for k in ("g", "wt") for n in state.params}
        return Payload(tensors=tensors, scalars={"t": (round - 1) * self.E})

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self.spec(state, "dg", "dwt")

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        names = list(state.params)
        ex = state.extra
        sched, t0 = self.schedule, (round - 1) * self.E
        w0 = {n: ex[f"w0/{n}"] for n in names}
        w_cur = {n: ex[f"w/{n}"] for n in names}
        wt = axpy({n: ex[f"wt/{n}"] for n in names}, sched.alpha(t0), w_cur)        # w~_{t_r}
        wt = axpy(wt, 1.0, self.mean(aggregate, "dwt", names))                       # w~_{t_{r+1}-1}
        g = axpy({n: ex[f"g/{n}"] for n in names}, 1.0, self.mean(aggregate, "dg", names))
        w = self.prox(g, wt, sched.total(t0 + self.E - 1), w0)                       # w_{t_{r+1}}
        ex.update(prefixed("g", g))
        ex.update(prefixed("wt", wt))
        ex.update(prefixed("w", w))
        self.set_model(state, w)

    # ------------------------------------------------------------------ client
    def local_solver(self, ctx: ClientContext, message: Payload, steps: int) -> Solver:
        names = [n for n, _ in ctx.model.named_parameters()]
        sched, t0 = self.schedule, int(message.scalars["t"])
        w0 = self.initial_params(ctx)
        g = unprefixed("g", message.tensors, names)
        wt = unprefixed("wt", message.tensors, names)
        w = self.prox(g, wt, sched.total(t0 - 1), w0)                                # w_{t_r}
        wt = axpy(wt, sched.alpha(t0), w)                                            # w~_{t_r}
        g_start, wt_start = dict(g), dict(wt)
        for j in range(steps):
            t = t0 + j
            g = axpy(g, sched.alpha(t), (yield w))                                   # g_t
            if j < steps - 1:
                w = self.prox(g, wt, sched.total(t), w0)                             # w_{t+1}
                wt = axpy(wt, sched.alpha(t + 1), w)                                 # w~_{t+1}
        out = prefixed("dg", {n: g[n] - g_start[n] for n in names})
        out.update(prefixed("dwt", {n: wt[n] - wt_start[n] for n in names}))
        return out


class CFedDA(FastFedDA):
    name = "c_fedda"
    Params = CFedDAParams
    params: CFedDAParams
    round_scale_in_code = True

    # ------------------------------------------------------------------ stage facts (one stage here)
    def stage_of(self, round: int) -> tuple[int, int]:
        """(stage m, round r within the stage, 0-based) of a 1-based run round."""
        return 0, round - 1

    def stage_lam(self, m: int) -> float:
        return self.lam

    def stage_radius(self, m: int) -> float:
        return float(self.params.radius) or math.inf

    def cprox(self, g: Tensors, wt: Tensors, A: float, w0: Tensors, m: int) -> Tensors:
        """CProx_r(g - mu E w~ / 2) with A = A_r (Algorithm 2), via the E-normalised form."""
        z = {n: g[n] / self.E - 0.5 * self.mu * wt[n] for n in g}
        return dual_averaging_prox(z, A=A, mu=self.mu, gamma=self.gamma, w0=w0, lam=self.stage_lam(m),
                                   kinds=self.kinds_of(g), radius=self.stage_radius(m), center=w0,
                                   rho=self.rho)

    # ------------------------------------------------------------------ server
    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        state.extra.update(prefixed("avg", to64(params)))
        return state

    def broadcast(self, state: ServerState, round: int) -> Payload:
        m, r = self.stage_of(round)
        tensors = {f"{k}/{n}": state.extra[f"{k}/{n}"].to(self.wire) for k in ("g", "wt") for n in state.params}
        return Payload(tensors=tensors, scalars={"r": r, "stage": m})

    def reply_spec(self, state: ServerState) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self.spec(state, "dg")

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        names = list(state.params)
        ex = state.extra
        m, r = self.stage_of(round)
        sched = self.schedule
        w0 = {n: ex[f"w0/{n}"] for n in names}
        wt = axpy({n: ex[f"wt/{n}"] for n in names}, sched.alpha(r), {n: ex[f"w/{n}"] for n in names})  # w~_r
        g = axpy({n: ex[f"g/{n}"] for n in names}, 1.0, self.mean(aggregate, "dg", names))
        w = self.cprox(g, wt, sched.total(r), w0, m)                                 # wbar_{r+1}
        share = sched.alpha(r) / sched.total(r) if sched.total(r) > 0 else 1.0
        avg = {n: ex[f"avg/{n}"] + share * (w[n] - ex[f"avg/{n}"]) for n in names}   # sum alpha_j wbar_{j+1} / A_r
        ex.update(prefixed("g", g))
        ex.update(prefixed("wt", wt))
        ex.update(prefixed("w", w))
        ex.update(prefixed("avg", avg))
        self.set_model(state, avg if self.params.output == "average" else w)

    def outputs(self, state: ServerState) -> dict[str, dict[str, torch.Tensor]]:
        names = list(state.params)
        return {kind: {n: state.extra[f"{key}/{n}"].to(state.params[n].dtype) for n in names}
                for kind, key in (("last", "w"), ("average", "avg"))}

    # ------------------------------------------------------------------ client
    def stage_w0(self, ctx: ClientContext, message: Payload, names: list[str]) -> Tensors:
        return self.initial_params(ctx)

    def local_solver(self, ctx: ClientContext, message: Payload, steps: int) -> Solver:
        names = [n for n, _ in ctx.model.named_parameters()]
        m, r = int(message.scalars["stage"]), int(message.scalars["r"])
        sched = self.schedule
        w0 = self.stage_w0(ctx, message, names)
        g = unprefixed("g", message.tensors, names)
        wt_prev = unprefixed("wt", message.tensors, names)
        w = self.cprox(g, wt_prev, sched.total(r - 1), w0, m)                        # wbar_r
        wt = axpy(wt_prev, sched.alpha(r), w)                                        # w~_r, fixed this round
        g_start = dict(g)
        alpha, A = sched.alpha(r), sched.total(r)
        for j in range(steps):
            g = axpy(g, alpha, (yield w))
            if j < steps - 1:
                w = self.cprox(g, wt, A, w0, m)
        return prefixed("dg", {n: g[n] - g_start[n] for n in names})


class MCFedDA(CFedDA):
    name = "mc_fedda"
    Params = MCFedDAParams
    params: MCFedDAParams

    def __init__(self, cfg: Any, params: Any = None) -> None:
        super().__init__(cfg, params)
        p = self.params
        self.num_stages = len(p.stage_rounds)
        self.bounds = [0]
        for rounds in p.stage_rounds:
            self.bounds.append(self.bounds[-1] + int(rounds))
        if p.stage_reg:
            self.lams = [float(v) for v in p.stage_reg]
            if self.lam not in (0.0, self.lams[-1]):
                raise ValueError(f"algorithm.reg = {self.lam} but algorithm.stage_reg ends with {self.lams[-1]}: "
                                 f"the last stage's lambda is the problem's lambda; make them equal (or reg = 0)")
        else:
            if self.lam <= 0:
                raise ValueError("mc_fedda: set algorithm.reg > 0 (the last stage's lambda; earlier stages double "
                                 "it) or list algorithm.stage_reg")
            self.lams = [self.lam * 2.0 ** (self.num_stages - 1 - m) for m in range(self.num_stages)]
        if p.stage_radius:
            self.radii = [float(v) for v in p.stage_radius]
        elif p.radius_psi_sq > 0:
            self.radii = [108.0 * p.radius_psi_sq * lam / p.mu for lam in self.lams]   # eps_m, Theorem 3.2
        else:
            self.radii = [float(p.radius) or math.inf] * self.num_stages

    def stage_of(self, round: int) -> tuple[int, int]:
        done = round - 1
        for m in range(self.num_stages - 1):
            if done < self.bounds[m + 1]:
                return m, done - self.bounds[m]
        return self.num_stages - 1, done - self.bounds[self.num_stages - 1]

    def stage_lam(self, m: int) -> float:
        return self.lams[m]

    def stage_radius(self, m: int) -> float:
        return self.radii[m]

    def init_state(self, params: dict[str, torch.Tensor]) -> ServerState:
        state = super().init_state(params)
        state.scalars[STAGE_KEY] = 0
        return state

    def begin_stage(self, state: ServerState, round: int) -> None:
        """Restart (Algorithm 3) once per stage, before the first round of a new stage is broadcast.
        A state without STAGE_KEY (a checkpoint written when the restart ran in the server step) has
        been restarted already."""
        m, _ = self.stage_of(round)
        held = int(state.scalars.get(STAGE_KEY, m))
        while held < m:
            self.restart(state)
            held += 1
        state.scalars[STAGE_KEY] = m

    def broadcast(self, state: ServerState, round: int) -> Payload:
        self.begin_stage(state, round)
        message = super().broadcast(state, round)
        if int(message.scalars["stage"]) > 0:
            message.tensors.update({f"w0/{n}": state.extra[f"w0/{n}"].to(self.wire) for n in state.params})
        return message

    def stage_w0(self, ctx: ClientContext, message: Payload, names: list[str]) -> Tensors:
        if int(message.scalars["stage"]) == 0:
            return self.initial_params(ctx)
        return unprefixed("w0", message.tensors, names)

    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        self.begin_stage(state, round)      # no-op after this round's broadcast
        super().server_update(state, aggregate, round)

    def restart(self, state: ServerState) -> None:
        """Stage restart (Algorithm 3): w0 <- ŵ_m, g <- 0, w~ <- 0 (so w~_0 = alpha_0 w0), r <- 0.
        w0 is rounded to the wire dtype so the server and the clients use the same w0 exactly."""
        names = list(state.params)
        ex = state.extra
        src = "w" if self.params.warm_start == "last" else "avg"
        start = {n: ex[f"{src}/{n}"].to(self.wire).to(F64) for n in names}
        ex.update(prefixed("w0", start))
        ex.update(prefixed("w", {n: t.clone() for n, t in start.items()}))
        ex.update(prefixed("avg", {n: t.clone() for n, t in start.items()}))
        ex.update(prefixed("g", {n: torch.zeros_like(t) for n, t in start.items()}))
        ex.update(prefixed("wt", {n: torch.zeros_like(t) for n, t in start.items()}))
        self.set_model(state, start)


REGISTER = [FastFedDA, CFedDA, MCFedDA]
