"""The server's group data planes: a round as one group broadcast and reduce (common/transport/groups.py).

- `GroupRounds` (star): the group of the client processes, rooted at the server.  Each process
  pre-aggregates its sampled clients (client/group_worker.py) and contributes one partial.
- `HierGroupRounds` (hierarchical): the group of the edges, rooted at the server; each edge runs
  kappa2 cluster rounds in its own group (edge/group_edge.py) and contributes its partial.
- `GroupSequentialPath` (sequential, Fed-CHS): the model moves by point-to-point sends in the
  edges' world (the server's side; edge/group_edge.py `GroupModelPath` is the edges').

The transport's `Worlds` (common/transport/groups.py `worlds`) sets the groups up; with
torch.distributed the tensors move as collectives and the control as fabric calls.  The
summation order differs from the per-client fan-out (per process, then across processes), so
results equal it within float rounding, not bit for bit (docs/torch_transport.md).
"""
from __future__ import annotations

import logging

from fedhop.common.processors.pipeline import reduced_chain
from fedhop.common.transport.base import CallFailed, RemoteError
from fedhop.common.transport.groups import Group, GroupFailed, Member, recv_beside_call, send_beside_call, worlds
from fedhop.common.util.nodeids import edge_index
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import Method
from fedhop.server.driver import DriverContext, RunFailed
from fedhop.server.sampled import DataPlane

log = logging.getLogger("fedhop.server")


class CollectiveFailed(RunFailed):
    pass


def _failed_run(exc: GroupFailed) -> CollectiveFailed:
    return CollectiveFailed(str(exc) if exc.code == "COLLECTIVE_FAILED" else f"{exc.code}: {exc.detail}")


def _members(ctx: DriverContext, role: str) -> list[Member]:
    nodes = [n for n in ctx.children.values() if n.role == role]
    key = (lambda n: edge_index(n.node_id)) if role == "edge" else (lambda n: n.node_id)
    return [Member(n.node_id, n.address) for n in sorted(nodes, key=key)]


class _GroupPlane(DataPlane):
    """A round of sampled clients as one group round rooted at the server."""

    per_client = False
    what = ""   # the members, in the reduced partial's name
    reduce_method = Method.TORCH_REDUCE   # the method whose members' partials are reduced

    def __init__(self, ctx: DriverContext, group: Group, timeout: float, prefix_failures: bool) -> None:
        super().__init__(ctx)
        self.group = group
        self.timeout = timeout
        self.prefix_failures = prefix_failures

    def dispatch(self, round: int, sampled: list[int], message: Payload, arrivals: dict[int, float]):
        ctx = self.ctx
        message = ctx.group_message(message, round, sampled)
        clients: dict[str, list[int]] = {m.node_id: [] for m in self.group.members}
        for cid in sampled:
            clients[ctx.client_home[cid].node_id].append(cid)
        try:
            result = self.group.round(round, message, clients, ops=ctx.algorithm.reply_reduce, timeout=self.timeout,
                                      reduce_timeout=ctx.cfg.run.round_timeout, where=f"round {round}")
        except GroupFailed as exc:
            raise _failed_run(exc) from None
        failures = result.all_failures(prefix=self.prefix_failures)
        if result.partial is None:
            return {}, failures
        try:
            reduced_chain(ctx.algorithm.reply_spec(ctx.state), self.reduce_method, round=round)(
                result.partial, f"round {round} reduced partial of the {self.what}")
        except PayloadError as exc:
            raise CollectiveFailed(str(exc)) from None
        return {0: result.partial}, failures


class GroupRounds(_GroupPlane):
    """Star: the group of the client processes (module docstring)."""

    what = "client processes"

    def __init__(self, ctx: DriverContext) -> None:
        procs = _members(ctx, "client")
        group = worlds(ctx.cfg.transport.kind).star(ctx.fabric, procs, ctx.cfg.transport, ctx.ledger, ctx.run_id)
        log.info("group of the server and %d client processes (transport %s)", len(procs), ctx.cfg.transport.kind)
        super().__init__(ctx, group, ctx.cfg.run.round_timeout, prefix_failures=False)


class HierGroupRounds(_GroupPlane):
    """Hierarchical (HierFAVG): the group of the edges; each edge runs its cluster rounds."""

    what = "edges"
    reduce_method = Method.TORCH_EDGE_REDUCE

    def __init__(self, ctx: DriverContext) -> None:
        compress = getattr(ctx.cfg.algorithm, "compress", "none")
        up = ctx.cfg.compression.up
        if up != "none":   # uploads are reduced as raw float sums here, never coded
            raise ValueError(f"compression.up = '{up}' is not supported with transport.kind = "
                             f"'{ctx.cfg.transport.kind}' and topology.kind = 'hierarchical' (allowed: 'none'); "
                             f"use transport.kind = 'grpc'")
        if compress != "none":
            raise ValueError(f"algorithm.compress = '{compress}' is not supported with transport.kind = "
                             f"'{ctx.cfg.transport.kind}' and topology.kind = 'hierarchical' (allowed: 'none'); "
                             f"use transport.kind = 'grpc'")
        world = worlds(ctx.cfg.transport.kind).edges(ctx.fabric, _members(ctx, "edge"), ctx.cfg.transport,
                                                      ctx.ledger, ctx.run_id)
        log.info("edges' world: %s", world.description)
        super().__init__(ctx, world.top, ctx.cfg.run.round_timeout * 2, prefix_failures=True)


class GroupSequentialPath:
    """Fed-CHS's model by peer sends at the server (server/sequential.py `MODEL_PATHS`): the
    server joins the edges' world; a resumed run's model goes to the holder as a send beside
    the first `seq_round` call, and the final (or checkpoint) model comes back as a send from
    the holder (link edge-server), which the control call `seq_final` asks for while the server
    posts the matching receive."""

    def __init__(self, coord: DriverContext) -> None:
        self.coord = coord
        world = worlds(coord.cfg.transport.kind).edges(coord.fabric, _members(coord, "edge"), coord.cfg.transport,
                                                        coord.ledger, coord.run_id)
        log.info("edges' world: %s", world.description)
        self.peers = world.peers

    def call_round(self, node, round: int, message: Payload, resumed: bool) -> Payload:
        fabric, timeout = self.coord.fabric, self.coord.cfg.run.round_timeout * 2
        if not resumed:
            return fabric.call(node.address, node.node_id, Method.SEQ_ROUND, message, round=round, timeout=timeout)
        return send_beside_call(fabric, self.peers, node.address, node.node_id, Method.SEQ_ROUND,
                                list(message.tensors.values()), payload=Payload(scalars=message.scalars,
                                                                                control=message.control),
                                round=round, link="edge-server", timeout=timeout, what="the resumed model")

    def final_model(self, node, round: int, reply: Payload, spec) -> Payload:
        try:
            tensors = recv_beside_call(self.coord.fabric, self.peers, node.address, node.node_id, Method.SEQ_FINAL,
                                       [(k, dtype, shape) for k, (dtype, shape) in spec.items()], round=round,
                                       link="edge-server", timeout=self.coord.cfg.run.round_timeout,
                                       what="the final model")
        except (CallFailed, RemoteError, PayloadError) as exc:
            raise RunFailed(f"round {round}: the final model from {node.node_id}: {exc}") from None
        return Payload(scalars=reply.scalars, tensors=tensors)

__all__ = ["GroupRounds", "HierGroupRounds", "GroupSequentialPath", "CollectiveFailed"]
