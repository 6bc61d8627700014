"""FedLGA (Li, Qu, Tang, Lu): local gradient approximation for stragglers.

Digest: research/seed-002.md (sections 2.1-2.5; the D-numbers below are its decisions).

Device i (Algorithm 1): plain local SGD from w^t for the E_i units of work it manages this
round (the straggler plan of common/engine/heterogeneity.py sets E_i), then sends Delta_i = w_{i,E_i} - w^t
and tau_i = E - E_i + 1 (a 0-dim float32 tensor: the paper counts it as one 4-byte int on the wire).

Server (Algorithm 2, Eq. 5-7), with K2 = {i : tau_i = 1} and K1 = {i : tau_i > 1}:

    w_hat - w^t = mbar = (1/K2) sum_{j in K2} Delta_j                      (first-order w_{i,E})
    v_i         = w_hat - w_{i,E_i} = mbar - Delta_i
    Dhat_i      = Delta_i + lambda * G_i v_i,   G_i = g_i g_i^T              (Eq. 5, 6)
    w^{t+1}     = w^t + eta_g * ( sum_{K1} p_i Dhat_i + sum_{K2} p_j Delta_j ) (Eq. 7)

with p_i the aggregation weights (1/K under algorithm.weighting = "uniform", the paper's
choice; sample-proportional otherwise, and mbar is then the weighted mean over K2).
G_i v_i is computed as g_i <g_i, v_i> over all parameters flattened into one vector (D4): one
dot product and one axpy per straggler, O(n) memory, never the n-by-n matrix.

Where g_i = grad F_i(w_{i,E_i}) comes from (D3, `lga_grad_source`):
- "delta" (default, no extra bytes): g_i = -Delta_i / (eta_l S_i), the mean SGD direction over
  the S_i local steps taken.  Then G_i v_i is parallel to Delta_i and FedLGA rescales each
  straggler's update: Dhat_i = (1 + lambda <Delta_i, v_i> / (eta_l S_i)^2) Delta_i.
- "client_last_grad": the straggler also sends its gradient at w_{i,E_i} on its local data
  (`lga_grad_batch` = 0: all of it, else one minibatch), n more floats uplink, counted by the
  ledger like every other byte.
- "diag": DC-ASGD style diag(g g^T) = g (.) g with the "delta" g: Dhat_i = Delta_i + lambda g.g.v_i.
`lga_lambda` scales the correction (1.0 = paper) and `lga_clip` > 0 caps its norm at
clip * ||Delta_i||; both are not in the paper (the Taylor step is not dimensionally consistent).

K2 = 0 (every participant straggled, D5): w_hat is undefined; the round falls back to plain
averaging of the stragglers' updates, is logged, and counted in state.scalars["lga_fallback_rounds"].
With no straggler in a round (rho = 0) the server step is FedAvg's, operation for operation, so
the model is bit-identical to FedAvg's (test_fedlga.py).

Aggregation stays a reduction over disjoint groups (edges): full devices' deltas are summed
as usual; each straggler's delta (and gradient) rides in the partial result under
"lga.<client>.<param>" names, since its correction needs the global mbar (seed-002.md 3.4, the
"edges forward per-device deltas" option).  Edge iterations (kappa2 > 1) are not supported.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TypeGuard

import torch

from fedhop.common.algorithms.base import (
    COUNT_KEY,
    WEIGHT_KEY,
    Algorithm,
    AlgorithmParams,
    ClientContext,
    Payload,
    ServerState,
    reduce_payloads,
    weighted_mean,
)
from fedhop.common.algorithms.local import get_params, local_sgd, set_params
from fedhop.common.algorithms.vectorized import every_parameter, local_sgd_together
from fedhop.common.numerics.sampling import local_batches
from fedhop.common.wire.message import COMPUTE_KEY

log = logging.getLogger("fedhop.fedlga")

TAU_KEY = "tau"                  # reply tensor: tau_i = E - E_i + 1 as a 0-dim float32
GRAD_PREFIX = "lga_grad."        # reply tensors of lga_grad_source = "client_last_grad"
STRAGGLER_PREFIX = "lga."        # partial-result entries of one straggler: lga.<cid>.<field>
FULL_WEIGHT_KEY = "lga_full_weight"


@dataclass
class FedLGAParams(AlgorithmParams):
    """[algorithm] keys of fedlga (local gradient approximation for stragglers).

    `lga_grad_source`: where a straggler's gradient g_i comes from: "delta" (from its update, no
        extra bytes), "client_last_grad" (sent by the client) or "diag" (diag(g g^T) with the
        "delta" g)
    `lga_lambda`: lambda, the scale of the gradient-approximation correction (1.0 = the paper)
    """

    lga_grad_source: str = field(default="delta", metadata={"choices": ("delta", "client_last_grad", "diag")})
    lga_lambda: float = field(default=1.0, metadata={"min": 0.0})
    lga_clip: float = field(default=0.0, metadata={"min": 0.0})        # not in the paper; 0 = off
    lga_grad_batch: int = field(default=0, metadata={"min": 0})       # client_last_grad: 0 = all local data


# ----------------------------------------------------------------------------- the correction
def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """<a, b> over all tensors flattened into one vector (no copies)."""
    return float(sum(float(torch.dot(a[n].reshape(-1), b[n].reshape(-1))) for n in a))


def _norm(a: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in a.values()))


def add_corrected(total: dict[str, torch.Tensor], delta: dict[str, torch.Tensor], mbar: dict[str, torch.Tensor],
                  weight: float, *, steps: int, lr: float, source: str = "delta", lam: float = 1.0,
                  clip: float = 0.0, grad: dict[str, torch.Tensor] | None = None) -> float:
    """total += weight * Dhat_i in place (Eq. 5 with G = g g^T or its diagonal); O(n) memory.

    Returns the correction's norm relative to ||Delta_i|| (a diagnostic).  "delta" and
    "client_last_grad" need no temporary at all: <g, v> = <g, mbar> - <g, Delta> are two dot
    products and Dhat_i = Delta_i + lam * s * g is two axpys.  "diag" needs one temporary
    per tensor.
    """
    if source in ("delta", "diag"):
        if steps <= 0 or lr <= 0:
            raise ValueError(f"fedlga: lga_grad_source = '{source}' needs local steps > 0 and lr > 0 "
                             f"(got steps = {steps}, lr = {lr})")
        scale = -1.0 / (lr * steps)          # g = scale * Delta
    elif grad is None:
        raise ValueError("fedlga: lga_grad_source = 'client_last_grad' but the straggler sent no gradient")
    delta_norm = _norm(delta)
    if source == "diag":
        corr = {}
        for n in delta:                      # g.g.v = scale^2 * Delta.Delta.(mbar - Delta)
            t = mbar[n] - delta[n]
            t.mul_(delta[n]).mul_(delta[n]).mul_(scale * scale)
            corr[n] = t
        c_norm = _norm(corr)
        factor = lam * _clip_factor(c_norm, delta_norm, clip)
        for n in delta:
            total[n].add_(delta[n], alpha=weight).add_(corr[n], alpha=weight * factor)
        return factor * c_norm / delta_norm if delta_norm > 0 else 0.0
    if source == "delta":
        # s = <g, v> = scale * (<Delta, mbar> - <Delta, Delta>);  G v = s * g = s * scale * Delta
        s = scale * (_dot(delta, mbar) - _dot(delta, delta))
        c_norm = abs(s * scale) * delta_norm
        coef = lam * _clip_factor(c_norm, delta_norm, clip) * s * scale
        for n in delta:
            total[n].add_(delta[n], alpha=weight * (1.0 + coef))
        return abs(coef)
    assert grad is not None                              # the elif above raised otherwise
    s = _dot(grad, mbar) - _dot(grad, delta)             # client_last_grad: <g, mbar - Delta>
    c_norm = abs(s) * _norm(grad)
    coef = lam * _clip_factor(c_norm, delta_norm, clip) * s
    for n in delta:
        total[n].add_(delta[n], alpha=weight).add_(grad[n], alpha=weight * coef)
    return abs(coef) * _norm(grad) / delta_norm if delta_norm > 0 else 0.0


def _clip_factor(c_norm: float, delta_norm: float, clip: float) -> float:
    if clip > 0 and c_norm > clip * delta_norm and c_norm > 0:
        return clip * delta_norm / c_norm
    return 1.0


def lga_estimate(delta: dict[str, torch.Tensor], mbar: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
    """Dhat_i for one straggler (the server's estimate of its full-E update)."""
    out = {n: torch.zeros_like(t) for n, t in delta.items()}
    add_corrected(out, delta, mbar, 1.0, **kwargs)
    return out


# ----------------------------------------------------------------------------- the algorithm
class ReplySpec(dict):
    """The reply spec: the required tensors (the parameter deltas), plus names that *may* also
    appear: a straggler's gradient ("lga_grad.<param>") and, in an edge's partial result, its
    stragglers' entries ("lga.<client>.<param>").  Iteration and `items()` give the required
    tensors, which validators check exactly; `in` also admits the optional names, so they are
    not rejected as undeclared extras.  Their shapes are checked in `FedLGA.aggregate`."""

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or (isinstance(name, str)
                                                 and name.startswith((GRAD_PREFIX, STRAGGLER_PREFIX)))


def _tau(p: Payload) -> int:
    t = p.tensors.get(TAU_KEY)
    return int(round(float(t))) if t is not None else 1


def _matches(t: torch.Tensor | None, like: torch.Tensor | None) -> bool:
    return t is not None and like is not None and t.dtype == like.dtype and t.shape == like.shape


def _all_match(got: dict[str, torch.Tensor | None],
               like: dict[str, torch.Tensor]) -> TypeGuard[dict[str, torch.Tensor]]:
    """Whether `got` holds, for every name of `like`, a tensor of its dtype and shape."""
    return all(_matches(got[n], like[n]) for n in like)


class FedLGA(Algorithm):
    name = "fedlga"
    Params = FedLGAParams
    params: FedLGAParams
    reply_reduce = {FULL_WEIGHT_KEY: "sum"}

    def reply_spec(self, state: ServerState) -> ReplySpec:
        return ReplySpec({name: (t.dtype, tuple(t.shape)) for name, t in state.params.items()})

    # -- device (Algorithm 1) --------------------------------------------------------
    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        set_params(ctx.model, message.tensors)
        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay)
        local = get_params(ctx.model)
        tensors = {name: local[name] - message.tensors[name] for name in message.tensors}
        tau = int(ctx.info.get("tau", 1))
        tensors[TAU_KEY] = torch.tensor(float(tau))   # a 0-dim float32: 4 bytes, as the paper counts
        if tau > 1 and self.params.lga_grad_source == "client_last_grad":
            tensors.update({GRAD_PREFIX + n: g for n, g in self._local_gradient(ctx).items()})
        weight = self.client_weight(ctx)
        return Payload(tensors=tensors, scalars={WEIGHT_KEY: weight, "train_loss": stats.mean_loss,
                                                 "local_steps": stats.steps,
                                                 FULL_WEIGHT_KEY: weight if tau == 1 else 0.0})

    @classmethod
    def trains_together(cls) -> bool:
        """Algorithm 1's plain local SGD in the vectorized solver ([algorithm] vectorized): each
        client's own E_i, from the straggler plan, is its own number of steps."""
        return cls.client_update is FedLGA.client_update

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client at once (common/algorithms/vectorized.py).  A straggler
        that sends its gradient (lga_grad_source = "client_last_grad") computes it alone, after
        the stack, at its own w_{i,E_i} and from its own generator, as `client_update` does."""
        every_parameter(ctxs, messages)
        start, final, stats, seconds = local_sgd_together(ctxs, [m.tensors for m in messages], self.cfg.lr,
                                                          self.cfg.batch_size, self.cfg.weight_decay)
        delta = {name: final[name] - start[name] for name in start}   # Delta_i = w_{i,E_i} - w^t, row i
        replies = []
        for i, ctx in enumerate(ctxs):
            tensors = {name: d[i] for name, d in delta.items()}
            tau = int(ctx.info.get("tau", 1))
            tensors[TAU_KEY] = torch.tensor(float(tau))
            if tau > 1 and self.params.lga_grad_source == "client_last_grad":
                set_params(ctx.model, {name: final[name][i] for name in start})
                tensors.update({GRAD_PREFIX + n: g for n, g in self._local_gradient(ctx).items()})
            weight = self.client_weight(ctx)
            replies.append(Payload(tensors=tensors, scalars={WEIGHT_KEY: weight, "train_loss": stats[i].mean_loss,
                                                             "local_steps": stats[i].steps,
                                                             FULL_WEIGHT_KEY: weight if tau == 1 else 0.0,
                                                             COMPUTE_KEY: seconds[i]}))
        return replies

    def _local_gradient(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        """grad F_i(w_{i,E_i}) on all local data, or on one minibatch of lga_grad_batch rows."""
        data = ctx.task.client_data(ctx.client_id)
        if self.params.lga_grad_batch > 0:
            idx = next(local_batches(data.rows, self.params.lga_grad_batch, 1, 0, ctx.generator))
            batch = tuple(t[idx] for t in data.tensors)
        else:
            batch = data.tensors
        ctx.model.zero_grad(set_to_none=True)
        ctx.task.loss(ctx.model, batch, ctx.generator).backward()
        return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                for n, p in ctx.model.named_parameters()}

    # -- aggregation (server or edge) ------------------------------------------------
    def aggregate(self, replies) -> Payload:
        """Full devices reduce as in FedAvg; stragglers are kept apart (see module docstring)."""
        reduced: list[Payload] = []
        kept: dict[str, torch.Tensor] = {}
        kept_scalars: dict[str, float | int] = {}
        shapes: dict[str, torch.Tensor] = {}
        for key, p in replies:
            tensors = {n: t for n, t in p.tensors.items()
                       if n != TAU_KEY and not n.startswith(GRAD_PREFIX) and not n.startswith(STRAGGLER_PREFIX)}
            shapes.update({n: t for n, t in tensors.items() if n not in shapes})
            scalars = {n: v for n, v in p.scalars.items() if not n.startswith(STRAGGLER_PREFIX)}
            kept.update({n: t for n, t in p.tensors.items() if n.startswith(STRAGGLER_PREFIX)})
            kept_scalars.update({n: v for n, v in p.scalars.items() if n.startswith(STRAGGLER_PREFIX)})
            tau = _tau(p)
            if COUNT_KEY in p.scalars or tau == 1:
                reduced.append(Payload(tensors=tensors, scalars=scalars))
                continue
            prefix = f"{STRAGGLER_PREFIX}{int(key)}."
            kept.update({prefix + n: t for n, t in tensors.items()})
            for n, t in p.tensors.items():   # a gradient that does not match its delta is left out
                if n.startswith(GRAD_PREFIX):
                    if _matches(t, tensors.get(n[len(GRAD_PREFIX):])):
                        kept[prefix + n] = t
                    else:
                        log.warning("fedlga: client %s sent gradient '%s' of dtype %s and shape %s, not its "
                                    "delta's; ignored", key, n, t.dtype, tuple(t.shape))
            kept_scalars.update({prefix + "weight": float(p.scalars[WEIGHT_KEY]),
                                 prefix + "steps": int(p.scalars.get("local_steps", 0)), prefix + "tau": tau})
            reduced.append(Payload(scalars=scalars))      # its weight and loss count; its delta does not
        out = reduce_payloads(reduced, self.reply_reduce)
        for n, t in shapes.items():                       # a group of stragglers only: zero full sum
            if n not in out.tensors:
                out.tensors[n] = torch.zeros_like(t)
        out.tensors.update(kept)
        out.scalars.update(kept_scalars)
        return out

    # -- server step (Algorithm 2) ---------------------------------------------------
    def server_update(self, state: ServerState, aggregate: Payload, round: int) -> None:
        stragglers = sorted({int(n.split(".")[1]) for n in aggregate.scalars if n.startswith(STRAGGLER_PREFIX)})
        if not stragglers:                                # no heterogeneity: exactly FedAvg
            for name, w in state.params.items():
                w.add_(weighted_mean(aggregate, name), alpha=self.cfg.server_lr)
            return
        total_weight = float(aggregate.scalars[WEIGHT_KEY])
        full_weight = float(aggregate.scalars.get(FULL_WEIGHT_KEY, 0.0))
        total = {name: aggregate.tensors[name].clone() for name in state.params}
        fallback = full_weight <= 0
        if fallback:                                      # D5: K2 = 0, w_hat undefined
            state.scalars["lga_fallback_rounds"] = int(state.scalars.get("lga_fallback_rounds", 0)) + 1
            log.warning("fedlga round %d: all %d participants straggled (K2 = 0); averaging their updates "
                        "without correction", round, len(stragglers))
        else:
            mbar = {name: aggregate.tensors[name] / full_weight for name in state.params}
        for cid in stragglers:
            prefix = f"{STRAGGLER_PREFIX}{cid}."
            delta = {name: aggregate.tensors.get(prefix + name) for name in state.params}
            weight = aggregate.scalars.get(prefix + "weight")
            if not _all_match(delta, state.params) or not isinstance(weight, float):
                log.warning("fedlga round %d: straggler %d's entries are incomplete or misshapen; left out",
                            round, cid)
                total_weight -= float(weight) if isinstance(weight, (int, float)) else 0.0
                continue
            if fallback:
                for name in state.params:
                    total[name].add_(delta[name], alpha=weight)
                continue
            source = self.params.lga_grad_source
            grad: dict[str, torch.Tensor] | None = None
            if source == "client_last_grad":
                sent = {name: aggregate.tensors.get(prefix + GRAD_PREFIX + name) for name in state.params}
                if _all_match(sent, state.params):
                    grad = sent
                else:
                    log.warning("fedlga round %d: straggler %d sent no usable gradient; using the delta proxy",
                                round, cid)
                    source = "delta"
            try:
                add_corrected(total, delta, mbar, weight, steps=int(aggregate.scalars.get(prefix + "steps", 0)),
                              lr=self.cfg.lr, source=source, lam=self.params.lga_lambda,
                              clip=self.params.lga_clip, grad=grad)
            except ValueError as exc:   # e.g. no local steps reported: keep the update uncorrected
                log.warning("fedlga round %d: straggler %d left uncorrected: %s", round, cid, exc)
                for name in state.params:
                    total[name].add_(delta[name], alpha=weight)
        state.scalars["lga_corrected"] = int(state.scalars.get("lga_corrected", 0)) + (0 if fallback else len(stragglers))
        for name, w in state.params.items():
            w.add_(total[name] / total_weight, alpha=self.cfg.server_lr)

    edge_iterations = False   # kappa2 > 1 is refused when the config is loaded

    def edge_step(self, message: Payload, partial: Payload) -> Payload:
        raise NotImplementedError("fedlga: edge iterations (topology kappa2 > 1) are not supported; "
                                  "use kappa2 = 1 (edges forward stragglers' deltas, seed-002.md 3.4)")


REGISTER = [FedLGA]
