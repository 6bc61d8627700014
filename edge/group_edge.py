"""An edge's side of the group data plane (common/transport/groups.py).

The EDGE_STEP plane of a transport with groups (torch.distributed; common/transport/factory.py
GROUP_PLANES); the sequential topology's model path builds on it (topologies/sequential/group_paths.py).  The edge belongs to two groups of the transport's
world (set up by `torch_init`): the top group {server, every edge}, rooted at the server, and
its cluster group {this edge, its client processes}, rooted here.

One HierFAVG round at this edge (the loop is edge/aggregator.py `EdgeAggregator.hierfavg`, as
for the fan-out):
  1. receive the server's message in the top group (`torch_edge_round`);
  2. the kappa2 iterations, each `GroupEdge.step`: one cluster round (the current edge model to
     the client processes, which train their sampled clients; their partials reduced into this
     edge);
  3. contribute the partial to the server's reduce in the top group (`torch_edge_reduce`).
A group round needs every member, so a client process that fails or does not answer fails this
edge's round (COLLECTIVE_FAILED, naming the process), which the server turns into a failed run.
"""
from __future__ import annotations

from typing import Any, Callable

from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.transport.groups import worlds
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method


class GroupEdge:
    """This edge's membership of the transport's world; its EDGE_STEP plane (`step`)."""

    joins_groups = True

    def __init__(self, aggregator) -> None:
        self.agg = aggregator
        self.node_id: str = aggregator.endpoint.node_id
        self.world: Any = None   # this edge's membership of the world (common/transport/groups.py Worlds.edge_member)

    def processes(self) -> Payload:
        """This edge's client processes (the server lays out the world from every edge's answer)."""
        return Payload(control=pb.Control(processes=sorted(self.agg.processes)))

    def ready(self):
        if self.world is None:
            raise HandlerError("NOT_READY", f"{self.node_id}: torch_init has not been called")
        return self.world

    def init(self, payload: Payload) -> Payload:
        """Join the world: forward each client process its set-up call, create every group."""
        self.world = worlds(self.agg.cfg.transport.kind).edge_member(
            self.agg.fabric, self.node_id, payload, self.agg.processes, self.agg.endpoint.ledger, self.agg.run_id)
        return Payload(scalars={"rank": self.world.rank})

    # ------------------------------------------------------------------ rounds
    def round(self, round: int, payload: Payload) -> Payload:
        """Steps 1-2 of the module docstring; the reply holds the failures and the partial's description."""
        world = self.ready()
        incoming = world.top.receive(round, payload)
        self.agg.check_sampled(incoming.clients)
        partial, failures = self.agg.hierfavg(round, incoming.clients, incoming.message)
        return world.top.answer(partial, failures, self.agg.algorithm.reply_reduce)

    def step(self, round: int, step: int, clients: list[int], message: Payload):
        """One cluster round: the message to the client processes, their partials reduced here."""
        by_proc: dict[str, list[int]] = {}
        for cid in clients:
            by_proc.setdefault(self.agg.client_home[cid][0], []).append(cid)
        result = self.ready().cluster.round(round, message, by_proc, ops=self.agg.algorithm.reply_reduce,
                                            timeout=self.agg.cfg.run.round_timeout,
                                            reduce_timeout=self.agg.cfg.run.round_timeout,
                                            where=f"{self.node_id}: round {round} edge iteration {step}", step=step)
        return result.partial, result.all_failures()

    def reduce(self, round: int, payload: Payload) -> Payload:
        """Step 3: this edge's partial (or the ops' identities) into the server's reduce."""
        return self.ready().top.contribute(round, payload)


def torch_handlers(edge: Any) -> dict[Method, Callable[[Request], Payload]]:
    """The group data plane's methods an edge serves in a torch run (named by the torch
    transport's registration, common/transport/factory.py); `edge` is its EdgeAggregator."""
    return {
        Method.TORCH_PROCS: lambda request: edge.group().processes(),
        Method.TORCH_INIT: lambda request: edge.group().init(request.payload),
        Method.TORCH_EDGE_ROUND: lambda request: edge.group().round(int(request.envelope.round), request.payload),
        Method.TORCH_EDGE_REDUCE: lambda request: edge.group().reduce(int(request.envelope.round), request.payload),
    }
