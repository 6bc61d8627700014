"""Group broadcast and reduce: the fabric's collective round (shared/DESIGN.md section 2).

A *group round* is the step that a client process's pre-aggregation, an edge's cluster
iteration and the torch.distributed data plane share: a root sends one message to every member
of its group (each member also learns which of its logical clients take part), every member
works on it and contributes one partial aggregate, and the root receives the partials reduced,
field by field with the algorithm's reduce ops (`wsum`, `sum`, `max`, `min`), together with the
clients that failed at each member.

    root:    result = group.round(round, message, clients_by_member, ops=..., timeout=..., where=...)
    member:  incoming = member.receive(round, payload)          # the message, its clients, its step
             ... train the clients, aggregate them ...
             return member.answer(partial, failures, ops)        # the reply to the round's call
             member.contribute(round, payload)                   # the reduce's call, where the transport has one

A role writes only these calls; which transport carries them is the fabric's:

- `FanoutGroup` / `FanoutMember` (gRPC and the in-memory transport): the message travels in each
  member's call, the partial in its reply, and the root reduces the partials in member order
  (`reduce_payloads`).
- `CollectiveGroup` / `CollectiveMember` (torch.distributed, transports/torch/groups.py):
  the tensors move as one broadcast and one reduce over the group's process group; the
  clients, tensor specs and layouts, failures and scalars travel as fabric calls beside them.

A failure that stops the round (a member that does not answer, a collective that breaks, ranks
that disagree on a tensor's layout) raises `GroupFailed`; a client that fails inside a member
is a failure of that client, never of the round.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from fedhop.common.transport.base import CallFailed, HandlerError
from fedhop.common.transport.control import control_of, failures_control, failures_of
from fedhop.common.transport.fabric import Fabric, Send
from fedhop.common.transport.factory import worlds_of
from fedhop.common.util.procexit import wait_stoppable
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.message import Payload, reduce_payloads
from fedhop.common.wire.methods import Method

STEP_KEY = "torch_step"   # control scalar: the edge iteration (0..kappa2-1) a cluster round belongs to


class GroupFailed(HandlerError):
    """A group round could not complete; `code` is COLLECTIVE_FAILED or LAYOUT_MISMATCH."""


@dataclass(frozen=True)
class Member:
    """A member of a group: its node id and where its calls go."""

    node_id: str
    address: str


@dataclass
class GroupResult:
    """The reduced partial of a group round (None when no client of any member succeeded) and,
    per member, its failed clients (client id -> reason)."""

    partial: Payload | None
    failures: dict[str, dict[int, str]] = field(default_factory=dict)

    def all_failures(self, prefix: bool = False) -> dict[int, str]:
        """Every member's failed clients; with `prefix`, each reason says which member reported it."""
        out: dict[int, str] = {}
        for node, failed in self.failures.items():
            out.update({c: f"at {node}: {why}" if prefix else why for c, why in failed.items()})
        return out


@dataclass
class Incoming:
    """What a member receives in a group round: the message, its clients and the iteration step."""

    message: Payload
    clients: list[int]
    step: int


@dataclass(frozen=True)
class GroupMethods:
    """The methods of a group's round and reduce calls, and what a failure names the members."""

    round: Method
    reduce: Method
    noun: str          # "client processes", "edges"
    stepped: bool      # the calls carry the iteration step (STEP_KEY): an edge's cluster group


CLIENT_PROCESSES = GroupMethods(Method.TORCH_ROUND, Method.TORCH_REDUCE, "client processes", stepped=False)
CLUSTER = GroupMethods(Method.TORCH_ROUND, Method.TORCH_REDUCE, "client processes", stepped=True)
EDGES = GroupMethods(Method.TORCH_EDGE_ROUND, Method.TORCH_EDGE_REDUCE, "edges", stepped=False)


