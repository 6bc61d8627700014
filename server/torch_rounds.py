"""The server's side of the torch.distributed data plane (common/transport/torchdist.py).

Star topology: rank 0 is the server, client process k (sorted by node id) is rank k + 1.
Each round costs one broadcast of the algorithm's message to every client process and one
reduce of their partial aggregates; the sampled clients, the tensor layout, failures and the
partials' scalars travel as gRPC control messages.  Hierarchical topology: `HierTorchRounds`
below (server + edges in a top group, one group per edge cluster; edge side edge/torch_edge.py).
"""
from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout

from fedhop.common.algorithms.base import Payload, reduce_payloads
from fedhop.common.codec import PayloadError
from fedhop.common.methods import Method
from fedhop.common.control import control_of, failures_of, torch_world
from fedhop.common.transport.base import CallFailed, RemoteError
from fedhop.common.transport.torchdist import (Collectives, LayoutMismatch, TorchParams, buffers_by_name, build_groups,
                                        free_port, init_watching, merge_layouts, reduce_buffers, specs_of)
from fedhop.common.topology import edge_index
from fedhop.common.transport.fabric import gather
from fedhop.common.validation import validate_reply
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.server.driver import DriverContext, RunFailed
from fedhop.server.sampled import DataPlane

log = logging.getLogger("fedhop.server")

NO_ANSWER = "timeout: no answer in time"


class TorchRounds(DataPlane):
    """Star topology over collectives (module docstring): the star driver's torch data plane."""

    def __init__(self, coordinator: DriverContext) -> None:
        super().__init__(coordinator)
        self.c = coordinator
        cfg = coordinator.cfg
        self.params = getattr(cfg.transport, "params", None) or TorchParams()
        self.procs = sorted((n for n in coordinator.children.values() if n.role == "client"),
                            key=lambda n: n.node_id)
        self.peers = [p.node_id for p in self.procs]
        host = cfg.transport.host
        master = f"{host}:{self.params.master_port or free_port(host)}"
        self.coll = Collectives("server", 0, len(self.procs) + 1, coordinator.ledger, self.params,
                                coordinator.run_id)
        calls = {p.node_id: coordinator.fabric.submit(
            coordinator.fabric.call, p.address, p.node_id, Method.TORCH_INIT,
            Payload(scalars={"rank": i + 1, "world_size": len(self.procs) + 1, "master": master,
                             "backend": self.params.backend, "timeout": self.params.timeout}),
            round=0, timeout=self.params.timeout) for i, p in enumerate(self.procs)}
        init_watching(self.coll, master, calls, "torch.distributed set-up failed")
        _, failed = gather(calls, self.params.timeout, NO_ANSWER)
        if failed:
            raise RuntimeError(f"torch.distributed set-up failed: {failed}")
        log.info("torch.distributed %s group of %d ranks at %s", self.params.backend, len(self.procs) + 1, master)

    def dispatch(self, round: int, sampled: list[int], message: Payload, arrivals: dict[int, float]):
        c = self.c
        message = c.group_message(message, round, sampled)
        by_proc = {p: [] for p in self.peers}
        for cid in sampled:
            by_proc[c.client_home[cid].node_id].append(cid)
        control = {p.node_id: c.fabric.submit(
            c.fabric.call, p.address, p.node_id, Method.TORCH_ROUND,
            Payload(scalars=message.scalars,
                    control=pb.Control(clients=by_proc[p.node_id], specs=specs_of(message.tensors))),
            round=round, timeout=c.cfg.run.round_timeout) for p in self.procs}
        try:
            self.coll.broadcast(list(message.tensors.values()), round, self.peers)
        except RuntimeError as exc:
            raise CollectiveFailed(f"round {round}: broadcast failed: {exc}") from None
        replies, failed = gather(control, c.cfg.run.round_timeout, NO_ANSWER)
        if failed:
            raise CollectiveFailed(f"round {round}: client processes {sorted(failed)} did not finish the round "
                                   f"({next(iter(failed.values()))}); a collective needs every rank")
        failures: dict[int, str] = {}
        layouts, scalar_parts = {}, []
        for node, reply in sorted(replies.items()):
            failures.update(failures_of(reply))
            if control_of(reply).layout:
                layouts[node] = control_of(reply).layout
                scalar_parts.append(Payload(scalars=dict(reply.scalars)))
        if not layouts:
            return {}, failures
        try:
            layout = merge_layouts(layouts, f"round {round}: client processes")
        except LayoutMismatch as exc:
            raise CollectiveFailed(f"LAYOUT_MISMATCH: {exc}") from None
        reduce_calls = {p.node_id: c.fabric.submit(c.fabric.call, p.address, p.node_id, Method.TORCH_REDUCE,
                                                  Payload(control=pb.Control(layout=layout)), round=round,
                                                  timeout=c.cfg.run.round_timeout) for p in self.procs}
        buffers = reduce_buffers(layout, None)
        try:
            self.coll.reduce(buffers, round, self.peers)
        except RuntimeError as exc:
            raise CollectiveFailed(f"round {round}: reduce failed: {exc}") from None
        _, failed = gather(reduce_calls, c.cfg.run.round_timeout, NO_ANSWER)
        if failed:
            raise CollectiveFailed(f"round {round}: reduce control failed: {failed}")
        partial = reduce_payloads(scalar_parts, c.algorithm.reply_reduce)
        partial.tensors = buffers_by_name(layout, buffers)
        try:
            validate_reply(partial, c.algorithm.reply_spec(c.state), f"round {round} reduced partial of the "
                                                                      f"client processes")
        except PayloadError as exc:
            raise CollectiveFailed(str(exc)) from None
        return {0: partial}, failures


