"""The `[secure_aggregation]` section's rules and the round's parameters from it.

Secure aggregation needs a round whose replies are summed and nothing else: a topology whose spec
declares the four phases' methods (the star's, the hierarchical one's), a transport that moves tensors inside its calls
(style "fanout": grpc, inmemory), a FedAvg-family algorithm (its reply is a parameter delta and
the server step reads only the weighted mean), uniform weighting (every weight is 1, so the sum of
the weights is the number of clients unmasked and no weight has to travel), the plain mean (a
robust rule needs every update), and no compressor (the masked values are already integers in
Z_R).  Behind edges each edge runs the protocol for its cluster, so the parameters are checked
against the smallest cluster's clients per round.  The config is read duck-typed: this layer sits
below the config schema."""
from __future__ import annotations

from typing import Any

from .messages import PHASES
from .params import SecAggParams

DROPOUT_ACTIONS = ("refuse", "exit")

#: the algorithms whose reply is a summable delta with the default weighted-sum aggregation
SUMMABLE = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
ADVERTISE = "secagg_advertise"   # the first phase's method: a topology serves secure aggregation when it declares it


def params_of(section: Any, n: int, seed: int) -> SecAggParams:
    """The round's parameters for `n` sampled clients (threshold 0 = floor(k / 2) + 1)."""
    k = n - 1 if section.degree <= 0 or section.degree >= n - 1 else int(section.degree)
    t = int(section.threshold) or k // 2 + 1
    return SecAggParams(n=n, degree=k, threshold=t, modulus_bits=int(section.modulus_bits), clip=float(section.clip),
                        quant_bits=int(section.quant_bits), seed=seed)


def dropout_plan(entries: list) -> dict[tuple[int, str, int], str]:
    """`secure_aggregation.dropouts` (tests and development only) as {(round, phase, client):
    action}: each entry "ROUND:PHASE:CLIENT" or "ROUND:PHASE:CLIENT:ACTION", ACTION "refuse" (the
    default: the client's call fails) or "exit" (its process ends).  ValueError names a bad entry."""
    plan: dict[tuple[int, str, int], str] = {}
    for entry in entries:
        parts = str(entry).split(":")
        ok = len(parts) in (3, 4) and parts[0].isdigit() and parts[2].isdigit() and parts[1] in PHASES
        action = parts[3] if ok and len(parts) == 4 else "refuse"
        if not ok or action not in DROPOUT_ACTIONS or int(parts[0]) < 1:
            raise ValueError(f"entry {entry!r} is not ROUND:PHASE:CLIENT[:ACTION] with ROUND >= 1, PHASE one of "
                             f"{', '.join(PHASES)} and ACTION one of {', '.join(DROPOUT_ACTIONS)}")
        plan[(int(parts[0]), parts[1], int(parts[2]))] = action
    return plan


def config_problem(cfg: Any, per_round: int, topology_methods: tuple[str, ...], transport_style: str,
                   where: str = "clients per round") -> str | None:
    """One line naming what the config asks that secure aggregation cannot do, or None.
    `per_round`: the clients of the smallest protocol round (the star's round, behind edges the
    smallest cluster's share of it), `where` says which; `topology_methods`: the methods the
    topology's spec declares; `transport_style`: the transport's (common/transport/entry.py)."""
    sa = cfg.secure_aggregation
    if not sa.enabled:
        return None
    key = "config key 'secure_aggregation.enabled'"
    if ADVERTISE not in topology_methods:
        return (f"{key}: topology.kind = '{cfg.topology.kind}' does not run secure aggregation's phases "
                f"(star and hierarchical do)")
    if transport_style != "fanout":
        return (f"{key}: secure aggregation's phases travel inside the fabric's calls (transport.kind = grpc or "
                f"inmemory), not over transport.kind = '{cfg.transport.kind}' ({transport_style})")
    if cfg.algorithm.name not in SUMMABLE:
        return (f"{key}: algorithm.name = '{cfg.algorithm.name}' does not reply with a summable delta (allowed: "
                f"{', '.join(SUMMABLE)})")
    if getattr(cfg.algorithm, "weighting", "samples") != "uniform":
        return (f"{key}: needs algorithm.weighting = \"uniform\" (a sample-count weight would have to be revealed "
                f"or masked)")
    if cfg.security.aggregation != "mean":
        return f"{key}: security.aggregation = '{cfg.security.aggregation}' needs every update; secure aggregation " \
               f"gives the server only their sum"
    if cfg.compression.up != "none" or cfg.compression.down != "none":
        return f"{key}: compression.up and compression.down must be \"none\" (the masked values are integers in Z_R)"
    try:
        plan = dropout_plan(list(sa.dropouts))
    except ValueError as exc:
        return f"config key 'secure_aggregation.dropouts': {exc}"
    stray = sorted({c for (_, _, c) in plan if c >= int(cfg.clients.count)})
    if stray:
        return f"config key 'secure_aggregation.dropouts': clients {stray} are not among the {cfg.clients.count} clients"
    problems = params_of(sa, per_round, int(cfg.run.seed)).problems()
    if problems:
        return f"config key 'secure_aggregation': {problems[0]} ({per_round} {where})"
    return None
