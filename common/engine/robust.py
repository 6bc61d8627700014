"""Byzantine-robust aggregation rules (`security.aggregation`), for runs whose participants
cannot all be trusted, and signSGD's majority vote (a vote of the updates' signs).

The default reduction (`reduce_payloads`, "mean") is the weighted mean of the clients'
updates: one client that sends a large update moves the model as far as it likes.  The rules
here replace the weighted sum of each `wsum` tensor by a statistic that a minority of
arbitrary values cannot drag far:

- "median": the coordinate-wise median of the n updates (Yin, Chen, Ramchandran, Bartlett,
  "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018,
  Definition 1 "coordinate-wise median").  numpy's convention: the mean of the two middle
  values when n is even.
- "trimmed_mean": per coordinate, drop the k largest and k smallest values and average the rest
  (same paper, Definition 2 "coordinate-wise trimmed mean", beta = trim), with
  k = max(1, floor(trim * n)) (`trim_count`): the paper's floor(beta * n), but at least one per
  side, so a small group (an edge's 5 clients at trim 0.1) is trimmed as asked and not averaged.
- "krum": the one update whose summed squared distance to its n - f - 2 nearest neighbours is
  smallest (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with Adversaries:
  Byzantine Tolerant Gradient Descent", NeurIPS 2017, section 4, score s(i) = sum over the
  n - f - 2 closest j != i of ||V_i - V_j||^2); needs n > 2f + 2 (the paper's condition), i.e.
  n >= 2f + 3.  f is `security.krum_f`, the same in every group (a round's clients in a star,
  an edge's clients, the server's edges).  The distances are sums of squared float64
  differences (`krum_scores`), never the |a|^2 + |b|^2 - 2ab of a matrix product, which loses
  the small distances between honest updates that share a large common part.  Equal scores are
  taken in the replies' order (client ids, then edge ids), so the choice never depends on
  which reply arrived first.
- "multi_krum": the same scores; the mean of the m lowest-scoring updates (the paper's
  multi-Krum), m = `security.krum_m`, 0 meaning n - f, and never more than n - f, so the m
  chosen can be honest whatever f updates are bad.  Krum keeps one client's update per round:
  with label-skewed data (the default Dirichlet partition) that one update is a poor step and
  the run loses accuracy with or without an attacker (docs/faults.md); multi-Krum averages.
- "majority_vote": signSGD with majority vote (Bernstein, Wang, Azizzadenesheli, Anandkumar,
  "signSGD: compressed optimisation for non-convex problems", ICML 2018, Algorithm 3: the server
  sends back sign(sum_i sign(g_i))): per coordinate, the sign of the sum of the n updates' signs,
  one vote per update, so the result is -1, 0 or +1.  A tie (the votes sum to 0, e.g. two
  updates that disagree) gives 0: that coordinate does not move (the paper leaves the tie open);
  an update's own 0 entry is sign(0) = 0, no vote.  With FedAvg and `server_lr` eta the server
  step is then w <- w + eta * sign(sum_i sign(Delta_i)).  It works with any `compression.up`: with
  "sign" the uploads arrive as +-1 already (the sign compressor codes 0 as +1, so a client's 0
  entry votes +), with another compressor or none the rule takes the decoded updates' signs.  In a
  hierarchical run each edge votes over its clients and the server votes over the edges' votes
  (their partials enter as their means, whose signs are the edges' votes): a vote of votes.

Each rule is unweighted over the updates it sees (a client's sample count is what an attacker
would inflate).  The result is returned in the shape the algorithms expect from `aggregate`:
each robust tensor multiplied by the total weight W, so `weighted_mean(aggregate, name)` (the
server step's sum_i w_i x_i / W) reads the robust value.  A partial aggregate from an edge
(carrying `num_results`) enters as its own mean (tensor / weight), so hierarchical runs apply the
rule at the edges over their clients and again at the server over the edges' robust means.

Group sizes.  Each rule needs a group of at least `rule_minimum` updates to outvote one bad
update: 3 for the median and the trimmed mean, 2f + 3 for Krum and multi-Krum (the majority
vote is defined for any group, 1 update included: it has no minimum and no fallback).  Where the config fixes the
largest group a round can have (the clients sampled per round in a star; at each edge of a
hierarchical run, its clients, at most the clients sampled per round) a group below that is a
config error (`config_group_problem`), and so is a `krum_m` above n - f of such a group, or a
`krum_m` with Krum, the median or the trimmed mean (with the mean it is not read).  A round that gets fewer updates than that (dropped or
refused replies) uses the fallback: the coordinate-wise median (of 1 or 2 updates: their mean,
since nothing can outvote one of two), and records it: `RobustAggregate.fallbacks` holds
(node, detail) pairs the server turns into `robust_fallback` events in run.db.  The server sees
an edge's short group too, from the `num_results` its partial carries.  The server's own group
over the edges' partials is not checked: with fewer edges than the rule needs, their robust
means are combined by the median (2 edges: their mean), and the robustness against a poisoned
client lies at the edges, which is why every edge's group must be large enough.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping

import torch

from fedhop.common.topologies import builtin_specs, spec_for
from fedhop.common.transport.factory import sums_in_collective
from fedhop.common.util.nodeids import edge_node
from fedhop.common.wire.message import COUNT_KEY, WEIGHT_KEY, Payload, ReduceOp, reduce_payloads

log = logging.getLogger("fedhop.robust")

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "majority_vote")
KRUM_RULES = ("krum", "multi_krum")


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 of an (n, ...) stack; the mean of the two middle values for even n."""
    n = stack.shape[0]
    ordered = torch.sort(stack, dim=0).values
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trim_count(n: int, trim: float) -> int:
    """Values dropped at each end of a group of n: max(1, floor(trim * n)) for trim > 0, else 0."""
    return max(1, int(math.floor(trim * n))) if trim > 0 else 0


