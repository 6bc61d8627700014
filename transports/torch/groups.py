"""Group rounds and peer sends over torch.distributed (common/transport/groups.py, docs/torch_transport.md).

The world: with the star topology rank 0 is the server and client process k (in node-id order)
is rank k + 1 (`star_world`).  With the hierarchical and sequential topologies rank 0 is the
server, ranks 1..E the edges (by edge index), then each edge's client processes (edge order,
then node id) (`hier_layout`); the groups, created in this order on every rank, are the top
group {server, every edge} and one cluster group {edge e, its client processes} per edge
(`EdgeWorld` at the server, `join_edge` at an edge, `join_member` at a client process).

A group round over collectives (`CollectiveGroup.round`):
  1. a control call to every member (its clients, the tensor specs), beside one broadcast of
     the message's tensors from the root;
  2. the members answer with their failures, their partial's layout and scalars;
  3. the root merges the layouts (`merge_layouts`), sends each member the merged layout in a
     reduce call, beside one reduce of the partials' tensors into the root.
A collective needs every rank of its group: a member that fails or does not answer fails the
round (GroupFailed, COLLECTIVE_FAILED) within the collective timeout, naming the member.

Peer sends (`TorchPeers`): Fed-CHS's model hand-off between edges and the model between an edge
and the server are `dist.send` / `dist.recv` by node id, each beside a control call.
"""
from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Callable, Mapping

import torch

from fedhop.common.transport.control import control_of, failures_control, failures_of, torch_world, world_layout
from fedhop.common.transport.fabric import Fabric, gather
from fedhop.common.transport.groups import (
    CLIENT_PROCESSES,
    CLUSTER,
    EDGES,
    STEP_KEY,
    Group,
    GroupFailed,
    GroupMember,
    GroupMethods,
    GroupResult,
    Incoming,
    Member,
    Worlds,
)
from fedhop.common.transport.grpc import RETRY_WINDOW
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload, Scalar, reduce_payloads
from fedhop.common.wire.methods import Method
from fedhop.transports.torch.dist import (
    Collectives,
    LayoutMismatch,
    TorchParams,
    buffers_by_name,
    build_groups,
    init_watching,
    layout_of,
    master_address,
    master_store,
    merge_layouts,
    reduce_buffers,
    specs_from_pb,
    specs_of,
)

NO_ANSWER = "timeout: no answer in time"


def _failed(calls: Mapping[str, Future], timeout: float, pending_ok: bool = False) -> dict[str, str]:
    return gather(calls, timeout, NO_ANSWER, pending_ok=pending_ok)[1]