class Group(ABC):
    """The root's side of a group (module docstring)."""

    def __init__(self, fabric: Fabric, members: list[Member], methods: GroupMethods) -> None:
        self.fabric = fabric
        self.members = members            # in the order the partials are reduced
        self.methods = methods

    def _round_payload(self, message: Payload, clients: list[int], step: int, tensors: bool) -> Payload:
        scalars = {**message.scalars, STEP_KEY: step} if self.methods.stepped else dict(message.scalars)
        return Payload(tensors=message.tensors if tensors else {}, scalars=scalars,
                       control=pb.Control(clients=clients))

    @abstractmethod
    def round(self, round: int, message: Payload, clients: Mapping[str, list[int]], *, ops: Mapping[str, str],
              timeout: float, reduce_timeout: float, where: str, step: int = 0) -> GroupResult:
        """Send `message` to every member (`clients`: member node id -> its clients in the round)
        and return the members' partials reduced with `ops`; raises GroupFailed."""


class GroupMember(ABC):
    """A member's side of a group (module docstring)."""

    @abstractmethod
    def receive(self, round: int, payload: Payload) -> Incoming:
        """The round's message as this member's handler got it: the payload, its clients, its step."""

    @abstractmethod
    def answer(self, partial: Payload | None, failures: Mapping[int, str], ops: Mapping[str, str]) -> Payload:
        """The reply to the round's call: this member's partial (or what the transport sends instead) and failures."""

    @abstractmethod
    def contribute(self, round: int, payload: Payload) -> Payload:
        """The reduce's call, where the transport has one (a fan-out's partials ride in the replies)."""


# ----------------------------------------------------------------------------- over fabric calls
class FanoutGroup(Group):
    """A group round as one fabric fan-out: every member's call carries the message, its reply
    the member's partial; the partials are reduced at the root in member order."""

    def round(self, round, message, clients, *, ops, timeout, reduce_timeout, where, step=0):
        requests = [Send(m.node_id, m.address, m.node_id, self.methods.round,
                         self._round_payload(message, list(clients.get(m.node_id, [])), step, tensors=True),
                         step=step) for m in self.members]
        replies, failed = self.fabric.send_and_receive(requests, round=round, timeout=timeout, call_timeout=timeout)
        if failed:
            node = sorted(failed)[0]
            raise GroupFailed("COLLECTIVE_FAILED", f"{where}: {self.methods.noun} {sorted(failed)} did not finish "
                                                   f"the round ({node}: {failed[node]})")
        failures = {m.node_id: failures_of(replies[m.node_id]) for m in self.members}
        partials = [Payload(tensors=replies[m.node_id].tensors, scalars=replies[m.node_id].scalars)
                    for m in self.members if replies[m.node_id].tensors]
        return GroupResult(reduce_payloads(partials, ops) if partials else None, failures)


class FanoutMember(GroupMember):
    """A member of a `FanoutGroup`: the message is the call's payload; the partial is the reply."""

    def receive(self, round, payload):
        scalars = dict(payload.scalars)
        step = int(scalars.pop(STEP_KEY, 0))
        return Incoming(Payload(tensors=payload.tensors, scalars=scalars), list(control_of(payload).clients), step)

    def answer(self, partial, failures, ops):
        out = Payload(control=failures_control(failures))
        if partial is not None:
            out.tensors, out.scalars = dict(partial.tensors), dict(partial.scalars)
        return out

    def contribute(self, round, payload):
        raise GroupFailed("NO_REDUCE", "a fan-out group's partials come in the round's replies")


# ----------------------------------------------------------------------------- peer sends beside a call
class PeerSends(Protocol):
    """A world's point-to-point sends by node id (transports/torch/groups.py `TorchPeers`)."""

    def knows(self, node: str) -> bool: ...

    def send(self, tensors: list[Any], node: str, round: int, link: str) -> None: ...

    def recv(self, specs: list[tuple[str, Any, tuple[int, ...]]], node: str, round: int,
             link: str) -> dict[str, Any]: ...