def rule_minimum(rule: str, krum_f: int = 1) -> int:
    """The fewest updates for which `rule` can outvote one bad update (Krum, multi-Krum: n > 2f + 2);
    1 for the mean and the majority vote, which are defined for any group and never fall back."""
    if rule in KRUM_RULES:
        return 2 * krum_f + 3
    return 3 if rule in ("median", "trimmed_mean") else 1


def trimmed_mean(stack: torch.Tensor, trim: float) -> torch.Tensor:
    """Mean over dim 0 after dropping the k = trim_count(n, trim) largest and smallest values per
    coordinate; the median where nothing would be left (n <= 2k)."""
    n = stack.shape[0]
    k = trim_count(n, trim)
    if n - 2 * k < 1:
        return coordinate_median(stack)
    ordered = torch.sort(stack, dim=0).values
    return ordered[k:n - k].mean(dim=0)


def majority_vote(stack: torch.Tensor) -> torch.Tensor:
    """sign(sum_i sign(x_i)) over dim 0 of an (n, ...) stack (Bernstein et al. 2018, Algorithm 3):
    one vote per row, whatever its magnitude; a coordinate whose votes sum to 0 (a tie, or every
    row 0 there) gives 0.  The sum of n values in {-1, 0, +1} is exact in float64."""
    return torch.sign(torch.sign(stack.double()).sum(dim=0))


def krum_scores(vectors: torch.Tensor, f: int) -> list[float]:
    """Krum's score of each row of an (n, d) matrix (Blanchard et al. 2017, section 4): the sum of
    its squared Euclidean distances to its n - f - 2 closest other rows.  The distances are
    summed differences, in float64 (not the |a|^2 + |b|^2 - 2ab expansion of a matrix product,
    which loses the small distances between honest updates beside a huge one)."""
    n = vectors.shape[0]
    closest = n - f - 2
    if closest < 1:
        raise ValueError(f"krum needs n > 2f + 2 updates, i.e. n - f - 2 >= 1 neighbours: n = {n}, f = {f}")
    v = vectors.double()
    d2 = torch.empty((n, n), dtype=torch.float64)
    for i in range(n):
        d2[i] = (v - v[i]).pow(2).sum(dim=1)
    scores = []
    for i in range(n):
        others = torch.cat([d2[i, :i], d2[i, i + 1:]])
        scores.append(float(torch.sort(others).values[:closest].sum()))
    return scores


def krum_order(vectors: torch.Tensor, f: int) -> list[int]:
    """Row indices by Krum score, lowest first; equal scores in index order (the replies' order:
    the clients' ids, then the edges', so the choice does not depend on arrival)."""
    scores = krum_scores(vectors, f)
    return sorted(range(len(scores)), key=lambda i: (scores[i], i))


def krum_index(vectors: torch.Tensor, f: int) -> int:
    """Index of the row with the smallest Krum score (ties: the lowest index)."""
    return krum_order(vectors, f)[0]


def multi_krum_count(n: int, f: int, m: int = 0) -> int:
    """How many updates multi-Krum averages in a group of n: m where it is set (> 0), else n - f
    (the paper's suggestion), and never more than n - f, so no choice can need a Byzantine update."""
    return max(1, min(m if m > 0 else n - f, n - f))