class CollectiveGroup(Group):
    """The root of a process group: group rounds as a broadcast and a reduce (module docstring)."""

    def __init__(self, fabric: Fabric, coll: Collectives, members: list[Member], methods: GroupMethods) -> None:
        super().__init__(fabric, members, methods)
        self.coll = coll
        self.peers = [m.node_id for m in members]

    def _calls(self, method: Method, payloads: Mapping[str, Payload], round: int, step: int,
               timeout: float) -> dict[str, Future]:
        return {m.node_id: self.fabric.submit(self.fabric.call, m.address, m.node_id, method, payloads[m.node_id],
                                              round=round, step=step, timeout=timeout) for m in self.members}

    def _collective(self, fn: Callable[[], object], what: str, control: Mapping[str, Future]) -> object:
        """Run one collective; when it fails (gloo: a peer gone, or the collective timeout) name the
        members whose control call of the same step failed too (a dead rank).  A call to a dead
        process fails only once its not-delivered retries give up (RETRY_WINDOW), so the wait for
        those failures outlasts that window."""
        try:
            return fn()
        except RuntimeError as exc:
            wait(list(control.values()), timeout=RETRY_WINDOW + 4.0, return_when=FIRST_EXCEPTION)
            failed = _failed(control, 0.0, pending_ok=True)
            dead = (f"; {self.methods.noun} {sorted(failed)} failed: {next(iter(failed.values()))}"
                    if failed else "")
            raise GroupFailed("COLLECTIVE_FAILED", f"{what} failed: {exc}{dead}") from None

    def round(self, round, message, clients, *, ops, timeout, reduce_timeout, where, step=0):
        noun = self.methods.noun
        specs = specs_of(message.tensors)
        payloads = {}
        for m in self.members:
            payload = self._round_payload(message, list(clients.get(m.node_id, [])), step, tensors=False)
            assert payload.control is not None   # _round_payload's control names the clients
            payload.control.specs.extend(specs)
            payloads[m.node_id] = payload
        control = self._calls(self.methods.round, payloads, round, step, timeout)
        self._collective(lambda: self.coll.broadcast(list(message.tensors.values()), round, self.peers, step),
                         f"{where}: broadcast to {noun}", control)
        replies, failed = gather(control, timeout, NO_ANSWER)
        if failed:
            node = sorted(failed)[0]
            raise GroupFailed("COLLECTIVE_FAILED", f"{where}: {noun} {sorted(failed)} did not finish the round "
                                                   f"({node}: {failed[node]}); a collective needs every rank")
        layouts, scalar_parts = {}, []
        for m in self.members:
            if control_of(replies[m.node_id]).layout:
                layouts[m.node_id] = control_of(replies[m.node_id]).layout
                scalar_parts.append(Payload(scalars=dict(replies[m.node_id].scalars)))
        failures = {m.node_id: failures_of(replies[m.node_id]) for m in self.members}
        if not layouts:
            return GroupResult(None, failures)
        try:
            layout = merge_layouts(layouts, f"{where}: {noun}")
        except LayoutMismatch as exc:
            raise GroupFailed("LAYOUT_MISMATCH", str(exc)) from None
        extra = {STEP_KEY: step} if self.methods.stepped else {}
        reduce_calls = self._calls(self.methods.reduce, {
            m.node_id: Payload(scalars=extra, control=pb.Control(layout=layout)) for m in self.members},
            round, step, reduce_timeout)
        buffers = reduce_buffers(layout, None)
        self._collective(lambda: self.coll.reduce(buffers, round, self.peers, step), f"{where}: reduce from {noun}",
                         reduce_calls)
        failed = _failed(reduce_calls, reduce_timeout)
        if failed:
            raise GroupFailed("COLLECTIVE_FAILED", f"{where}: reduce control failed: {failed}")
        partial = reduce_payloads(scalar_parts, ops)
        partial.tensors = buffers_by_name(layout, buffers)
        return GroupResult(partial, failures)


class CollectiveMember(GroupMember):
    """A member of a process group: receives the root's broadcasts and contributes its partial
    to the root's reduces (module docstring).  The partial waits here between the two calls."""

    def __init__(self, coll: Collectives) -> None:
        self.coll = coll
        self.partial: Payload | None = None

    def receive(self, round, payload):
        scalars = dict(payload.scalars)
        control = control_of(payload)
        step = int(scalars.pop(STEP_KEY, 0))   # a cluster round: the edge iteration (as the gRPC path's call step)
        specs = specs_from_pb(control.specs)
        empties = [torch.empty(shape, dtype=dtype) for _, dtype, shape in specs]
        try:
            received = self.coll.broadcast(empties, round, peers=[self.coll.node_id], step=step)
        except RuntimeError as exc:
            raise GroupFailed("COLLECTIVE_FAILED", f"{self.coll.node_id}: round {round}: broadcast from "
                                                   f"{self.coll.root_node} failed: {exc}") from None
        message = Payload(tensors={name: t.cpu() for (name, _, _), t in zip(specs, received)}, scalars=scalars)
        return Incoming(message, list(control.clients), step)

    def answer(self, partial, failures, ops):
        self.partial = partial
        control = failures_control(failures)
        out = Payload(control=control)
        if partial is not None:
            control.layout.extend(layout_of(partial.tensors, ops))
            out.scalars.update(partial.scalars)
        return out

    def contribute(self, round, payload):
        buffers = reduce_buffers(control_of(payload).layout, self.partial.tensors if self.partial is not None else None)
        self.partial = None
        try:
            self.coll.reduce(buffers, round, peers=[self.coll.node_id], step=int(payload.scalars.get(STEP_KEY, 0)))
        except RuntimeError as exc:
            raise GroupFailed("COLLECTIVE_FAILED", f"{self.coll.node_id}: round {round}: reduce to "
                                                   f"{self.coll.root_node} failed: {exc}") from None
        return Payload()