class CollectiveFailed(RunFailed):
    pass


class HierTorchRounds(DataPlane):
    """Hierarchical topology (HierFAVG) over torch.distributed; the edge side is edge/torch_edge.py.

    World: rank 0 the server, ranks 1..E the edges (by edge index), then each edge's client
    processes (edge order, then node id).  Groups, created in this order on every rank: the top
    group [0, 1..E], then the cluster group [edge, its processes] of each edge.  A round: the
    message is broadcast over the top group to every edge; each edge with sampled clients runs
    kappa2 iterations of broadcast / train / reduce in its cluster group; the edges' partials
    are reduced into the server over the top group.  Edges without sampled clients receive the
    broadcast (a collective reaches the whole group) and add the reduce ops' identities.
    """

    per_client = False

    def __init__(self, coordinator: DriverContext) -> None:
        super().__init__(coordinator)
        self.c = c = coordinator
        compress = getattr(c.cfg.algorithm, "compress", "none")
        if compress != "none":   # uploads are reduced as raw float sums here, never QSGD-coded
            raise ValueError(f"algorithm.compress = '{compress}' is not supported with transport.kind = 'torch' "
                             f"and topology.kind = 'hierarchical' (allowed: 'none'); use transport.kind = 'grpc'")
        self.params = getattr(c.cfg.transport, "params", None) or TorchParams()
        world = EdgeWorld(c, self.params)
        self.edges, self.peers, self.layout = world.edges, world.peers, world.layout
        self.top = world.coll.scoped(world.handles[0], 0, "server", "edge-server")

    def dispatch(self, round: int, sampled: list[int], message: Payload, arrivals: dict[int, float]):
        c = self.c
        message = c.group_message(message, round, sampled)
        timeout = c.cfg.run.round_timeout * 2   # as the gRPC path's edge_round calls
        by_edge: dict[str, list[int]] = {e: [] for e in self.peers}
        for cid in sampled:
            by_edge[c.client_home[cid].node_id].append(cid)
        specs = specs_of(message.tensors)
        control = {e.node_id: c.fabric.submit(
            c.fabric.call, e.address, e.node_id, "torch_edge_round",
            Payload(scalars=message.scalars, control=pb.Control(clients=by_edge[e.node_id], specs=specs)),
            round=round, timeout=timeout) for e in self.edges}
        try:
            self.top.broadcast(list(message.tensors.values()), round, self.peers)
        except RuntimeError as exc:
            raise CollectiveFailed(f"round {round}: broadcast to the edges failed: {exc}") from None
        replies, failed = gather(control, timeout, NO_ANSWER)
        if failed:
            raise CollectiveFailed(f"round {round}: edges {sorted(failed)} did not finish the round "
                                   f"({next(iter(failed.values()))}); a collective needs every rank")
        failures: dict[int, str] = {}
        layouts, scalar_parts = {}, []
        for node, reply in sorted(replies.items(), key=lambda kv: edge_index(kv[0])):
            failures.update({k: f"at {node}: {v}" for k, v in failures_of(reply).items()})
            if control_of(reply).layout:
                layouts[node] = control_of(reply).layout
                scalar_parts.append(Payload(scalars=dict(reply.scalars)))
        if not layouts:
            return {}, failures
        try:
            layout = merge_layouts(layouts, f"round {round}: edges")
        except LayoutMismatch as exc:
            raise CollectiveFailed(f"LAYOUT_MISMATCH: {exc}") from None
        reduce_calls = {e.node_id: c.fabric.submit(c.fabric.call, e.address, e.node_id, "torch_edge_reduce",
                                                  Payload(control=pb.Control(layout=layout)), round=round,
                                                  timeout=c.cfg.run.round_timeout) for e in self.edges}
        buffers = reduce_buffers(layout, None)
        try:
            self.top.reduce(buffers, round, self.peers)
        except RuntimeError as exc:
            raise CollectiveFailed(f"round {round}: reduce from the edges failed: {exc}") from None
        _, failed = gather(reduce_calls, c.cfg.run.round_timeout, NO_ANSWER)
        if failed:
            raise CollectiveFailed(f"round {round}: reduce control failed: {failed}")
        partial = reduce_payloads(scalar_parts, c.algorithm.reply_reduce)
        partial.tensors = buffers_by_name(layout, buffers)
        try:
            validate_reply(partial, c.algorithm.reply_spec(c.state), f"round {round} reduced partial of the edges")
        except PayloadError as exc:
            raise CollectiveFailed(str(exc)) from None
        return {0: partial}, failures