def _own_value(p: Payload, name: str) -> torch.Tensor:
    """A payload's update for a `wsum` tensor: a client's as sent, a partial's as its weighted mean."""
    t = p.tensors[name]
    if COUNT_KEY in p.scalars:
        w = float(p.scalars[WEIGHT_KEY])
        return t / w if w > 0 else torch.zeros_like(t)
    return t


def robust_reduce(payloads: list[Payload], ops: Mapping[str, ReduceOp], rule: str, *,
                  trim: float = 0.1, krum_f: int = 1, krum_m: int = 0) -> Payload:
    """`reduce_payloads` with the `wsum` tensors combined by `rule` (module docstring); Krum or
    multi-Krum with fewer than 2f + 3 updates: the coordinate-wise median.  The majority vote
    reads each update's sign only, so a partial's sign (its weighted sum's) is its mean's."""
    out = reduce_payloads(payloads, ops)
    if rule == "mean":
        return out
    names = [n for n in payloads[0].tensors if ops.get(n, "wsum") == "wsum"
             and all(n in p.tensors for p in payloads)]
    if not names:
        return out
    total = float(out.scalars[WEIGHT_KEY])
    n = len(payloads)
    if rule in KRUM_RULES and n < rule_minimum(rule, krum_f):
        rule = "median"
    if rule in KRUM_RULES:
        flat = torch.stack([torch.cat([_own_value(p, nm).reshape(-1).double() for nm in names]) for p in payloads])
        order = krum_order(flat, krum_f)
        chosen = order[:multi_krum_count(n, krum_f, krum_m) if rule == "multi_krum" else 1]
        for nm in names:
            value = torch.stack([_own_value(payloads[i], nm).double() for i in chosen]).mean(dim=0)
            out.tensors[nm] = (value * total).to(out.tensors[nm].dtype)
        return out
    for nm in names:
        stack = torch.stack([_own_value(p, nm).double() for p in payloads])
        if rule == "majority_vote":
            value = majority_vote(stack)
        elif rule == "median":
            value = coordinate_median(stack)
        else:
            value = trimmed_mean(stack, trim)
        out.tensors[nm] = (value * total).to(out.tensors[nm].dtype)
    return out


def short_groups(replies: list[tuple[int, Payload]], rule: str, krum_f: int) -> list[tuple[str, str]]:
    """(node, detail) for each group below `rule_minimum`: the replies themselves where they are
    clients' (a star round, an edge's clients), else each edge partial whose `num_results` is."""
    need = rule_minimum(rule, krum_f)
    if not replies:
        return []
    if all(COUNT_KEY not in p.scalars for _, p in replies):
        if len(replies) >= need:
            return []
        return [("", f"{rule} needs {need} updates to outvote one bad update, the round's group had "
                     f"{len(replies)}: coordinate-wise median (of 1 or 2: their mean)")]
    out = []
    for key, p in replies:
        got = p.scalars.get(COUNT_KEY)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and got < need:
            out.append((edge_node(key), f"{rule} needs {need} updates to outvote one bad update, the edge's "
                                       f"group had {int(got)}: coordinate-wise median (of 1 or 2: their mean)"))
    return out


class RobustAggregate:
    """An algorithm's `aggregate` with a robust rule (installed by `build_algorithm`).  A rule is
    a statistic over every reply at once, so an algorithm carrying one does not stream
    (`Algorithm.streams` is False: the server and the edges collect every reply, as before).
    `fallbacks`: the short groups (`short_groups`) seen since the owner last emptied it (kept to
    the latest 1000)."""

    def __init__(self, ops: Mapping[str, ReduceOp], rule: str, trim: float, krum_f: int, krum_m: int = 0) -> None:
        self.ops, self.rule, self.trim, self.krum_f, self.krum_m = ops, rule, trim, krum_f, krum_m
        self.fallbacks: list[tuple[str, str]] = []

    def __call__(self, replies: Iterable[tuple[int, Payload]]) -> Payload:
        replies = list(replies)
        for node, detail in short_groups(replies, self.rule, self.krum_f):
            log.warning("robust aggregation%s: %s", f" ({node})" if node else "", detail)
            self.fallbacks.append((node, detail))
        del self.fallbacks[:-1000]
        return robust_reduce([p for _, p in replies], self.ops, self.rule, trim=self.trim, krum_f=self.krum_f,
                             krum_m=self.krum_m)

    def drain(self) -> list[tuple[str, str]]:
        """The short groups seen since the last drain, and forget them."""
        out, self.fallbacks = list(dict.fromkeys(self.fallbacks)), []
        return out


