"""A client process's side of the torch.distributed data plane (common/transport/torchdist.py).

Control calls arrive over gRPC (`torch_init`, `torch_round`, `torch_reduce`) from the server
(star) or from this process's edge (hierarchical: the collectives run in the edge's cluster
group, rooted at the edge, once per edge iteration); the tensors move as collectives.  The
process pre-aggregates its own sampled logical clients with the algorithm's `aggregate`, as
an edge would, and contributes one partial to the reduce.  A client's reply holding NaN or Inf
is left out of that partial and reported as a NON_FINITE failure (the server's
`security.nan_policy` applies to it as on the gRPC path).
"""
from __future__ import annotations

import torch

from fedhop.common.algorithms.base import Payload, finite_or_raise
from fedhop.common.codec import PayloadError
from fedhop.common.control import control_of, failures_control, world_layout
from fedhop.common.transport.base import CallFailed, HandlerError, RemoteError
from fedhop.common.transport.torchdist import (STEP_KEY, Collectives, TorchParams, build_groups, layout_of,
                                               reduce_buffers, specs_from_pb)


class TorchWorker:
    def __init__(self, host) -> None:
        self.host = host
        self.coll: Collectives | None = None
        self.partial: Payload | None = None

    def ready(self) -> Collectives:
        if self.coll is None:
            raise HandlerError("NOT_READY", "torch_init has not been called")
        return self.coll

    def init(self, payload: Payload) -> Payload:
        s = payload.scalars
        params = TorchParams(backend=str(s["backend"]), timeout=float(s["timeout"]))
        self.coll = Collectives(self.host.node_id, int(s["rank"]), int(s["world_size"]), self.host.ledger, params,
                                self.host.run_id)
        self.coll.init(str(s["master"]))
        world = control_of(payload).world
        if world.groups:   # hierarchical: collectives in this process's edge cluster, rooted at the edge
            groups = build_groups(world_layout(world)["groups"], params.timeout)
            self.coll = self.coll.scoped(groups[world.group], int(s["root_rank"]), str(s["root_node"]),
                                         "client-edge")
        return Payload(scalars={"rank": self.coll.rank})

    def round(self, round: int, payload: Payload) -> Payload:
        self.ready()
        scalars = dict(payload.scalars)
        control = control_of(payload)
        clients = list(control.clients)
        specs = specs_from_pb(control.specs)
        step = int(scalars.pop(STEP_KEY, 0))   # hierarchical: the edge iteration (as the gRPC path's call step)
        empties = [torch.empty(shape, dtype=dtype) for _, dtype, shape in specs]
        received = self.coll.broadcast(empties, round, peers=[self.host.node_id], step=step)
        message = Payload(tensors={name: t.cpu() for (name, _, _), t in zip(specs, received)}, scalars=scalars)
        replies, failures = {}, {}
        for cid in clients:
            try:
                reply = self.host.train(cid, round, message, step)
                try:   # as the gRPC receiver would: a NaN reply leaves its client out, not the whole sum
                    finite_or_raise(reply, f"round {round} reply of client {cid}")
                except ValueError as exc:
                    raise PayloadError("NON_FINITE", str(exc)) from None
                replies[cid] = reply
            except (PayloadError, HandlerError, ValueError, RuntimeError) as exc:
                failures[cid] = str(exc)
        self.partial = self.host.algorithm.aggregate(sorted(replies.items())) if replies else None
        out = Payload(control=failures_control(failures))
        if self.partial is not None:
            out.control.layout.extend(layout_of(self.partial.tensors, self.host.algorithm.reply_reduce))
            out.scalars.update(self.partial.scalars)
        return out

    def reduce(self, round: int, payload: Payload) -> Payload:
        self.ready()
        buffers = reduce_buffers(control_of(payload).layout, self.partial.tensors if self.partial is not None else None)
        self.coll.reduce(buffers, round, peers=[self.host.node_id],
                         step=int(payload.scalars.get(STEP_KEY, 0)))
        self.partial = None
        return Payload()


__all__ = ["TorchWorker", "CallFailed", "RemoteError"]