class TorchPeers:
    """Point-to-point tensor sends in the world, by node id (Fed-CHS's model)."""

    def __init__(self, coll: Collectives, ranks: Mapping[str, int]) -> None:
        self.coll = coll
        self.ranks = dict(ranks)

    def knows(self, node: str) -> bool:
        return node in self.ranks

    def send(self, tensors: list[torch.Tensor], node: str, round: int, link: str) -> None:
        self.coll.send(tensors, self.ranks[node], node, round, link)

    def recv(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], node: str, round: int,
             link: str) -> dict[str, torch.Tensor]:
        return self.coll.recv(specs, self.ranks[node], node, round, link)


# ----------------------------------------------------------------------------- set-up
def params_of(transport) -> TorchParams:
    """The [transport] keys of kind = "torch" (defaults where the config has none)."""
    return getattr(transport, "params", None) or TorchParams()


def star_world(fabric: Fabric, procs: list[Member], params: TorchParams, host: str, ledger: Ledger,
               run_id: str) -> CollectiveGroup:
    """The server's set-up of the star world: `torch_init` to every client process (rank k + 1
    in the given order), join, and the group of the whole world rooted at the server."""
    store = master_store(host, params.master_port, len(procs) + 1, params.timeout)   # listening before it is named
    master = master_address(host, store)
    coll = Collectives("server", 0, len(procs) + 1, ledger, params, run_id)
    calls = {p.node_id: fabric.submit(
        fabric.call, p.address, p.node_id, Method.TORCH_INIT,
        Payload(scalars={"rank": i + 1, "world_size": len(procs) + 1, "master": master, "backend": params.backend,
                         "timeout": params.timeout}),
        round=0, timeout=params.timeout) for i, p in enumerate(procs)}
    init_watching(coll, master, calls, "torch.distributed set-up failed", store)
    failed = _failed(calls, params.timeout)
    if failed:
        raise RuntimeError(f"torch.distributed set-up failed: {failed}")
    return CollectiveGroup(fabric, coll, procs, CLIENT_PROCESSES)


def join_member(node_id: str, payload: Payload, ledger: Ledger, run_id: str) -> CollectiveMember:
    """A client process's `torch_init`: join the world; in an edge's world, create every group
    and become a member of this process's edge cluster (rooted at the edge)."""
    s = payload.scalars
    params = TorchParams(backend=str(s["backend"]), timeout=float(s["timeout"]))
    coll = Collectives(node_id, int(s["rank"]), int(s["world_size"]), ledger, params, run_id)
    coll.init(str(s["master"]))
    world = control_of(payload).world
    if world.groups:
        groups = build_groups(world_layout(world)["groups"], params.timeout)
        coll = coll.scoped(groups[world.group], int(s["root_rank"]), str(s["root_node"]), "client-edge")
    return CollectiveMember(coll)


