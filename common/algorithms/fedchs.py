"""Fed-CHS (Yan et al., "Sequential Federated Learning in Hierarchical Architecture on Non-IID
Datasets"; digest shared/research/seed-004.md section 2): Algorithm 1 in one place.

Runs only on `topology.kind = "sequential"`; the edges move the messages (topologies/sequential/edge.py)
and the server is the control plane (topologies/sequential/driver.py).  Algorithm 1, as this module has it:

- the cluster round (`cluster_round`, the inner loop of Algorithm 1): in round t the active
  edge m(t) makes K steps; at step k it broadcasts w_k to every client of its cluster and

- E = 1 (`local_iters`, the paper's theory and Table 1): each client returns one minibatch
  gradient g_n = grad f(w_k, xi_{n,k}) and the edge steps
      w_{k+1} = w_k - eta_k * sum_n gamma_n g_n,   gamma_n = D_n / D_{A,m}        (Eq. 5)
- E > 1 (Sec. 5.3, Fig. 2; the reply is not specified by the paper, digest 2.3): each client
  runs E SGD steps from w_k with the step sizes the edge sends (tensor `lr_steps`, E float32)
  and returns Delta_n = w_n^(E) - w_k; the edge steps w_{k+1} = w_k + sum_n gamma_n Delta_n.

- the next cluster (`next_holder`, "selection of next passing cluster"): the neighbour with the
  least visit count c(m'), then the largest cluster data size D_{A,m'}, then the smallest id
  (the paper leaves that tie open); the rest of that order are the fall-backs when it does not
  answer;
- the visit bookkeeping (`VisitCount`): c(m) += 1 when the model arrives at m; the start edge
  counts its first visit only with `topology.count_start` (the paper's literal pseudocode
  leaves c(m(0)) at 0 until the walk returns), and an edge that keeps the model because no
  neighbour took it counts that as a visit.

Step sizes are indexed by the local iteration j = k E + e of the round, J = K E in all:
`lr_schedule = "inv_sqrt"`: eta_j = lr / (J sqrt(j + 1)) (Appendix B.1 with lr = 1 = 1/L),
`"constant"`: eta_j = lr.  For E = 1 the client needs no step size, so a round moves exactly
(2 K N_m + 1) model-sized tensors (digest 2.5).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedhop.common.algorithms.base import (
    AlgorithmParams,
    ClientContext,
    ClusterRound,
    ClusterStep,
    Payload,
    SequentialAlgorithm,
    weighted_mean,
)
from fedhop.common.algorithms.local import get_params, local_sgd, set_params
from fedhop.common.algorithms.vectorized import every_parameter, local_sgd_together
from fedhop.common.numerics.sampling import local_batches
from fedhop.common.wire.message import COMPUTE_KEY

LR_STEPS = "lr_steps"


@dataclass
class FedCHSParams(AlgorithmParams):
    local_iters: int = field(default=1, metadata={"min": 1})   # E: local iterations per client-edge interaction


def step_sizes(lr: float, schedule: str, total: int) -> list[float]:
    """eta_j for j = 0..total-1 (the schedule restarts every round)."""
    if schedule == "inv_sqrt":
        return [lr / (total * math.sqrt(j + 1)) for j in range(total)]
    if schedule == "constant":
        return [lr] * total
    raise ValueError(f"algorithm.lr_schedule: got {schedule!r}, allowed for fedchs: constant, inv_sqrt")


class VisitCount:
    """c(m): how often the model came to this edge (Algorithm 1's visit counter)."""

    def __init__(self, count_start: bool) -> None:
        self.count_start = count_start
        self.value = 0

    def started_here(self) -> None:
        """This edge is m(0) and builds w^0."""
        if self.count_start:
            self.value += 1

    def arrived(self) -> None:
        """The model was handed to this edge, or it kept the model for another round."""
        self.value += 1


class FedCHS(SequentialAlgorithm):
    name = "fedchs"
    Params = FedCHSParams
    params: FedCHSParams

    # ------------------------------------------------------------------ edge side
    def cluster_round(self, params: dict[str, torch.Tensor], step: ClusterStep, steps: int) -> ClusterRound:
        """Algorithm 1's inner loop at the active edge: K steps of broadcast w_k, reduce the
        cluster's replies data-weighted (gamma_n = D_n / D_{A,m}), step (Eq. 5)."""
        etas = self.round_step_sizes(steps)
        out = ClusterRound(params=params, failures={})
        for k in range(steps):
            aggregate, failed = step(k, self.step_message(out.params, k, etas))
            out.failures.update({c: f"step {k}: {why}" for c, why in failed.items()})
            if aggregate is None:
                raise NoClusterReplies(k, failed)
            out.params = self.cluster_step(out.params, aggregate, k, etas)
            if "train_loss" in aggregate.scalars:
                out.loss_sum += float(aggregate.scalars["train_loss"])
                out.weight_sum += float(aggregate.scalars["weight"])
        return out

    def next_holder(self, candidates: dict[int, tuple[int, int]]) -> list[int]:
        """Selection of the next passing cluster: least c(m'), then largest D_{A,m'}, then smallest id."""
        return sorted(candidates, key=lambda e: (candidates[e][0], -candidates[e][1], e))

    def round_step_sizes(self, steps_per_round: int) -> list[float]:
        return step_sizes(self.cfg.lr, self.cfg.lr_schedule, steps_per_round * self.params.local_iters)

    def step_message(self, params: dict[str, torch.Tensor], k: int, etas: list[float]) -> Payload:
        """The broadcast of intra-round step k: w_k, plus the E step sizes when E > 1."""
        tensors = dict(params)
        E = self.params.local_iters
        if E > 1:
            tensors[LR_STEPS] = torch.tensor(etas[k * E:(k + 1) * E], dtype=torch.float32)
        return Payload(tensors=tensors)

    def cluster_step(self, params: dict[str, torch.Tensor], aggregate: Payload, k: int,
                     etas: list[float]) -> dict[str, torch.Tensor]:
        """w_{k+1} from w_k and the reduced replies (Eq. 5, or the delta form for E > 1)."""
        out = {}
        for name, w in params.items():
            mean = weighted_mean(aggregate, name)
            out[name] = (w - etas[k] * mean) if self.params.local_iters == 1 else (w + mean)
        return out

    # ------------------------------------------------------------------ client side
    def client_update(self, ctx: ClientContext, message: Payload) -> Payload:
        model_tensors = {n: t for n, t in message.tensors.items() if n != LR_STEPS}
        set_params(ctx.model, model_tensors)
        E = self.params.local_iters
        if E == 1:
            data = ctx.task.client_data(ctx.client_id)
            idx = next(iter(local_batches(data.rows, self.cfg.batch_size, 1, 0, ctx.generator)))
            ctx.model.zero_grad(set_to_none=True)
            loss = ctx.task.loss(ctx.model, tuple(t[idx] for t in data.tensors), ctx.generator)
            loss.backward()
            grads = {}
            for name, p in ctx.model.named_parameters():
                g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                if self.cfg.weight_decay:
                    g = g + self.cfg.weight_decay * p.detach()
                grads[name] = g
            return Payload(tensors=grads, scalars={"weight": self.client_weight(ctx), "train_loss": float(loss.detach()),
                                                   "local_steps": 1})
        etas = message.tensors.get(LR_STEPS)
        if etas is None or etas.numel() != E:
            raise ValueError(f"fedchs: with local_iters = {E} the message must carry '{LR_STEPS}' of {E} step sizes")
        ctx.local_steps = E
        stats = local_sgd(ctx, self.cfg.lr, self.cfg.batch_size, self.cfg.weight_decay,
                          lr_at=lambda j: float(etas[j]))
        local = get_params(ctx.model)
        delta = {name: local[name] - model_tensors[name] for name in model_tensors}
        return Payload(tensors=delta, scalars={"weight": self.client_weight(ctx), "train_loss": stats.mean_loss,
                                               "local_steps": stats.steps})

    @classmethod
    def trains_together(cls) -> bool:
        """Both replies in the vectorized solver ([algorithm] vectorized)."""
        return cls.client_update is FedCHS.client_update

    def client_updates(self, ctxs: list[ClientContext], messages: list[Payload]) -> list[Payload]:
        """`client_update` of every client at once (common/algorithms/vectorized.py).  E = 1: each
        client's gradient at w_k on its first minibatch, weight decay added, is the first step's
        gradient of a one-step local SGD, taken as the step makes it; E > 1: E steps of local SGD,
        each client with the step sizes its message carries."""
        every_parameter(ctxs, messages, skip=LR_STEPS)
        starts = [{n: t for n, t in m.tensors.items() if n != LR_STEPS} for m in messages]
        E = self.params.local_iters
        if E == 1:
            for ctx in ctxs:   # `client_update`'s one batch: local_batches(rows, batch_size, 1, 0, generator)
                ctx.local_steps, ctx.local_epochs = 1, 0
            taken: dict[str, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}

            def keep(name: str, p: torch.Tensor, g: torch.Tensor, start: torch.Tensor, rows) -> torch.Tensor:
                taken.setdefault(name, []).append((rows, g))   # g_n = grad f(w_k, xi_n) (+ weight decay), Eq. 5
                return g

            _, _, stats, seconds = local_sgd_together(ctxs, starts, self.cfg.lr, self.cfg.batch_size,
                                                      self.cfg.weight_decay, keep)
            if any(s.steps != 1 for s in stats):
                empty = [ctx.client_id for ctx, s in zip(ctxs, stats) if s.steps != 1]
                raise ValueError(f"fedchs: clients {empty} have no minibatch to take a gradient on")
            grads = {name: _rows_together(parts, len(ctxs)) for name, parts in taken.items()}
            tensors = [{name: grads[name][i] for name in starts[0]} for i in range(len(ctxs))]
        else:
            etas = []
            for ctx, m in zip(ctxs, messages):
                lr_steps = m.tensors.get(LR_STEPS)
                if lr_steps is None or lr_steps.numel() != E:
                    raise ValueError(f"fedchs: with local_iters = {E} the message must carry '{LR_STEPS}' of {E} "
                                     f"step sizes")
                etas.append([float(v) for v in lr_steps.reshape(-1).tolist()])
                ctx.local_steps = E
            start, final, stats, seconds = local_sgd_together(ctxs, starts, self.cfg.lr, self.cfg.batch_size,
                                                              self.cfg.weight_decay, step_sizes=etas)
            delta = {name: final[name] - start[name] for name in start}   # Delta_n = w_n^(E) - w_k, row n
            tensors = [{name: d[i] for name, d in delta.items()} for i in range(len(ctxs))]
        return [Payload(tensors=tensors[i], scalars={"weight": self.client_weight(ctx), "train_loss": stats[i].mean_loss,
                                                     "local_steps": stats[i].steps, COMPUTE_KEY: seconds[i]})
                for i, ctx in enumerate(ctxs)]


def _rows_together(parts: list[tuple[torch.Tensor | None, torch.Tensor]], count: int) -> torch.Tensor:
    """One stacked tensor from the groups' gradients of a step: (rows, gradients), rows None for
    every client."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    out = torch.empty((count, *parts[0][1].shape[1:]), dtype=parts[0][1].dtype, device=parts[0][1].device)
    for rows, g in parts:
        out[slice(None) if rows is None else rows] = g
    return out


class NoClusterReplies(RuntimeError):
    """No client of the cluster answered step `k` of a cluster round."""

    def __init__(self, k: int, failures: dict[int, str]) -> None:
        super().__init__(f"no client answered step {k}: {failures}")
        self.k = k
        self.failures = failures


REGISTER = [FedCHS]