def send_beside_call(fabric: Fabric, peers: PeerSends, address: str, node: str, method: Method, tensors: list[Any],
                     *, round: int, link: str, timeout: float, what: str, payload: Payload | None = None) -> Payload:
    """Send `tensors` to `node` as a peer send while the control call `method` (carrying
    `payload`, no tensors) makes it post the matching receive; the call's reply.  A send that
    breaks, or a call without an answer within `timeout`, is a CallFailed naming `what`."""
    call = fabric.submit(fabric.call, address, node, method, payload if payload is not None else Payload(),
                         round=round, timeout=timeout)
    try:
        peers.send(tensors, node, round, link)
    except RuntimeError as exc:
        raise CallFailed("COLLECTIVE_FAILED", f"sending {what} failed: {exc}", node) from None
    try:
        wait_stoppable([call], timeout)   # a stop signal is raised here, at a wait (common/util/procexit.py)
        return call.result(timeout=0)
    except FutureTimeout:
        raise CallFailed("DEADLINE_EXCEEDED", f"no answer to {what} within {timeout:g}s", node) from None


def recv_beside_call(fabric: Fabric, peers: PeerSends, address: str, node: str, method: Method,
                     specs: list[tuple[str, Any, tuple[int, ...]]], *, round: int, link: str, timeout: float,
                     what: str) -> dict[str, Any]:
    """Receive tensors of `specs` (name, dtype, shape) from `node`'s peer send, which the
    control call `method` asks it for.  A receive that breaks, or a call without an answer within
    `timeout`, is a CallFailed naming `what`; the call's own failure is raised as it came."""
    call = fabric.submit(fabric.call, address, node, method, Payload(), round=round, timeout=timeout)
    try:
        tensors = peers.recv(specs, node, round, link)
    except RuntimeError as exc:
        raise CallFailed("COLLECTIVE_FAILED", f"{what} did not arrive: {exc}", node) from None
    try:
        wait_stoppable([call], timeout)
        call.result(timeout=0)
    except FutureTimeout:
        raise CallFailed("DEADLINE_EXCEEDED", f"no answer to {what} within {timeout:g}s", node) from None
    return tensors


# ----------------------------------------------------------------------------- worlds by transport
class Worlds(ABC):
    """How a transport sets up groups: the server's star world (a group of the client
    processes) and edges' world (`top`: a group of the edges; `peers`: point-to-point sends),
    and each member's side of them, joined on its `torch_init`-style set-up call.  Every
    transport has a star world; an edges' world only one whose tensors move outside the calls
    (the others refuse it: their hierarchical rounds are fan-outs of calls)."""

    @abstractmethod
    def star(self, fabric: Fabric, procs: list[Member], transport, ledger, run_id: str) -> Group: ...

    @abstractmethod
    def member(self, node_id: str, payload: Payload, ledger, run_id: str) -> GroupMember: ...

    def edges(self, fabric: Fabric, edges: list[Member], transport, ledger, run_id: str):
        raise NotImplementedError(f"{type(self).__name__} has no edges' world")

    def edge_member(self, fabric: Fabric, node_id: str, payload: Payload, processes: Mapping[str, str], ledger,
                    run_id: str):
        raise NotImplementedError(f"{type(self).__name__} has no edges' world")


class FanoutWorlds(Worlds):
    """Groups over fabric calls (gRPC, in memory): nothing to join; a group is its members."""

    def star(self, fabric, procs, transport, ledger, run_id):
        return FanoutGroup(fabric, procs, CLIENT_PROCESSES)

    def member(self, node_id, payload, ledger, run_id):
        return FanoutMember()


FANOUT_WORLDS = FanoutWorlds()


def worlds(kind: str) -> Worlds:
    """The group set-up of transport `kind` (its entry in common/transport/factory.py `TRANSPORTS`)."""
    return worlds_of(kind)


__all__ = ["worlds", "Worlds", "FANOUT_WORLDS", "CLIENT_PROCESSES", "CLUSTER", "EDGES", "STEP_KEY", "GroupFailed", "Member", "GroupResult", "Incoming", "GroupMethods", "Group", "GroupMember",
           "FanoutGroup", "FanoutMember", "PeerSends", "send_beside_call", "recv_beside_call"]