def hier_layout(edges: list[str], procs: dict[str, list[str]]) -> dict:
    """Ranks and groups of the edges' world (module docstring):
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


class EdgeWorld:
    """The server's set-up of the edges' world (hierarchical and sequential topologies): ask each
    edge for its client processes (`torch_procs`), lay out the ranks and groups (`hier_layout`),
    send `torch_init` to every edge (which forwards it to its processes), join through the TCP
    store on `host` and create the groups.  `top`: the group of the edges rooted at the server;
    `peers`: point-to-point sends to any rank."""

    def __init__(self, fabric: Fabric, edges: list[Member], params: TorchParams, host: str, ledger: Ledger,
                 run_id: str) -> None:
        asked = {e.node_id: fabric.submit(fabric.call, e.address, e.node_id, Method.TORCH_PROCS, Payload(),
                                          round=0, timeout=params.timeout) for e in edges}
        answers, failed = gather(asked, params.timeout, NO_ANSWER)
        if failed:
            raise RuntimeError(f"torch.distributed set-up failed: edges did not list their client processes: {failed}")
        self.layout = hier_layout([e.node_id for e in edges],
                                  {e.node_id: list(control_of(answers[e.node_id]).processes) for e in edges})
        world = len(self.layout["ranks"]) + 1
        store = master_store(host, params.master_port, world, params.timeout)   # listening before it is named
        master = master_address(host, store)
        coll = Collectives("server", 0, world, ledger, params, run_id)
        calls = {e.node_id: fabric.submit(
            fabric.call, e.address, e.node_id, Method.TORCH_INIT,
            Payload(scalars={"world_size": world, "master": master, "backend": params.backend,
                             "timeout": params.timeout}, control=pb.Control(world=torch_world(self.layout))),
            round=0, timeout=params.timeout + 10.0) for e in edges}
        init_watching(coll, master, calls, "torch.distributed set-up failed", store)
        handles = build_groups(self.layout["groups"], params.timeout)
        failed = _failed(calls, params.timeout + 10.0)
        if failed:
            raise RuntimeError(f"torch.distributed set-up failed: {failed}")
        self.top = CollectiveGroup(fabric, coll.scoped(handles[0], 0, "server", "edge-server"), edges, EDGES)
        self.peers = TorchPeers(coll, self.layout["ranks"])
        self.description = f"{params.backend} world of {world} ranks at {master}: groups {self.layout['groups']}"


class EdgeMembership:
    """An edge's side of the edges' world: a member of the top group (rooted at the server), the
    root of its cluster group, and point-to-point sends to any rank."""

    def __init__(self, fabric: Fabric, node_id: str, payload: Payload, processes: Mapping[str, str],
                 ledger: Ledger, run_id: str) -> None:
        """`torch_init` at an edge: forward each client process its rank, join, create every group."""
        s = payload.scalars
        params = TorchParams(backend=str(s["backend"]), timeout=float(s["timeout"]))
        layout = world_layout(control_of(payload).world)
        ranks: dict[str, int] = layout["ranks"]
        mine = int(layout["clusters"][node_id])
        procs = sorted((p for p in ranks if p in processes), key=lambda p: ranks[p])
        if sorted(procs) != sorted(processes):
            raise GroupFailed("BAD_LAYOUT", f"{node_id}: the server's layout lists {procs}, this edge serves "
                                            f"{sorted(processes)}")
        common: dict[str, Scalar] = {"world_size": int(s["world_size"]), "master": str(s["master"]),
                                     "backend": params.backend, "timeout": params.timeout,
                                     "root_rank": ranks[node_id], "root_node": node_id}
        cluster = pb.Control(world=pb.TorchWorld(groups=[pb.RankGroup(ranks=g) for g in layout["groups"]],
                                                 group=mine))
        calls = {p: fabric.submit(fabric.call, processes[p], p, Method.TORCH_INIT,
                                  Payload(scalars={**common, "rank": ranks[p]}, control=cluster), round=0,
                                  timeout=params.timeout) for p in procs}
        coll = Collectives(node_id, ranks[node_id], int(s["world_size"]), ledger, params, run_id)
        try:
            init_watching(coll, str(s["master"]), calls, f"{node_id}: torch.distributed set-up failed")
            handles = build_groups(layout["groups"], params.timeout)
        except RuntimeError as exc:
            raise GroupFailed("COLLECTIVE_FAILED", str(exc) if node_id in str(exc) else
                              f"{node_id}: torch.distributed set-up failed: {exc}") from None
        failed = _failed(calls, params.timeout + 5.0)
        if failed:
            raise GroupFailed("COLLECTIVE_FAILED", f"{node_id}: client processes {sorted(failed)} did not join "
                                                   f"torch.distributed ({next(iter(failed.values()))})")
        self.rank = coll.rank
        self.top = CollectiveMember(coll.scoped(handles[0], 0, "server", "edge-server"))
        self.cluster = CollectiveGroup(fabric, coll.scoped(handles[mine], ranks[node_id], node_id, "client-edge"),
                                       [Member(p, processes[p]) for p in procs], CLUSTER)
        self.peers = TorchPeers(coll, {**ranks, "server": 0})


class TorchWorlds(Worlds):
    """torch.distributed's group set-up (common/transport/groups.py `Worlds`)."""

    def star(self, fabric, procs, transport, ledger, run_id):
        return star_world(fabric, procs, params_of(transport), transport.host, ledger, run_id)

    def edges(self, fabric, edges, transport, ledger, run_id):
        return EdgeWorld(fabric, edges, params_of(transport), transport.host, ledger, run_id)

    def member(self, node_id, payload, ledger, run_id):
        return join_member(node_id, payload, ledger, run_id)

    def edge_member(self, fabric, node_id, payload, processes, ledger, run_id):
        return EdgeMembership(fabric, node_id, payload, processes, ledger, run_id)


TORCH_WORLDS = TorchWorlds()

__all__ = ["TORCH_WORLDS", "TorchWorlds", "CollectiveGroup", "CollectiveMember", "TorchPeers", "star_world", "join_member", "hier_layout",
           "EdgeWorld", "EdgeMembership", "params_of", "NO_ANSWER"]
