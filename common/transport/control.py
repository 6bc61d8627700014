"""Typed control data of the protocol (proto/fedhop.proto `Control`; docs/architecture.md,
"The protocol"): the few records the roles exchange besides tensors and scalars (sampled
clients, failures, hand-off bookkeeping, torch.distributed layouts), built and read here so
that no role writes structure into a scalar as text."""
from __future__ import annotations

from typing import Iterable, Mapping

from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.message import Payload


def control_of(payload: Payload) -> pb.Control:
    """The message's control data (an empty one when it carries none)."""
    return payload.control if payload.control is not None else pb.Control()


def without_control(payload: Payload) -> Payload:
    """The same tensors and scalars without control data: what a role forwards to its children."""
    return Payload(tensors=payload.tensors, scalars=payload.scalars)


def sampled_clients(clients: Iterable[int]) -> pb.Control:
    return pb.Control(clients=list(clients))


def failures_control(failures: Mapping[int, str], control: pb.Control | None = None) -> pb.Control:
    """`control` (or a new one) with the clients left out, by client id."""
    out = control if control is not None else pb.Control()
    out.failures.extend(pb.ClientFailure(client_id=c, reason=why) for c, why in sorted(failures.items()))
    return out


def failures_of(payload: Payload) -> dict[int, str]:
    return {int(f.client_id): f.reason for f in control_of(payload).failures}


def torch_world(layout: dict) -> pb.TorchWorld:
    """The hierarchical world's layout (transports/torch/groups.py `hier_layout`) as a typed record."""
    return pb.TorchWorld(ranks=layout["ranks"], groups=[pb.RankGroup(ranks=g) for g in layout["groups"]],
                         clusters=layout.get("clusters", {}))


def world_layout(world: pb.TorchWorld) -> dict:
    """Inverse of `torch_world`: {"ranks": node -> rank, "groups": [[rank, ...], ...], "clusters": edge -> group}."""
    return {"ranks": {n: int(r) for n, r in world.ranks.items()}, "groups": [list(g.ranks) for g in world.groups],
            "clusters": {e: int(i) for e, i in world.clusters.items()}}
