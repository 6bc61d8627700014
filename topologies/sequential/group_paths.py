"""The sequential topology's model path over a transport with groups (torch.distributed,
docs/torch_transport.md): at the server, `GroupSequentialPath` joins the edges' world and takes
the final (or checkpoint) model as a peer send; at an edge, `GroupModelPath` runs each cluster
step as a group round in the edge's cluster group (edge/group_edge.py `GroupEdge`) and hands the
model to the next edge as a peer send beside the `seq_handoff` call."""
from __future__ import annotations

import logging

import torch

from fedhop.common.processors.pipeline import reduced_chain
from fedhop.common.transport.base import CallFailed, HandlerError, RemoteError
from fedhop.common.transport.groups import recv_beside_call, send_beside_call, worlds
from fedhop.common.util.nodeids import edge_node
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method
from fedhop.edge.group_edge import GroupEdge
from fedhop.server.driver import DriverContext, RunFailed
from fedhop.server.group_rounds import group_members
from fedhop.topologies.sequential import SEQ_FINAL, SEQ_HANDOFF, SEQ_ROUND

log = logging.getLogger("fedhop.server")


class GroupSequentialPath:
    """Fed-CHS's model by peer sends at the server (driver.py; `SERVER_PATHS` style "group"): the
    server joins the edges' world; a resumed run's model goes to the holder as a send beside
    the first `seq_round` call, and the final (or checkpoint) model comes back as a send from
    the holder (link edge-server), which the control call `seq_final` asks for while the server
    posts the matching receive."""

    def __init__(self, ctx: DriverContext) -> None:
        self.ctx = ctx
        cfg = ctx.run.cfg
        world = worlds(cfg.transport.kind).edges(ctx.fabric, group_members(ctx, "edge"), cfg.transport,
                                                  ctx.records.ledger, ctx.run.run_id)
        log.info("edges' world: %s", world.description)
        self.peers = world.peers

    def call_round(self, node, round: int, message: Payload, resumed: bool) -> Payload:
        fabric, timeout = self.ctx.fabric, self.ctx.run.cfg.run.round_timeout * 2
        if not resumed:
            return fabric.call(node.address, node.node_id, SEQ_ROUND, message, round=round, timeout=timeout)
        return send_beside_call(fabric, self.peers, node.address, node.node_id, SEQ_ROUND,
                                list(message.tensors.values()), payload=Payload(scalars=message.scalars,
                                                                                control=message.control),
                                round=round, link="edge-server", timeout=timeout, what="the resumed model")

    def final_model(self, node, round: int, reply: Payload, spec) -> Payload:
        try:
            tensors = recv_beside_call(self.ctx.fabric, self.peers, node.address, node.node_id, SEQ_FINAL,
                                       [(k, dtype, shape) for k, (dtype, shape) in spec.items()], round=round,
                                       link="edge-server", timeout=self.ctx.run.cfg.run.round_timeout,
                                       what="the final model")
        except (CallFailed, RemoteError, PayloadError) as exc:
            raise RunFailed(f"round {round}: the final model from {node.node_id}: {exc}") from None
        return Payload(scalars=reply.scalars, tensors=tensors)


class GroupModelPath:
    """Fed-CHS's model by group rounds and peer sends at an edge (edge.py;
    `EDGE_PATHS` style "group"): each cluster step is a group round in this edge's cluster group, a hand-off
    is a peer send to the next edge beside the `seq_handoff` control call (which makes the
    receiver post the matching receive), and the final (or checkpoint) model waits here for
    `seq_final`, which sends it to the server.  Every model received is drained from the wire
    before it is checked."""

    def __init__(self, edge) -> None:
        self.edge = edge                                   # edge.py's SequentialEdge
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
                         SEQ_HANDOFF, [w[k] for k in self.edge.spec], round=round, link="edge-edge",
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