class EdgeWorld:
    """The server's set-up of a world of the server, the edges and their client processes
    (hierarchical and sequential topologies): ask each edge for its client processes
    (`torch_procs`), compute the ranks and groups (`hier_layout`), send `torch_init` to every
    edge (which forwards it to its processes), join through the TCP store on transport.host and
    create the groups.  `coll` is the server's membership of the whole world (rank 0)."""

    def __init__(self, c, params: TorchParams) -> None:
        self.edges = sorted((n for n in c.children.values() if n.role == "edge"), key=lambda n: edge_index(n.node_id))
        self.peers = [e.node_id for e in self.edges]
        asked = {e.node_id: c.fabric.submit(c.fabric.call, e.address, e.node_id, Method.TORCH_PROCS, Payload(),
                                           round=0, timeout=params.timeout) for e in self.edges}
        answers, failed = gather(asked, params.timeout, NO_ANSWER)
        if failed:
            raise RuntimeError(f"torch.distributed set-up failed: edges did not list their client processes: {failed}")
        procs = {e: list(control_of(answers[e]).processes) for e in self.peers}
        self.layout = hier_layout(self.peers, procs)
        world = len(self.layout["ranks"]) + 1
        host = c.cfg.transport.host
        master = f"{host}:{params.master_port or free_port(host)}"
        self.coll = Collectives("server", 0, world, c.ledger, params, c.run_id)
        calls = {e.node_id: c.fabric.submit(
            c.fabric.call, e.address, e.node_id, Method.TORCH_INIT,
            Payload(scalars={"world_size": world, "master": master, "backend": params.backend,
                             "timeout": params.timeout}, control=pb.Control(world=torch_world(self.layout))),
            round=0, timeout=params.timeout + 10.0) for e in self.edges}
        init_watching(self.coll, master, calls, "torch.distributed set-up failed")
        self.handles = build_groups(self.layout["groups"], params.timeout)
        _, failed = gather(calls, params.timeout + 10.0, NO_ANSWER)
        if failed:
            raise RuntimeError(f"torch.distributed set-up failed: {failed}")
        log.info("torch.distributed %s world of %d ranks at %s: groups %s", params.backend, world, master,
                 self.layout["groups"])


