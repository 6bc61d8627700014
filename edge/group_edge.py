"""An edge's side of the group data plane, hierarchical and sequential topologies (common/transport/groups.py).

The EDGE_STEP and SEQ_EDGE_PATH planes of a transport with groups (torch.distributed;
common/transport/factory.py GROUP_PLANES).  The edge belongs to two groups of the transport's
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

import torch

from fedhop.common.processors.pipeline import reduced_chain
from fedhop.common.transport.base import HandlerError, Request
from fedhop.common.transport.groups import send_beside_call, worlds
from fedhop.common.util.nodeids import edge_node
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


class GroupModelPath:
    """Fed-CHS's model by group rounds and peer sends at an edge (edge/sequential.py
    `MODEL_PATHS`): each cluster step is a group round in this edge's cluster group, a hand-off
    is a peer send to the next edge beside the `seq_handoff` control call (which makes the
    receiver post the matching receive), and the final (or checkpoint) model waits here for
    `seq_final`, which sends it to the server.  Every model received is drained from the wire
    before it is checked."""

    def __init__(self, edge) -> None:
        self.edge = edge                                   # edge/sequential.py's SequentialEdge
        self.final: dict[str, torch.Tensor] | None = None  # the model the server fetches with seq_final

    @property
    def group_edge(self) -> GroupEdge:
        group_edge = self.edge.agg.group()
        group_edge.ready()
        return group_edge

    def _entries(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(k, dtype, shape) for k, (dtype, shape) in self.edge.spec.items()]

    def cluster_step(self, round: int, step: int, message: Payload) -> tuple[Payload | None, dict[int, str]]:
        group_edge = self.group_edge
        partial, failed = group_edge.step(round, step, list(self.edge.agg.cluster), message)
        if partial is not None:
            reduced_chain(self.edge.spec, Method.TORCH_REDUCE, round=round)(
                partial, f"round {round} step {step} reduced partial of {group_edge.node_id}'s client processes")
        return partial, failed

    def handoff_model(self, src: str, round: int, payload: Payload) -> dict[str, torch.Tensor]:
        group_edge = self.group_edge
        peers = group_edge.world.peers
        if not peers.knows(src):
            raise HandlerError("NOT_NEIGHBOUR", f"{src} has no rank in the world")
        try:
            tensors = peers.recv(self._entries(), src, round, "edge-edge")
        except RuntimeError as exc:
            raise HandlerError("COLLECTIVE_FAILED", f"{group_edge.node_id}: hand-off from {src} failed: {exc}") from None
        return self.edge.model_in(Payload(tensors=tensors), f"hand-off from {src}")

    def resumed_model(self, round: int, message: Payload) -> dict[str, torch.Tensor]:
        group_edge = self.group_edge
        try:
            tensors = group_edge.world.peers.recv(self._entries(), "server", round, "edge-server")
        except RuntimeError as exc:
            raise HandlerError("COLLECTIVE_FAILED", f"{group_edge.node_id}: the resumed model from the server did "
                                                    f"not arrive: {exc}") from None
        return self.edge.model_in(Payload(tensors=tensors), f"resumed model for round {round}")

    def send_model(self, round: int, peer: int, address: str, w: dict[str, torch.Tensor]) -> None:
        send_beside_call(self.edge.agg.fabric, self.group_edge.world.peers, address, edge_node(peer),
                         Method.SEQ_HANDOFF, [w[k] for k in self.edge.spec], round=round, link="edge-edge",
                         timeout=self.edge.cfg.run.call_timeout, what="the hand-off")

    def final_model(self, w: dict[str, torch.Tensor], reply: Payload) -> None:
        self.final = dict(w)   # the server fetches it with `seq_final` (a peer send)

    def send_final(self, round: int) -> Payload:
        group_edge, final = self.group_edge, self.final
        if final is None:
            raise HandlerError("NO_TOKEN", f"{group_edge.node_id} holds no final model for round {round}")
        try:
            group_edge.world.peers.send([final[k] for k in self.edge.spec], "server", round, "edge-server")
        except RuntimeError as exc:
            raise HandlerError("COLLECTIVE_FAILED", f"{group_edge.node_id}: sending the final model failed: "
                                                    f"{exc}") from None
        self.final = None
        return Payload()


def torch_handlers(edge: Any) -> dict[Method, Callable[[Request], Payload]]:
    """The group data plane's methods an edge serves in a torch run (named by the torch
    transport's registration, common/transport/factory.py); `edge` is its EdgeAggregator."""
    return {
        Method.TORCH_PROCS: lambda request: edge.group().processes(),
        Method.TORCH_INIT: lambda request: edge.group().init(request.payload),
        Method.TORCH_EDGE_ROUND: lambda request: edge.group().round(int(request.envelope.round), request.payload),
        Method.TORCH_EDGE_REDUCE: lambda request: edge.group().reduce(int(request.envelope.round), request.payload),
    }