def config_problem(cfg: Any) -> str | None:
    """Why the config cannot carry its robust `security.aggregation` (a one-line config error), or
    None; the config loader raises it (common/config/rules.py).  A rule other than "mean" needs a
    topology whose spec says how it groups updates (`TopologySpec.robust`), a transport that hands
    over every update apart (not one that sums them in a collective, `Transport.sums_in_collective`),
    and groups large enough for the rule (`config_group_problem`).  Whether the algorithm lets its
    reduction be replaced is the algorithm's rule (common/algorithms `config_problem`)."""
    rule = cfg.security.aggregation
    if rule == "mean":
        return None
    try:
        spec = spec_for(cfg.topology.kind)
    except (KeyError, ValueError):   # an unknown kind, a plug-in that does not load
        spec = None
    if spec is None or spec.robust is None:
        kinds = " or ".join(f"'{k}'" for k, s in builtin_specs().items() if s.robust is not None)
        return f"config key 'security.aggregation': '{rule}' works in topology.kind = {kinds}, got '{cfg.topology.kind}'"
    if sums_in_collective(cfg.transport.kind):
        return (f"config key 'security.aggregation': '{rule}' needs every update apart, but "
                f"transport.kind = '{cfg.transport.kind}' sums them in a collective; use transport.kind = 'grpc'")
    return config_group_problem(cfg)


def config_group_problem(cfg: Any) -> str | None:
    """Why the config's groups cannot carry its robust rule (a one-line config error), or None.
    The largest group a round can have: star, the clients sampled per round; hierarchical, at each
    edge, its clients (at most the clients sampled per round).  A malformed topology is left to the
    config's own checks (None)."""
    sec = cfg.security
    rule = sec.aggregation
    if rule == "mean":
        return None
    if rule == "trimmed_mean" and sec.trim <= 0:
        return ("config key 'security.trim': got 0, a trimmed mean that trims nothing is the mean; use "
                "security.aggregation = 'mean' or trim > 0")
    krum_m = int(getattr(sec, "krum_m", 0) or 0)
    if krum_m and rule != "multi_krum":
        return (f"config key 'security.krum_m': got {krum_m}, but only security.aggregation = 'multi_krum' "
                f"averages m updates (aggregation is '{rule}')")
    from fedhop.common.config.schema import resolve_clients_per_round
    need = rule_minimum(rule, sec.krum_f)
    sampled = resolve_clients_per_round(cfg)
    why = (f"{rule} with security.krum_f = {sec.krum_f} needs n > 2f + 2 = {need - 1} updates per group"
           if rule in KRUM_RULES else f"{rule} needs at least {need} updates per group to outvote one bad update")

    def too_many(group: int, where: str) -> str | None:   # multi-Krum's m against the group's n - f
        if rule == "multi_krum" and krum_m > group - sec.krum_f:
            return (f"config key 'security.krum_m': got {krum_m}, but multi-Krum averages at most n - f = "
                    f"{group - sec.krum_f} updates of {where}'s group of n = {group} (f = {sec.krum_f}); "
                    f"use krum_m <= {group - sec.krum_f}, or 0 for n - f")
        return None
    try:
        groups = spec_for(cfg.topology.kind).robust   # how the topology groups updates
    except (KeyError, ValueError):
        return None
    if groups == "round":
        if sampled < need:
            return (f"config key 'security.aggregation': {why}, but a round samples {sampled} clients "
                    f"(clients.per_round = {cfg.clients.per_round})")
        return too_many(sampled, "a round")
    if groups != "edge":
        return None
    from fedhop.common.topologies.graphs import cluster_assignment
    try:
        if not 1 <= cfg.topology.edges <= cfg.clients.count:
            return None
        clusters = cluster_assignment(cfg)
    except (ValueError, TypeError):
        return None
    for e, cluster in enumerate(clusters):
        if min(len(cluster), sampled) < need:
            return (f"config key 'security.aggregation': {why}, but edge {e} can aggregate at most "
                    f"{min(len(cluster), sampled)} client updates a round ({len(cluster)} clients, "
                    f"{sampled} sampled per round); use fewer edges or more clients per edge")
    for e, cluster in enumerate(clusters):
        problem = too_many(min(len(cluster), sampled), f"edge {e}")
        if problem:
            return problem
    return None