def hier_layout(edges: list[str], procs: dict[str, list[str]]) -> dict:
    """Ranks and groups of the hierarchical world (module docstring of HierTorchRounds):
    {"ranks": node -> rank (the server, rank 0, left out), "groups": [top, cluster of edge 0, ...],
    "clusters": edge -> its group's index}."""
    ranks = {e: i + 1 for i, e in enumerate(edges)}
    for e in edges:
        for p in sorted(procs[e]):
            if p in ranks:
                raise ValueError(f"client process {p} is listed by two edges")
            ranks[p] = len(ranks) + 1
    groups = [[0] + [ranks[e] for e in edges]] + [[ranks[e]] + [ranks[p] for p in sorted(procs[e])] for e in edges]
    return {"ranks": ranks, "groups": groups, "clusters": {e: i + 1 for i, e in enumerate(edges)}}


class TorchSequentialPath:
    """Fed-CHS's model over torch.distributed at the server (server/sequential.py `MODEL_PATHS`):
    the server joins the edges' world (`EdgeWorld`); a resumed run's model goes to the holder as
    a `dist.send` beside the first `seq_round` call, and the final (or checkpoint) model comes
    back as a `dist.send` from the holder (link edge-server), which the control call `seq_final`
    asks for while the server posts the matching receives."""

    def __init__(self, coord: DriverContext) -> None:
        self.coord = coord
        self.world = EdgeWorld(coord, getattr(coord.cfg.transport, "params", None) or TorchParams())

    def call_round(self, node, round: int, message: Payload, resumed: bool) -> Payload:
        fabric, timeout = self.coord.fabric, self.coord.cfg.run.round_timeout * 2
        if not resumed:
            return fabric.call(node.address, node.node_id, Method.SEQ_ROUND, message, round=round, timeout=timeout)
        call = fabric.submit(fabric.call, node.address, node.node_id, Method.SEQ_ROUND,
                             Payload(scalars=message.scalars, control=message.control), round=round, timeout=timeout)
        try:
            self.world.coll.send(list(message.tensors.values()), self.world.layout["ranks"][node.node_id],
                                 node.node_id, round, "edge-server")
        except RuntimeError as exc:
            raise CallFailed("COLLECTIVE_FAILED", f"sending the resumed model failed: {exc}", node.node_id) from None
        try:
            return call.result(timeout=timeout)
        except FutureTimeout:
            raise CallFailed("DEADLINE_EXCEEDED", f"no answer within {timeout:g}s", node.node_id) from None

    def final_model(self, node, round: int, reply: Payload, spec) -> Payload:
        fabric, timeout = self.coord.fabric, self.coord.cfg.run.round_timeout
        rank = self.world.layout["ranks"][node.node_id]
        call = fabric.submit(fabric.call, node.address, node.node_id, Method.SEQ_FINAL, Payload(), round=round,
                             timeout=timeout)
        try:
            tensors = self.world.coll.recv([(k, dtype, shape) for k, (dtype, shape) in spec.items()], rank,
                                           node.node_id, round, "edge-server")
        except RuntimeError as exc:
            raise RunFailed(f"round {round}: the final model from {node.node_id} did not arrive: {exc}") from None
        try:
            call.result(timeout=timeout)
        except (CallFailed, RemoteError, PayloadError, FutureTimeout) as exc:
            raise RunFailed(f"round {round}: {node.node_id} failed to send the final model: {exc}") from None
        return Payload(scalars=reply.scalars, tensors=tensors)


__all__ = ["TorchRounds", "HierTorchRounds", "EdgeWorld", "TorchSequentialPath", "hier_layout", "CollectiveFailed",
           "CallFailed", "RemoteError"]
