"""Secure aggregation behind edges (docs/secure-aggregation.md, "Behind edges"): each edge runs
SecAgg+'s four phases for its cluster's sampled clients, unmasks their sum and answers the server
with it as its partial aggregate, so the server sees cluster sums only.

The edge is the protocol's server for its cluster: one SecAgg+ round per edge iteration
(common/transport/secagg_round.py, the implementation the star's server runs), its parameters
those of the cluster's clients (n = the cluster's sampled clients), its protocol round number
`protocol_round(round, iteration, kappa2)` so that no two iterations share keys' context, graph or
rounding.  A client that drops in an iteration is one of the round's failures and sits out the
edge's later iterations; an iteration without a sum fails the edge's whole round
(SECAGG_FAILED, the typed reason in the message), which the server records as a `secagg_failed`
event (driver.py) and counts as that edge's clients lost, a short round as any other."""
from __future__ import annotations

import logging
from typing import ClassVar

from fedhop.common.security.secagg.settings import params_of
from fedhop.common.transport.base import HandlerError
from fedhop.common.transport.fabric import Send
from fedhop.common.transport.secagg_round import FAILED, protocol_round, secagg_round
from fedhop.common.util.nodeids import client_node
from fedhop.common.wire.message import Payload
from fedhop.edge.aggregator import EdgeAggregator

log = logging.getLogger("fedhop.edge")


def failed_message(why: str, node: str, step: int, dropped: list[int]) -> str:
    """The SECAGG_FAILED error's message: the typed reason, then the clients that dropped before
    unmasking (the server counts only those as the round's failures, as the star does: driver.py)."""
    return f"{why} ({node}, step {step}; clients dropped: {dropped})"


class SecAggCluster:
    """The EDGE_STEP plane with secure aggregation: one edge iteration is one SecAgg+ round."""

    joins_groups: ClassVar[bool] = False

    def __init__(self, aggregator: EdgeAggregator) -> None:
        self.agg = aggregator
        self.first: list[int] = []   # the round's clients at its first iteration

    def step(self, round: int, step: int, clients: list[int], message: Payload
             ) -> tuple[Payload | None, dict[int, str]]:
        agg, cfg = self.agg, self.agg.cfg
        node = agg.endpoint.node_id
        unknown = {c: f"UNKNOWN_CLIENT: client {c} never registered with {node}" for c in clients
                   if c not in agg.client_home}
        if step == 0:
            self.first = list(clients)
        clients = [c for c in clients if c not in unknown]
        params = params_of(cfg.secure_aggregation, len(clients), cfg.run.seed, cfg.compression)
        number = protocol_round(round, step, getattr(agg.params, "kappa2", 1))

        def target(cid: int, method: str, payload: Payload) -> Send:
            return Send(cid, agg.client_home[cid][1], client_node(cid), method, payload, step=step,
                        who=f"round {round} step {step} {method} reply of client {cid}")

        out = secagg_round(agg.fabric, params, number, clients, message, target, lambda cid: message, round=round,
                           timeout=cfg.run.round_timeout, call_timeout=cfg.run.call_timeout,
                           note=lambda line: log.info("%s round %d step %d secagg %s", node, round, step, line))
        agg.suspect_failed(out.failures)
        failures = {**unknown, **out.failures}
        if out.partial is None:   # the round's dropouts: this iteration's and the earlier iterations'
            dropped = set(failures) | (set(self.first) - set(clients))
            raise HandlerError(FAILED, failed_message(out.failed or "", node, step, sorted(dropped)))
        for cid, why in sorted(out.late.items()):
            log.info("%s round %d: client %d dropped in unmasking, its input is in the sum (%s)", node, round, cid, why)
        return out.partial, failures


class SecAggEdge:
    """The hierarchical spec's `edge_role`: with `[secure_aggregation] enabled` the edge's
    iterations run through `SecAggCluster` instead of the transport's plain fan-out."""

    def __init__(self, aggregator: EdgeAggregator) -> None:
        if aggregator.cfg.secure_aggregation.enabled:
            aggregator.use_plane(SecAggCluster(aggregator))
